"""What ``python -m megarl.train`` checks and makes before any model loads: the model, data and role
paths (Hub ids resolved), the reward function built once, the built-in task files and tiny model
(built once, cached at their paths; every rank but the first waits for them), and the run
directory's ``config.yaml`` / ``run.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from megarl.errors import ConfigError, MegarlError

#: the torchrun variables a rank's child process (the tiny model's build) must not inherit
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
             "TORCHELASTIC_USE_AGENT_STORE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME")


def _wait_for(path: str, what: str, timeout_s: float = 3600.0) -> None:
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > timeout_s:
            raise MegarlError(f"timed out after {timeout_s:.0f}s waiting for rank 0 to build {what} ({path})")
        time.sleep(1.0)


def ensure_builtin_task(cfg) -> None:
    """Write the recipe's built-in task files (``data.task``, megarl/builtin/tasks) if they are
    missing: rank 0 writes, the other ranks wait for them.  The held-out file holds distinct
    problems (an evaluation set).  A file already there must hold exactly what these settings
    write -- a cache made by other ``data.task`` settings or an older megarl is refused, naming
    the file, never used in silence."""
    from megarl.builtin.tasks import get_task, task_settings
    from megarl.data.tasks.arithmetic import write_jsonl

    rank = int(os.environ.get("RANK", "0"))
    d, task = cfg.data, cfg.data.task
    if task.name is None or not task.build:
        return
    splits = get_task(task.name).splits(task_settings(task.name, task.args), task.train_n, task.heldout_n)
    want = [(d.train_path, "train")] + ([(d.heldout_path, "heldout")] if d.heldout_path else [])
    for path, split in want:
        if rank != 0:
            if not os.path.exists(path):
                _wait_for(path, f"the {task.name} {split} split")
            continue
        rows = splits[split]()
        if os.path.exists(path):
            _check_cached_task(path, rows, split)
            continue
        write_jsonl(path, rows)
        print(f"wrote the built-in {task.name} {split} split: {path} ({len(rows)} problems)", flush=True)


def _check_cached_task(path: str, rows, split: str) -> None:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            cached = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise MegarlError(f"data.task: {path} exists but cannot be read as the built-in {split} "
                          f"split ({type(e).__name__}: {e}); delete it to have it written again") from None
    if cached != rows:
        raise MegarlError(f"data.task: {path} holds another {split} split than these settings write "
                          "(other data.task values, or a cache from an older megarl); delete it to have it "
                          "written again, point MEGARL_CACHE elsewhere, or set data.task.build=false to use "
                          "the file as it is")


def build_command(cfg) -> list[str]:
    """``python -m megarl.tinymodel ...`` for the tiny model of ``model.tiny.*`` on ``data.task``."""
    from megarl.builtin.tasks import settings_dict, task_settings

    t, task = cfg.model.tiny, cfg.data.task
    cmd = [sys.executable, "-m", "megarl.tinymodel", "--out", cfg.model.path, "--task", task.name,
           "--hidden-size", str(t.hidden_size), "--num-layers", str(t.num_layers), "--num-heads", str(t.num_heads),
           "--num-kv-heads", str(t.num_kv_heads), "--intermediate-size", str(t.intermediate_size),
           "--steps", str(t.warmstart_steps), "--lr", str(t.warmstart_lr), "--batch", str(t.warmstart_batch),
           "--adam-beta2", str(t.warmstart_adam_beta2), "--target-accuracy", str(t.warmstart_target_accuracy or 0),
           "--heldout-n", str(task.heldout_n), "--seed", str(t.seed), "--overwrite"]
    if t.family != "llama":
        cmd += ["--family", t.family, "--num-experts", str(t.num_experts), "--top-k", str(t.top_k),
                "--moe-intermediate-size", str(t.moe_intermediate_size)]
    for k, v in settings_dict(task_settings(task.name, task.args)).items():
        cmd += ["--task-arg", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return cmd


def ensure_builtin_model(cfg) -> None:
    """Build the recipe's built-in tiny model if it is missing (rank 0 builds, the other ranks
    wait for the finished marker).  The build runs as a plain single process, outside this job's
    process group."""
    from megarl.builtin.warmstart import MARKER, is_built

    rank = int(os.environ.get("RANK", "0"))
    m = cfg.model
    if m.build_tiny and is_built(m.path):
        _check_cached_model(cfg)
    if m.build_tiny and not is_built(m.path):
        if rank == 0:
            _run_build(build_command(cfg), m.path)
        else:
            _wait_for(os.path.join(m.path, MARKER), "the tiny model")


def teacher_build_recipe(recipe: str) -> str:
    """``teacher.build.recipe`` as a file: the path itself, or one under the project's root (where
    ``configs/`` is).  ConfigError naming the key otherwise."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for candidate in (recipe, os.path.join(root, recipe)):
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise ConfigError(f"teacher.build.recipe: {recipe!r} is not a file (looked in the working directory and {root})")


