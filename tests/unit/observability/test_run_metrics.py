"""The seed's run metrics on constructed cases: drift and reward hacking (repetition, reward vs
length, format without the answer), each reward component's distribution, and the model FLOPs
MFU is measured from (the PaLM count against the matrices a transformers model really holds)."""

from __future__ import annotations

import pytest
import torch

from megarl.observability import drift


def test_repetition_rate_counts_ngrams_seen_earlier_in_the_same_response():
    # "1 2 3 1 2 3": 4 bigram-windows of n=3 ... by hand: trigrams 123 231 312 123 -> 1 repeated of 4
    assert drift.repetition_rate([[1, 2, 3, 1, 2, 3]], n=3) == 0.25
    # a loop of one token: every 2-gram after the first repeats (4 of 5)
    assert drift.repetition_rate([[7] * 6], n=2) == 0.8
    # across responses: totals add, an n-gram repeated in *another* response is no repetition
    assert drift.repetition_rate([[1, 2, 3], [1, 2, 3]], n=3) == 0.0
    assert drift.repetition_rate([[1, 2], [5, 5, 5, 5]], n=2) == pytest.approx(2 / 4)  # [1,2]: 1 gram; [5..]: 3, 2 repeat
    assert drift.repetition_rate([[1, 2]], n=4) == 0.0  # no n-gram at all
    with pytest.raises(ValueError):
        drift.repetition_rate([[1]], n=0)


