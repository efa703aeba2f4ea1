"""The GPU check: one program on one GPU (budget: 8 minutes), printing a table.

    bash tests/gpu/run.sh                  # on a GPU machine (the Docker image has everything)
    pytest -q tests/gpu/                   # the same through pytest; skipped without CUDA / sglang

Rows (each a pass/fail with its figures; a row whose inputs failed is "not run"):

1. setup: a random tiny Llama (head_dim 64: SGLang's default attention backend on Hopper, fa3,
   and flashinfer/triton all take it), the megatron actor on transformer-engine in bf16 with its
   optimizer, the actor's own greedy continuation, from which the eos id is chosen so that a
   response really ends on EOS;
2. sglang backend, greedy: the engine (synced from the megatron actor) reproduces the actor's
   greedy tokens and stops on EOS exactly where the actor's continuation has it (a divergence is
   accepted only at a near-tie of the actor's logits);
3. sglang backend, raw log-probs: sampled at T=0.7, the engine's log-probs equal the megatron
   actor's teacher-forced raw log-probs (TE kernels vs SGLang kernels, bf16), and clearly differ
   from the temperature-scaled ones;
4. sleep/wake twice (kv cache + weights released, exactly those resumed), reload and identical
   greedy output each time, then a kv-only sleep keeping the version: the process survives;
5. the actor's offload round trip after a real optimizer step: CUDA memory is released, the
   params come back bitwise;
6. weight sync of the updated actor (v1): the engine's greedy output changes and equals that of
   a fresh SGLang engine started from an HF export of v1;
7. bf16 end to end: actor params, manifest, stream, engine and export all bf16;
8. TP=1 weight-sync bandwidth on a ~0.8 GB bf16 model (megatron actor -> engine, GB/s);
9. (after 3) agent sessions on SGLang (megarl/rollout/agent.py): multi-turn trajectories whose
   later turns continue from the trajectory's token ids (``input_ids``, never text), environment
   output rendered by the tiny chat template in between; every policy token is what the engine
   sampled (the per-sample audit) and its raw log-prob equals the megatron actor's teacher-forced
   log-prob over the whole trajectory, environment tokens included as context.
10. (after the packed forward) ``algo.micro_batch_tokens`` and ``algo.log_prob_chunk``: one optimizer step
   on packed token-budget micro-batches (THD through TE's attention, in training) has the padded
   step's gradient norm (bf16: 2e-2 relative); log-probs with the output layer a chunk at a time
   equal the whole logits' to a bf16 rounding, and the log-prob pass's peak CUDA memory drops by
   more than half.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests._tolerance import bf16_logprob_tol, bf16_near_tie  # noqa: E402
from tests.gpu._gpu_check import MAX_NEW, SKIP_REASON, TOKENIZER_HASH, Table, run_as_pytest  # noqa: E402

# bf16 TE forward vs bf16 SGLang kernels: log-prob parity within tests._tolerance.bf16_logprob_tol and
# greedy divergences accepted under bf16_near_tie, both from the model's depth and the largest
# |logit| each check measures on the actor (no fixed number: a random checkpoint's logits scale
# with its init std).  Not run yet: no GPU has been lent.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
        "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
BIG = dict(TINY, vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=12,
           num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)


# ---- helpers ----------------------------------------------------------------------------------------


def set_eos(model_dir: str, eos: int) -> None:
    """The engine reads its eos ids from config.json (+ generation_config.json)."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = eos
    with open(path, "w") as f:
        json.dump(cfg, f)
    gen = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)


def param_digest(model) -> str:
    from megarl.checkpointing.checkpoint import tensor_digest  # no numpy view: storages stay resizable

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(f"{name}={tensor_digest(p)}".encode())
    return h.hexdigest()[:16]


def actor_logits(model, ids: list[int]) -> torch.Tensor:
    from tests._logits import full_logits

    return full_logits(model, torch.tensor([ids], device="cuda"))[0].float()


