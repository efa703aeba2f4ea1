"""SGLang's generate() inputs and outputs, mapped to and from megarl's rollout contract.

Pure functions, CPU-testable (``tests/unit/rollout/test_rollout_sglang_mapping.py``): our sampling contract as
SGLang's ``sampling_params``, one generate() output as a :class:`GenerationResult` (tokens, raw
log-probs, the finish reason checked against the stop ids sent), and the routed experts of a
mixture-of-experts model from ``meta_info``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.experience.schema import SampleRouting, compact_expert_dtype
from megarl.rollout.protocol import FinishReason, GenerationRequest, GenerationResult, RolloutError, SamplingParams

def stop_token_ids_sent(sampling: SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ``stop_token_ids`` one request sends: the eos ids, then the contract's stop ids."""
    return tuple(dict.fromkeys([*(int(t) for t in eos_token_ids), *sampling.stop_token_ids]))


def sglang_sampling_params(sampling: SamplingParams, seed: int | None, with_seed: bool,
                           eos_token_ids: Sequence[int] = ()) -> dict:
    """Our sampling contract as an SGLang ``sampling_params`` dict for one candidate (n=1: we
    expand candidates ourselves so each gets its own seed, like the hf backend).

    ``with_seed``: the engine honours ``sampling_seed`` (deterministic inference is on)."""
    stop = stop_token_ids_sent(sampling, eos_token_ids)
    params = {
        "temperature": sampling.temperature,  # 0 -> greedy in SGLang (top_k=1)
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # -1 = off, same convention as SGLang
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(stop) or None,
        "n": 1,
        "ignore_eos": False,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # the stop token stays in output_ids: the response boundary
    }
    if with_seed and seed is not None and not sampling.greedy:
        params["sampling_seed"] = int(seed)
    return params


def result_from_sglang_output(
    out: dict,
    request: GenerationRequest,
    candidate_index: int,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int],
    version_id: str,
    seed: int | None,
) -> GenerationResult:
    """Map one SGLang generate() output (``output_ids`` + ``meta_info``) to a GenerationResult.

    ``meta_info["output_token_logprobs"]`` is a list of ``(logprob, token_id, text_or_None)``,
    one per generated token; ``meta_info["finish_reason"]`` is ``{"type": "stop"|"length"|
    "abort", "matched": token id or str or None, ...}`` (``managers/schedule_batch.py``
    ``FINISH_*.to_json``).  A stop must be on an id that was sent
    (:func:`stop_token_ids_sent` of ``sampling`` and ``eos_token_ids``): an eos id is EOS, a
    stop id STOP.
    """
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise RolloutError(f"{request.request_id}: SGLang output has no output_token_logprobs (return_logprob not set?)")
    tokens = [int(e[1]) for e in entries]
    output_ids = out.get("output_ids")
    if output_ids is not None and list(output_ids) != tokens:
        raise RolloutError(
            f"{request.request_id}/{candidate_index}: SGLang output_ids {list(output_ids)[:8]}... disagree "
            f"with the tokens of output_token_logprobs {tokens[:8]}..."
        )
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    matched = fr.get("matched") if isinstance(fr, dict) else None
    if kind == "length":
        reason = FinishReason.LENGTH
    elif kind == "abort":
        reason = FinishReason.ABORT
    elif kind == "stop":
        sent = stop_token_ids_sent(sampling, eos_token_ids)
        last = matched if isinstance(matched, int) else None
        if last is None or last not in sent:
            raise RolloutError(
                f"{request.request_id}: SGLang stopped on {matched!r}, which is not one of the stop ids "
                f"sent ({list(sent)}: eos {list(eos_token_ids)}, stop {list(sampling.stop_token_ids)})"
            )
        reason = FinishReason.EOS if last in set(eos_token_ids) else FinishReason.STOP
        if not tokens or tokens[-1] != last:
            raise RolloutError(
                f"{request.request_id}: SGLang finished on {last} but the response does not end with it "
                f"({tokens[-3:]}); the response boundary would be wrong"
            )
    else:
        raise RolloutError(f"{request.request_id}: unknown SGLang finish_reason {fr!r}")
    raw = torch.tensor([float(e[0]) for e in entries], dtype=torch.float32)
    return GenerationResult(
        request_id=request.request_id,
        candidate_index=candidate_index,
        prompt_ids=request.prompt_ids,
        response_ids=tuple(tokens),
        finish_reason=reason,
        raw_log_probs=raw,
        processed_log_probs=None,
        policy_version=version_id,
        seed=seed,
        attempt=request.attempt,
        latency_s=_latency(out.get("meta_info") or {}),
        cached_prompt_tokens=_meta_int(out.get("meta_info") or {}, "cached_tokens"),
        preemptions=_meta_int(out.get("meta_info") or {}, "num_retractions"),
    )


