"""sglang backend pieces that run without sglang: the lazy-import error, the sampling and
output mappings (the engine: against the recorded SGLang API in
tests/unit/rollout/test_sglang_api_contract.py, on a GPU in tests/gpu/test_sglang_backend.py)."""

import importlib.util

import pytest
import torch

from megarl.rollout import create_rollout_engine
from megarl.rollout.protocol import FinishReason, GenerationRequest, SamplingParams
from megarl.models.safetensors_io import model_dir_eos_token_ids
from megarl.rollout.sglang_outputs import result_from_sglang_output, sglang_sampling_params, stop_token_ids_sent
from megarl.rollout.sglang_release import BackendUnavailableError
from megarl.rollout.protocol import RolloutError

REQ = GenerationRequest("r1", (2, 5, 6))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                    reason="checks the error for a missing sglang; sglang is installed here")
def test_asking_for_sglang_without_it_names_package_and_extra(tmp_path):
    with pytest.raises(BackendUnavailableError, match=r"'sglang'.*pip install -e \"\.\[gpu\]\""):
        create_rollout_engine("sglang", tmp_path)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown rollout backend 'vllm'"):
        create_rollout_engine("vllm", ".")


def test_sampling_params_mapping():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=12, stop_token_ids=(7,), seed=1)
    d = sglang_sampling_params(sp, 123, with_seed=True)
    assert d["top_k"] == -1 and d["stop_token_ids"] == [7] and d["n"] == 1 and d["sampling_seed"] == 123
    assert d["no_stop_trim"] is True and d["ignore_eos"] is False
    # the eos ids travel as stop ids too (SGLang would otherwise stop only on the model config's)
    assert sglang_sampling_params(sp, 1, with_seed=False, eos_token_ids=(3, 7))["stop_token_ids"] == [3, 7]
    assert stop_token_ids_sent(sp, (5, 3)) == (5, 3, 7)
    assert sglang_sampling_params(SamplingParams(), None, with_seed=False)["stop_token_ids"] is None
    assert "sampling_seed" not in sglang_sampling_params(sp, 123, with_seed=False)
    assert sglang_sampling_params(SamplingParams(top_k=5), 1, with_seed=True)["top_k"] == 5
    g = sglang_sampling_params(SamplingParams(temperature=0.0), None, with_seed=True)
    assert g["temperature"] == 0.0 and "sampling_seed" not in g


def out(tokens, lps, finish):
    return {"output_ids": tokens, "meta_info": {"finish_reason": finish,
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, tokens)]}}


@pytest.mark.parametrize("finish, stop_ids, expected", [
    ({"type": "stop", "matched": 3}, (), FinishReason.EOS),
    ({"type": "stop", "matched": 9}, (9,), FinishReason.STOP),
    ({"type": "length", "length": 3}, (), FinishReason.LENGTH),
    ({"type": "abort", "message": "x"}, (), FinishReason.ABORT),
])
def test_output_mapping_finish_reasons(finish, stop_ids, expected):
    last = finish.get("matched", 4)
    sp = SamplingParams(temperature=0.7, stop_token_ids=stop_ids)
    r = result_from_sglang_output(out([11, 12, last], [-1.0, -2.0, -0.5], finish), REQ, 1, sp, (3,), "v1.0-abcd", 5)
    assert r.finish_reason is expected and r.response_ids == (11, 12, last) and r.candidate_index == 1
    assert torch.equal(r.raw_log_probs, torch.tensor([-1.0, -2.0, -0.5]))
    assert r.processed_log_probs is None and r.policy_version == "v1.0-abcd" and r.prompt_ids == REQ.prompt_ids


def test_output_mapping_rejects_inconsistent_outputs():
    sp = SamplingParams()
    with pytest.raises(RolloutError, match="disagree"):
        result_from_sglang_output({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"},
                                   "output_token_logprobs": [(-1.0, 1, None), (-1.0, 5, None)]}}, REQ, 0, sp, (3,), "v", None)
    with pytest.raises(RolloutError, match="not one of the stop ids sent"):
        result_from_sglang_output(out([1, 8], [-1.0, -1.0], {"type": "stop", "matched": 8}), REQ, 0, sp, (3,), "v", None)
    with pytest.raises(RolloutError, match="not one of the stop ids sent"):  # a stop string: never sent
        result_from_sglang_output(out([1, 3], [-1.0, -1.0], {"type": "stop", "matched": "</s>"}), REQ, 0, sp, (3,), "v", None)
    with pytest.raises(RolloutError, match="does not end with it"):
        result_from_sglang_output(out([3, 8], [-1.0, -1.0], {"type": "stop", "matched": 3}), REQ, 0, sp, (3,), "v", None)
    with pytest.raises(RolloutError, match="output_token_logprobs"):
        result_from_sglang_output({"meta_info": {"finish_reason": {"type": "length"}}}, REQ, 0, sp, (3,), "v", None)


def test_output_mapping_reads_the_engine_counts_where_reported():
    """SGLang's per-request meta_info: end-to-end latency, prompt tokens served from the radix
    cache, and retractions (preemptions when the KV pool ran out); absent or not a number: None."""
    o = out([11, 3], [-1.0, -0.5], {"type": "stop", "matched": 3})
    o["meta_info"].update(e2e_latency=0.25, cached_tokens=2, num_retractions=1)
    r = result_from_sglang_output(o, REQ, 0, SamplingParams(), (3,), "v", None)
    assert (r.latency_s, r.cached_prompt_tokens, r.preemptions) == (0.25, 2, 1)
    o["meta_info"].update(e2e_latency=None, cached_tokens=True, num_retractions="1")
    r = result_from_sglang_output(o, REQ, 0, SamplingParams(), (3,), "v", None)
    assert (r.latency_s, r.cached_prompt_tokens, r.preemptions) == (None, None, None)


def test_sampling_params_round_trip_with_the_experience_schema():
    from megarl.experience.schema import FinishReason as SchemaFinishReason, SamplingConfig

    assert FinishReason is SchemaFinishReason  # one enum for rollout and experience
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, n=4, stop_token_ids=(5,))
    sp = SamplingParams.from_config(cfg, seed=9)
    assert sp.seed == 9 and sp.to_config() == cfg
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="greedy"):
        SamplingParams(temperature=0.0).to_config()


def test_model_dir_eos_ids_are_config_plus_generation_config(tmp_path):
    """What SGLang stops on by itself (configs/model_config.py ``_get_hf_eos_token_id``)."""
    import json

    assert model_dir_eos_token_ids(tmp_path) == ()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151645}))
    assert model_dir_eos_token_ids(tmp_path) == (151645,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert model_dir_eos_token_ids(tmp_path) == (151645, 151643)