def test_pearson_golden_and_undefined_cases():
    assert drift.pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert drift.pearson([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    # by hand: x = 1..4, y = 1, 3, 2, 4: sxy = 4, sxx = syy = 5 -> 0.8
    assert drift.pearson([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert drift.pearson([1, 2, 3], [5, 5, 5]) is None  # constant reward: undefined, not 0
    assert drift.pearson([1], [2]) is None
    with pytest.raises(ValueError):
        drift.pearson([1, 2], [1])


def test_format_without_answer_share():
    comps = [{"fmt": 1.0, "ok": 0.0}, {"fmt": 1.0, "ok": 1.0}, {"fmt": 0.0, "ok": 1.0}, {"fmt": 1.0, "ok": 0.0}]
    totals = [0.2, 1.2, 1.0, 0.0]  # the last is not rewarded: not counted
    assert drift.format_without_answer_share(totals, comps, ("fmt",), ("ok",)) == pytest.approx(1 / 3)
    assert drift.format_without_answer_share(totals, comps, (), ("ok",)) is None  # no format check
    assert drift.format_without_answer_share([0.0] * 4, comps, ("fmt",), ("ok",)) is None  # nothing rewarded
    # a sample that does not report a named component is not judged
    assert drift.format_without_answer_share([1.0, 1.0], [{"fmt": 1.0}, {"fmt": 1.0, "ok": 0.0}],
                                             ("fmt",), ("ok",)) == 1.0


def test_distribution_against_numpy():
    import numpy as np

    xs = [0.0, 1.0, 1.0, 3.0, 10.0]
    d = drift.distribution(xs)
    assert d["mean"] == pytest.approx(np.mean(xs)) and d["std"] == pytest.approx(np.std(xs))
    assert (d["min"], d["max"]) == (0.0, 10.0)
    for q in (10, 50, 90):
        assert d[f"p{q}"] == pytest.approx(np.percentile(xs, q))
    with pytest.raises(ValueError):
        drift.distribution([])


def test_rollout_metrics_on_a_constructed_batch():
    """The engine-side rollout metrics of ``rollout_metrics`` on samples built by hand: first and
    group completion latency, the prefix-cache hit rate and preemptions (SGLang reports them per
    request), the repetition rate and the reward/length correlation; a backend that reports no
    latency, cache or preemption writes none of those keys (never a 0 it did not measure)."""
    from megarl.control.interfaces import Sample
    from megarl.control.production import rollout_metrics
    from megarl.experience.schema import FinishReason, RewardRecord

    def sample(group, resp, reward, latency=None, cached=None, pre=None, prompt=(1, 2, 3, 4)):
        return Sample(prompt_id=group, group_id=group, sample_id=f"{group}/{len(resp)}", request_id=group,
                      prompt_ids=prompt, response_ids=tuple(resp), raw_log_probs=torch.zeros(len(resp)),
                      finish_reason=FinishReason.EOS, policy_version="v0", seed=0,
                      record=RewardRecord(total=reward, scorer_version="t"), latency_s=latency,
                      cached_prompt_tokens=cached, preemptions=pre)

    samples = [sample("a", [5, 6], 1.0, 0.5, 0, 0), sample("a", [5, 6, 7, 8], 0.0, 1.5, 4, 2),
               sample("b", [9, 9, 9, 9, 9, 9], 1.0, 0.75, 2, 0, prompt=(1, 2)), sample("b", [4], 0.0, 2.0, 2, 0, prompt=(1, 2))]
    m = rollout_metrics(samples, {}, gen_s=2.0)
    assert m["rollout/first_completion_s"] == 0.5
    assert m["rollout/group_completion_s_max"] == 2.0
    assert m["rollout/group_completion_s_mean"] == pytest.approx((1.5 + 2.0) / 2)
    assert m["rollout/prefix_cache_hit_rate"] == pytest.approx((0 + 4 + 2 + 2) / (4 + 4 + 2 + 2))
    assert m["rollout/preemptions"] == 2.0 and m["rollout/preempted_share"] == 0.25
    # 4-grams: [5,6,7,8] 1 (new), [9]*6 3 of which 2 repeat; shorter responses have none
    assert m["rollout/repetition_4gram"] == pytest.approx(2 / 4)
    assert m["rollout/reward_length_corr"] == pytest.approx(drift.pearson([2, 4, 6, 1], [1.0, 0.0, 1.0, 0.0]))
    bare = rollout_metrics([sample("a", [5, 6], 1.0), sample("a", [7], 0.0)], {}, gen_s=1.0)
    for key in ("first_completion_s", "group_completion_s_mean", "prefix_cache_hit_rate", "preemptions",
                "preempted_share"):
        assert f"rollout/{key}" not in bare, key


def test_reward_components_name_their_checks():
    from megarl.rewards import build_reward_function
    from megarl.rewards.declarations import component_checks

    comp = build_reward_function("composite", None, [{"name": "fmt", "fn": "regex", "kwargs": {"pattern": "x"}},
                                                     {"name": "ok", "fn": "arithmetic"}])
    assert component_checks(comp) == (("fmt",), ("ok",))
    assert component_checks(build_reward_function("arithmetic")) == ((), ("arithmetic",))
    assert component_checks(build_reward_function("regex", {"pattern": "x"})) == (("regex",), ())


def _hf_matmul_params(model, top_k=None, num_experts=None) -> int:
    """The weights a token multiplies by in a transformers model: every Linear but the embedding
    lookup; a routed expert counted top_k / num_experts times (a token visits top_k of them)."""
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            n += mod.weight.numel()
    for name, p in model.named_parameters():
        if ".experts." in name and p.dim() == 3:  # fused expert tensors (transformers 5: gate_up_proj, down_proj)
            n += p.numel() * top_k // num_experts
        elif name.endswith("mlp.gate.weight") and p.dim() == 2 and num_experts and p.shape[0] == num_experts:
            n += p.numel()  # the router (transformers 5: a TopKRouter module, not a Linear)
    return n


@pytest.mark.parametrize("family,extra", [
    ("llama", {}), ("qwen2", {"tie_word_embeddings": False}),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2}),
    ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2}),
])
def test_matmul_params_per_token_equal_what_transformers_holds(family, extra):
    """N of the PaLM count is the Linear weights of the HF model (routed experts: top_k of them),
    by family; the value head's one row replaces the vocabulary.  Negative control: counting the
    embedding too is off by vocab x hidden."""
    import transformers

    from megarl.builtin.tiny_checkpoint import tiny_hf_config
    from megarl.models.flops import matmul_params_per_token, train_flops
    from megarl.models.hf_config import spec_from_hf_config

    cfg = tiny_hf_config(family, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    spec = spec_from_hf_config(cfg.to_dict())
    moe = spec.moe
    want = _hf_matmul_params(model, moe.top_k if moe else None, moe.num_experts if moe else None)
    if moe is not None:  # per-expert Linear modules (older layouts) are counted in full above: take them back
        per_expert = [m for n_, m in model.named_modules() if ".experts." in n_ and isinstance(m, torch.nn.Linear)]
        want -= sum(m.weight.numel() for m in per_expert) * (moe.num_experts - moe.top_k) // moe.num_experts
    got = matmul_params_per_token(spec, cfg.vocab_size)
    assert got == want, (family, got, want)
    assert got + cfg.vocab_size * cfg.hidden_size != want  # the embedding is no matmul
    # the whole count for two sequences, by hand from the formula
    lhq = spec.num_layers * spec.num_attention_heads * spec.head_dim
    assert train_flops(spec, cfg.vocab_size, [3, 5]) == (6 * got + 12 * lhq * 3) * 3 + (6 * got + 12 * lhq * 5) * 5