def actor_greedy(model, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(actor_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


def new_engine(model_dir: str, eos: int, **kw):
    from megarl.rollout.sglang_backend import SGLangRolloutEngine

    return SGLangRolloutEngine(model_dir, tp_size=1, eos_token_ids=[eos], dtype="bfloat16",
                               mem_fraction_static=kw.pop("mem_fraction_static", 0.25), **kw)


def sync(ctx, engine, model, step: int):
    from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine

    manifest = actor_manifest(model, dtype=engine.dtype)
    version = make_version(model, manifest, run_id="gpu-check", optimizer_step=step, tokenizer_hash=TOKENIZER_HASH)
    t0 = time.perf_counter()
    report = sync_actor_to_engine(model, engine, version, manifest, bucket_bytes=ctx.bucket_bytes)
    seconds = time.perf_counter() - t0
    engine.activate(version)
    return version, manifest, report, seconds


def greedy(engine, ctx):
    from megarl.rollout.protocol import SamplingParams

    return engine.generate(ctx.requests, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))


# ---- the checks -------------------------------------------------------------------------------------


def check_setup(ctx):
    from megarl.builtin.tiny_checkpoint import write_random_hf_checkpoint
    from megarl.config import OptimSettings
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import wrap_for_training
    from megarl.models.weights import export_hf
    from megarl.rollout.protocol import GenerationRequest

    hf0 = os.path.join(ctx.work, "hf0")
    write_random_hf_checkpoint(hf0, TINY, seed=0, std=0.2, dtype=torch.bfloat16)
    model = load_model(hf0, tp=1, pp=1, dtype=torch.bfloat16)
    ctx.ddp, ctx.opt = wrap_for_training(model, OptimSettings(optimizer="adam", lr=3e-3, clip_grad=1.0))
    te = type(_first_layer(model).self_attention.linear_qkv).__module__
    assert "transformer_engine" in te, f"the actor's layers are not transformer-engine ({te})"
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(10, 1000, (4 + 3 * i,), generator=g).tolist() for i in range(4)]
    ctx.actor_greedy = [actor_greedy(ctx.ddp, p, MAX_NEW) for p in prompts]
    first = ctx.actor_greedy[0]
    k = next(i for i in range(3, MAX_NEW) if first[i] not in first[:i])
    ctx.eos, ctx.eos_at = first[k], k
    ctx.requests = [GenerationRequest(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]
    ctx.engine_dir = os.path.join(ctx.work, "engine")
    export_hf(ctx.ddp, ctx.engine_dir, dtype=torch.bfloat16)
    set_eos(ctx.engine_dir, ctx.eos)
    ctx.bucket_bytes = 8 << 20
    return f"qkv from {te}; eos id {ctx.eos} (prompt 0's greedy token {k})"


def _first_layer(model):
    from megarl.models.weights import unwrap

    return unwrap(model).decoder.layers[0]


def check_greedy(ctx):
    from megarl.rollout.protocol import FinishReason

    before = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    ctx.engine = new_engine(ctx.engine_dir, ctx.eos)
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == before, "Engine() left CUDA_DEVICE_MAX_CONNECTIONS changed"
    ctx.v0, _, report, _ = sync(ctx, ctx.engine, ctx.ddp, 0)
    ctx.g0 = greedy(ctx.engine, ctx)
    exact = ties = 0
    for r, ref in zip(ctx.g0, ctx.actor_greedy):
        expected = ref[:ref.index(ctx.eos) + 1] if ctx.eos in ref else ref
        got = list(r.response_ids)
        if got == expected:
            exact += 1
        else:
            t = next(i for i in range(min(len(got), len(expected)) + 1)
                     if i >= len(got) or i >= len(expected) or got[i] != expected[i])
            assert t < len(got) and t < len(expected), f"{r.request_id}: lengths differ without a token divergence"
            logits = actor_logits(ctx.ddp, list(r.prompt_ids) + got[:t])[-1]
            gap = float(logits.max() - logits[got[t]])
            tie = bf16_near_tie(TINY["num_hidden_layers"], float(logits.abs().max()))
            assert gap < tie, (f"{r.request_id}: engine token {got[t]} at {t} where the actor's greedy is "
                               f"{expected[t]} (logit gap {gap:.3f} is no tie: bf16 ties are under {tie:.3f})")
            ties += 1
        ends_on_eos = got[-1] == ctx.eos
        assert (r.finish_reason is FinishReason.EOS) == ends_on_eos, (r.request_id, r.finish_reason, got[-3:])
    g = ctx.g0[0]
    assert g.finish_reason is FinishReason.EOS and len(g.response_ids) == ctx.eos_at + 1, (
        f"prompt 0 should stop on EOS {ctx.eos} at token {ctx.eos_at}: {g.finish_reason}, {g.response_ids}")
    return (f"{exact}/{len(ctx.g0)} responses identical to the actor's greedy ({ties} near-tie divergences); "
            f"prompt 0 ends on EOS at token {ctx.eos_at}; {report.num_tensors} tensors in {report.num_buckets} buckets")


def check_parity(ctx):
    from megarl.models.forward import teacher_forced_log_probs
    from megarl.rollout.protocol import SamplingParams

    hot = ctx.engine.generate(ctx.requests, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=MAX_NEW, n=2, seed=4))
    raw_err = scaled_err = scale = 0.0
    for r in hot:
        ids = torch.tensor([list(r.prompt_ids) + list(r.response_ids)], device="cuda")
        start = len(r.prompt_ids) - 1
        scale = max(scale, float(actor_logits(ctx.ddp, ids[0].tolist()).abs().max()))
        raw = teacher_forced_log_probs(ctx.ddp, ids)[0, start:].cpu()
        scaled = teacher_forced_log_probs(ctx.ddp, ids, temperature=0.7)[0, start:].cpu()
        raw_err = max(raw_err, float((raw - r.raw_log_probs).abs().max()))
        scaled_err = max(scaled_err, float((scaled - r.raw_log_probs).abs().max()))
    tol = bf16_logprob_tol(TINY["num_hidden_layers"], scale)
    assert raw_err < tol, f"raw log-prob parity {raw_err:.4f} >= {tol:.4f} (bf16, |logit| <= {scale:.2f})"
    assert scaled_err > 3 * raw_err, f"engine log-probs look temperature-scaled ({scaled_err:.4f} vs raw {raw_err:.4f})"
    return (f"max |engine - actor| {raw_err:.4f} (raw; bound {tol:.4f}), {scaled_err:.4f} vs log softmax(logits/T); "
            f"{len(hot)} samples")


