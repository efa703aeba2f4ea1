"""Import layering: the data-plane packages never reach up into orchestration code.

``megarl/rollout``, ``megarl/experience`` and ``megarl/algo`` are used by the control loop and the
roles; they must not import ``megarl.control``, ``megarl.roles`` or ``megarl.train`` (that would
make a backend depend on the loop that drives it).  Types they share with the control plane live
in leaf modules such as ``megarl/versions.py``, which import nothing from megarl but other leaf
modules (``megarl/hashing.py``: the standard library only).

The check reads the source (AST), so it sees imports inside functions and ``TYPE_CHECKING``
blocks as well, and needs none of the heavy dependencies installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "megarl"

LOWER_LAYERS = ("rollout", "experience", "algo")
FORBIDDEN = ("megarl.control", "megarl.roles", "megarl.train")
LEAF_MODULES = ("versions.py", "hashing.py")
#: all a leaf module may import from megarl: the leaf modules
LEAF_IMPORTS = tuple("megarl." + leaf.removesuffix(".py") for leaf in LEAF_MODULES)


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(path: Path, root: Path = ROOT):
    """Yield (lineno, absolute module name) for every import in ``path``.

    ``from a import b`` yields both ``a`` and ``a.b`` (``b`` may be a submodule, e.g.
    ``from megarl import control``); relative imports are resolved against the file's package;
    ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name count too.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts)
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{mod}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            fn_name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            arg = node.args[0]
            if fn_name in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                yield node.lineno, arg.value


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _violations(path: Path, prefixes, root: Path = ROOT) -> list[str]:
    """``file:line: imports X`` for each import matching a prefix, one entry per imported name
    (``from a import b`` yields ``a`` and ``a.b``: ``a.b`` is dropped when ``a`` matched)."""
    hits: dict[int, set] = {}
    for lineno, mod in _imported_modules(path, root):
        if any(_matches(mod, p) for p in prefixes):
            hits.setdefault(lineno, set()).add(mod)
    out = []
    for lineno in sorted(hits):
        mods = hits[lineno]
        for mod in sorted(m for m in mods if not any(m != o and _matches(m, o) for o in mods)):
            out.append(f"{path.relative_to(root)}:{lineno}: imports {mod}")
    return out


def _lower_layer_files():
    files = []
    for sub in LOWER_LAYERS:
        files.extend(sorted((PKG / sub).rglob("*.py")))
    return files


def test_lower_layers_exist():
    # Guard against the walk silently checking nothing after a rename.
    for sub in LOWER_LAYERS:
        assert (PKG / sub / "__init__.py").is_file(), f"megarl/{sub} is not a package any more"
    assert len(_lower_layer_files()) >= 10


