"""The mixture-of-experts GPU check (issue 19): SGLang and the megatron actor on a tiny Qwen3-MoE.

    bash tests/gpu/run.sh                   # runs this after the dense check
    python3 tests/gpu/test_moe_sglang.py    # one GPU: rows 1-3 (row 4 SKIP without a second GPU)
    pytest -q tests/gpu/                    # the same through pytest; skipped without CUDA / sglang

Rows (pass / fail with figures; a row whose inputs failed is "not run", a row this machine
cannot run -- too few GPUs -- is "skip" with the reason and does not fail the table):

1. moe setup: a random tiny Qwen3-MoE in bf16 (8 experts, top-2, head_dim 64, every layer MoE),
   the megatron actor on transformer-engine at EP=1, synced into an SGLang engine started with
   ``enable_return_routed_experts``;
2. routed experts returned by SGLang: sampled responses come back with the top-k of every prompt
   and response token but the last, in every MoE layer (``SampleRouting``, ids < 8); the actor
   teacher-forcing the same tokens chooses the same top-k *set* on most (token, layer) pairs
   (bf16 kernels on both sides: the share that differs is reported -- the routing mismatch
   replay exists for);
3. routed experts replayed: the samples collated into the experience layout and teacher-forced
   through megarl's trainer-side replay (``megarl.models.router_replay``: megatron-core's
   ``REPLAY_FORWARD`` fed with SGLang's ids) dispatch every recorded token of every layer to
   exactly SGLang's experts (read from the routers' routing maps), and the log-probs are no
   further from the engine's than without replay;
4. EP=2 weight sync to SGLang (2 GPUs, ``torchrun --nproc-per-node 2``): the actor at EP=2 (each
   rank holds 4 of each layer's 8 experts) streams every expert exactly once into an SGLang
   engine with ``tp_size=2, ep_size=2``; the engine's greedy tokens equal the EP=2 actor's
   (a divergence accepted only at a near-tie of the actor's logits).

Row 2 reads the actor's own routing with a forward hook on megatron-core's routers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from tests.gpu._gpu_check import MAX_NEW, SKIP_REASON, TOKENIZER_HASH, Table, run_as_pytest  # noqa: E402

from tests._tolerance import bf16_logprob_tol, bf16_near_tie  # noqa: E402

E, K = 8, 2
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 256,
       "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": E, "num_experts_per_tok": K,
       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
       "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False, "hidden_act": "silu",
       "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "router_aux_loss_coef": 0.0,
       "output_router_logits": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
#: share of (token, layer) top-k sets on which bf16 SGLang and the bf16 actor may disagree
#: without replay (R3 reports ~10% of routers on real models; random tiny routers are decisive)
MAX_NATURAL_MISMATCH = 0.2


class MoETable(Table):
    """The dense check's table, plus SKIP rows (a check this machine cannot run)."""

    def skip(self, name: str, reason: str) -> None:
        self.rows.append({"name": name, "status": "SKIP", "detail": reason, "seconds": 0.0})
        print(f"[gpu-check] SKIP       0.0s  {name}: {reason}", flush=True)

    @property
    def ok(self) -> bool:
        return all(r["status"] in ("PASS", "SKIP") for r in self.rows)


# ---- helpers ----------------------------------------------------------------------------------------


def write_moe(path: str, seed: int) -> None:
    from megarl.builtin.tiny_checkpoint import write_random_hf_checkpoint

    # std 0.2: decisive routers and a peaked next-token distribution (near-ties are rare)
    write_random_hf_checkpoint(path, MOE, seed=seed, std=0.2, dtype=torch.bfloat16)


def routers(model):
    from megarl.models.weights import unwrap

    return [layer.mlp.router for layer in unwrap(model).decoder.layers]


def actor_forward_routing(model, ids: list[int]):
    """Teacher-forced forward of one sequence: (raw log-probs of tokens 1.., the experts each
    router dispatched every token to as sets ``[T][layer] -> frozenset``, the largest |logit|)."""
    from tests._logits import full_logits

    rs = routers(model)
    maps, hooks = [], [r.register_forward_hook(lambda mod, args, out: maps.append(out[1].detach())) for r in rs]
    try:
        with torch.no_grad():
            logits = full_logits(model, torch.tensor([ids], device="cuda"))[0].float()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0]
    sets = [[frozenset(m[t].nonzero()[:, 0].tolist()) for m in maps] for t in range(len(ids))]
    return lp.cpu(), sets, float(logits.abs().max())