def check_agent_sessions(ctx):
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.data.tokenizer import TokenizerContract
    from megarl.envs.render import EnvTurnRenderer
    from megarl.models.forward import teacher_forced_log_probs
    from megarl.rollout.agent import POLICY, AgentLimits, AgentSessionEngine, audit
    from megarl.rollout.protocol import GenerationRequest, SamplingParams
    from tests.plugins.echo_tool import EchoTool

    tok_dir = os.path.join(ctx.work, "tiny_tokenizer")
    build_tiny_tokenizer(tok_dir)
    contract = TokenizerContract.from_pretrained(tok_dir)  # ids < 128: inside the random model's vocabulary
    agent = AgentSessionEngine(ctx.engine, env_factory=EchoTool, renderer=EnvTurnRenderer(contract),
                               limits=AgentLimits(max_turns=3, max_total_tokens=4 * MAX_NEW),
                               decode=lambda ids: " ".join(map(str, ids)), step_timeout_s=10.0, max_workers=4)
    # greedy: prompt 0's first turn ends on EOS (row 1), so its session takes a second turn
    reqs = [GenerationRequest(q.request_id, q.prompt_ids, task={}) for q in ctx.requests]
    results = agent.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    multi = [r for r in results if len(r.episode.generated) >= 2]
    assert multi, f"no session took a second turn: {[(r.request_id, r.finish_reason) for r in results]}"
    err = scale = 0.0
    for r in results:
        t = r.episode
        assert audit(t) == [], audit(t)
        for k, g in enumerate(t.generated):  # each turn was fed exactly the trajectory so far, as ids
            start = sum(len(x.response_ids) for x in t.generated[:k]) + sum(len(x) for x in t.rendered[:k])
            assert g.prompt_ids == t.prompt_ids + tuple(t.response_ids[:start]), f"{r.request_id}: turn {k} input"
        ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)], device="cuda")
        scale = max(scale, float(actor_logits(ctx.ddp, ids[0].tolist()).abs().max()))
        lp = teacher_forced_log_probs(ctx.ddp, ids)[0, len(t.prompt_ids) - 1:].cpu()
        pol = torch.tensor(t.source) == POLICY
        err = max(err, float((lp[pol] - r.raw_log_probs[pol]).abs().max()))
    tol = bf16_logprob_tol(TINY["num_hidden_layers"], scale)
    assert err < tol, f"agent trajectories: raw log-prob parity {err:.4f} >= {tol:.4f} (|logit| <= {scale:.2f})"
    env_tokens = sum(r.episode.source.count(2) for r in results)
    return (f"{len(multi)}/{len(results)} sessions multi-turn, {env_tokens} environment tokens; policy tokens "
            f"max |engine - actor| {err:.4f} over whole trajectories")


