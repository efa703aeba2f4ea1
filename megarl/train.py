"""The main job: PPO / GRPO training.

    python -m megarl.train --config configs/grpo_arith_tiny.yaml [key=value ...]
    torchrun --nproc-per-node N -m megarl.train --config ... parallel.tp=2
    sbatch launch/multinode.sh configs/....yaml key=value ...

Start-up order: the config is loaded and validated first (unknown keys, wrong types and
inconsistent sizes exit with status 2 and the key named, before any model loads); then the
built-in assets are made if the recipe asks for them and they are missing (the tiny model, the
arithmetic task files: built once, cached at their paths); then torch.distributed and megatron
come up, the run directory gets the resolved config and its hash, and the loop runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from megarl.errors import MegarlError, cli_main

_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
             "TORCHELASTIC_USE_AGENT_STORE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME")


def _wait_for(path: str, what: str, timeout_s: float = 3600.0) -> None:
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > timeout_s:
            raise MegarlError(f"timed out after {timeout_s:.0f}s waiting for rank 0 to build {what} ({path})")
        time.sleep(1.0)


def ensure_builtin_assets(cfg) -> None:
    """Make the recipe's built-in tiny model and task files if they are missing (rank 0 builds,
    the other ranks wait for the finished marker).  The build runs as a plain single process,
    outside this job's process group."""
    from megarl.tinymodel import MARKER, is_built

    rank = int(os.environ.get("RANK", "0"))
    d = cfg.data
    if d.build_arithmetic:
        want = [(d.train_path, "train", d.arithmetic_train_n, 0)]
        if d.heldout_path:
            want.append((d.heldout_path, "heldout", d.arithmetic_heldout_n, 1))
        for path, split, n, seed in want:
            if os.path.exists(path):
                continue
            if rank == 0:
                from megarl.data.tasks.arithmetic import make_problems, write_jsonl

                rows = make_problems(split, seed, n, digits=(d.arithmetic_min_digits, d.arithmetic_max_digits))
                write_jsonl(path, rows)
                print(f"wrote the built-in arithmetic {split} split: {path} ({n} problems)", flush=True)
            else:
                _wait_for(path, f"the arithmetic {split} split")
    m = cfg.model
    if m.build_tiny and not is_built(m.path):
        if rank == 0:
            t = m.tiny
            cmd = [sys.executable, "-m", "megarl.tinymodel", "--out", m.path, "--hidden-size", str(t.hidden_size),
                   "--num-layers", str(t.num_layers), "--num-heads", str(t.num_heads),
                   "--num-kv-heads", str(t.num_kv_heads), "--intermediate-size", str(t.intermediate_size),
                   "--steps", str(t.warmstart_steps), "--lr", str(t.warmstart_lr), "--batch", str(t.warmstart_batch),
                   "--seed", str(t.seed), "--min-digits", str(d.arithmetic_min_digits),
                   "--max-digits", str(d.arithmetic_max_digits), "--overwrite"]
            env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
            print(f"model.path {m.path} is missing: building the built-in tiny model (cached for later runs)",
                  flush=True)
            if subprocess.run(cmd, env=env).returncode != 0:
                raise MegarlError(f"model.build_tiny: building the tiny model into {m.path} failed (see above)")
        else:
            _wait_for(os.path.join(m.path, MARKER), "the tiny model")


def _check_model(cfg) -> None:
    from megarl.config import ConfigError, validate_model_fit
    from megarl.models.hf_config import ModelConfigError, load_spec

    if not os.path.isdir(cfg.model.path):
        raise ConfigError(f"model.path: {cfg.model.path} is not a directory (an HF or megarl checkpoint); "
                          "set model.build_tiny=true to build the built-in tiny model there")
    try:
        spec = load_spec(cfg.model.path)
    except ModelConfigError as e:
        raise ConfigError(f"model.path: {e}") from None
    if spec.value_head:
        raise ConfigError(f"model.path: {cfg.model.path} is a value-head model; the actor needs a causal LM")
    validate_model_fit(cfg, spec, where=os.path.join(cfg.model.path, "config.json"))
    for key, path in (("data.train_path", cfg.data.train_path), ("data.heldout_path", cfg.data.heldout_path)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{key}: {path}: file not found")
    for key, path in (("critic.path", cfg.critic.path if cfg.critic else None),
                      ("reward.model.path", cfg.reward.model.path), ("reference.path", cfg.reference.path)):
        if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{key}: {path} has no config.json (expected an HF or megarl checkpoint)")


def _check_reward(cfg) -> None:
    """Build the reward function once, before any model: a bad ``reward.*`` fails fast."""
    if cfg.reward.fn:
        from megarl.rewards import build_reward_function

        build_reward_function(cfg.reward.fn, cfg.reward.kwargs, cfg.reward.components)


def write_run_files(cfg, run_dir: str, cfg_hash: str, world: int, dp: int) -> None:
    from omegaconf import OmegaConf

    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), os.path.join(run_dir, "config.yaml"))
    info = {"config_hash": cfg_hash, "recipe": cfg.recipe, "run_id": cfg.trainer.run_id,
            "world_size": world, "tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": dp,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv}
    with open(os.path.join(run_dir, "run.json"), "w") as f:
        json.dump(info, f, indent=1)


@cli_main
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a YAML recipe (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides (omegaconf dotlist)")
    args = p.parse_args(argv)

    from megarl.config import config_hash, default_run_dir, load_config, validate

    cfg = load_config(args.config, args.overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = validate(cfg, world)
    _check_reward(cfg)
    ensure_builtin_assets(cfg)
    _check_model(cfg)

    import torch

    from megarl.control.trainer import Trainer
    from megarl.runtime import distributed as rt
    from megarl.runtime.data_parallel import broadcast_object

    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(cfg.trainer.seed)
    rt.initialize(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.trainer.seed)
    run_dir = broadcast_object(cfg.trainer.run_dir or default_run_dir(cfg))
    cfg.trainer.run_dir = run_dir
    cfg.trainer.run_id = cfg.trainer.run_id or os.path.basename(os.path.normpath(run_dir)).replace("/", "-")
    h = config_hash(cfg)
    if rt.is_main():
        write_run_files(cfg, run_dir, h, world, dp)
        print(f"megarl.train: recipe {cfg.recipe}, {cfg.algo.name} ({cfg.algo.advantage}), world {world} = "
              f"tp {cfg.parallel.tp} x pp {cfg.parallel.pp} x dp {dp}, run dir {run_dir}, config {h[:15]}", flush=True)
    tokenizer_dir = cfg.model.tokenizer or cfg.model.path
    trainer = Trainer(cfg, run_dir, cfg.model.path, tokenizer_dir, run_id=cfg.trainer.run_id)
    result = trainer.run()
    if rt.is_main():
        acc = result.get("heldout_accuracy")
        print(f"done: {result['iterations']} iterations; final held-out accuracy "
              f"{'-' if acc is None else f'{acc:.3f}'}; exports in {os.path.join(run_dir, 'export')}", flush=True)
    rt.shutdown()
    return result


if __name__ == "__main__":
    main()
