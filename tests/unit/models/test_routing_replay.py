"""Trainer-side rollout routing replay (``algo.routing_replay``) on the megatron actor.

The rollout is the real hf engine serving the checkpoint the megatron model loaded (fp32, or
bf16 for a deliberately different rollout precision); the trainer is the megatron model.  With replay on, every MoE layer dispatches every recorded token to the recorded
experts (checked on the router's dispatched map, token by token and layer by layer), the
trainer's log-probs equal the rollout's to the dense parity tolerance, and the router still gets
a gradient.  With replay off, the bf16 rollout's routing differs measurably from the trainer's.
"""

from __future__ import annotations

import pytest
import torch

from megarl.control.batch import collate
from megarl.experience.schema import routing_token_mask
from megarl.models.forward import response_log_probs
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import train_step, wrap_for_training
from megarl.models.router_replay import (RecordRouting, RouterTargets, RoutingReplayError, RoutingStats,
                                         RowRouting, local_routers, record_to_rows, routed)
from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.rollout.hf_backend import HFRolloutEngine
from megarl.rollout.protocol import GenerationRequest, SamplingParams
from megarl.rollout.weight_stream import TensorManifest, hf_logical_tensors, iter_buckets
from megarl.versions import PolicyVersion
from tests._tiny_actor import ADAM
from tests._tolerance import LAYOUT_FP32_LOGPROB, NET_FP32_LOGPROB, adam_weights_tol, within

#: wide init (routing depends on the input), 8 experts top-2 over 3 MoE layers
SHAPE = dict(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, num_layers=3,
             num_experts=8, vocab_size=300)
PROMPTS = [GenerationRequest(f"p{i}", tuple(int(t) for t in torch.randint(
    4, 290, (3 + 2 * i,), generator=torch.Generator().manual_seed(i)))) for i in range(5)]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=5, return_routed_experts=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, megatron_world):
    hf = make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("replay") / "q3"), "qwen3_moe", seed=11,
                                 initializer_range=0.3, **SHAPE)
    return hf, load_model(hf)


def rollout(hf, dtype):
    """Samples from the hf engine serving the checkpoint's weights (those the megatron model
    loaded) in ``dtype``, collated."""
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tensors = [(n, t.to(dtype)) for n, t in hf_logical_tensors(src)]
    manifest = TensorManifest.from_named_tensors(tensors)
    version = PolicyVersion(run_id="test", optimizer_step=0, update_attempt=0, weight_manifest_hash=manifest.global_hash,
                            tokenizer_hash="sha256:" + "0" * 64, model_config_hash="sha256:" + "1" * 64)
    engine = HFRolloutEngine(hf, dtype=dtype)
    engine.load_weights(version, iter_buckets(iter(tensors), 1 << 16), manifest)
    engine.activate(version)
    res = engine.generate(PROMPTS, SAMPLING)
    return collate([r.prompt_ids for r in res], [r.response_ids for r in res], [r.raw_log_probs for r in res],
                   0, routing=[r.routed_experts for r in res], version=version.short_id)


def trainer_log_probs(model, c, replay, stats=None, pack=False, experts=None):
    routing = RecordRouting(c.routed_experts.experts if experts is None else experts,
                            c.routed_experts.moe_layers, replay=replay, stats=stats)
    return response_log_probs(model, c.prompt_ids, c.response_ids, c.attention_mask, 4, pack=pack,
                              routing=routing)


def measured(model, c, replay, **kw):
    stats = RoutingStats(c.routed_experts.moe_layers)
    lp = trainer_log_probs(model, c, replay, stats, **kw)
    return lp, stats.reduce()


def max_err(lp, c):
    keep = c.response_mask.bool()
    return float((lp - c.rollout_log_probs).abs()[keep].max())