def check_sleep_wake(ctx):
    freed = []
    for _ in range(2):
        free0 = torch.cuda.mem_get_info()[0]
        ctx.engine.sleep()
        freed.append((torch.cuda.mem_get_info()[0] - free0) / 2**30)
        ctx.engine.wake()
        assert ctx.engine.active_version is None  # weights were released: reload
        sync(ctx, ctx.engine, ctx.ddp, 0)
        again = greedy(ctx.engine, ctx)
        assert [r.response_ids for r in again] == [r.response_ids for r in ctx.g0], "greedy output changed after wake"
    assert min(freed) > 0.5, f"sleep() released only {freed} GiB (memory saver off?)"
    ctx.engine.sleep(release_weights=False)
    ctx.engine.wake()
    assert ctx.engine.active_version == ctx.v0
    assert [r.response_ids for r in greedy(ctx.engine, ctx)] == [r.response_ids for r in ctx.g0]
    return f"released {freed[0]:.1f} / {freed[1]:.1f} GiB; identical greedy after each wake; kv-only sleep kept v0"


def check_offload(ctx):
    from megarl.models.vocab_parallel import token_log_probs_from_logits
    from megarl.models.optim import train_step
    from megarl.models.weights import unwrap
    from megarl.roles.offload import ActorOffloader

    V = unwrap(ctx.ddp).megarl_spec.vocab_size
    tokens = torch.tensor([list(r.prompt_ids) + list(r.response_ids) for r in ctx.g0[:1]], device="cuda")

    def loss_fn(output, mb):  # raise the likelihood of a fixed continuation: a real update
        lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], V)
        loss = -lp.mean()
        return loss, {"loss": loss.detach()}

    for _ in range(3):
        assert train_step(ctx.ddp, ctx.opt, [{"tokens": tokens}], loss_fn).update_successful
    digest = param_digest(ctx.ddp)
    off = ActorOffloader(ctx.ddp, ctx.opt, preserve_grads=False)
    torch.cuda.synchronize()
    alloc0, free0 = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    moved = off.offload()
    torch.cuda.synchronize()
    alloc1, free1 = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    total = sum(moved.values())
    assert total > 0 and alloc0 - alloc1 >= 0.9 * total, (moved, alloc0, alloc1)
    off.onload()
    assert param_digest(ctx.ddp) == digest, "params changed across the offload round trip"
    mib = 2**20
    return (f"moved {total / mib:.1f} MiB ({', '.join(f'{k} {v / mib:.1f}' for k, v in moved.items())}); "
            f"allocated -{(alloc0 - alloc1) / mib:.1f} MiB, device free +{(free1 - free0) / mib:.1f} MiB; bitwise back")


def check_new_weights(ctx):
    import sglang

    from megarl.models.weights import export_hf
    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.sglang_outputs import result_from_sglang_output, sglang_sampling_params

    ctx.v1, ctx.m1, report, seconds = sync(ctx, ctx.engine, ctx.ddp, 1)
    g1 = greedy(ctx.engine, ctx)
    assert all(r.policy_version == ctx.v1.short_id for r in g1)
    assert [r.response_ids for r in g1] != [r.response_ids for r in ctx.g0], "the engine still serves v0"
    ctx.engine.shutdown()
    ctx.engine = None
    export = os.path.join(ctx.work, "export_v1")
    export_hf(ctx.ddp, export, dtype=torch.bfloat16)
    set_eos(export, ctx.eos)
    ctx.export_dtype = json.load(open(os.path.join(export, "config.json"))).get("torch_dtype")
    saved = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    fresh = sglang.Engine(model_path=export, skip_tokenizer_init=True, dtype="bfloat16", mem_fraction_static=0.25,
                          random_seed=0, log_level="error")  # real weights from disk, no megarl in between
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = saved or "1"
    try:
        sp = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
        outs = fresh.generate(input_ids=[list(r.prompt_ids) for r in ctx.requests],
                              sampling_params=[sglang_sampling_params(sp, None, False, (ctx.eos,))] * len(ctx.requests),
                              return_logprob=True)
        ref = [result_from_sglang_output(o, r, 0, sp, (ctx.eos,), "export", None).response_ids
               for o, r in zip(outs, ctx.requests)]
    finally:
        fresh.shutdown()
    assert [r.response_ids for r in g1] == ref, "the synced engine and a fresh engine from the v1 export disagree"
    return f"v1 greedy differs from v0 and equals a fresh engine from the HF export of v1 ({len(ref)} prompts)"


