"""megarl.runtime: layout validation and the plain-process (world of one) bring-up."""

import os
import subprocess
import sys

import pytest

from megarl.runtime.distributed import ParallelConfigError, ParallelLayout
from tests._dist import ROOT


def test_layout_sizes_context_and_expert_parallel_and_rejects_unfit_ones_by_name():
    # context parallelism: dp = world / (tp x pp x cp)
    assert ParallelLayout(cp=2).validate(4) == 2
    assert ParallelLayout(tp=2, cp=2).validate(8) == 2
    with pytest.raises(ParallelConfigError, match=r"tp\*pp\*cp = 1\*1\*2 = 2"):
        ParallelLayout(cp=2).validate(3)
    with pytest.raises(ParallelConfigError, match=r"parallel\.cp must be >= 1"):
        ParallelLayout(cp=0).validate(2)
    # expert parallelism: the EP groups come out of the data-parallel ranks (etp * ep * pp | world)
    assert ParallelLayout(ep=2).validate(4) == 4
    assert ParallelLayout(tp=2, ep=2).validate(4) == 2
    assert ParallelLayout(tp=2, ep=2, etp=1).validate(2) == 1
    with pytest.raises(ParallelConfigError, match=r"parallel\.ep=3"):
        ParallelLayout(ep=3).validate(4)
    with pytest.raises(ParallelConfigError, match=r"parallel\.ep=2.*etp\*ep\*pp"):
        ParallelLayout(tp=2, ep=2).validate(2)
    with pytest.raises(ParallelConfigError, match=r"parallel\.etp"):
        ParallelLayout(etp=0).validate(2)
    with pytest.raises(ParallelConfigError, match="not divisible by tp\\*pp\\*cp"):
        ParallelLayout(tp=2, pp=2).validate(6)
    assert ParallelLayout(tp=2, pp=1).validate(8) == 4


def test_plain_process_world_leaves_environment_to_children(megatron_world):
    """A world of one must not export RANK/MASTER_PORT: a tool launched from this process
    would otherwise join (or collide with) this process's store instead of starting its own."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        assert key not in os.environ or os.environ.get("TORCHELASTIC_RUN_ID"), key
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from megarl.runtime import distributed as rt\n"
            "rt.initialize(tp=1, pp=1); rt.shutdown(); print('child ok')\n") % ROOT
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0 and "child ok" in out.stdout, out.stderr[-2000:]
