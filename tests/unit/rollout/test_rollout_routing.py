"""Routed experts from the hf rollout engine (MoE): every prompt and response token, the experts
the model actually dispatched to, reproducible, independent of the batch."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.experience.schema import routing_token_mask
from megarl.control.batch import collate
from megarl.rollout.hf_backend import HFRolloutEngine, _RoutingRecorder, moe_experts_modules
from megarl.rollout.protocol import GenerationRequest, InvalidRequestError, SamplingParams
from megarl.rollout.sglang_outputs import moe_layout_from_config
from megarl.rollout.weight_stream import iter_buckets
from megarl.builtin.hf_actor import HFActorStandIn, tiny_llama_config, tiny_moe_config

PROMPTS = [GenerationRequest("p0", (2, 5, 17, 40, 9)), GenerationRequest("p1", (2, 33)),
           GenerationRequest("p2", (2, 7, 7, 11, 25, 6, 12))]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3, return_routed_experts=True)


def engine_for(config, tmp_path):
    actor = HFActorStandIn.create(config, seed=0)
    engine = HFRolloutEngine(actor.export_config(tmp_path))
    version, manifest = actor.commit(0)
    engine.load_weights(version, iter_buckets(actor.named_tensors(), 1 << 20), manifest)
    engine.activate(version)
    return actor, engine


def teacher_forced_routing(model, tokens):
    """The experts the model dispatches each token to in one full forward of ``tokens``."""
    rec = _RoutingRecorder(moe_experts_modules(model))
    with torch.no_grad(), rec:
        model(torch.tensor([list(tokens)]))
    return torch.stack([c[0] for c in rec.calls], dim=1)  # (tokens, layers, k)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_every_token_routed_as_the_model_dispatched_it(family, tmp_path):
    actor, engine = engine_for(tiny_moe_config(family), tmp_path)
    results = engine.generate(PROMPTS, SAMPLING)
    assert len(results) == 6
    for r in results:
        re_ = r.routed_experts
        assert re_.backend == "hf" and re_.num_experts == 4 and re_.top_k == 2 and re_.moe_layers == (0, 1)
        assert re_.experts.dtype == torch.uint8
        tokens = list(r.prompt_ids) + list(r.response_ids)
        assert re_.experts.shape == (len(tokens) - 1, 2, 2)  # every token but the last (never fed)
        tf = teacher_forced_routing(actor.model, tokens)[:-1]
        # the same top-k sets as a teacher-forced forward of the same tokens at the same precision
        assert torch.equal(tf.sort(-1).values, re_.experts.long().sort(-1).values), r.request_id
    # reproducible, and a candidate's routing does not depend on what else is in the batch
    again = engine.generate(PROMPTS[2:], SAMPLING)
    for a, b in zip(again, results[4:]):
        assert a.response_ids == b.response_ids and torch.equal(a.routed_experts.experts, b.routed_experts.experts)


def test_routing_only_when_asked_and_only_for_moe(tmp_path):
    _, engine = engine_for(tiny_moe_config("qwen3_moe"), tmp_path / "moe")
    plain = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert plain[0].routed_experts is None
    _, dense = engine_for(tiny_llama_config(), tmp_path / "dense")
    with pytest.raises(InvalidRequestError, match="no MoE layers"):
        dense.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4, return_routed_experts=True))


def test_collated_routing_sits_on_the_token_grid(tmp_path):
    actor, engine = engine_for(tiny_moe_config("mixtral"), tmp_path)
    results = engine.generate(PROMPTS, SAMPLING)
    c = collate([r.prompt_ids for r in results], [r.response_ids for r in results], [r.raw_log_probs for r in results],
                pad_id=0, routing=[r.routed_experts for r in results], version="v0")
    grid = c.routed_experts.experts
    assert grid.shape == (6, c.prompt_ids.shape[1] + c.response_ids.shape[1], 2, 2)
    mask = routing_token_mask(c.attention_mask)
    ids = torch.cat([c.prompt_ids, c.response_ids], 1)
    for b, r in enumerate(results):
        tf = teacher_forced_routing(actor.model, list(r.prompt_ids) + list(r.response_ids))[:-1]
        assert torch.equal(grid[b][mask[b]].long().sort(-1).values, tf.sort(-1).values)
        assert ids[b][mask[b]].tolist() == (list(r.prompt_ids) + list(r.response_ids))[:-1]
    assert (grid[~mask] == torch.arange(2, dtype=grid.dtype)).all()  # 0..k-1 where nothing routed


@pytest.mark.parametrize("family,over,want", [
    ("qwen3_moe", {}, (0, 1, 2, 3)),
    ("qwen3_moe", {"mlp_only_layers": [1], "decoder_sparse_step": 1}, (0, 2, 3)),
    ("qwen2_moe", {"decoder_sparse_step": 2}, (1, 3)),
    ("mixtral", {}, (0, 1, 2, 3)),
])
def test_moe_layers_from_config_json_are_the_models(family, over, want, tmp_path):
    """The sglang backend reads the MoE layers from config.json; the hf model is the truth."""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(family, layers=4, **over)
    config.save_pretrained(tmp_path)
    layout = moe_layout_from_config(json.loads((tmp_path / "config.json").read_text()))
    model = AutoModelForCausalLM.from_config(config)
    assert layout.moe_layers == tuple(i for i, _ in moe_experts_modules(model)) == want
    assert (layout.num_hidden_layers, layout.num_experts, layout.top_k) == (4, 4, 2)
    assert moe_layout_from_config(json.loads(tiny_llama_config().to_json_string())) is None