def check_bf16(ctx):
    dtypes = {p.dtype for p in ctx.ddp.parameters()}
    assert dtypes == {torch.bfloat16}, dtypes
    assert {e.dtype for e in ctx.m1.entries.values()} == {"bfloat16"}
    assert ctx.export_dtype == "bfloat16", ctx.export_dtype
    return "actor params, manifest/stream, engine (dtype=bfloat16) and HF export: bfloat16"


def check_bandwidth(ctx):
    from megarl.builtin.tiny_checkpoint import write_random_hf_checkpoint
    from megarl.models.megatron_ckpt import load_model

    hf = os.path.join(ctx.work, "big")
    gb = write_random_hf_checkpoint(hf, BIG, seed=1, std=0.02, dtype=torch.bfloat16)
    model = load_model(hf, tp=1, pp=1, dtype=torch.bfloat16)
    # the engine reads only config.json (load_format=dummy): the weights arrive by the stream
    engine = new_engine(hf, BIG["eos_token_id"], mem_fraction_static=0.3, engine_kwargs={"disable_cuda_graph": True})
    ctx.bucket_bytes = 512 << 20  # rollout.bucket_mb default
    try:
        best = None
        for step in range(3):
            _, _, report, seconds = sync(ctx, engine, model, step)
            best = seconds if best is None else min(best, seconds)
        engine_side = report.num_bytes / 1e9 / report.seconds
        full = report.num_bytes / 1e9 / best
    finally:
        engine.shutdown()
    return (f"{report.num_bytes / 1e9:.2f} GB bf16 ({gb:.2f} GiB on disk), {report.num_buckets} buckets of 512 MiB: "
            f"{full:.2f} GB/s gather+check+hand-over+load, {engine_side:.2f} GB/s engine side (best of 3)")


def check_checksum(ctx):
    """The weight checksum is a function of the bytes alone: the same on the GPU as on the CPU
    (a manifest made on one device is verified on the other), at GPU memory bandwidth."""
    import time

    from megarl.rollout.weight_stream import tensor_checksum

    g = torch.Generator().manual_seed(0)
    for shape, dtype in [((4096, 4096), torch.bfloat16), ((1001, 7), torch.float32), ((13,), torch.bfloat16)]:
        t = torch.randn(*shape, generator=g).to(dtype)
        assert tensor_checksum(t.cuda()) == tensor_checksum(t), (shape, dtype)
    # K inside a fused QKV (8 groups of [q 256 | k 128 | v 128] x 4096): read in place on both
    fused = torch.randn(8, 512, 4096, generator=g).to(torch.bfloat16)
    assert tensor_checksum(fused.cuda()[:, 256:384]) == tensor_checksum(fused[:, 256:384].contiguous())
    big = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    tensor_checksum(big)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tensor_checksum(big)
    seconds = time.perf_counter() - t0
    return f"GPU checksum == CPU checksum (bf16/fp32, odd sizes, strided QKV blocks); {big.numel() * 2 / 1e9 / seconds:.0f} GB/s on 2 GiB"


