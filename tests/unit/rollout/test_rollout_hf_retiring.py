"""The hf backend's decode that retires finished rows (``retire_finished``,
megarl/rollout/hf_retiring.py) against transformers' ``generate`` on the same weights: the same
tokens, finish reasons and log-probs (to fp32 rounding: a step over fewer rows may round
otherwise), and a finished row costs nothing after its last token -- the rows computed over the
call are exactly the tokens produced.  Negative control: when no row finishes early the two are
the same computation, bitwise, and do the same work."""

import pytest

from megarl.rollout.hf_backend import HFRolloutEngine
from megarl.rollout.protocol import GenerationRequest, InvalidRequestError, SamplingParams
from tests._tolerance import NET_FP32_LOGPROB, max_abs_diff, within
from tests._hf_engine import make_actor, sync

PROMPTS = [GenerationRequest(f"p{i}", tuple([2] + [(7 * i + 13 * j) % 250 + 3 for j in range(1 + 3 * i)]))
           for i in range(5)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    actor = make_actor()
    d = actor.export_config(tmp_path_factory.mktemp("cfg"))
    dense, retiring = HFRolloutEngine(d), HFRolloutEngine(d, retire_finished=True)
    # and without an EOS id: every row runs to max_new_tokens
    endless = HFRolloutEngine(d, eos_token_ids=[]), HFRolloutEngine(d, eos_token_ids=[], retire_finished=True)
    for e in (dense, retiring, *endless):
        sync(e, actor, 0)
    return dense, retiring, endless


def _run(engine, sampling):
    res = engine.generate(PROMPTS, sampling)
    return res, dict(engine.last_decode)


def _stops(engines):
    """Stop ids that end the candidates at many different steps: the most frequent tokens of a
    dense run, so the lengths spread over the whole range."""
    from collections import Counter

    res, _ = _run(engines[0], SamplingParams(temperature=1.0, max_new_tokens=24, n=8, seed=5))
    counts = Counter(t for r in res for t in r.response_ids)
    return tuple(t for t, _ in counts.most_common(6))


@pytest.mark.parametrize("sampling", ["greedy", "sampled", "top_p"])
def test_same_candidates_as_generate_and_finished_rows_cost_nothing(engines, sampling):
    stops = _stops(engines)
    params = {"greedy": SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=stops),
              "sampled": SamplingParams(temperature=1.0, max_new_tokens=24, n=8, seed=5, stop_token_ids=stops),
              "top_p": SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=24, n=8, seed=9,
                                      stop_token_ids=stops)}[sampling]
    (dense, dense_work), (ret, ret_work) = _run(engines[0], params), _run(engines[1], params)
    assert [(r.request_id, r.candidate_index) for r in ret] == [(r.request_id, r.candidate_index) for r in dense]
    lengths = [len(r.response_ids) for r in dense]
    assert len(set(lengths)) >= (3 if sampling == "greedy" else 6), lengths  # a spread to retire
    for a, b in zip(dense, ret):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason and a.seed == b.seed
        assert within(max_abs_diff(a.raw_log_probs, b.raw_log_probs), NET_FP32_LOGPROB, "retiring/raw")
        if a.processed_log_probs is not None:
            assert within(max_abs_diff(a.processed_log_probs, b.processed_log_probs), NET_FP32_LOGPROB,
                          "retiring/processed")
    # generate computes every row for as many steps as the longest; retiring, each row its own tokens
    assert dense_work["row_steps"] == len(dense) * max(lengths)
    assert ret_work["row_steps"] == sum(lengths) < dense_work["row_steps"]
    # a retired row is complete when it retires (a shorter one no later than a longer one); generate
    # returns every row at the end of the call
    assert len({r.latency_s for r in dense}) == 1 and dense[0].latency_s > 0
    by_len = sorted(ret, key=lambda r: len(r.response_ids))
    assert all(a.latency_s <= b.latency_s for a, b in zip(by_len, by_len[1:])), [(len(r.response_ids), r.latency_s)
                                                                             for r in by_len]
    assert by_len[0].latency_s < by_len[-1].latency_s


def test_with_no_early_finish_it_is_generate_bitwise(engines):
    params = SamplingParams(temperature=0.8, max_new_tokens=6, n=4, seed=3)
    (dense, dense_work), (ret, ret_work) = _run(engines[2][0], params), _run(engines[2][1], params)
    assert all(len(r.response_ids) == 6 for r in dense)
    for a, b in zip(dense, ret):
        assert a.response_ids == b.response_ids
        assert a.raw_log_probs.equal(b.raw_log_probs) and a.processed_log_probs.equal(b.processed_log_probs)
    assert dense_work["row_steps"] == ret_work["row_steps"] == len(dense) * 6


def test_routing_capture_is_refused(engines):
    with pytest.raises(InvalidRequestError, match="retire_finished"):
        engines[1].generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=2, return_routed_experts=True))


def test_config_key_and_what_it_refuses():
    from megarl.config import load_config
    from megarl.config.validation import validate
    from megarl.errors import ConfigError
    from tests._dist import ROOT

    recipe = f"{ROOT}/configs/grpo_arith_tiny.yaml"
    assert load_config(recipe, []).rollout.retire_finished is False
    assert validate(load_config(recipe, ["rollout.retire_finished=true"]), 1) == 1
    for extra in (["rollout.backend=sglang"], ["algo.routing_replay=rollout"]):
        with pytest.raises(ConfigError, match=r"rollout\.retire_finished"):
            validate(load_config(recipe, ["rollout.retire_finished=true", *extra]), 1)
