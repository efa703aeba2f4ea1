"""The GPU image's requirement files, read without network: the exact pins of
``docker/requirements-gpu.txt`` and the requirements megarl's ``setup.py`` declares."""

from __future__ import annotations

import ast
import os

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests._dist import ROOT

REQUIREMENTS = os.path.join(ROOT, "docker", "requirements-gpu.txt")


def pin_lines(path=REQUIREMENTS):
    """(line number, requirement text) of every non-comment line of a requirements file."""
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        text = line.split("#", 1)[0].strip()
        if text:
            yield n, text


def pinned_gpu_requirements(path=REQUIREMENTS) -> dict[str, str]:
    """canonical name -> its specifier (``==x.y.z``), from docker/requirements-gpu.txt."""
    return {canonicalize_name(Requirement(t).name): str(Requirement(t).specifier) for _, t in pin_lines(path)}


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """``install_requires`` and ``extras_require`` of setup.py, read from its source (AST)."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return kw["install_requires"], kw["extras_require"]


def gpu_extra_sglang_range() -> SpecifierSet:
    """The sglang versions setup.py's ``gpu`` extra accepts."""
    _, extras = setup_requirements()
    return next(Requirement(r).specifier for r in extras["gpu"] if Requirement(r).name == "sglang")