def _meta_int(meta: dict, key: str):
    """A count SGLang's meta_info reports where it does: ``cached_tokens`` (prompt tokens served
    from its radix cache), ``num_retractions`` (times the scheduler retracted the request when
    the KV pool ran out, to recompute it later: a preemption)."""
    v = meta.get(key)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _latency(meta: dict):
    """The request's end-to-end seconds where SGLang's meta_info reports them (``e2e_latency``)."""
    v = meta.get("e2e_latency")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class MoELayout:
    """What the routing output of one model looks like: ``num_hidden_layers`` columns (SGLang's),
    of which ``moe_layers`` are MoE, ``top_k`` ids each among ``num_experts``."""

    def __init__(self, num_hidden_layers: int, num_experts: int, top_k: int, moe_layers: tuple[int, ...]):
        self.num_hidden_layers, self.num_experts, self.top_k = num_hidden_layers, num_experts, top_k
        self.moe_layers = tuple(moe_layers)

    def __repr__(self):
        return (f"MoELayout(layers={self.num_hidden_layers}, experts={self.num_experts}, top_k={self.top_k}, "
                f"moe_layers={self.moe_layers})")


def moe_layout_from_config(config: dict) -> MoELayout | None:
    """The MoE layout of an HF ``config.json`` (None for a dense model): Mixtral (every layer),
    Qwen2-MoE / Qwen3-MoE (``mlp_only_layers``, ``decoder_sparse_step``), DeepSeek-style
    (``first_k_dense_replace``, ``moe_layer_freq``)."""
    text = config.get("text_config") or config
    n_layers = int(text["num_hidden_layers"])
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    if not experts:
        return None
    top_k = int(text["num_experts_per_tok"])
    if "first_k_dense_replace" in text or "moe_layer_freq" in text:  # DeepSeek-style
        first, freq = int(text.get("first_k_dense_replace", 0)), int(text.get("moe_layer_freq", 1))
        layers = tuple(i for i in range(n_layers) if i >= first and i % freq == 0)
    elif "mlp_only_layers" not in text and "decoder_sparse_step" not in text:  # Mixtral: every layer
        layers = tuple(range(n_layers))
    else:  # Qwen2-MoE / Qwen3-MoE (transformers 5 writes their num_experts as num_local_experts)
        only = set(text.get("mlp_only_layers") or ())
        step = int(text.get("decoder_sparse_step", 1))
        layers = tuple(i for i in range(n_layers) if i not in only and (i + 1) % step == 0)
    return MoELayout(n_layers, int(experts), top_k, layers)


def routed_experts_from_sglang_output(meta: dict, rows: int, layout: MoELayout, where: str) -> SampleRouting:
    """``meta_info["routed_experts"]`` -> the sample's routing on its MoE layers.

    The value is base64 of int32 bytes (0.5.23) or the int32 tensor itself (0.5.7), laid out
    ``(rows, num_hidden_layers, top_k)`` with ``rows = prompt + output tokens - 1``.  Anything
    else (absent, another size, ids outside the experts) is an error naming the request.
    """
    import base64

    import numpy as np

    value = meta.get("routed_experts")
    if value is None:
        raise RolloutError(f"{where}: SGLang output has no meta_info['routed_experts'] (engine started without "
                           "enable_return_routed_experts, or a model SGLang does not capture?)")
    if isinstance(value, str):
        flat = torch.from_numpy(np.frombuffer(base64.b64decode(value), dtype=np.int32).copy())
    elif isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu", torch.int32).reshape(-1)
    else:
        flat = torch.as_tensor(np.asarray(value, dtype=np.int32)).reshape(-1)
    want = rows * layout.num_hidden_layers * layout.top_k
    if flat.numel() != want:
        raise RolloutError(f"{where}: SGLang routed_experts has {flat.numel()} ids, expected {rows} tokens x "
                           f"{layout.num_hidden_layers} layers x top-{layout.top_k} = {want}")
    ids = flat.reshape(rows, layout.num_hidden_layers, layout.top_k)[:, list(layout.moe_layers)]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_experts):
        raise RolloutError(f"{where}: SGLang routed_experts ids outside [0, {layout.num_experts}) "
                           f"(physical ids of redundant experts?)")
    return SampleRouting(ids.to(compact_expert_dtype(layout.num_experts)), layout.num_experts, layout.moe_layers,
                         "sglang")