def test_record_to_rows_follows_right_align():
    """The record's token grid (left-padded prompt, right-padded response) moved to the actor's
    right-aligned rows: each recorded position keeps its experts, the rest read 0 .. k-1."""
    am = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    ex = torch.arange(2 * 6 * 1 * 2).reshape(2, 6, 1, 2) % 7
    rows = record_to_rows(ex, am, 3, (0,))
    assert rows.experts.shape == (2, 6, 1, 2)
    # row 0: tokens at record columns 1, 2, 3, 4; the last real one and the padding are filler
    assert torch.equal(rows.experts[0, :3], ex[0, 1:4])
    assert torch.equal(rows.experts[0, 3:], torch.tensor([[[0, 1]]] * 3))
    assert torch.equal(rows.experts[1, :5], ex[1, :5])
    assert rows.valid.tolist() == [[True] * 3 + [False] * 3, [True] * 5 + [False]]
    # the valid positions are exactly the record's routing_token_mask, moved
    assert int(rows.valid.sum()) == int(routing_token_mask(am).sum())
    # a data-parallel padding row counts nowhere
    assert not record_to_rows(ex, am, 3, (0,), real_rows=torch.tensor([True, False])).valid[1].any()


def test_replay_dispatches_the_recorded_experts_and_matches_the_rollout(moe):
    hf, model = moe
    c = rollout(hf, torch.float32)
    assert c.routed_experts.moe_layers == (0, 1, 2)
    lp_off, off = measured(model, c, replay=False)
    lp_on, on = measured(model, c, replay=True)
    n = int(routing_token_mask(c.attention_mask).sum())
    assert on["tokens"] == off["tokens"] == n
    # replay: the dispatched top-k set equals the record on every recorded token and layer
    assert on["replay_differs"] == 0.0
    # fp32 rollout, fp32 trainer: the router agrees by itself too, and replay changes nothing
    # but the order of the top-k inside the gate's softmax: one model, one kernel family, a
    # reordered sum of two expert outputs per MoE layer (3 layers)
    assert off["mismatch_tokens"] == 0.0 and on["mismatch_tokens"] == 0.0
    err = float((lp_on - lp_off).abs().max())
    assert within(err, LAYOUT_FP32_LOGPROB, "routing_replay/on_vs_off"), err
    # the trainer's log-probs equal the rollout's (fp32, transformers vs megatron: two kernel
    # families through 3 wide-init layers) to the dense parity tolerance
    err = max_err(lp_on, c)
    assert within(err, NET_FP32_LOGPROB, "routing_replay/trainer_vs_rollout"), err
    # packed forwards lay the tokens out differently; the replay follows them
    lp_packed, packed = measured(model, c, replay=True, pack=True)
    err = max_err(lp_packed, c)
    assert packed["replay_differs"] == 0.0 and within(err, NET_FP32_LOGPROB, "routing_replay/packed_vs_rollout"), err


def test_replay_is_not_the_routers_choice(moe):
    """A routing the router would never choose is still what replay dispatches: the check that
    the replayed experts, not the router's own top-k, reach the experts."""
    hf, model = moe
    c = rollout(hf, torch.float32)
    g = torch.Generator().manual_seed(0)
    ex = c.routed_experts.experts
    other = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(ex[..., 0].numel())])
    other = other.reshape(ex.shape).to(ex.dtype)
    lp, st = measured(model, c, replay=True, experts=other)
    assert st["replay_differs"] == 0.0
    assert st["mismatch_tokens"] > 0.9  # the router's own choice differs from the forced one
    # and the log-probs are those of the forced sub-network: far outside the parity tolerance
    assert max_err(lp, c) > 100 * NET_FP32_LOGPROB


