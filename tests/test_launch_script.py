"""launch/multinode.sh builds the right srun/torchrun line (Slurm commands faked on PATH)."""

import os
import stat
import subprocess

from tests._dist import ROOT

SCRIPT = os.path.join(ROOT, "launch", "multinode.sh")


def _fake(bin_dir, name, body):
    p = bin_dir / name
    p.write_text("#!/bin/bash\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_multinode_passes_config_and_overrides(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "srun.log"
    _fake(bin_dir, "scontrol", 'printf "node-a\\nnode-b\\n"\n')
    _fake(bin_dir, "srun", f'if [[ "$*" == *hostname* ]]; then echo 10.9.8.7; else echo "$@" >> {log}; fi\n')
    cfg = tmp_path / "job.yaml"
    cfg.write_text("a: 1\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NNODES="2",
               SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_ID="77", GPUS_PER_NODE="4")
    proc = subprocess.run(["bash", SCRIPT, str(cfg), "actor.tp=4", "algo.name=grpo"], env=env,
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = log.read_text().strip()
    for part in ("torchrun", "--nnodes 2", "--nproc-per-node 4", "--rdzv-id 77", "--rdzv-backend c10d",
                 "--rdzv-endpoint 10.9.8.7:29500", "-m megarl.train", f"--config {cfg}",
                 "actor.tp=4 algo.name=grpo"):
        assert part in line, (part, line)


def test_multinode_rejects_missing_config(tmp_path):
    proc = subprocess.run(["bash", SCRIPT, str(tmp_path / "nope.yaml")], capture_output=True, text=True)
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr
