#!/usr/bin/env python
"""Each stage of an iteration against its floor on this machine, as ratios (1.0 = at the floor).

    python bench/limits.py                  # the tiny recipe's model shape + a ~0.3B model for weight sync
    python bench/limits.py --skip-large --json limits.json

Stages and their floors, on the same bytes / tokens:

* weight sync (actor manifest at commit + gathered stream + engine staging + manifest check +
  activation, ``megarl.rollout.weight_sync``)  vs  ``copy_`` of the same bytes into preallocated
  buffers;
* rollout (``HFRolloutEngine.generate``: per-candidate seeded sampling with raw log-probs) vs
  transformers ``generate`` alone on the same model and batch;
* old log-prob forward (``Actor.log_probs``: right-align, micro-batches, vocab-parallel
  log-softmax gather)  vs  a bare megatron forward of the same token matrix;
* actor update (``Actor.train_step`` with the real GRPO loss through megatron's schedule) vs a
  bare forward + backward of the same tokens with a trivial loss plus ``optimizer.step()``;
* the whole iteration vs the sum of its stages (the controller's own time, ``e2e/controller_s``),
  from a run of the tiny GRPO recipe.

Each stage and its floor alternate for ``--repeats`` rounds after a warm-up; the ratio is the median
of the per-round ratios.  One torch thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.shapes import POINT_3B, TINY_RECIPE  # noqa: E402


TINY = dict(TINY_RECIPE, eos_token_id=None, bos_token_id=None, pad_token_id=0)  # random weights never stop
LARGE = POINT_3B


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _paired(ours, floor, repeats: int, warmup: int = 1) -> tuple:
    """(median seconds of ``ours``, of ``floor``, median of the per-round ratios).

    The two alternate round by round after ``warmup`` calls of each, so this VM's drift (the
    same work runs +-20 % slower from one minute to the next) hits both sides of a ratio alike.
    """
    for _ in range(warmup):
        ours()
        floor()
    a, b = [], []
    for _ in range(repeats):
        a.append(_timed(ours))
        b.append(_timed(floor))
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def _actor(hf_dir):
    from megarl.config import OptimSettings
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import wrap_for_training

    model = load_model(hf_dir)
    return wrap_for_training(model, OptimSettings(optimizer="adam", lr=1e-5))


def bench_weight_sync(name, config, workdir, repeats) -> dict:
    from megarl.builtin.tiny_checkpoint import write_random_hf_checkpoint
    from megarl.rollout.hf_backend import HFRolloutEngine
    from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine

    d = os.path.join(workdir, f"sync-{name}")
    write_random_hf_checkpoint(d, config)
    ddp, _ = _actor(d)
    engine = HFRolloutEngine(d, dtype=torch.float32)
    step = [0]

    def sync():
        step[0] += 1
        manifest = actor_manifest(ddp)
        version = make_version(ddp, manifest, "bench", step[0], "sha256:" + "0" * 64)
        report = sync_actor_to_engine(ddp, engine, version, manifest, 256 << 20)
        engine.activate(version)
        return report

    nbytes = sync().num_bytes  # the first writes into the engine's first buffer
    params = [p.detach() for p in ddp.parameters()]
    bufs = [torch.empty_like(p) for p in params]

    def copy():
        for b, p in zip(bufs, params):
            b.copy_(p)

    # warm-up: the first writes into the engine's second buffer and into the copy's buffers
    t_sync, t_copy, ratio = _paired(sync, copy, repeats)
    return {"stage": f"weight sync ({name})", "bytes": nbytes, "seconds": t_sync, "floor_seconds": t_copy,
            "floor": "copy_ of the same bytes", "ratio": ratio,
            "gb_per_s": nbytes / 1e9 / t_sync, "floor_gb_per_s": nbytes / 1e9 / t_copy}


def bench_stages(workdir, repeats, batch, prompt_len, new_tokens) -> list:
    from megarl.algo.aggregation import global_normaliser
    from megarl.algo.objective import actor_loss
    from megarl.algo.policy_loss import PolicyLossConfig
    from megarl.experience.schema import LogProbProducer, LogProbs
    from megarl.models.forward import gather_response, response_log_probs
    from megarl.models.vocab_parallel import token_log_probs_from_logits
    from megarl.models.micro_batches import position_ids_for
    from megarl.builtin.tiny_checkpoint import write_random_hf_checkpoint
    from megarl.models.optim import train_step
    from megarl.rollout.hf_backend import HFRolloutEngine
    from megarl.rollout.protocol import GenerationRequest, SamplingParams
    from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine

    d = os.path.join(workdir, "stages")
    write_random_hf_checkpoint(d, TINY)
    ddp, opt = _actor(d)
    vocab = TINY["vocab_size"]
    rows = []

    # rollout vs transformers generate alone
    engine = HFRolloutEngine(d, dtype=torch.float32, eos_token_ids=(), pad_token_id=0)
    manifest = actor_manifest(ddp)
    version = make_version(ddp, manifest, "bench", 0, "sha256:" + "0" * 64)
    sync_actor_to_engine(ddp, engine, version, manifest)
    engine.activate(version)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (batch, prompt_len), generator=g)
    requests = [GenerationRequest(f"r{i}", tuple(prompts[i].tolist())) for i in range(batch)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=1, seed=0)
    model = engine._active.model

    def ours():
        res = engine.generate(requests, sampling)
        assert all(len(r.response_ids) == new_tokens for r in res)

    def plain():
        with torch.no_grad():
            model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                           top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    t_ours, t_plain, r_roll = _paired(ours, plain, repeats)
    rows.append({"stage": "rollout", "seconds": t_ours, "floor_seconds": t_plain,
                 "floor": "transformers generate alone", "ratio": r_roll})
    res = engine.generate(requests, sampling)

    # the experience of that rollout, in the trainer's layout
    response = torch.tensor([r.response_ids for r in res])
    attention = torch.ones(batch, prompt_len + new_tokens, dtype=torch.long)
    tokens = torch.cat([prompts, response], dim=1)
    pos = position_ids_for(tokens)

    def old_lp():
        response_log_probs(ddp, prompts, response, attention, micro_batch_size=batch)

    def bare_forward():
        with torch.no_grad():
            ddp.eval()
            ddp(tokens, pos, None)

    t_lp, t_fwd, r_lp = _paired(old_lp, bare_forward, repeats)
    rows.append({"stage": "old log-prob forward", "seconds": t_lp, "floor_seconds": t_fwd,
                 "floor": "bare megatron forward", "ratio": r_lp})

    old = response_log_probs(ddp, prompts, response, attention, micro_batch_size=batch).detach()
    adv = torch.randn(batch, 1).expand(batch, new_tokens).contiguous()
    mask = torch.ones(batch, new_tokens)
    cfg = PolicyLossConfig(name="vanilla", clip_low=0.2, clip_high=0.28, agg_mode="token-mean")
    norm = global_normaliser(mask, "token-mean")
    mb = {"tokens": tokens, "prompt_lens": torch.full((batch,), prompt_len), "response_lens":
          torch.full((batch,), new_tokens), "old": old, "adv": adv, "mask": mask}

    def loss_fn(output, m):
        lp_all = token_log_probs_from_logits(output[:, :-1], m["tokens"][:, 1:], vocab)
        lp = gather_response(lp_all, m["prompt_lens"], m["response_lens"], new_tokens)
        out = actor_loss(lp, old_log_probs=LogProbs(m["old"], LogProbProducer("actor", "v0", "raw")),
                         advantages=m["adv"], loss_mask=m["mask"], cfg=cfg, normaliser=norm,
                         old_version="v0")
        return out.loss, out.metrics

    def update():
        train_step(ddp, opt, [mb], loss_fn)

    def bare_update():
        ddp.train()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = ddp(tokens, pos, None)
        out.float().logsumexp(-1).mean().backward()
        opt.step()

    t_up, t_bare, r_up = _paired(update, bare_update, repeats)
    rows.append({"stage": "actor update", "seconds": t_up, "floor_seconds": t_bare,
                 "floor": "bare forward + backward + optimizer.step", "ratio": r_up})
    return rows


def bench_controller(workdir, iterations) -> dict:
    run_dir = os.path.join(workdir, "run")
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-m", "megarl.train", "--config", os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml"),
                    f"trainer.run_dir={run_dir}", f"trainer.iterations={iterations}", "trainer.loggers=[jsonl]",
                    "eval.every=0"], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:-1]  # no warm-up, no final eval
    it = statistics.median(r["e2e/iteration_s"] for r in rows)
    ctl = statistics.median(r["e2e/controller_s"] for r in rows)
    return {"stage": "iteration (tiny GRPO recipe)", "seconds": it, "floor_seconds": it - ctl,
            "floor": "sum of its stages", "ratio": it / (it - ctl), "controller_share": ctl / it}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-large", action="store_true", help="no ~0.3B weight-sync row")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        rows.append(bench_weight_sync("tiny", TINY, work, args.repeats))
        if not args.skip_large:
            rows.append(bench_weight_sync("~0.3B", LARGE, work, args.repeats))
        rows += bench_stages(work, args.repeats, batch=128, prompt_len=16, new_tokens=6)
        rows.append(bench_controller(work, args.iterations))
    print(f"{'stage':<32}{'seconds':>10}{'floor s':>10}{'ratio':>8}  floor")
    for r in rows:
        print(f"{r['stage']:<32}{r['seconds']:>10.4f}{r['floor_seconds']:>10.4f}{r['ratio']:>7.2f}x  {r['floor']}")
    for r in rows:
        if "gb_per_s" in r:
            print(f"  {r['stage']}: {r['bytes'] / 1e6:.1f} MB at {r['gb_per_s']:.2f} GB/s, copy_ {r['floor_gb_per_s']:.2f} GB/s")
        if "controller_share" in r:
            print(f"  controller: {100 * r['controller_share']:.1f}% of an iteration (target < 5%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "threads": args.threads, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
