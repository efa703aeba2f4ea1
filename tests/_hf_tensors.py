"""Every tensor of an HF checkpoint directory, and a bitwise comparison of two such sets: the
round-trip tests (dense and MoE) read exports with these."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file


def load_all(d):
    """``{name: tensor}`` of ``d``'s ``model.safetensors`` or of every shard its index names."""
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return load_file(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for fn in files:
        out.update(load_file(os.path.join(d, fn)))
    return out


def assert_bitwise(a, b, what):
    """The same names, dtypes, shapes and bytes."""
    assert set(a) == set(b), f"{what}: tensor names differ: {sorted(set(a) ^ set(b))[:6]}"
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