def ensure_teacher(cfg) -> None:
    """``teacher.build``: make the teacher when ``teacher.path`` is missing, by training
    ``teacher.build.recipe`` into ``teacher.build.run_dir`` (rank 0, a plain single process; the
    other ranks wait for the run's DONE marker).  Afterwards ``teacher.path`` must exist: else
    one error naming it and the exports the build left."""
    import sys

    t = cfg.teacher
    if not t.path or not t.build.recipe or os.path.isfile(os.path.join(t.path, "config.json")):
        return
    run_dir = t.build.run_dir
    done = os.path.join(run_dir, "DONE")
    if int(os.environ.get("RANK", "0")) == 0:
        cmd = [sys.executable, "-m", "megarl.train", "--config", teacher_build_recipe(t.build.recipe),
               *t.build.overrides, f"trainer.run_dir={run_dir}"]
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        env["PYTHONUNBUFFERED"] = "1"
        print(f"teacher.path {t.path} is missing: training the teacher ({' '.join(cmd[3:])})", flush=True)
        if subprocess.run(cmd, env=env).returncode != 0:
            raise MegarlError(f"teacher.build: training the teacher into {run_dir} failed (see above)")
    else:
        _wait_for(done, "the teacher")
    if not os.path.isfile(os.path.join(t.path, "config.json")):
        exports = sorted(os.listdir(os.path.join(run_dir, "export"))) if os.path.isdir(os.path.join(run_dir, "export")) else []
        raise ConfigError(f"teacher.path: {t.path!r} is not among what teacher.build made in {run_dir} "
                          f"(its exports: {exports or 'none'})")