def test_bf16_rollout_mismatch_measured_and_removed_by_replay(moe):
    hf, model = moe
    c = rollout(hf, torch.bfloat16)
    lp_off, off = measured(model, c, replay=False)
    lp_on, on = measured(model, c, replay=True)
    # replay off: the trainer's dispatched experts are its own, and differ from the rollout's
    assert off["mismatch_tokens"] > 0 and off["replay_differs"] > 0
    assert off["replay_differs"] == off["mismatch_router"]
    assert sum(off[f"mismatch_layer/{i}"] for i in range(3)) == pytest.approx(3 * off["mismatch_router"])
    # replay on: every recorded token dispatched as the rollout did, while the router's own
    # choice (measured beside the replay, on the replayed upstream layers) still differs
    assert on["replay_differs"] == 0.0
    assert on["mismatch_tokens"] > 0
    # the rollout / trainer log-prob gap (bf16 rounding stays; the flipped experts go)
    keep = c.response_mask.bool()
    def k3(lp):  # the mean k3 estimate of KL(rollout || trainer) over response tokens
        d = (lp - c.rollout_log_probs)[keep]
        return float((torch.exp(d) - 1 - d).mean())

    gap_off, gap_on = max_err(lp_off, c), max_err(lp_on, c)
    print(f"bf16 rollout: mismatch tokens {off['mismatch_tokens']:.3f}, router {off['mismatch_router']:.3f}; "
          f"max |dlogp| off {gap_off:.4f} on {gap_on:.4f}; k3 off {k3(lp_off):.5f} on {k3(lp_on):.5f}")
    assert k3(lp_on) < k3(lp_off)


def _replay_batch(c, vocab_size: int, packed: bool = False):
    """The rollout ``c`` as update micro-batches of 5 rows carrying its recorded routing, and a
    token-mean NLL loss over its real tokens.  ``packed``: each micro-batch also as one packed
    sequence of its rows (``algo.micro_batch_tokens``' form), which is what the model then runs."""
    from megarl.models.forward import right_align
    from megarl.models.vocab_parallel import token_log_probs_from_logits
    from megarl.models.micro_batches import PackedMicroBatch, next_token_terms

    tokens, plen, rlen = right_align(c.prompt_ids, c.response_ids, c.attention_mask)
    rows = record_to_rows(c.routed_experts.experts, c.attention_mask, c.prompt_ids.shape[1],
                          c.routed_experts.moe_layers, tokens.shape[1])
    mask = (torch.arange(tokens.shape[1] - 1)[None, :] < (plen + rlen - 1)[:, None]).float()
    mbs = [{"tokens": tokens[i:i + 5], "loss_mask": mask[i:i + 5], "routing": rows.experts[i:i + 5],
            "routing_valid": rows.valid[i:i + 5]} for i in range(0, tokens.shape[0], 5)]
    if packed:
        for i, mb in enumerate(mbs):
            own = (plen + rlen)[i * 5:i * 5 + 5]
            mb["tokens"] = mb["tokens"][:, :int(own.max())]
            mb["loss_mask"] = mb["loss_mask"][:, :int(own.max()) - 1]
            mb["packed"] = PackedMicroBatch.from_rows(mb["tokens"], own)

    def loss_fn(output, mb):
        lp = next_token_terms(output, mb, lambda logits, nxt: token_log_probs_from_logits(logits, nxt, vocab_size))
        loss = -(lp * mb["loss_mask"]).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    return mbs, loss_fn


def test_replayed_update_reaches_the_router(moe, tmp_path):
    """One optimizer step with replay: the router weights get a non-zero gradient (the gate
    probabilities of the replayed experts are computed from the router's logits)."""
    hf, _ = moe
    model = load_model(hf)
    ddp, opt = wrap_for_training(model, ADAM)
    c = rollout(hf, torch.bfloat16)
    mbs, loss_fn = _replay_batch(c, model.megarl_spec.vocab_size)
    routers = local_routers(model)
    assert len(routers) == 3
    before = [r.weight.detach().clone() for _, r in routers]
    res = train_step(ddp, opt, mbs, loss_fn, replay_layers=c.routed_experts.moe_layers)
    assert res.update_successful
    for (layer, r), w in zip(routers, before):
        assert float(r.weight.main_grad.abs().sum()) > 0, f"layer {layer}: no router gradient under replay"
        assert not torch.equal(r.weight.detach(), w), f"layer {layer}: router not updated"
        assert r.router_replay.router_replay_action is None and r.router_replay.target_topk_idx is None