def engine_sets(routing) -> list:
    """SampleRouting ``(T - 1, layers, k)`` -> ``[t][layer] -> frozenset``."""
    e = routing.experts.long()
    return [[frozenset(e[t, j].tolist()) for j in range(e.shape[1])] for t in range(e.shape[0])]


def sync(engine, model, step: int, bucket_bytes: int = 8 << 20):
    from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine

    manifest = actor_manifest(model, dtype=engine.dtype if engine is not None else torch.bfloat16)
    version = make_version(model, manifest, run_id="gpu-moe-check", optimizer_step=step,
                           tokenizer_hash=TOKENIZER_HASH)
    report = sync_actor_to_engine(model, engine, version, manifest, bucket_bytes=bucket_bytes,
                                  dtype=torch.bfloat16)
    if engine is not None:
        engine.activate(version)
    return version, manifest, report


def expert_counts(manifest) -> dict:
    """``(layer, expert) -> number of manifest entries`` (gate, up, down: 3 each)."""
    import re

    pat = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    counts: dict = {}
    for name in manifest.entries:
        m = pat.search(name)
        if m:
            key = (int(m[1]), int(m[2]))
            counts[key] = counts.get(key, 0) + 1
    return counts


def prompts(n: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(10, 1000, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


# ---- one GPU: rows 1-3 ------------------------------------------------------------------------------


def check_setup(ctx):
    from megarl.models.megatron_ckpt import load_model
    from megarl.rollout.sglang_backend import SGLangRolloutEngine

    hf = os.path.join(ctx.work, "moe")
    write_moe(hf, seed=0)
    ctx.model = load_model(hf, tp=1, pp=1, dtype=torch.bfloat16)
    ctx.model.eval()
    te = type(routers(ctx.model)[0]).__module__
    ctx.engine = SGLangRolloutEngine(hf, tp_size=1, eos_token_ids=[MOE["eos_token_id"]], dtype="bfloat16",
                                     mem_fraction_static=0.25, return_routed_experts=True)
    _, manifest, report = sync(ctx.engine, ctx.model, 0)
    counts = expert_counts(manifest)
    assert len(counts) == MOE["num_hidden_layers"] * E and set(counts.values()) == {3}, counts
    return f"{report.num_tensors} tensors ({len(counts)} experts x 3) in {report.num_buckets} buckets; router {te}"


def check_routed_experts(ctx):
    from megarl.rollout.protocol import GenerationRequest, SamplingParams

    reqs = [GenerationRequest(f"p{i}", tuple(p)) for i, p in enumerate(prompts(4))]
    sp = SamplingParams(temperature=0.8, max_new_tokens=MAX_NEW, n=2, seed=3, return_routed_experts=True)
    ctx.samples = ctx.engine.generate(reqs, sp)
    differ = pairs = 0
    ctx.logit_scale = 0.0
    for r in ctx.samples:
        ids = list(r.prompt_ids) + list(r.response_ids)
        ro = r.routed_experts
        assert ro is not None and ro.backend == "sglang", r.request_id
        assert tuple(ro.experts.shape) == (len(ids) - 1, MOE["num_hidden_layers"], K), tuple(ro.experts.shape)
        assert ro.moe_layers == tuple(range(MOE["num_hidden_layers"])) and int(ro.experts.max()) < E
        _, mine, scale = actor_forward_routing(ctx.model, ids)
        ctx.logit_scale = max(ctx.logit_scale, scale)
        theirs = engine_sets(ro)
        for t in range(len(theirs)):
            for j in range(len(theirs[t])):
                assert len(theirs[t][j]) == K, (r.request_id, t, j, theirs[t][j])
                pairs += 1
                differ += theirs[t][j] != mine[t][j]
    share = differ / pairs
    assert share <= MAX_NATURAL_MISMATCH, f"{share:.3f} of (token, layer) top-k sets differ from the actor's"
    ctx.natural_mismatch = share
    return (f"{len(ctx.samples)} samples, {pairs} (token, layer) top-k sets; {share:.2%} differ from the bf16 "
            "actor's own routing (no replay)")


def check_replay(ctx):
    """megarl's trainer-side replay (``megarl.models.router_replay`` through ``response_log_probs``,
    what the old-log-prob forward runs) on the collated SGLang samples: every recorded token of
    every layer dispatched to SGLang's experts, log-probs no further from the engine's."""
    from megarl.control.batch import collate
    from megarl.models.forward import response_log_probs
    from megarl.models.router_replay import RecordRouting, RoutingStats

    s = ctx.samples
    c = collate([r.prompt_ids for r in s], [r.response_ids for r in s], [r.raw_log_probs for r in s], 0,
                routing=[r.routed_experts for r in s], version="v0")
    routed = c.routed_experts
    out = {}
    for replay in (False, True):
        stats = RoutingStats(routed.moe_layers)
        lp = response_log_probs(ctx.model, c.prompt_ids, c.response_ids, c.attention_mask, 4,
                                routing=RecordRouting(routed.experts, routed.moe_layers, replay=replay, stats=stats))
        keep = c.response_mask.bool()
        out[replay] = (float((lp.cpu() - c.rollout_log_probs)[keep].abs().max()), stats.reduce())
    (err_free, free), (err_replay, rep) = out[False], out[True]
    assert rep["replay_differs"] == 0.0, f"{rep['replay_differs']:.4f} of (token, layer) pairs dispatched elsewhere"
    noise = bf16_logprob_tol(MOE["num_hidden_layers"], ctx.logit_scale)  # bf16 actor vs bf16 engine
    assert err_replay <= max(err_free, noise), f"replayed log-probs {err_replay:.4f} vs free {err_free:.4f}"
    return (f"every token and layer dispatched to SGLang's experts; max |actor - engine| log-prob "
            f"{err_free:.4f} free, {err_replay:.4f} replayed; mismatch without replay {free['mismatch_tokens']:.2%} "
            f"of tokens ({free['mismatch_router']:.2%} of routers)")


# ---- two GPUs: row 4, under torchrun ---------------------------------------------------------------


def ep2_main(out_json: str) -> int:
    """One rank of the EP=2 weight-sync check (``torchrun --nproc-per-node 2``); rank 0 writes
    its row to ``out_json``."""
    import time
    import traceback

    import torch.distributed as dist

    from tests._logits import full_logits
    from megarl.models.megatron_ckpt import load_model
    from megarl.rollout.protocol import GenerationRequest, SamplingParams
    from megarl.rollout.sglang_backend import SGLangRolloutEngine
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1, ep=2)
    rank = dist.get_rank()
    t0 = time.perf_counter()
    row = {"name": "EP=2 weight sync -> SGLang (tp 2, ep 2): greedy = EP=2 actor's", "status": "PASS"}
    engine = None
    try:
        work = os.environ["MEGARL_GPU_MOE_WORK"]
        hf = os.path.join(work, "moe_ep2")
        if rank == 0:
            write_moe(hf, seed=1)
        dist.barrier()
        model = load_model(hf, tp=1, pp=1, dtype=torch.bfloat16)
        model.eval()
        local = {n for n, _ in model.named_parameters() if "experts" in n}
        engine = SGLangRolloutEngine(hf, tp_size=2, group=dist.group.WORLD, eos_token_ids=[MOE["eos_token_id"]],
                                     dtype="bfloat16", mem_fraction_static=0.2, engine_kwargs={"ep_size": 2})
        _, manifest, report = sync(engine, model, 0)
        counts = expert_counts(manifest)
        assert len(counts) == MOE["num_hidden_layers"] * E and set(counts.values()) == {3}, counts
        ps = prompts(4)
        outs = engine.generate([GenerationRequest(f"p{i}", tuple(p)) for i, p in enumerate(ps)],
                               SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
        exact = ties = 0
        for p, r in zip(ps, outs):
            seq = list(p)  # the EP=2 actor's greedy (both ranks run every forward: EP is collective)
            for _ in range(MAX_NEW):
                with torch.no_grad():
                    seq.append(int(full_logits(model, torch.tensor([seq], device="cuda"))[0, -1].argmax()))
            ref, got = seq[len(p):], list(r.response_ids)
            ref = ref[:ref.index(MOE["eos_token_id"]) + 1] if MOE["eos_token_id"] in ref else ref
            if got == ref:
                exact += 1
                continue
            t = next(i for i in range(min(len(got), len(ref))) if got[i] != ref[i])
            with torch.no_grad():
                logits = full_logits(model, torch.tensor([list(p) + got[:t]], device="cuda"))[0, -1].float()
            gap = float(logits.max() - logits[got[t]])
            tie = bf16_near_tie(MOE["num_hidden_layers"], float(logits.abs().max()))
            assert gap < tie, f"{r.request_id}: engine token {got[t]} at {t}, actor {ref[t]} (gap {gap:.3f} >= {tie:.3f})"
            ties += 1
        row["detail"] = (f"{report.num_tensors if report else 0} tensors, every expert once ({len(counts)} x 3) from "
                         f"2 EP ranks ({len(local)} local expert tensors on rank {rank}); {exact}/{len(ps)} greedy "
                         f"identical ({ties} near-tie divergences)")
    except Exception as e:  # noqa: BLE001 - the row reports
        row.update(status="FAIL", detail=f"rank {rank}: {type(e).__name__}: {e}".splitlines()[0][:300],
                   traceback=traceback.format_exc(limit=-3))
        print(row["traceback"], file=sys.stderr, flush=True)
    finally:
        if engine is not None:
            engine.shutdown()
    row["seconds"] = round(time.perf_counter() - t0, 1)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        worst = next((r for r in rows if r["status"] != "PASS"), rows[0])
        with open(out_json, "w") as f:
            json.dump(worst, f)
    rt.shutdown()
    return 0


def run_ep2(ctx, table: MoETable, name: str) -> None:
    devices = os.environ.get("MEGARL_GPU_EP_DEVICES", "")
    if len([d for d in devices.split(",") if d.strip()]) < 2:
        table.skip(name, "needs 2 GPUs (MEGARL_GPU_EP_DEVICES=0,1; run.sh sets it when 2 are present)")
        return
    out = os.path.join(ctx.work, "ep2_row.json")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices, MEGARL_GPU_MOE_WORK=ctx.work)

    def launch():
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               os.path.abspath(__file__), "--ep2-rank", out], env=env, capture_output=True,
                              text=True, timeout=int(os.environ.get("MEGARL_GPU_EP_TIMEOUT", "240")))
        if not os.path.exists(out):
            raise RuntimeError(f"torchrun exited {proc.returncode} without a row: {proc.stderr[-600:]}")
        with open(out) as f:
            row = json.load(f)
        if row["status"] != "PASS":
            raise AssertionError(row["detail"])
        return row["detail"]

    table.run(name, launch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--ep2-rank", default=None, help=argparse.SUPPRESS)  # a torchrun rank of row 4
    args = ap.parse_args(argv)
    if args.ep2_rank:
        return ep2_main(args.ep2_rank)
    if SKIP_REASON:
        print(f"MoE GPU check not run: {SKIP_REASON}", flush=True)
        return 1
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    torch.manual_seed(0)
    table = MoETable()
    names = ["moe setup: tiny Qwen3-MoE, megatron actor (TE, bf16) -> SGLang, every expert once",
             "sglang routed experts: returned per token and layer, vs the actor's own",
             "routed experts replayed: actor dispatches to SGLang's experts exactly",
             "EP=2 weight sync -> SGLang (tp 2, ep 2): greedy = EP=2 actor's"]
    with tempfile.TemporaryDirectory(prefix="megarl-gpu-moe-") as work:
        ctx = SimpleNamespace(work=work, engine=None)
        try:
            table.run(names[0], lambda: check_setup(ctx))
            table.run(names[1], lambda: check_routed_experts(ctx), needs=(names[0],))
            table.run(names[2], lambda: check_replay(ctx), needs=(names[1],))
            if ctx.engine is not None:
                ctx.engine.shutdown()
                ctx.engine = None
            run_ep2(ctx, table, names[3])
        finally:
            if ctx.engine is not None:
                ctx.engine.shutdown()
            table.print()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": table.rows}, f, indent=1)
    return 0 if table.ok else 1


def test_gpu_moe_check():
    """pytest entry: the MoE check in a fresh process (SGLang's schedulers are processes)."""
    run_as_pytest(__file__, "MEGARL_GPU_MOE_TIMEOUT", 300)


if __name__ == "__main__":
    sys.exit(main())
