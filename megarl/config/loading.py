"""Loading a recipe: the YAML merged onto the schema, ``key=value`` overrides merged as an omegaconf
dotlist (an unknown key or a value of the wrong type is refused with the key's full name), and
the resolved config's hash.

A recipe may start from another: a top-level ``base: <file>`` (a path relative to the recipe's
own directory; a list of them merges in order) is loaded first, itself with its own base if it
names one, and the recipe's keys are merged over it, so a recipe states only how it differs
(``configs/*_tiny.yaml`` start from ``configs/base/tiny.yaml``).  ``base`` is not a config key:
the resolved config, its hash and ``--print-config`` hold the merged whole."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional

from megarl.config.schema import CriticConfig, TrainConfig
from megarl.errors import ConfigError
from megarl.hashing import json_sha256


# ---- loading ---------------------------------------------------------------------------------


def _closest_key(key: str, schema=TrainConfig) -> str:
    """`` (did you mean X?)`` for the schema key nearest to a mistyped one, or ``""``."""
    import difflib

    from megarl.config.help import iter_keys

    close = difflib.get_close_matches(key, [k.key for k in iter_keys(schema)], n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]}?)"
    if "." not in key:  # a top-level key: name the sections (python -m megarl.train --help lists their keys)
        return f" (the top level holds: {', '.join(f.name for f in dataclasses.fields(schema))})"
    return ""


#: keys that moved: old dotted key -> where it lives now
MOVED = {
    "data.build_arithmetic": "data.task.name=arithmetic (data.task.build=false: use the files as they are)",
    "data.build_running_sum": "data.task.name=running_sum",
    "data.arithmetic_train_n": "data.task.train_n", "data.arithmetic_heldout_n": "data.task.heldout_n",
    "data.arithmetic_min_digits": "data.task.args.min_digits", "data.arithmetic_max_digits": "data.task.args.max_digits",
    "data.running_sum_train_n": "data.task.train_n", "data.running_sum_heldout_n": "data.task.heldout_n",
    "data.running_sum_min_terms": "data.task.args.min_terms", "data.running_sum_max_terms": "data.task.args.max_terms",
    "data.running_sum_alpha": "data.task.args.alpha",
    "model.tiny.task": "data.task.name",
    "model.tiny.warmstart_validation": "data.task.args.validation (the arithmetic task's)",
    "model.tiny.tool_demos": "data.task.name=calculator with data.task.args.demos",
    "model.tiny.tool_only_steps": "data.task.args.only_steps (the calculator task's)",
    "model.tiny.tool_mixture_steps": "data.task.args.mixture_steps (the calculator task's)",
    "model.tiny.tool_min_digits": "data.task.args.min_digits (the calculator task's)",
    "model.tiny.tool_max_digits": "data.task.args.max_digits (the calculator task's)",
    "model.tiny.tool_role": "data.task.args.tool_role (the calculator task's)",
    "model.tiny.two_turn_demos": "data.task.name=two_turn with data.task.args.demos",
}


def _omegaconf_error(e: Exception, where: str, key: Optional[str] = None, schema=TrainConfig) -> ConfigError:
    """omegaconf's exception as one line that blames ``where`` (the recipe file, or the one
    override that caused it) and names the key in the schema's words."""
    from omegaconf.errors import ConfigKeyError

    key = getattr(e, "full_key", None) or getattr(e, "key", None) or key
    msg = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
    if isinstance(e, ConfigKeyError) and key and str(key) in MOVED:
        return ConfigError(f"{where}: {key} has moved: set {MOVED[str(key)]}")
    if isinstance(e, ConfigKeyError) and key:
        return ConfigError(f"{where}: unknown key {key}{_closest_key(str(key), schema)}")
    if "is not a ListConfig" in msg and key:
        value = getattr(e, "value", None)
        example = value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else 3
        return ConfigError(f"{where}: {key} expects a list, e.g. {key}=[{example}]")
    if "is not a subclass of" in msg and key:  # a scalar given for a whole section
        return ConfigError(f"{where}: {key} is a section; set its keys ({key}.<key>=...), not a value")
    return ConfigError(f"{where}: {key}: {msg}" if key else f"{where}: {msg}")


