"""The README's commands work as printed, and so do those of the reference pages it links
(``docs/*.md``): every training command on a recipe of configs/ sets every required key and
validates at the world size it launches (torchrun's --nproc-per-node, sbatch's --nodes x 8 GPUs of
launch/multinode.sh), every config key they name exists, and the README's test command is the one
.ci/run runs."""

import os
import re
import shlex

from megarl.commands.run_checks import check_run
from megarl.config import load_config
from tests._dist import ROOT

README = os.path.join(ROOT, "README.md")
#: the README and the reference pages that hold what moved out of it
PAGES = [README] + sorted(os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                          if f.endswith(".md"))


def _all_pages() -> str:
    text = []
    for path in PAGES:
        with open(path, encoding="utf-8") as f:
            text.append(f.read())
    return "\n".join(text)


def _bash_commands(text):
    """Every command of the README's ```bash blocks, continuation lines joined, comments cut."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _training_launch(cmd):
    """``(config, overrides, world size)`` of a training command, else None."""
    argv = shlex.split(cmd)
    if "launch/multinode.sh" in argv:
        i = argv.index("launch/multinode.sh")
        nodes = next((int(a.split("=", 1)[1]) for a in argv[:i] if a.startswith("--nodes=")), 2)  # #SBATCH --nodes=2
        return argv[i + 1], argv[i + 2:], nodes * 8  # GPUS_PER_NODE defaults to 8
    if "megarl.train" not in argv or "--config" not in argv:
        return None
    world = 1
    if argv[0] == "torchrun":
        world = int(argv[argv.index("--nproc-per-node") + 1])
    rest = argv[argv.index("megarl.train") + 1:]
    config = rest[rest.index("--config") + 1]
    if "--world-size" in rest:
        world = int(rest[rest.index("--world-size") + 1])
    return config, [a for a in rest if "=" in a and not a.startswith("-")], world


def test_readme_training_commands_validate():
    commands = _bash_commands(_all_pages())
    checked = []
    for cmd in commands:
        launch = _training_launch(cmd)
        if launch is None:
            continue
        config, overrides, world = launch
        if not os.path.isfile(os.path.join(ROOT, config)):  # a placeholder: my.yaml, YOUR_RECIPE.yaml
            continue
        assert not any(o.endswith("=...") for o in overrides), f"a placeholder value in: {cmd}"
        cfg = load_config(os.path.join(ROOT, config), overrides)  # a required key left unset fails here
        check_run(cfg, world)
        checked.append((config, world))
    # at least the four launch lines of docs/recipes.md
    for want in [("configs/grpo_arith_tiny.yaml", 1), ("configs/ppo_arith_tiny.yaml", 2),
                 ("configs/grpo_qwen2_7b.yaml", 8), ("configs/ppo_llama3_8b.yaml", 16)]:
        assert want in checked, (want, checked)


def test_readme_test_command_is_what_ci_runs():
    with open(README, encoding="utf-8") as f:
        commands = _bash_commands(f.read())
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith(("#", "set ", "cd "))]
    for line in ci:
        assert line in commands, line
    assert len(ci) == 3, ci
    assert ci[0].startswith("command -v bwrap") and "apt-get install" in ci[0] and "bubblewrap" in ci[0]
    # the suites say what they skip and why
    assert "python -m pytest -q -rs -p no:cacheprovider tests" in ci[1]
    # the real SGLang engine's tests, in the environment tools/sglang_env.sh builds
    assert "tools/sglang_env.sh" in ci[2] and "-rs" in ci[2] and ci[2].endswith("tests/sglang_real")


def _schema_has(path):
    """Whether ``section.key[.sub...]`` names a key of megarl.config's schema, or of
    ``python -m megarl.train_rm``'s (a dict-typed key such as reward.kwargs takes any sub-key)."""
    from megarl.config.rm_schema import RMTrainConfig

    return _has(path) or _has(path, RMTrainConfig)


def _has(path, root=None):
    import dataclasses

    from megarl import config as C

    if path.startswith("data.task.args."):  # a built-in task's own setting (megarl/builtin/tasks)
        from megarl.builtin.tasks import TASKS, get_task

        key = path.split(".")[3]
        return any(key in {f.name for f in dataclasses.fields(get_task(t).Settings)} for t in TASKS)
    cls = root or C.TrainConfig
    for i, part in enumerate(path.split(".")):
        if cls is None:
            return False
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return False
        if i == 0 and part == "critic":  # Optional[CriticConfig], None by default
            cls = C.CriticConfig
            continue
        f = fields[part]
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if isinstance(value, dict):
            return True
        cls = type(value) if dataclasses.is_dataclass(value) else None
    return True


def test_readme_keys_exist():
    """Every dotted config key the README names (``trainer.loggers``, ``data.on_missing_fields``,
    ``reward.model.path`` ...) is a key of the schema: a renamed key cannot leave the README stale."""
    import dataclasses

    from megarl.config import TrainConfig

    text = _all_pages()
    sections = "|".join(f.name for f in dataclasses.fields(TrainConfig))
    keys = {m.group(1) for m in re.finditer(rf"(?<![\w/.-])((?:{sections})\.[a-z_][a-z_0-9.]*[a-z_0-9])\b", text)
            if text[m.end():m.end() + 1] != "*"}  # data.arithmetic_*: a family, not a key
    keys = {k for k in keys if not k.endswith(".py")}
    assert len(keys) > 40 and "trainer.loggers" in keys, sorted(keys)
    assert not [k for k in keys if not _schema_has(k)]
    assert not _schema_has("trainer.tensorboard") and not _schema_has("data.no_such_key")