def _replayed_step(hf, c, recompute=None, packed=False):
    """One AdamW step replaying the rollout's routing, the model built with ``recompute``, on padded
    or ``packed`` micro-batches: its weights after the step (HF names)."""
    from megarl.models.weights import iter_hf_tensors

    model = load_model(hf, recompute=recompute)
    ddp, opt = wrap_for_training(model, ADAM)
    mbs, loss_fn = _replay_batch(c, model.megarl_spec.vocab_size, packed)
    assert train_step(ddp, opt, mbs, loss_fn, replay_layers=c.routed_experts.moe_layers).update_successful
    for _, r in local_routers(model):  # nothing queued for a backward is left behind
        assert r.router_replay.replay_backward_list == [] and r.router_replay.router_replay_action is None
    return {k: v.clone() for k, v in iter_hf_tensors(ddp)}


def test_recompute_replays_the_recorded_routing_in_the_backward(moe, monkeypatch):
    """parallel.recompute re-runs the routers in the backward (full recompute; the selective
    recompute of the MoE layer): each replays the micro-batch's recorded experts there too
    (megatron's REPLAY_BACKWARD), so the replayed step is bitwise the one without recompute.
    Negative control: a recompute that routes on its own (nothing queued for the backward)
    trains another sub-network."""
    from megarl.config.schema import RecomputeSettings
    from megarl.models import router_replay

    hf, _ = moe
    c = rollout(hf, torch.bfloat16)
    want = _replayed_step(hf, c)
    for rc in (RecomputeSettings(granularity="full", method="uniform", num_layers=1),
               RecomputeSettings(granularity="full", method="block", num_layers=2),
               RecomputeSettings(granularity="selective", modules=["moe"])):
        got = _replayed_step(hf, c, rc)
        for k in want:
            assert torch.equal(got[k], want[k]), (rc, k)
    monkeypatch.setattr(router_replay, "recomputes_routers", lambda config: False)
    natural = _replayed_step(hf, c, RecomputeSettings(granularity="full", method="uniform", num_layers=1))
    assert max((natural[k] - want[k]).abs().max().item() for k in want) > 1e-5


def test_packed_replayed_step_equals_padded(moe):
    """Token-budget micro-batches run packed: the recorded routing is laid out in packed order
    (``RouterTargets.for_packed``) and replayed there, in the forward and in a full recompute's
    backward, so the step equals the padded one (fp32 rounding: the GEMMs see other shapes), and
    with recompute bitwise the packed step without it."""
    from megarl.config.schema import RecomputeSettings

    hf, _ = moe
    c = rollout(hf, torch.bfloat16)
    padded, packed = _replayed_step(hf, c), _replayed_step(hf, c, packed=True)
    err = max((packed[k] - padded[k]).abs().max().item() for k in padded)
    assert within(err, adam_weights_tol(ADAM.lr, 1, 1e-3), "routing_replay/packed_vs_padded"), err
    again = _replayed_step(hf, c, RecomputeSettings(granularity="full", method="uniform", num_layers=1), packed=True)
    for k in packed:
        assert torch.equal(again[k], packed[k]), k


def test_replay_refuses_a_record_that_does_not_fit(moe):
    hf, model = moe
    rows = RowRouting(torch.zeros(1, 4, 2, 2, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool), (0, 1))
    with pytest.raises(RoutingReplayError, match=r"no columns for MoE layers \[2\]"):
        with routed(model, RouterTargets.for_padded(rows), replay=True):
            pass
    rows = RowRouting(torch.zeros(1, 4, 3, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool), (0, 1, 2))
    with pytest.raises(RoutingReplayError, match="top-3 routing, the router routes to 2"):
        with routed(model, RouterTargets.for_padded(rows), replay=True):
            pass
    # a refusal leaves no replay state behind
    assert all(r.router_replay.router_replay_action is None for _, r in local_routers(model))
