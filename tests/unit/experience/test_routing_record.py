"""The routing record of MoE samples: typed, sealed, hashed, saved, sliced; refused when it does
not belong to the samples; absent for dense models, whose hashes do not change.  And the
routing statistics (mismatch, expert load) on golden tensors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests._experience import make_facts
from megarl.algo.routing import expert_load, routing_load_metrics
from tests._routing import routing_mismatch
from megarl.experience.packing import pack, pack_layout
from megarl.experience.routing import collate_routing
from megarl.experience.schema import (
    ExperienceBatch,
    RoutedExperts,
    RoutingProducer,
    SampleRouting,
    compact_expert_dtype,
    routing_token_mask,
)
from megarl.experience.seal import (CorruptExperienceError, SealedWriteError, content_hash, load_sealed, save_sealed,
                                   seal)

#: content hashes of make_facts(seed) sealed before routing existed (megarl at caf431e): a dense
#: batch hashes exactly as it did
DENSE_HASHES = {0: "sha256:89667890786830bbf194793123e265f2ea7b3849b9bda03825b7bfd28bd086c1",
                1: "sha256:b74c8f9918d4fc8cd064e0ada35fda1f30c224312763cb0814c3ab9bab0fdd11"}


def routing_for(facts, num_experts=4, k=2, layers=(0, 1), seed=0, version="v7", role="rollout", backend="hf"):
    bs, S = facts.attention_mask.shape
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(bs, S, len(layers), num_experts, generator=g).argsort(-1)[..., :k]
    return RoutedExperts(ids.to(compact_expert_dtype(num_experts)), RoutingProducer(role, backend, version),
                         num_experts, layers)


def test_dense_batches_hash_as_before():
    for s, h in DENSE_HASHES.items():
        facts = make_facts(seed=s)
        assert facts.routed_experts is None and facts.token_origins is None
        assert content_hash(ExperienceBatch(facts)) == h
    assert seal(ExperienceBatch(make_facts(seed=0))).content_hash == DENSE_HASHES[0]
    # make_facts(seed=1) has real tokens outside response_mask inside responses: a multi-turn
    # record, which sealing refuses without token_origins (tests/unit/experience/test_agent_record.py)
    with pytest.raises(ValueError, match="no token_origins"):
        seal(ExperienceBatch(make_facts(seed=1)))


def test_routing_is_hashed_sealed_and_survives_save_and_load(tmp_path):
    facts = make_facts()
    routed = routing_for(facts)
    b = seal(ExperienceBatch(dataclasses.replace(facts, routed_experts=routed)))
    assert b.content_hash != DENSE_HASHES[0]
    with pytest.raises(SealedWriteError):
        b.facts.routed_experts.experts[0, 0, 0, 0] = 3
    other = seal(ExperienceBatch(dataclasses.replace(facts, routed_experts=routing_for(facts, seed=1))))
    assert other.content_hash != b.content_hash  # the ids are in the hash
    relabelled = dataclasses.replace(routed, producer=RoutingProducer("rollout", "sglang", "v7"))
    assert seal(ExperienceBatch(dataclasses.replace(facts, routed_experts=relabelled))).content_hash != b.content_hash
    save_sealed(b, tmp_path / "x")
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert manifest["metadata"]["routed_experts"] == {
        "producer": {"role": "rollout", "backend": "hf", "version": "v7"}, "num_experts": 4, "moe_layers": [0, 1],
        "top_k": 2}
    assert manifest["tensors"]["facts.routed_experts"]["dtype"] == "torch.uint8"
    back = load_sealed(tmp_path / "x")
    assert back.content_hash == b.content_hash
    assert back.facts.routed_experts.producer == routed.producer and back.facts.routed_experts.moe_layers == (0, 1)
    assert torch.equal(back.facts.routed_experts.experts, routed.experts)
    # a manifest that names routing without its tensor (or the reverse) is refused
    manifest["metadata"].pop("routed_experts")
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptExperienceError, match="routed_experts"):
        load_sealed(tmp_path / "x")


def test_routing_of_another_version_producer_or_shape_is_refused():
    facts = make_facts()
    with pytest.raises(ValueError, match="routed_experts version 'v6' != sample policy_version"):
        dataclasses.replace(facts, routed_experts=routing_for(facts, version="v6"))
    with pytest.raises(ValueError, match="rollout's routing"):
        dataclasses.replace(facts, routed_experts=routing_for(facts, role="actor"))
    r = routing_for(facts)
    with pytest.raises(ValueError, match="must have shape"):
        dataclasses.replace(facts, routed_experts=dataclasses.replace(r, experts=r.experts[:, 1:]))
    with pytest.raises(TypeError, match="RoutedExperts record"):
        dataclasses.replace(facts, routed_experts=r.experts)
    with pytest.raises(ValueError, match="compact dtype"):
        dataclasses.replace(r, experts=r.experts.to(torch.int32))
    with pytest.raises(ValueError, match="outside"):
        dataclasses.replace(r, experts=(r.experts + 3))
    dup = r.experts.clone()
    dup[0, 0, 0] = torch.tensor([1, 1], dtype=dup.dtype)
    with pytest.raises(ValueError, match="twice"):
        dataclasses.replace(r, experts=dup)
    with pytest.raises(ValueError, match="layers"):
        dataclasses.replace(r, moe_layers=(0,))


def test_compact_dtypes():
    assert [compact_expert_dtype(n) for n in (4, 256, 257, 32768, 32769)] == \
        [torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int32]


def test_collation_pads_and_mini_batches_and_packing_keep_alignment():
    # two samples: prompts of 2 and 3 tokens, responses of 3 and 1 (the last token has no row)
    s0 = SampleRouting(torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]]], dtype=torch.uint8), 4, (1,), "hf")
    s1 = SampleRouting(torch.tensor([[[2, 1]], [[3, 1]], [[0, 2]]], dtype=torch.uint8), 4, (1,), "hf")
    r = collate_routing([s0, s1], [2, 3], [3, 1], 3, 3, "v1")
    assert r.producer == RoutingProducer("rollout", "hf", "v1") and r.experts.shape == (2, 6, 1, 2)
    fill = [[0, 1]]
    assert r.experts[0].tolist() == [fill, [[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]], fill]
    assert r.experts[1].tolist() == [[[2, 1]], [[3, 1]], [[0, 2]], fill, fill, fill]
    am = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    assert routing_token_mask(am).tolist() == [[False, True, True, True, True, False],
                                                [True, True, True, False, False, False]]
    assert torch.equal(r.select(torch.tensor([1])).experts, r.experts[1:])
    packed = pack(r.experts, pack_layout(am, 3))  # (total real tokens, layers, k), in token order
    assert packed.shape == (9, 1, 2) and packed[:4].tolist() == [[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]]]
    with pytest.raises(ValueError, match="one batch, one model"):
        collate_routing([s0, SampleRouting(s1.experts, 8, (1,), "hf")], [2, 3], [3, 1], 3, 3, "v1")
    with pytest.raises(ValueError, match="routing rows"):
        collate_routing([s0, s1], [2, 3], [3, 2], 3, 3, "v1")


def test_routing_mismatch_golden():
    # 3 tokens x 2 layers x top-2; token 2 is masked out
    rollout = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 1], [0, 1]]])
    trainer = torch.tensor([[[1, 0], [2, 3]],   # same sets (order differs): no mismatch
                            [[1, 3], [0, 3]],   # layer 0 differs
                            [[2, 3], [2, 3]]])  # masked
    m = routing_mismatch(rollout, trainer, torch.tensor([1, 1, 0]))
    assert m.tokens == 2 and m.token_share == 0.5 and m.per_layer.tolist() == [0.5, 0.0] and m.router_share == 0.25
    m = routing_mismatch(rollout, trainer, torch.tensor([1, 1, 1]))
    assert m.token_share == pytest.approx(2 / 3) and m.per_layer.tolist() == pytest.approx([2 / 3, 1 / 3])
    empty = routing_mismatch(rollout, trainer, torch.zeros(3))
    assert empty.tokens == 0 and empty.token_share == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        routing_mismatch(rollout, trainer[:, :1], torch.ones(3))


def test_expert_load_golden():
    # 4 tokens, 1 layer, top-2 over 4 experts: loads [3, 3, 1, 1] -> mean 2, max/mean 1.5, cv 0.5
    experts = torch.tensor([[[0, 1]], [[0, 1]], [[1, 0]], [[2, 3]], [[2, 3]]], dtype=torch.uint8)
    load = expert_load(experts, torch.tensor([1, 1, 1, 1, 0]), 4)
    assert load.counts.tolist() == [[3.0, 3.0, 1.0, 1.0]]
    assert load.max_over_mean.tolist() == [1.5] and load.cv.tolist() == [0.5]
    balanced = expert_load(torch.tensor([[[0, 1]], [[2, 3]]]), torch.ones(2), 4)
    assert balanced.max_over_mean.tolist() == [1.0] and balanced.cv.tolist() == [0.0]
    facts = make_facts()
    m = routing_load_metrics(routing_for(facts), facts.attention_mask)
    assert set(m) == {"prep/routing/load_max_over_mean_worst_layer", "prep/routing/load_max_over_mean",
                      "prep/routing/load_cv"} and m["prep/routing/load_max_over_mean"] >= 1.0


def test_routing_replay_config():
    from types import SimpleNamespace

    from megarl.commands.run_checks import check_run
    from megarl.config import ConfigError, load_config
    from megarl.models.fit import moe_num_experts, validate_model_fit
    from megarl.models.hf_config import spec_from_hf_config
    from tests._train_runs import GRPO

    assert load_config(GRPO, []).algo.routing_replay == "none"
    check_run(load_config(GRPO, ["algo.routing_replay=rollout"]), 1)
    with pytest.raises(ConfigError, match="algo.routing_replay"):
        check_run(load_config(GRPO, ["algo.routing_replay=trainer"]), 1)
    dense = spec_from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
                                 "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "max_position_embeddings": 64, "rms_norm_eps": 1e-6})
    validate_model_fit(load_config(GRPO, []), dense, "config.json")
    with pytest.raises(ConfigError, match="algo.routing_replay.*dense model"):
        validate_model_fit(load_config(GRPO, ["algo.routing_replay=rollout"]), dense, "config.json")
    assert moe_num_experts(dense) is None
    from megarl.builtin.hf_actor import tiny_moe_config

    moe = spec_from_hf_config(json.loads(tiny_moe_config("qwen3_moe").to_json_string()))
    validate_model_fit(load_config(GRPO, ["algo.routing_replay=rollout"]), moe, "config.json")
    assert moe_num_experts(moe) == 4
    assert moe_num_experts(SimpleNamespace(raw_config={"num_local_experts": 8})) == 8
    assert moe_num_experts(SimpleNamespace(moe=SimpleNamespace(num_experts=128), raw_config={})) == 128