@pytest.mark.parametrize("path", _lower_layer_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_lower_layers_do_not_import_orchestration(path):
    bad = _violations(path, FORBIDDEN)
    assert not bad, (
        f"layering violation (megarl/{'|'.join(LOWER_LAYERS)} must not import "
        f"{', '.join(FORBIDDEN)}):\n" + "\n".join(bad)
    )


@pytest.mark.parametrize("leaf", LEAF_MODULES)
def test_leaf_modules_import_only_leaf_modules(leaf):
    path = PKG / leaf
    assert path.is_file(), f"megarl/{leaf} is missing"
    bad = [v for v in _violations(path, ("megarl",))
           if not any(_matches(v.rpartition(" imports ")[2], ok) for ok in LEAF_IMPORTS)]
    assert not bad, (f"megarl/{leaf} must be a leaf module (no megarl imports but "
                     f"{', '.join(LEAF_IMPORTS)}):\n" + "\n".join(bad))


def test_old_version_module_is_gone():
    assert not (PKG / "control" / "versions.py").exists(), (
        "megarl/control/versions.py was moved to megarl/versions.py; do not reintroduce it"
    )


def test_checker_sees_relative_and_nested_imports(tmp_path):
    # The checker itself: relative imports are resolved, imports inside functions are seen.
    pkg = tmp_path / "megarl" / "rollout"
    pkg.mkdir(parents=True)
    mod = pkg / "x.py"
    mod.write_text(
        "from ..control import state_machine\n"
        "def f():\n"
        "    import megarl.roles.offload\n"
        "    from megarl import train\n"
        "    import importlib; importlib.import_module('megarl.control.loop')\n"
        "from .protocol import LoadReport\n"
    )
    found = {(ln, m) for ln, m in _imported_modules(mod, tmp_path) if any(_matches(m, f) for f in FORBIDDEN)}
    assert (1, "megarl.control") in found
    assert (3, "megarl.roles.offload") in found
    assert (4, "megarl.train") in found
    assert (5, "megarl.control.loop") in found
    assert not any(ln == 6 for ln, _ in found)
    assert _violations(mod, FORBIDDEN, tmp_path) == [
        "megarl/rollout/x.py:1: imports megarl.control",
        "megarl/rollout/x.py:3: imports megarl.roles.offload",
        "megarl/rollout/x.py:4: imports megarl.train",
        "megarl/rollout/x.py:5: imports megarl.control.loop",
    ]


# ---- the iteration's phase components (megarl/control) --------------------------------------

#: one module per phase; each may import the shared control infrastructure below, never another
#: phase component: what one phase hands the next travels through the driver as the types of
#: ``megarl/control/interfaces.py``
PHASE_COMPONENTS = ("publication", "production", "scoring", "preparation", "learning", "persistence", "heldout",
                    "export")
#: what a phase component may import from megarl.control
SHARED_CONTROL = ("megarl.control.interfaces", "megarl.control.state_machine", "megarl.control.batch",
                  "megarl.control.candidates",
                  "megarl.control.placement")
#: the composition root and the driver: the only modules that import the phase components
WIRING = ("assembly", "trainer")


def _phase_of(stem: str):
    """The phase a module of megarl/control belongs to: the phase itself, or one of its variants
    (``<phase>_<variant>.py``: a part composed into the phase, e.g. ``production_ahead``)."""
    return next((c for c in PHASE_COMPONENTS if stem == c or stem.startswith(c + "_")), None)


def _phase_modules():
    return sorted(p.stem for p in (PKG / "control").glob("*.py") if _phase_of(p.stem) is not None)


def test_control_layout_is_the_phase_components():
    # Guard against a rename leaving a phase unchecked, and against a phase growing back into
    # one module: every module of megarl/control is a phase (or a variant of one), shared
    # infrastructure or wiring.
    present = {p.stem for p in (PKG / "control").glob("*.py")} - {"__init__"}
    expected = set(PHASE_COMPONENTS) | {m.rpartition(".")[2] for m in SHARED_CONTROL} | set(WIRING)
    assert present - set(_phase_modules()) == expected - set(PHASE_COMPONENTS), \
        f"megarl/control holds {sorted(present)}, the layout names {sorted(expected)} and phase variants"
    assert set(PHASE_COMPONENTS) <= present
    for name in present:
        lines = len((PKG / "control" / f"{name}.py").read_text().splitlines())
        assert lines <= 500, f"megarl/control/{name}.py has {lines} lines; split it (at most ~500 per module)"


@pytest.mark.parametrize("component", _phase_modules())
def test_phase_components_import_each_other_only_through_interfaces(component):
    path = PKG / "control" / f"{component}.py"
    own = f"megarl.control.{_phase_of(component)}"  # a variant composes into its own phase
    bad = [v for v in _violations(path, ("megarl.control",))
           if not any(_matches(v.rpartition(" imports ")[2], ok) for ok in SHARED_CONTROL + (own,))
           and v.rpartition(" imports ")[2] != "megarl.control"]
    assert not bad, (f"megarl/control/{component}.py may import only {', '.join(SHARED_CONTROL)} (and its own "
                     "phase) from megarl.control (phases talk through the driver):\n" + "\n".join(bad))


def test_only_the_wiring_imports_the_phase_components():
    users = []
    for path in sorted(PKG.rglob("*.py")):
        if path.parent == PKG / "control" and path.stem in WIRING:
            continue
        mine = _phase_of(path.stem) if path.parent == PKG / "control" else None
        others = tuple(f"megarl.control.{c}" for c in _phase_modules() if _phase_of(c) != mine)
        for line in _violations(path, others):
            users.append(line)
    assert not users, "only megarl/control/assembly.py and trainer.py may import phase components:\n" + "\n".join(users)


# ---- the whole package: no import circles, and direction rules ----------------------------


def _module_graph(root: Path = ROOT) -> dict:
    """megarl's import graph, lazy imports included: module -> {imported module: first line}.
    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a`` (whose
    ``__init__`` defines ``b``); a name inside a module is an edge to that module.  A package's
    own ``__init__`` running because a submodule is imported is Python's mechanics, not an edge."""
    pkg = root / "megarl"
    modules = {_module_name(p, root): p for p in pkg.rglob("*.py")}

    def owner(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict = {m: {} for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    mod = ".".join(base) + (f".{node.module}" if node.module else "")
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                fn = node.func
                if (fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)) in ("import_module", "__import__"):
                    targets = [node.args[0].value]
            for t in targets:
                if _matches(t, "megarl"):
                    o = owner(t)
                    if o is not None and o != name:
                        graph[name].setdefault(o, node.lineno)
    return graph


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(circle: list, graph: dict) -> str:
    return "  " + " | ".join(f"{a} -> {b} (line {graph[a][b]})" for a in circle for b in circle if b in graph[a])


def test_no_import_circles():
    graph = _module_graph()
    assert len(graph) > 100  # the walk saw the package
    circles = _circles(graph)
    assert not circles, "import circles (lazy imports included):\n" + "\n".join(_describe(c, graph) for c in circles)


def test_the_circle_finder_finds_a_lazy_circle(tmp_path):
    pkg = tmp_path / "megarl"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from megarl.a.y import f\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from megarl.a import z\n")
    (pkg / "a" / "z.py").write_text("from . import x\n")
    (pkg / "b.py").write_text("import megarl.a.x\n")
    graph = _module_graph(tmp_path)
    assert _circles(graph) == [["megarl.a.x", "megarl.a.y", "megarl.a.z"]]
    (pkg / "a" / "z.py").write_text("")
    assert _circles(_module_graph(tmp_path)) == []


#: who may not import whom: a package (prefix) -> the packages it must not reach.  The commands
#: and entry points sit on top; control and roles orchestrate; the rest are used by them.
TOP = ("megarl.train", "megarl.eval", "megarl.quickstart", "megarl.commands")
DIRECTION = {
    "megarl.config.schema": ("megarl",),  # the schema: no feature, only the leaf vocabulary (below)
    # the config never imports a feature: each checks its own keys where the run is assembled
    # (megarl/commands/run_checks.py)
    "megarl.config": TOP + ("megarl.control", "megarl.roles", "megarl.rollout", "megarl.experience",
                            "megarl.evaluation", "megarl.data", "megarl.runtime", "megarl.algo", "megarl.envs",
                            "megarl.models", "megarl.observability", "megarl.rewards", "megarl.builtin",
                            "megarl.checkpointing"),
    "megarl.models": TOP + ("megarl.builtin", "megarl.control", "megarl.roles", "megarl.rollout", "megarl.rewards", "megarl.envs",
                            "megarl.data", "megarl.evaluation", "megarl.observability", "megarl.algo",
                            "megarl.checkpointing"),
    # checkpoints and run directories: above the models they save, below the loop that decides when
    "megarl.checkpointing": TOP + ("megarl.builtin", "megarl.control", "megarl.roles", "megarl.rollout",
                                   "megarl.evaluation", "megarl.rewards", "megarl.envs", "megarl.data", "megarl.algo",
                                   "megarl.observability", "megarl.experience"),
    "megarl.roles": TOP + ("megarl.builtin", "megarl.control", "megarl.evaluation"),
    "megarl.data": TOP + ("megarl.builtin", "megarl.control", "megarl.roles", "megarl.rollout", "megarl.models", "megarl.evaluation",
                          "megarl.observability", "megarl.algo", "megarl.runtime", "megarl.checkpointing"),
    # a built-in task defines its own scoring (megarl/data/tasks): rewards may read it
    "megarl.rewards": TOP + ("megarl.builtin", "megarl.control", "megarl.roles", "megarl.rollout", "megarl.models",
                             "megarl.evaluation", "megarl.observability", "megarl.algo", "megarl.envs",
                             "megarl.runtime", "megarl.config", "megarl.checkpointing"),
    "megarl.envs": TOP + ("megarl.builtin", "megarl.control", "megarl.roles", "megarl.rollout", "megarl.models", "megarl.evaluation",
                          "megarl.observability", "megarl.algo", "megarl.runtime", "megarl.config",
                          "megarl.checkpointing"),
    "megarl.observability": TOP + ("megarl.builtin", "megarl.control", "megarl.roles", "megarl.rollout", "megarl.models",
                                   "megarl.data", "megarl.rewards", "megarl.envs", "megarl.evaluation",
                                   "megarl.algo", "megarl.experience", "megarl.runtime", "megarl.checkpointing"),
    # the ground floor (process groups, device policy, the fault decisions): nothing above it,
    # models, rollout, roles and control included; checkpoints live in megarl.checkpointing
    "megarl.runtime": ("megarl",),
    "megarl.control": TOP,
    # the estimators: pure functions of the candidates' outcomes
    "megarl.evaluation": TOP + ("megarl.builtin", "megarl.control", "megarl.roles", "megarl.rollout", "megarl.models", "megarl.runtime",
                            "megarl.checkpointing"),
    # the built-in assets sit beside the commands that make them; nothing below imports them
    "megarl.builtin": TOP + ("megarl.control", "megarl.evaluation"),
}
#: what every module may import whatever its rules: the leaf vocabulary
LEAF_VOCABULARY = ("megarl.errors", "megarl.hashing", "megarl.versions", "megarl.dotted", "megarl.splitmix")


def _direction_violations(root: Path = ROOT) -> list:
    graph = _module_graph(root)
    out = []
    for name, edges in sorted(graph.items()):
        rules = [p for p in DIRECTION if _matches(name, p)]
        if not rules:
            continue
        rule = max(rules, key=len)  # the most specific package's rule
        rel = str(Path(*name.split(".")).with_suffix(".py"))
        if not (root / rel).is_file():
            rel = str(Path(*name.split(".")) / "__init__.py")
        for target, line in sorted(edges.items()):
            if _matches(target, rule) or any(_matches(target, ok) for ok in LEAF_VOCABULARY):
                continue
            if any(_matches(target, bad) for bad in DIRECTION[rule]):
                out.append(f"{rel}:{line}: imports {target} ({rule} must not import {', '.join(DIRECTION[rule])})")
    return out


def test_imports_run_downward():
    bad = _direction_violations()
    assert not bad, "imports that run upward:\n" + "\n".join(bad)


def test_the_direction_rule_finds_a_planted_violation(tmp_path):
    # The direction check itself, on a copy of the layout: an upward import (lazy, relative or
    # by name) is reported with its file, line and rule; the same tree without it is clean.
    pkg = tmp_path / "megarl"
    for sub in ("runtime", "models", "rollout", "checkpointing", "control"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "models" / "builder.py").write_text("from megarl.runtime import faults\n")
    (pkg / "rollout" / "protocol.py").write_text("")
    (pkg / "control" / "loop.py").write_text("")
    (pkg / "checkpointing" / "checkpoint.py").write_text("from megarl.models import builder\n")
    (pkg / "runtime" / "faults.py").write_text("from megarl.errors import MegarlError\n")
    assert _direction_violations(tmp_path) == []
    (pkg / "runtime" / "faults.py").write_text(
        "from megarl.errors import MegarlError\n"
        "def wrap():\n"
        "    from ..rollout.protocol import EngineWrapper\n"
        "import importlib; importlib.import_module('megarl.models.builder')\n")
    (pkg / "checkpointing" / "checkpoint.py").write_text("from megarl.models import builder\nimport megarl.control.loop\n")
    bad = _direction_violations(tmp_path)
    assert [b.split(" (")[0] for b in bad] == [
        "megarl/checkpointing/checkpoint.py:2: imports megarl.control.loop",
        "megarl/runtime/faults.py:4: imports megarl.models.builder",
        "megarl/runtime/faults.py:3: imports megarl.rollout.protocol",
    ], bad
    assert all("megarl.runtime must not import megarl)" in b for b in bad[1:])


#: what only the micro-batch layer calls: megatron's schedule and the model's forward on a micro-batch
ONE_PLACE = {"get_forward_backward_func": "megarl/models/micro_batches.py",
             "packed_seq_params=mb.packed_seq_params()": "megarl/models/micro_batches.py"}


def _callers(root: Path, needle: str) -> list:
    """The files under ``root``/megarl whose code (not comments or strings) names ``needle``."""
    out = []
    for path in sorted((root / "megarl").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and needle in ast.unparse(node):
                out.append(str(path.relative_to(root)))
                break
    return out


@pytest.mark.parametrize("needle", sorted(ONE_PLACE))
def test_one_schedule_call_and_one_model_call(needle):
    """The forward-only passes and the update reach megatron's schedule and the model's packed
    forward through one module: a second copy is where CP, SP, EP or VPP would land twice."""
    assert _callers(ROOT, needle) == [ONE_PLACE[needle]]


def test_the_one_place_check_sees_a_second_copy(tmp_path):
    pkg = tmp_path / "megarl" / "models"
    pkg.mkdir(parents=True)
    (pkg / "micro_batches.py").write_text("def f(g):\n    return g.get_forward_backward_func()()\n")
    assert _callers(tmp_path, "get_forward_backward_func") == ["megarl/models/micro_batches.py"]
    (pkg / "optim.py").write_text("# get_forward_backward_func is not called here\n"
                                  "from x import get_forward_backward_func\n"
                                  "def step():\n    get_forward_backward_func()(forward_only=False)\n")
    assert _callers(tmp_path, "get_forward_backward_func") == ["megarl/models/micro_batches.py", "megarl/models/optim.py"]


def _imports_of(path: Path) -> list:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


def _test_module_imports(root: Path) -> list:
    """Test modules (``test_*.py``) imported by any file under tests/, bench/ or tools/, and any
    tests module bench/ or tools/ import: shared helpers live in the tests' support modules."""
    out = []
    for folder in ("tests", "bench", "tools"):
        for path in sorted((root / folder).rglob("*.py")) if (root / folder).is_dir() else []:
            for name in _imports_of(path):
                last = name.split(".")[-1]
                bare = "." not in name and name.startswith("test_")  # from test_x import ... (a sibling on sys.path)
                if bare or name.startswith("tests.") and (last.startswith("test_") or folder != "tests"):
                    out.append(f"{path.relative_to(root)}: {name}")
    return sorted(out)


def test_no_test_module_imports_another_and_bench_imports_no_test():
    bad = _test_module_imports(ROOT)
    assert not bad, "\n".join(bad)


def test_the_test_import_check_sees_one(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("from tests._support import x\n")
    (tmp_path / "bench" / "b.py").write_text("import json\n")
    assert _test_module_imports(tmp_path) == []
    (tmp_path / "tests" / "test_c.py").write_text("def f():\n    from tests.test_a import y\n")
    (tmp_path / "bench" / "b.py").write_text("from tests._support import x\n")
    assert _test_module_imports(tmp_path) == ["bench/b.py: tests._support", "tests/test_c.py: tests.test_a"]
    (tmp_path / "tests" / "test_d.py").write_text("from test_a import y\n")  # the sibling, by its bare name
    assert _test_module_imports(tmp_path)[-1] == "tests/test_d.py: test_a"