def _load_yaml(path: str):
    from omegaconf import DictConfig, OmegaConf

    try:
        recipe = OmegaConf.load(path)
    except Exception as e:  # yaml syntax
        raise ConfigError(f"{path}: not a valid YAML recipe ({str(e).splitlines()[0]})") from None
    if not isinstance(recipe, DictConfig):
        raise ConfigError(f"{path}: not a valid YAML recipe (a mapping of sections expected)")
    return recipe


def _recipe_chain(path: str, _seen: tuple[str, ...] = ()) -> list:
    """``[(file, recipe), ...]`` to merge in order: the bases a recipe names (``base:``, relative
    to its directory, each with its own bases first), then the recipe without its ``base`` key."""
    from omegaconf import ListConfig

    real = os.path.realpath(path)
    if real in _seen:
        raise ConfigError(f"{path}: base recipes form a cycle ({' -> '.join(_seen + (real,))})")
    recipe = _load_yaml(path)
    bases = recipe.pop("base", None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    elif not (isinstance(bases, ListConfig) and all(isinstance(b, str) for b in bases)):
        raise ConfigError(f"{path}: base must be a recipe file name or a list of them, got {bases!r}")
    chain = []
    for base in bases:
        base_path = os.path.join(os.path.dirname(path), base)
        if not os.path.isfile(base_path):
            raise ConfigError(f"{path}: base recipe {base} not found ({base_path})")
        chain += _recipe_chain(base_path, _seen + (real,))
    return chain + [(path, recipe)]


def merge_config(path: Optional[str], overrides: list[str] = (), schema=TrainConfig):
    """The recipe and the overrides merged onto the schema: an omegaconf ``DictConfig``, not yet
    resolved (``--print-config`` shows it; :func:`load_config` turns it into a
    :class:`TrainConfig`, or the ``schema`` given).  A bad recipe is blamed on its file, a bad
    override on the override."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = OmegaConf.structured(schema)
    critic = schema is TrainConfig  # the one Optional section (null by default)
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"--config {path}: file not found")
        for file, recipe in _recipe_chain(path):
            try:
                if critic and recipe.get("critic") is not None and merged.critic is None:
                    # an Optional[dataclass] node merges only onto a structured default
                    merged.critic = OmegaConf.structured(CriticConfig)
                merged = OmegaConf.merge(merged, recipe)
            except OmegaConfBaseException as e:
                raise _omegaconf_error(e, file, schema=schema) from None
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r}: expected key=value")
        key = ov.split("=", 1)[0]
        try:
            if critic and ov.startswith("critic.") and merged.critic is None:
                merged.critic = OmegaConf.structured(CriticConfig)
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([ov]))
        except OmegaConfBaseException as e:
            raise _omegaconf_error(e, f"override {ov!r}", key=key, schema=schema) from None
    return merged


def load_config(path: Optional[str], overrides: list[str] = (), schema=TrainConfig) -> TrainConfig:
    """YAML recipe + dotlist overrides merged onto the schema; a typed :class:`TrainConfig`.

    Unknown keys, wrong types and missing required keys raise :class:`ConfigError` naming the
    key (and, for a typo, the closest key).  Relative paths in the recipe stay relative to the
    working directory (like every CLI).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = merge_config(path, overrides, schema)
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"{path or 'config'}: required key(s) not set: {', '.join(missing)} "
                          f"(set {'them' if len(missing) > 1 else 'it'} in the recipe or as key=value)")
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, path or "config", schema=schema) from None
    if path is not None and cfg.recipe == "custom":
        cfg.recipe = os.path.splitext(os.path.basename(path))[0]
    return cfg


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_hash(cfg: TrainConfig, *, exclude: tuple[str, ...] = ("trainer.run_dir", "trainer.run_id")) -> str:
    """:func:`megarl.hashing.json_sha256` of the resolved config (where the run writes is not part
    of it); written to run.json."""
    d = to_dict(cfg)
    for dotted in exclude:
        node = d
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.get(p) or {}
        node.pop(leaf, None)
    return json_sha256(d)


def section_hash(section: Any) -> str:
    """:func:`megarl.hashing.json_sha256` of a config section (a dataclass, as a dict) or of any
    JSON-able value: what a resumed run must share with its checkpoint."""
    return json_sha256(dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section)


def default_run_dir(cfg: TrainConfig) -> str:
    return os.path.join("runs", f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}")
