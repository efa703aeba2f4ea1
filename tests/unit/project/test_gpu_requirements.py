"""The GPU image's pinned requirement set resolves, checked on CPU against PyPI.

``docker/requirements-gpu.txt`` is what the Dockerfile installs on top of SGLang's image; a pin
that conflicts with SGLang's own exact pins (torch, transformers, ...), with another pin's
requirements or with megarl's ``setup.py`` would only fail inside ``docker build`` on a GPU
cluster.  Here pip (a pinned recent release, run from its wheel: it fetches only the metadata of
each wheel through HTTP range requests, never a multi-GB wheel) resolves the pins for the image's
platform (linux x86_64, CPython 3.12, glibc 2.39), and every requirement declared by a pinned
package or by megarl is checked against every exact pin.  A failure names the pin.  Where the
package index cannot be reached from this machine the tests that need it skip, saying so (the
file checks still run).

``MEGARL_FULL_GPU_RESOLVE=1`` additionally resolves the whole dependency tree (about 240
packages; 40 s or more, so not by default).
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests._dist import ROOT
from tests._gpu_pins import gpu_extra_sglang_range, pin_lines, setup_requirements

DOCKERFILE = os.path.join(ROOT, "Dockerfile")
#: a pip whose --dry-run resolves from metadata alone (pip 23.x downloads every wheel)
PIP = "26.3"
#: SGLang's image: Ubuntu 24.04 (glibc 2.39), its python3 (3.12)
PYTHON, GLIBC_MINOR = "3.12", 39
ENVIRONMENT = {"python_version": PYTHON, "python_full_version": PYTHON + ".3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython",
               "platform_release": "", "platform_version": "", "implementation_version": PYTHON + ".3"}
#: pins that exist only as source distributions (built inside the image): pip cannot resolve
#: them for another platform, their presence on the index is checked instead
SDIST_ONLY = {"transformer-engine-torch"}


# ---- the files ------------------------------------------------------------------------------------


def test_the_pins_file_the_dockerfile_and_setup_py_agree():
    pins = {}
    for n, text in pin_lines():
        req = Requirement(text)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==" and "*" not in spec[0].version, (
            f"docker/requirements-gpu.txt:{n}: {text!r} is not an exact pin (name==version)")
        assert req.marker is None, f"docker/requirements-gpu.txt:{n}: no markers: the image is one platform"
        pins[canonicalize_name(req.name)] = Version(spec[0].version)
    docker = open(DOCKERFILE, encoding="utf-8").read()
    base = re.search(r"^ARG SGLANG_IMAGE=(\S+)$", docker, re.M)
    assert base and base.group(1) == f"lmsysorg/sglang:v{pins['sglang']}", (
        f"Dockerfile base {base and base.group(1)} is not SGLang's image of the pinned sglang=={pins['sglang']}")
    assert "-r docker/requirements-gpu.txt" in docker and "check_pins.py docker/requirements-gpu.txt" in docker
    assert pins["sglang"] in gpu_extra_sglang_range(), f"setup.py gpu extra sglang{gpu_extra_sglang_range()} excludes the pin"
    te = {k: v for k, v in pins.items() if k.startswith("transformer-engine")}
    assert len(set(te.values())) == 1, f"transformer-engine packages must share one version: {te}"
    install_requires, extras = setup_requirements()
    for r in install_requires + extras["gpu"] + extras["dev"]:
        req = Requirement(r)
        name = canonicalize_name(req.name)
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"setup.py requires {r!r} but docker/requirements-gpu.txt pins {name}=={pins[name]}")


# ---- pip -------------------------------------------------------------------------------------------


def _clean_env() -> dict:
    """This machine's pip configuration (extra local indexes, find-links, constraints) must not
    decide the resolution: only PyPI (or PIP_INDEX_URL) and the certificate settings are kept."""
    keep = {"PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT", "PIP_PROXY"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _index_unreachable() -> str | None:
    """Why the package index the resolution uses cannot be reached from here, or None when it
    answers: one HEAD request for pip's project page (5 s at most), through PIP_PROXY if set.
    A page, a redirect, 401 (pip may hold the credentials) or 405 (no HEAD) is an answer from
    the index, and so is a TLS failure (pip has certificate settings of its own: it runs and
    names what is wrong); a refused or timed-out connection, an unknown host, or another HTTP
    status (a gateway's "404" for a host it cannot reach) is not."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    parts = urllib.parse.urlsplit(f"{index}/pip/")
    if parts.scheme not in ("http", "https"):
        return None  # a local (file://) index: nothing to reach over the network
    url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()  # no credentials in the request
    proxy = os.environ.get("PIP_PROXY")
    cert = os.environ.get("PIP_CERT")
    handlers = [urllib.request.ProxyHandler({"http": proxy, "https": proxy})] if proxy else []
    if cert and os.path.exists(cert):
        ctx = ssl.create_default_context(**({"capath": cert} if os.path.isdir(cert) else {"cafile": cert}))
        handlers.append(urllib.request.HTTPSHandler(context=ctx))
    try:
        urllib.request.build_opener(*handlers).open(urllib.request.Request(url, method="HEAD"), timeout=5).close()
    except urllib.error.HTTPError as e:
        if e.code in (401, 405):
            return None
        return f"HEAD {url} answered HTTP {e.code} {e.reason} (server: {e.headers.get('server', 'unnamed')})"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ssl.SSLError):
            return None
        return f"HEAD {url} failed: {reason}"
    return None


