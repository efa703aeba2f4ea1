"""Recipes that start from a base recipe (``base: <file>``, relative to the recipe): the resolved
config is the base's keys with the recipe's merged over them, and a missing or circular base is
one clear error naming the file."""

import glob
import os

import pytest
import yaml

from megarl.config import ConfigError, config_hash, load_config, merge_config, to_dict

from tests._dist import ROOT
CONFIGS = os.path.join(ROOT, "configs")
TINY = sorted(p for p in glob.glob(os.path.join(CONFIGS, "*_tiny.yaml")) if not p.endswith("quickstart_tiny.yaml"))


def _deep_merge(base: dict, over: dict) -> dict:
    """The textual merge a reader does by hand: mappings key by key, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _flattened(path: str) -> dict:
    with open(path) as f:
        recipe = yaml.safe_load(f)
    bases = recipe.pop("base", [])
    merged = {}
    for b in [bases] if isinstance(bases, str) else bases:
        merged = _deep_merge(merged, _flattened(os.path.join(os.path.dirname(path), b)))
    return _deep_merge(merged, recipe)


def test_every_tiny_recipe_starts_from_the_tiny_base():
    """Directly, or through another tiny recipe (ppo_arith_rm_tiny.yaml is ppo_arith_tiny.yaml's
    variant, grpo_arith_judge_tiny.yaml grpo_arith_tiny.yaml's, grpo_rsum_process_tiny.yaml and
    opd_rsum_tiny.yaml grpo_rsum_tiny.yaml's)."""
    assert len(TINY) == 12
    for path in TINY:
        with open(path) as f:
            base = yaml.safe_load(f)["base"]
        assert base == "base/tiny.yaml" or os.path.join(CONFIGS, base) in TINY, path


@pytest.mark.parametrize("path", TINY, ids=os.path.basename)
def test_recipe_resolves_to_its_base_plus_its_own_keys(path, tmp_path, monkeypatch):
    """Loading the recipe gives the same config (and config hash, part of a run's identity) as one
    file holding the base with the recipe's keys written over it by hand."""
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    flat = tmp_path / os.path.basename(path)
    flat.write_text(yaml.safe_dump(_flattened(path), sort_keys=False))
    cfg, expected = load_config(path), load_config(str(flat))
    assert to_dict(cfg) == to_dict(expected)
    assert config_hash(cfg) == config_hash(expected)
    assert "base" not in merge_config(path)  # not a config key: --print-config shows the merged whole


def test_missing_base_is_one_error_naming_the_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base: bases/nope.yaml\ntrainer: {iterations: 3}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(recipe))
    assert str(e.value) == f"{recipe}: base recipe bases/nope.yaml not found ({tmp_path}/bases/nope.yaml)"


def test_bases_chain_relative_to_each_file_and_a_cycle_is_refused(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "root.yaml").write_text("model: {path: m}\ndata: {train_path: d}\n"
                                              "trainer: {iterations: 3, seed: 7}\nrollout: {n: 2}\n")
    (tmp_path / "b" / "mid.yaml").write_text("base: root.yaml\ntrainer: {iterations: 5}\n")
    (tmp_path / "r.yaml").write_text("base: b/mid.yaml\nrollout: {n: 4}\n")
    cfg = load_config(str(tmp_path / "r.yaml"))
    assert (cfg.trainer.iterations, cfg.trainer.seed, cfg.rollout.n, cfg.recipe) == (5, 7, 4, "r")
    (tmp_path / "b" / "root.yaml").write_text("base: ../r.yaml\n")
    with pytest.raises(ConfigError, match="base recipes form a cycle"):
        load_config(str(tmp_path / "r.yaml"))


def test_a_bad_key_in_a_base_is_blamed_on_the_base(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer: {iteratons: 3}\n")
    (tmp_path / "r.yaml").write_text("base: base.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "r.yaml"))
    assert str(e.value).startswith(f"{tmp_path}/base.yaml: unknown key trainer.iteratons"), str(e.value)