def check_packed(ctx):
    """algo.pack_sequences on CUDA: each micro-batch as one THD sequence (megatron-core
    PackedSeqParams through TE's attention) gives the padded forward's log-probs."""
    import time

    from megarl.models.forward import response_log_probs

    core = type(_first_layer(ctx.ddp).self_attention.core_attention)
    assert "transformer_engine" in core.__module__, f"core attention is {core.__module__}.{core.__name__}, not TE"
    g = torch.Generator().manual_seed(3)
    B, P, R = 128, 32, 64
    plen, rlen = torch.randint(8, P + 1, (B,), generator=g), torch.randint(1, R + 1, (B,), generator=g)
    pos = torch.arange(P + R)
    attn = ((pos >= (P - plen)[:, None]) & (pos < (P + rlen)[:, None])).long()
    prompt = torch.randint(10, 1000, (B, P), generator=g) * attn[:, :P]
    resp = torch.randint(10, 1000, (B, R), generator=g) * attn[:, P:]
    args = [t.cuda() for t in (prompt, resp, attn)]
    secs = {}
    for pack in (False, True, False, True):  # the first pass of each warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = response_log_probs(ctx.ddp, *args, 16, pack=pack)
        torch.cuda.synchronize()
        secs[pack] = (time.perf_counter() - t0, out)
    keep = attn[:, P:].bool().cuda()
    err = float((secs[True][1] - secs[False][1]).abs()[keep].max())
    from tests._logits import full_logits

    with torch.no_grad():
        scale = float(full_logits(ctx.ddp, torch.cat(args[:2], 1)).abs().max())
    tol = bf16_logprob_tol(TINY["num_hidden_layers"], scale)  # one implementation, two batch layouts
    assert err < tol, f"max |packed - padded| log-prob {err:.4f} >= {tol:.4f} (|logit| <= {scale:.2f})"
    return (f"max |packed - padded| {err:.4f} over {int(keep.sum())} response tokens (bf16, {core.__name__}); "
            f"{B} rows, mbs 16: padded {secs[False][0] * 1e3:.1f} ms, packed {secs[True][0] * 1e3:.1f} ms")


def check_token_budget(ctx):
    """algo.micro_batch_tokens and algo.log_prob_chunk on CUDA: one optimizer step on packed
    token-budget micro-batches (THD through TE's attention, in training) has the padded step's
    gradient norm, and the log-probs with the output layer a chunk at a time equal the whole logits'
    to a bf16 rounding while the pass's peak CUDA memory drops by more than half."""
    from megarl.experience.token_budget import first_fit
    from megarl.models.forward import response_log_probs
    from megarl.models.vocab_parallel import token_log_probs_from_logits
    from megarl.models.micro_batches import PackedMicroBatch, next_token_terms
    from megarl.models.optim import train_step

    g = torch.Generator().manual_seed(5)
    lengths = [int(n) for n in torch.randint(12, 200, (24,), generator=g)]  # >= the 8 prompt tokens below
    lengths[0] = 900  # the tail
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(10, 1000, (n,), generator=g)
    lens = torch.tensor(lengths)
    mask = (torch.arange(tokens.shape[1] - 1)[None, :] < (lens - 1)[:, None]).float()
    V = unwrap_spec(ctx.ddp).vocab_size
    norm = float(mask.sum())

    def loss_fn(output, mb):
        lp = next_token_terms(output, mb, lambda logits, nxt: token_log_probs_from_logits(logits, nxt, V))
        return -(lp * mb["loss_mask"][:, :lp.shape[1]]).sum() / norm, {}

    padded = [{"tokens": tokens[i:i + 4], "loss_mask": mask[i:i + 4]} for i in range(0, len(lengths), 4)]
    packed = []
    for rows in first_fit(lengths, 1024):
        idx = torch.tensor(rows)
        w = int(lens[idx].max())
        packed.append({"tokens": tokens[idx, :w], "loss_mask": mask[idx, :w - 1],
                       "packed": PackedMicroBatch.from_rows(tokens[idx, :w], lens[idx])})
    start = {k: v.detach().clone() for k, v in ctx.ddp.state_dict().items() if torch.is_tensor(v)}
    norms = []
    for mbs in (padded, packed):
        ctx.ddp.load_state_dict(start, strict=False)
        norms.append(train_step(ctx.ddp, ctx.opt, mbs, loss_fn).grad_norm)
    ctx.ddp.load_state_dict(start, strict=False)
    rel = abs(norms[1] - norms[0]) / norms[0]
    assert rel < 2e-2, f"grad norm padded {norms[0]:.5f} vs token budget {norms[1]:.5f} (bf16: 2e-2 relative)"
    prompt, resp = tokens[:, :8].cuda(), tokens[:, 8:].cuda()
    attn = (torch.arange(tokens.shape[1])[None, :] < lens[:, None]).long().cuda()
    peaks, outs = {}, {}
    for chunk in (0, 64):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outs[chunk] = response_log_probs(ctx.ddp, prompt, resp, attn, 0, log_prob_chunk=chunk)
        peaks[chunk] = torch.cuda.max_memory_allocated() - base
    # the output layer a chunk at a time (megarl/models/fused_output.py): the same bf16 logits up to
    # the matmul kernel's choice for another row count, one bf16 rounding of a logit (|z| <~ 20: 2^-8 x 20)
    err = (outs[0] - outs[64]).abs().max().item()
    assert err < 0.08, f"log-probs with the output layer 64 positions at a time differ by {err:.4f} from the whole's"
    assert peaks[64] < peaks[0] / 2, f"the chunked pass's peak {peaks[64]} is not below half the whole's {peaks[0]}"
    return (f"grad norm padded {norms[0]:.5f}, token budget {norms[1]:.5f} ({len(padded)} vs {len(packed)} "
            f"micro-batches); log-prob pass peak {peaks[0] / 2**20:.0f} MiB whole, {peaks[64] / 2**20:.0f} MiB "
            f"chunked, max |diff| {err:.2e}")


