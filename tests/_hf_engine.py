"""The hf rollout engine's tests' actor: a transformers stand-in with peaked distributions, and one
weight sync of it into an engine."""

from __future__ import annotations

from megarl.builtin.hf_actor import HFActorStandIn, tiny_llama_config
from megarl.rollout.weight_stream import iter_buckets

BUCKET = 40_000  # bytes: several buckets for the tiny model


def make_actor(**cfg):
    # a larger init spread than the default 0.02 gives peaked, input-dependent distributions,
    # so greedy outputs and top-p sets actually depend on the weights
    return HFActorStandIn.create(tiny_llama_config(initializer_range=0.3, **cfg), seed=0)


def sync(engine, actor, step, buckets=None):
    version, manifest = actor.commit(step)
    stream = buckets if buckets is not None else iter_buckets(actor.named_tensors(), BUCKET)
    engine.load_weights(version, stream, manifest)
    engine.activate(version)
    return version, manifest
