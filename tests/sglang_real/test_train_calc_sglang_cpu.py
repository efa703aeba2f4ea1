"""configs/grpo_calc_tiny.yaml with ``rollout.backend=sglang`` on CPU: multi-turn calculator sessions
on the real engine, trained by ``python -m megarl.train`` (one process, the engine beside the actor).

Checked from what the run leaves behind, with the main suite's audit of agent runs
(``tests/test_agent_training.check_agent_run``): every sealed trajectory's environment tokens are
out of the loss and carry no version, every policy token is on the iteration's version, GRPO groups
are whole trajectories, and the actor's one teacher-forced forward over each whole trajectory
reproduces the raw log-probs SGLang returned turn by turn (``rollout.reuse_rollout_log_probs=false``:
the old log-probs are the actor's, compared with the engine's) -- which holds only if every turn
continued from the trajectory's token ids."""

from __future__ import annotations

import os
import subprocess
import sys

from tests._dist import subprocess_env
from tests._train_runs import batches
from tests._agent_runs import B, CALC, G, calc_assets, check_agent_run  # noqa: F401 - a fixture


def test_calculator_recipe_trains_on_sessions_the_real_engine_ran(calc_assets, tmp_path):  # noqa: F811
    run_dir = str(tmp_path / "calc_sglang")
    a = calc_assets
    overrides = [f"model.path={a['model']}", "model.build_tiny=false", f"data.train_path={a['train']}",
                 f"data.heldout_path={a['heldout']}", "data.task.build=false", f"trainer.run_dir={run_dir}",
                 "trainer.iterations=2", f"trainer.prompts_per_iteration={B}", f"rollout.n={G}", "eval.n=8",
                 "eval.every=1", "eval.save_results=true", "trainer.save_experience=true",
                 "rollout.reuse_rollout_log_probs=false", "rollout.backend=sglang", "trainer.run_id=sglang-calc-cpu"]
    proc = subprocess.run([sys.executable, "-m", "megarl.train", "--config", CALC, *overrides], capture_output=True,
                          text=True, env=subprocess_env(), timeout=900)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    env_tokens, rate = check_agent_run(run_dir)
    assert env_tokens > 0 and rate > 0, (env_tokens, rate)  # the tool was called: the audit had something to audit
    from omegaconf import OmegaConf

    assert OmegaConf.load(os.path.join(run_dir, "config.yaml")).rollout.backend == "sglang"
    for b in batches(run_dir):
        assert b.facts.rollout_log_probs.producer.role == "rollout"