@pytest.fixture(scope="module")
def pip(tmp_path_factory):
    """argv prefix running pip PIP from its wheel (1.9 MB), whatever pip this machine has.
    Skips (naming why) when the package index cannot be reached from this machine."""
    why = _index_unreachable()
    if why:
        pytest.skip("the package index is not reachable from this machine (needed to resolve the GPU "
                    f"requirements): {why}")
    d = tmp_path_factory.mktemp("pip")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", f"pip=={PIP}", "--no-deps", "--only-binary=:all:",
                           "-d", str(d), "-q"], capture_output=True, text=True, env=_clean_env(), timeout=120)
    assert proc.returncode == 0, f"could not fetch pip {PIP} from the index (is PyPI reachable?):\n{proc.stderr[-2000:]}"
    wheel = next(p for p in d.iterdir() if p.name.endswith(".whl"))
    return [sys.executable, os.path.join(str(wheel), "pip")]


def _platform_args() -> list[str]:
    plats = [f"manylinux_2_{m}_x86_64" for m in range(17, GLIBC_MINOR + 1)]
    plats += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    return [a for p in plats for a in ("--platform", p)] + [
        "--python-version", PYTHON, "--implementation", "cp", "--abi", "cp" + PYTHON.replace(".", ""),
        "--only-binary=:all:"]


def _dry_run(pip, requirements: list[str], tmp_path, no_deps: bool, timeout: int):
    req_file = tmp_path / "requirements.txt"
    req_file.write_text("\n".join(requirements) + "\n")
    report = tmp_path / "report.json"
    cmd = pip + ["install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps", "--no-cache-dir",
                 "--target", str(tmp_path / "target"), "--report", str(report), "-r", str(req_file)]
    cmd += _platform_args() + (["--no-deps"] if no_deps else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=timeout)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        conflict = re.search(r"The conflict is caused by:\n(.*?)\n\n", out, re.S)
        missing = re.findall(r"No matching distribution found for (\S+)", out)
        why = (conflict.group(1) if conflict else "") or (
            f"no wheel for {missing} on linux x86_64 / CPython {PYTHON}" if missing else out[-3000:])
        network = " (network error: is PyPI reachable?)" if re.search(r"NewConnectionError|ConnectTimeout|Network is unreachable", out) else ""
        pytest.fail(f"docker/requirements-gpu.txt does not resolve{network}:\n{why}", pytrace=False)
    assert not (tmp_path / "target").exists(), "--dry-run installed something"
    return json.loads(report.read_text()), seconds


def _marker_ok(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(dict(ENVIRONMENT, extra=e)) for e in (extras or {""}))


def test_pinned_set_resolves_and_no_declared_requirement_contradicts_a_pin(pip, tmp_path):
    lines = [t for _, t in pin_lines()]
    pins = {canonicalize_name(Requirement(t).name): Requirement(t) for t in lines}
    wheel_lines = [t for t in lines if canonicalize_name(Requirement(t).name) not in SDIST_ONLY]
    report, _ = _dry_run(pip, wheel_lines, tmp_path, no_deps=True, timeout=300)
    installed = {canonicalize_name(i["metadata"]["name"]): i for i in report["install"]}
    assert set(installed) == set(pins) - SDIST_ONLY, set(pins) - SDIST_ONLY - set(installed)
    for name in SDIST_ONLY:
        proc = subprocess.run(pip + ["index", "versions", name], capture_output=True, text=True, env=_clean_env(), timeout=120)
        want = str(next(iter(pins[name].specifier)).version)
        assert proc.returncode == 0 and re.search(rf"[ ,]{re.escape(want)}(,|$)", proc.stdout, re.M), (
            f"docker/requirements-gpu.txt pins {name}=={want}, which the index does not have:\n{proc.stdout[-1500:]}")

    # every exact pin: ours, and the exact pins the pinned packages declare (sglang pins ~40)
    exact: dict[str, tuple[Version, str]] = {n: (Version(next(iter(r.specifier)).version), "docker/requirements-gpu.txt")
                                             for n, r in pins.items()}
    declared: list[tuple[str, Requirement]] = []
    for name, item in installed.items():
        meta = item["metadata"]
        assert SpecifierSet(meta.get("requires_python") or "").contains(PYTHON + ".3"), (
            f"{name}=={meta['version']} requires Python {meta['requires_python']}, the image has {PYTHON}")
        extras = {canonicalize_name(e) for e in pins[name].extras}
        for text in meta.get("requires_dist") or []:
            req = Requirement(text)
            if _marker_ok(req, extras):
                declared.append((f"{meta['name']} {meta['version']}", req))
    install_requires, extras = setup_requirements()
    declared += [("megarl setup.py", Requirement(r)) for r in install_requires + extras["gpu"] + extras["dev"]]
    conflicts = []
    for source, req in declared:
        spec = list(req.specifier)
        name = canonicalize_name(req.name)
        if len(spec) == 1 and spec[0].operator == "==" and "*" not in spec[0].version and name not in exact:
            exact[name] = (Version(spec[0].version), f"{source}")
    for source, req in declared:
        name = canonicalize_name(req.name)
        if name in exact and not req.specifier.contains(exact[name][0], prereleases=True):
            conflicts.append(f"{source} requires {req} but {exact[name][1]} pins {name}=={exact[name][0]}")
    assert not conflicts, "conflicting pins:\n  " + "\n  ".join(sorted(set(conflicts)))

    # the CUDA major of the pinned torch decides which transformer-engine core must be pinned
    torch_deps = " ".join(installed["torch"]["metadata"].get("requires_dist") or [])
    cuda13 = re.search(r"cu13|cuda-toolkit.*13\.|nvidia-cuda-runtime[^,;]*==13\.", torch_deps) is not None
    assert cuda13 == ("transformer-engine-cu13" in pins), (
        f"torch=={exact['torch'][0]} is {'a CUDA 13' if cuda13 else 'not a CUDA 13'} build; "
        "pin the transformer-engine core of the same CUDA major (transformer-engine-cu13 / core-cu13)")


@pytest.mark.skipif(os.environ.get("MEGARL_FULL_GPU_RESOLVE") != "1",
                    reason="opt-in (MEGARL_FULL_GPU_RESOLVE=1): resolving all ~240 packages of the image "
                           "takes 40 s+; every exact pin is resolved by the tests above on each run")
def test_the_whole_dependency_tree_resolves(pip, tmp_path):
    lines = []
    for _, text in pin_lines():
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in SDIST_ONLY:
            continue
        if name == "transformer-engine":  # its pytorch extra is the sdist: pinned and built in the image
            text = f"{req.name}[{','.join(sorted(req.extras - {'pytorch'}))}]{req.specifier}"
        lines.append(text)
    install_requires, extras = setup_requirements()
    lines += [r for r in install_requires + extras["dev"]]
    report, seconds = _dry_run(pip, lines, tmp_path, no_deps=False, timeout=900)
    print(f"{len(report['install'])} packages resolved in {seconds:.0f} s")
