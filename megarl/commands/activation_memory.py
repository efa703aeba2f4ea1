"""The dry run's estimate of the update's activation memory per GPU, from config.json and the keys.

After Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198), for the layers megarl builds on CUDA (transformer-engine: flash attention, so no
``s x s`` score tensor is kept; RMSNorm; SwiGLU MLPs; bf16 activations, 2 bytes).  What one
decoder layer keeps for its backward, per micro-batch of ``T`` tokens and with each recomputation
setting: :func:`_layer_bytes`; the pipeline's micro-batches in flight, the last stage's logits
and context parallelism: :func:`activation_lines`.
"""

from __future__ import annotations

from typing import List

GiB = 1024 ** 3


def micro_batch_tokens(cfg, dp: int) -> tuple:
    """``(tokens of one micro-batch, how they were counted)``: the token budget, or the rows of a
    micro-batch at the longest prompt plus the longest response (padded to the batch's longest)."""
    a, r, t = cfg.algo, cfg.rollout, cfg.trainer
    if a.micro_batch_tokens:
        return a.micro_batch_tokens, f"algo.micro_batch_tokens={a.micro_batch_tokens}"
    rows = a.micro_batch_size or max(t.prompts_per_iteration * r.n // a.num_mini_batches // dp, 1)
    width = cfg.data.max_prompt_tokens + r.max_new_tokens
    return rows * width, (f"{rows} row(s) x ({cfg.data.max_prompt_tokens} prompt + {r.max_new_tokens} response "
                          "tokens), padded to the longest")


def _layer_bytes(spec, i: int, T: int, tp: int, etp: int, sp: bool, drop: set) -> float:
    """Bytes one decoder layer keeps for its backward, without recomputation but for the
    selectively recomputed parts in ``drop``.

    Per decoder layer and micro-batch of ``T`` tokens, what the backward keeps:

    * attention: the norm's input and output (``2h``), Q, K, V (``q + 2 kv``), the attention output
      (``q``), then the MLP's norm input and output (``2h``);
    * MLP: gate and up outputs and the SwiGLU output (``3f``); an MoE layer instead keeps ``top_k`` of
      its experts' (``3 f_moe`` each, over expert TP) and the shared expert's, and the router's fp32
      logits (``4 E`` bytes);

    ``2 T (4h + 2q + 2kv + 3f)`` bytes, where TP splits ``q``, ``kv`` and ``f`` and sequence parallelism
    also the ``h`` terms (megatron saves the sequence-parallel shard and gathers it again in the
    backward).  Recomputation keeps less: ``full`` only each recomputed chunk's input (``2 T h``, /tp
    under SP) plus one chunk's activations while it is recomputed; ``selective`` drops the named parts
    (``mlp``: its inner ``3f``; ``layernorm``: the norms' outputs; ``moe`` / ``moe_act``: the experts'
    inner tensors; ``core_attn`` nothing more with flash attention, which keeps no scores).
    """
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    seq = tp if sp else 1
    norms_in, norms_out = 2 * h / seq, (0 if "layernorm" in drop else 2 * h / seq)
    attn = (2 * q + 2 * kv) / tp
    mla = getattr(spec, "mla", None)
    if mla is not None:  # the gathered latents (whole on every TP rank), then q, k, v and the output
        latents = (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim
        n = spec.num_attention_heads
        attn = 2 * latents + (2 * n * spec.head_dim + 2 * n * mla.v_head_dim) / tp
    moe = getattr(spec, "moe", None)
    if moe is not None and moe.moe_layers[i]:
        inner = 0 if drop & {"moe", "moe_act"} else moe.top_k * 3 * moe.ffn_hidden_size / etp
        shared = 3 * (moe.shared_expert_ffn_hidden_size or 0) / tp
        mlp = inner + (0 if "shared_experts" in drop else shared) + h / seq  # the experts' input tokens
        router = 2 * moe.num_experts / seq  # fp32 logits: 4 bytes = 2 x 2
    else:
        mlp, router = (0 if "mlp" in drop else 3 * spec.ffn_hidden_size / tp), 0
    return 2 * T * (norms_in + norms_out + attn + mlp + router)


def activation_estimate(cfg, spec, dp: int) -> dict:
    """The numbers behind :func:`activation_lines`: ``total`` bytes per GPU in the update, and
    its parts (``kept`` per micro-batch, ``inflight`` micro-batches, ``logits``) with the words
    that describe them."""
    p, a = cfg.parallel, cfg.algo
    tokens, how = micro_batch_tokens(cfg, dp)
    T = -(-tokens // p.cp)  # this context-parallel rank's share of them
    tp, pp = p.tp, p.pp
    etp = p.etp or p.tp
    sp = bool(p.sequence_parallel and tp > 1)
    rc = p.recompute
    if p.first_stage_layers is not None or p.last_stage_layers is not None:  # the heaviest stage's
        from megarl.models.stages import stage_layer_counts

        layers = max(stage_layer_counts(spec.num_layers, pp, p.first_stage_layers, p.last_stage_layers))
    else:
        layers = -(-spec.num_layers // pp)  # the first stage's
    drop = set(rc.modules) if rc.granularity == "selective" else set()
    per_layer = [_layer_bytes(spec, i, T, tp, etp, sp, drop) for i in range(layers)]
    if rc.granularity == "full":
        n = max(rc.num_layers, 1)
        chunk_input = 2 * T * spec.hidden_size / (tp if sp else 1)
        if rc.method == "block":
            kept = sum(per_layer[n:]) + min(n, layers) * chunk_input + max(per_layer[:n], default=0)
        else:
            kept = -(-layers // n) * chunk_input + sum(sorted(per_layer)[-n:])
        mode = f"full ({rc.method}, {n} layer(s) a chunk)"
    else:
        kept = sum(per_layer)
        mode = f"selective ({', '.join(rc.modules)})" if rc.granularity == "selective" else "none"
    rows_per_rank = cfg.trainer.prompts_per_iteration * cfg.rollout.n // a.num_mini_batches // dp
    micro = max(rows_per_rank // a.micro_batch_size, 1) if (a.micro_batch_size and not a.micro_batch_tokens) else pp
    inflight = min(pp, micro)
    schedule = f"1F1B at pp {pp}"
    if p.vpp > 1:  # interleaved: chunk forwards in flight on rank 0, each 1/vpp of its layers
        filled = -(-micro // pp) * pp  # micro-batch counts are filled to a multiple of pp
        inflight = min(p.vpp * pp + pp - 1, filled * p.vpp) / p.vpp
        schedule = f"interleaved 1F1B at pp {pp} x vpp {p.vpp}"
    vocab = spec.padded_vocab_size(cfg.model.vocab_multiple) / tp
    if a.log_prob_chunk:  # megarl/models/fused_output.py: three fp32 chunks and dW's fp32 sum
        logits = 3 * 4 * min(a.log_prob_chunk, T) * vocab + 4 * vocab * spec.hidden_size
        fp32_note = (f"the output layer {a.log_prob_chunk} positions at a time: no full logits; "
                     f"incl. its fp32 weight-gradient sum {4 * vocab * spec.hidden_size / GiB:.1f} GiB")
    else:
        logits = 2 * 2 * T * vocab + 4 * T * vocab
        fp32_note = f"incl. the fp32 softmax {4 * T * vocab / GiB:.1f} GiB; algo.log_prob_chunk drops it"
    total = inflight * kept + logits
    return dict(tokens=tokens, how=how, T=T, sp=sp, mode=mode, layers=layers, inflight=inflight, kept=kept,
                schedule=schedule, logits=logits, fp32_note=fp32_note, total=total)


def activation_lines(cfg, spec, dp: int) -> List[str]:
    """The dry run's lines on the update's activation memory (per layer: :func:`_layer_bytes`).

    Under 1F1B the first pipeline stage holds ``min(pp, micro-batches)`` micro-batches in flight; with
    ``parallel.vpp`` virtual stages (interleaved 1F1B, Narayanan et al. 2021, arXiv 2104.04473) it
    holds ``vpp pp + pp - 1`` chunk forwards of ``1/vpp`` of its layers each (megatron's warm-up on
    rank 0 plus one), that is ``pp + (pp - 1) / vpp`` micro-batches' worth.  The last
    stage adds the logits (``2 T V/tp``), their gradient (the same) and the fp32 softmax megatron's
    cross-entropy keeps (``4 T V/tp``); with ``algo.log_prob_chunk`` = c instead three fp32 chunks
    (``12 c V/tp``) and the output weight's fp32 gradient sum (``4 V/tp h``).  Context
    parallelism (``parallel.cp``) gives each rank ``T / cp`` of a micro-batch's tokens: every term
    above is per rank's tokens.
    """
    p = cfg.parallel
    e = activation_estimate(cfg, spec, dp)
    tokens, how, T, sp, mode = e["tokens"], e["how"], e["T"], e["sp"], e["mode"]
    layers, inflight, kept, schedule = e["layers"], e["inflight"], e["kept"], e["schedule"]
    logits, fp32_note, total = e["logits"], e["fp32_note"], e["total"]
    uneven = p.first_stage_layers is not None or p.last_stage_layers is not None
    return [
        f"activations per GPU in the update (bf16, flash attention; arXiv 2205.05198's accounting): a micro-batch "
        f"of {tokens} tokens ({how}){f', {T} on each of cp {p.cp} ranks' if p.cp > 1 else ''}; "
        f"sequence parallelism {'on' if sp else 'off'}; recompute {mode}",
        f"  layers  {layers} on the {'heaviest' if uneven else 'first'} stage x {inflight:g} micro-batch(es) in flight "
        f"({schedule}): "
        f"{inflight * kept / GiB:.1f} GiB ({kept / max(layers, 1) / GiB * 1024:.0f} MiB a layer a micro-batch)",
        f"  logits  {logits / GiB:.1f} GiB on the last stage ({fp32_note})",
        f"  total   ~{total / GiB:.1f} GiB (left out: the sequence gathered under SP while a layer runs, the MoE "
        "dispatcher's permutation buffers, megatron's temporary buffers, allocator fragmentation, the K/V chunks "
        "context parallelism exchanges; measured on CPU: bench/scale.py)",
    ]
