import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests._dist import subprocess_env  # noqa: E402  (needs ROOT on sys.path)

#: the tiers, one folder each: tests/unit/<package>/ (in-process, the fast tier a newcomer runs
#: first), tests/multiproc/ (torchrun workers, subprocesses of megatron or of the tools),
#: tests/e2e/ (real runs of python -m megarl.train and the launchers)
TIERS = ("unit", "multiproc", "e2e")


def pytest_collection_modifyitems(config, items):
    """Each test carries its folder's tier as a marker (``-m unit`` selects the fast tier)."""
    tests = Path(__file__).resolve().parent
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(tests).parts
        if parts[0] in TIERS:
            item.add_marker(parts[0])


@pytest.fixture(scope="session")
def megatron_world():
    """A world-size-1 megatron parallel state (TP=PP=DP=1) shared by in-process tests."""
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    yield


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """A tiny warm-started model and task files (built by the real tools, small and quick)."""
    d = tmp_path_factory.mktemp("assets")
    model = d / "tiny"
    subprocess.run([sys.executable, "-m", "megarl.tinymodel", "--out", str(model), "--steps", "40",
                    "--target-accuracy", "0",
                    "--hidden-size", "64", "--num-layers", "2", "--intermediate-size", "128", "--task-arg", "max_digits=2"],
                   check=True, env=subprocess_env(), capture_output=True, timeout=600)
    for split, seed, n in (("train", 0, 400), ("heldout", 1, 16)):
        subprocess.run([sys.executable, "-m", "megarl.data.tasks.arithmetic", "--split", split, "--seed", str(seed),
                        "--n", str(n), "--max-digits", "2", "--out", str(d / f"{split}.jsonl")],
                       check=True, env=subprocess_env(), capture_output=True, timeout=120)
    return {"model": str(model), "train": str(d / "train.jsonl"), "heldout": str(d / "heldout.jsonl")}


