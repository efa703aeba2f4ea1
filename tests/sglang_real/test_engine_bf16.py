"""A bf16 SGLang engine (the GPU default) against the fp32 megatron actor.  Its own module, run
before test_engine_cpu.py: SGLang's ``Engine.shutdown()`` kills every child process of the
caller, which would take another live engine's scheduler with it."""

from __future__ import annotations

import torch

from megarl.rollout import sglang_cpu
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.sglang_backend import SGLangRolloutEngine
from tests.sglang_real._engine import EOS, PROMPTS, MegatronActor, load, make_model_dir


def test_bf16_engine_log_probs_match_the_fp32_actor_within_bf16_rounding(megatron_world, tmp_path):
    """A bf16 engine (the GPU default) against the fp32 actor on the same weights.  Each of the
    model's layers rounds its output to bf16 (unit roundoff u = 2^-8), and the weights themselves
    are rounded once: the logits carry about (layers + 1) * u * |logit| of error, and a log-prob
    twice that (the logit and the log-sum-exp).  The tolerance is twice that bound (measured: the
    error is ~1/7 of it); at T=0.5 the tempered log-probs (the wrong space) are off by about |logit|,
    far outside it."""
    from tests._tolerance import U

    model_dir = make_model_dir(tmp_path)
    actor = MegatronActor(model_dir)
    e = SGLangRolloutEngine(model_dir, eos_token_ids=[EOS], dtype="bfloat16", device="cpu",
                            engine_kwargs=sglang_cpu.engine_kwargs(4096))
    try:
        assert e.dtype == torch.bfloat16
        load(e, actor)
        out = e.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
        out += e.generate(PROMPTS, SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=8, n=2))
    finally:
        e.shutdown()
    layers = 2
    tol = 2 * 2 * (layers + 1) * U[torch.bfloat16] * actor.logit_scale(out)
    worst = max(float((r.raw_log_probs - actor.log_probs(r)).abs().max()) for r in out)
    assert worst < tol, (worst, tol)
    gap = max(float((r.raw_log_probs - actor.log_probs(r, temperature=0.5)).abs().max()) for r in out[len(PROMPTS):])
    assert gap > 3 * tol, (gap, tol)