def unwrap_spec(model):
    from megarl.models.weights import unwrap

    return unwrap(model).megarl_spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if SKIP_REASON:
        print(f"GPU check not run: {SKIP_REASON}", flush=True)
        return 1
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    torch.manual_seed(0)
    table = Table()
    with tempfile.TemporaryDirectory(prefix="megarl-gpu-check-") as work:
        ctx = SimpleNamespace(work=work, engine=None)
        names = ["setup: random tiny Llama, megatron actor (TE, bf16)",
                 "sglang backend: greedy tokens = actor's, EOS",
                 "sglang backend: raw log-prob parity with the megatron actor",
                 "sleep/wake x2 (kv cache + weights), process alive",
                 "actor offload round trip, CUDA memory released",
                 "weight sync v1 -> engine serves v1 (= fresh engine from HF export)",
                 "bf16 end to end",
                 "TP=1 weight sync bandwidth",
                 "weight checksum: GPU == CPU, GB/s",
                 "packed (THD, TE) forward-only = padded",
                 "agent sessions: input_ids continuation, policy tokens = actor's log-probs",
                 "token-budget update (THD on TE) = padded; chunked log-probs, peak memory"]
        try:
            table.run(names[0], lambda: check_setup(ctx))
            table.run(names[1], lambda: check_greedy(ctx), needs=(names[0],))
            table.run(names[2], lambda: check_parity(ctx), needs=(names[1],))
            table.run(names[10], lambda: check_agent_sessions(ctx), needs=(names[2],))
            table.run(names[3], lambda: check_sleep_wake(ctx), needs=(names[1],))
            table.run(names[4], lambda: check_offload(ctx), needs=(names[1],))
            table.run(names[5], lambda: check_new_weights(ctx), needs=(names[4],))
            table.run(names[6], lambda: check_bf16(ctx), needs=(names[5],))
            if ctx.engine is not None:
                ctx.engine.shutdown()
                ctx.engine = None
            table.run(names[7], lambda: check_bandwidth(ctx), needs=(names[0],))
            table.run(names[8], lambda: check_checksum(ctx))
            table.run(names[9], lambda: check_packed(ctx), needs=(names[0],))
            table.run(names[11], lambda: check_token_budget(ctx), needs=(names[9],))
        finally:
            if ctx.engine is not None:
                ctx.engine.shutdown()
            table.print()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": table.rows}, f, indent=1)
    return 0 if table.ok else 1


def test_gpu_check():
    """pytest entry: the dense check in a fresh process (SGLang's schedulers are processes).  The
    MoE program is test_moe_sglang.py's own entry: ``pytest tests/gpu/`` runs each program once
    (bash tests/gpu/run.sh runs both, as programs)."""
    run_as_pytest(__file__, "MEGARL_GPU_CHECK_TIMEOUT", 470)


if __name__ == "__main__":
    sys.exit(main())