def _run_build(cmd: list[str], path: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["PYTHONUNBUFFERED"] = "1"  # the build's progress reaches a redirected log as it happens, not at its exit
    print(f"model.path {path} is missing: building the built-in tiny model (cached for later runs)", flush=True)
    if subprocess.run(cmd, env=env).returncode != 0:
        raise MegarlError(f"model.build_tiny: building the tiny model into {path} failed (see above)")


#: the config key behind each ``tiny_model.json`` entry the cache check compares
_CONFIG_KEYS = {"warmstart.max_steps": "model.tiny.warmstart_steps", "warmstart.lr": "model.tiny.warmstart_lr",
                "warmstart.batch": "model.tiny.warmstart_batch", "warmstart.seed": "model.tiny.seed",
                "warmstart.adam_beta2": "model.tiny.warmstart_adam_beta2",
                "warmstart.target_accuracy": "model.tiny.warmstart_target_accuracy",
                "warmstart.heldout_n": "data.task.heldout_n", "task.name": "data.task.name",
                "moe": "model.tiny.num_experts / top_k / moe_intermediate_size"}


def _tiny_settings(cfg) -> dict:
    """What ``tiny_model.json`` records of a build made with these settings (dotted keys)."""
    from megarl.builtin.tasks import get_task, task_settings

    t, task = cfg.model.tiny, cfg.data.task
    want = {"family": t.family, "hidden_size": t.hidden_size, "num_layers": t.num_layers,
            "num_heads": t.num_heads, "num_kv_heads": t.num_kv_heads,
            "warmstart.max_steps": t.warmstart_steps, "warmstart.lr": t.warmstart_lr,
            "warmstart.batch": t.warmstart_batch, "warmstart.seed": t.seed,
            "warmstart.target_accuracy": t.warmstart_target_accuracy or None,
            "warmstart.heldout_n": task.heldout_n}
    if t.warmstart_adam_beta2 != 0.999:  # (a build by an older megarl records none: the default)
        want["warmstart.adam_beta2"] = t.warmstart_adam_beta2
    if t.family == "llama":
        want["intermediate_size"] = t.intermediate_size
    else:
        want["moe"] = {"num_experts": t.num_experts, "top_k": t.top_k, "moe_intermediate_size": t.moe_intermediate_size}
    want.update(get_task(task.name).recorded(task_settings(task.name, task.args), bool(t.warmstart_target_accuracy)))
    return want


def _check_cached_model(cfg) -> None:
    """A tiny model already at ``model.path`` must be the build of these ``model.tiny.*`` and
    ``data.task`` settings: one made by other settings, or by an older megarl, is refused naming
    the first setting that differs -- never trained on in silence."""
    import json

    from megarl.builtin.tasks import get_task
    from megarl.builtin.warmstart import MARKER

    path = os.path.join(cfg.model.path, MARKER)
    with open(path) as f:
        info = json.load(f)
    for key, want in _tiny_settings(cfg).items():
        node = info
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != want:
            config_key = {**_CONFIG_KEYS, **get_task(cfg.data.task.name).CONFIG_KEYS}.get(key, f"model.tiny.{key}")
            raise MegarlError(
                f"model.build_tiny: {cfg.model.path} holds a tiny model built with other settings ({config_key}: "
                f"the cached build has {node!r}, the config {want!r}; a build by an older megarl records no "
                "warmstart.max_steps); delete it to have it built again, point MEGARL_CACHE elsewhere, or set "
                "model.build_tiny=false to use it as it is")


def check_model(cfg) -> dict:
    """Resolve Hub ids to local snapshots (megarl/data/hub.py), then check the model, data and role
    paths without loading weights.  Returns what was resolved from the Hub (for run.json)."""
    from megarl.config import ConfigError
    from megarl.data.hub import resolve_sources
    from megarl.data.prompts import check_source
    from megarl.models.fit import validate_model_fit
    from megarl.models.hf_config import ModelConfigError, load_spec

    sources = resolve_sources(cfg)
    if not os.path.isdir(cfg.model.path):
        raise ConfigError(f"model.path: {cfg.model.path} is not a directory (an HF or megarl checkpoint, or a Hub "
                          "id like Qwen/Qwen2.5-0.5B-Instruct); or set model.build_tiny=true to build the built-in "
                          "tiny model there")
    try:
        spec = load_spec(cfg.model.path)
    except ModelConfigError as e:
        raise ConfigError(f"model.path: {e}") from None
    if spec.value_head:
        raise ConfigError(f"model.path: {cfg.model.path} is a value-head model; the actor needs a causal LM")
    validate_model_fit(cfg, spec, where=os.path.join(cfg.model.path, "config.json"))
    for key, path in (("data.train_path", cfg.data.train_path), ("data.heldout_path", cfg.data.heldout_path)):
        if path is not None:
            try:
                check_source(path)  # a file, a directory of files, a `datasets` directory or a Hub dataset
            except MegarlError as e:
                raise ConfigError(f"{key}: {e}") from None
    for key, path in (("critic.path", cfg.critic.path if cfg.critic else None), ("reference.path", cfg.reference.path),
                      *((f"{k}.path", m.path) for k, m in cfg.reward.neural_models())):
        if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{key}: {path} has no config.json (expected an HF or megarl checkpoint)")
    for key, m in cfg.reward.neural_models():
        try:
            head = load_spec(m.path)
        except ModelConfigError as e:
            raise ConfigError(f"{key}.path: {e}") from None
        if not head.value_head:
            raise ConfigError(f"{key}.path: {m.path} is {head.architecture}, not a reward model (expected an HF "
                              "*ForSequenceClassification or *ForTokenClassification with num_labels=1; "
                              "python -m megarl.train_rm makes one from a causal LM)")
        from megarl.roles.reward_model import recorded_scorer_prompt

        known, trained = recorded_scorer_prompt(m.path)
        if known and trained != m.prompt:  # it would score inputs unlike any it was trained on
            raise ConfigError(f"{key}.prompt: {m.prompt!r}, but {m.path} was trained reading the user turn as "
                              f"{trained!r} (megarl.train_rm's data.prompt); set {key}.prompt to that")
    for i, j in enumerate(cfg.reward.judges):
        key = f"reward.judges[{i}].path"
        if not os.path.isfile(os.path.join(j.path, "config.json")):
            raise ConfigError(f"{key}: {j.path} has no config.json (expected an HF causal LM)")
        try:
            head = load_spec(j.path)
        except ModelConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        if head.value_head:
            raise ConfigError(f"{key}: {j.path} is {head.architecture}, a scoring head; a judge generates its "
                              "verdict (an HF *ForCausalLM expected; a scoring model goes in reward.models)")
    return sources


def check_reward(cfg) -> None:
    """Build the reward function once, before any model: a bad ``reward.*`` fails fast."""
    if cfg.reward.fn:
        from megarl.rewards.dataset_fields import configured_reward

        from megarl.rewards.config_checks import check_sandbox_hides_data

        # the start-up data check reads its field declaration from this object
        check_sandbox_hides_data(cfg, configured_reward(cfg))
    if cfg.eval.grader is not None:
        from megarl.rewards import build_reward_function

        try:
            build_reward_function(cfg.eval.grader, cfg.eval.grader_kwargs, [])
        except MegarlError as e:
            raise ConfigError(f"eval.grader: {str(e).removeprefix('reward.fn: ')}") from None
        except (ValueError, TypeError, ImportError) as e:
            raise ConfigError(f"eval.grader: {cfg.eval.grader!r}: {e}") from None


def write_run_files(cfg, run_dir: str, cfg_hash: str, world: int, dp: int, sources: dict | None = None) -> None:
    from omegaconf import OmegaConf

    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), os.path.join(run_dir, "config.yaml"))
    info = {"config_hash": cfg_hash, "recipe": cfg.recipe, "run_id": cfg.trainer.run_id,
            "world_size": world, "tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "cp": cfg.parallel.cp, "dp": dp,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv}
    if sources:  # Hub ids the config named: id, revision and the commit the run loaded
        info["sources"] = sources
    with open(os.path.join(run_dir, "run.json"), "w") as f:
        json.dump(info, f, indent=1)


def check_start_paths(cfg) -> None:
    """Every directory the start writes into, before anything is built: the run directory (or
    runs/ for the default one) and the built-in assets' directories when they must be built."""
    from megarl.builtin.warmstart import is_built
    from megarl.checkpointing.run_dir import check_writable

    run_dir = cfg.trainer.run_dir
    check_writable("trainer.run_dir", run_dir if run_dir else "runs")
    if cfg.model.build_tiny and not is_built(cfg.model.path):
        check_writable("model.path", cfg.model.path)
    if cfg.data.task.name is not None and cfg.data.task.build:
        for key in ("data.train_path", "data.heldout_path"):
            path = getattr(cfg.data, key.split(".")[1])
            if path and not os.path.exists(path):
                check_writable(key, os.path.dirname(os.path.abspath(path)))
