"""What the Megatron-at-scale features buy on one update, on CPU: memory and seconds.

    python bench/scale.py [--out bench_scale.json] [--only memory|logits|budget] [--repeats 2]

Every setting runs in its own process (``torch.distributed.run``, one rank, gloo) so that its peak
resident memory is its own.  A process builds the model, runs one warm-up update (the optimizer
state and gradient buffers are allocated then), resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``), and runs the measured updates: the update's peak is ``VmHWM`` after
them minus ``VmRSS`` before them (the weights, gradients and optimizer state are already in
``VmRSS``, so what is left is activations, logits and their copies).  Seconds: median of the
measured updates.  The update is the real one (``Learner.update``: GRPO's loss, one optimizer
step, megatron's forward-backward schedule) on a synthetic sealed batch.

Three tables:

* **memory** -- a ~50M-parameter Llama (hidden 512, 12 layers, vocabulary 8,000), 4 rows of 1024
  tokens, micro-batches of 2 rows, log-probs 256 positions at a time (so the layers' activations,
  not the logits, are what is measured): ``parallel.recompute`` none / selective (core_attn) /
  full (uniform, 1 layer).
* **logits** -- a Llama with Qwen's 151,936-token vocabulary (hidden 512, 4 layers: 170M
  parameters, most of them the embedding and the output layer), the same batch,
  ``algo.log_prob_chunk`` 0 (the model's output layer makes the whole logits, megatron's kernel
  takes an fp32 copy) against 256 positions at a time (the output layer applied to the hidden
  states a chunk at a time, ``megarl/models/fused_output.py``): the update, and the forward-only
  log-prob pass (what the old and reference log-probs run).
* **budget** -- a ~15M-parameter Llama (hidden 256, 4 layers, vocabulary 8,000), 32 rows whose
  lengths follow a heavy tail (8-1024 tokens, Pareto, median ~16): padded micro-batches of 4 rows
  (each padded to the batch's longest row, today's update) against ``algo.micro_batch_tokens=2048``.
  The same rows, so the same trained tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "152k": dict(vocab_size=151936, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                 intermediate_size=1408, max_position_embeddings=2048),
    "50m": dict(vocab_size=8000, hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4,
                intermediate_size=1408, max_position_embeddings=2048),
    "15m": dict(vocab_size=8000, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                intermediate_size=704, max_position_embeddings=2048),
}


def _status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _lengths(kind: str, rows: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    if kind == "fixed":
        return [(16, 1008)] * rows
    # heavy tail: responses 4-1016 tokens, most short (a reasoning batch: few long chains)
    return [(4 + rng.randint(0, 4), min(1016, int(4 * rng.paretovariate(0.8)))) for _ in range(rows)]


def _batch(lengths, vocab: int, seed: int = 0):
    """A sealed GRPO batch (groups of 4) with the given (prompt, response) lengths."""
    import torch

    from megarl.control.batch import collate
    from megarl.experience.groups import candidate_sample_id
    from megarl.experience.schema import (DerivedTensors, ExperienceBatch, ExperienceFacts, FinishReason,
                                          LogProbProducer, LogProbs, RewardRecord, SamplingConfig)
    from megarl.experience.seal import seal, with_derived
    from megarl.hashing import json_sha256
    from megarl.versions import PolicyVersion

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(1, vocab, (r,), generator=g).tolist() for _, r in lengths]
    lps = [-torch.rand(r, generator=g) for _, r in lengths]
    c = collate(prompts, responses, lps, pad_id=0)
    n = len(lengths)
    v = PolicyVersion("bench", 0, 0, json_sha256("w"), json_sha256("t"), json_sha256("c"))
    gid = [f"bench/it0/r0/p{i // 4:03d}" for i in range(n)]
    facts = ExperienceFacts(
        run_id="bench", iteration=0, prompt_id=tuple(gid), group_id=tuple(gid),
        sample_id=tuple(candidate_sample_id(gid[i], i % 4) for i in range(n)), prompt_ids=c.prompt_ids, response_ids=c.response_ids,
        attention_mask=c.attention_mask, response_mask=c.response_mask,
        finish_reason=(FinishReason.EOS,) * n, policy_version=(v.short_id,) * n,
        sampling=SamplingConfig(n=4, max_new_tokens=c.response_ids.shape[1]), request_id=tuple(gid),
        seed=tuple(range(n)), rewards=tuple(RewardRecord(total=float(i % 2), components={"acc": float(i % 2)},
                                                         scorer_version="bench") for i in range(n)),
        rollout_log_probs=LogProbs(c.rollout_log_probs, LogProbProducer("rollout", v.short_id)),
        old_log_probs=LogProbs(c.rollout_log_probs.clone(), LogProbProducer("actor", v.short_id)))
    m = c.response_mask.float()
    derived = DerivedTensors(advantages=torch.randn(m.shape, generator=g) * m, loss_mask=c.response_mask.clone(),
                             estimator="grpo", hyperparameters={"note": "bench"})
    return v, with_derived(seal(ExperienceBatch(facts)), derived), c


def one(setting: dict) -> dict:
    """Run one setting in this process (under torch.distributed.run) and return its numbers."""
    from collections import Counter

    import torch

    from megarl.algo.kl import FixedKLController
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.config import load_config
    from megarl.config.schema import RecomputeSettings
    from megarl.control.learning import Learner
    from megarl.control.state_machine import IterationStateMachine
    from megarl.roles.actor import Actor
    from megarl.runtime import distributed as rt

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    rt.initialize()
    model = MODELS[setting["model"]]
    hf = make_tiny_hf_checkpoint(os.path.join(setting["dir"], setting["model"]), "llama", seed=0, **model)
    rc = {"none": None, "selective": RecomputeSettings(granularity="selective", modules=["core_attn"]),
          "full": RecomputeSettings(granularity="full", method="uniform", num_layers=1)}[setting.get("recompute", "none")]
    lengths = _lengths(setting["lengths"], setting["rows"])
    v, batch, c = _batch(lengths, model["vocab_size"])
    overrides = [f"trainer.prompts_per_iteration={setting['rows'] // 4}", "rollout.n=4", "algo.num_mini_batches=1",
                 "algo.ppo_epochs=1", f"algo.micro_batch_size={setting['mbs']}",
                 f"algo.micro_batch_tokens={setting.get('budget', 0)}", f"algo.log_prob_chunk={setting.get('chunk', 0)}",
                 "algo.kl.placement=none", "actor.optim.lr=1e-5",
                 # no host snapshot of v for a rollback: its copy of weights and Adam state is not the update's
                 "trainer.update_rollback=none", "trainer.on_update_failure=stop"]
    cfg = load_config(os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml"), overrides)
    actor = Actor(hf, 1, 1, cfg.actor.optim, total_steps=100, recompute=rc, log_prob_chunk=setting.get("chunk", 0))
    out = {**setting, "params": sum(p.numel() for p in actor.ddp.parameters()),
           "tokens": int(c.attention_mask.sum()), "rows": len(lengths),
           "padded_tokens": len(lengths) * int(c.attention_mask.sum(1).max())}

    def sm():
        from megarl.control.state_machine import ExportEvidence, RolloutActivation, SealEvidence

        s = IterationStateMachine(v)
        s.begin_export()
        s.begin_rollout_loading(ExportEvidence(v.weight_manifest_hash))
        s.mark_rollout_ready([RolloutActivation(v.short_id, v.weight_manifest_hash, True, True)], 1)
        s.begin_generating([v.short_id])
        n = batch.facts.batch_size
        s.seal_experience(SealEvidence(n, n, n // 4, n // 4, frozenset({v.short_id})))
        return s

    def run():
        if setting["what"] == "log_probs":
            with torch.no_grad():
                actor.log_probs(c.prompt_ids, c.response_ids, c.attention_mask, setting["mbs"],
                                micro_batch_tokens=setting.get("budget", 0))
            return
        learner = Learner(cfg, actor=actor, critic=None, sm=sm(), kl_ctl=FixedKLController(0.0), counters=Counter(),
                          dp=1, sync_dtype=None, rank0=True, ckpt_root=setting["dir"])
        learner.update(0, batch, v)

    run()  # warm-up: gradient buffers and optimizer state allocated
    import gc

    gc.collect()
    base = _status("VmRSS")
    _reset_peak()
    seconds = []
    for _ in range(setting["repeats"]):
        t0 = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t0)
    out.update(peak_bytes=_status("VmHWM") - base, seconds=statistics.median(seconds), all_seconds=seconds)
    rt.shutdown()
    return out


def launch(setting: dict) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        result_path = f.name
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(port), os.path.abspath(__file__), "--one", json.dumps(setting), "--result", result_path]
    # a fixed mmap threshold: every large tensor is its own mapping, returned to the kernel when
    # freed, so the resident set follows the live tensors (glibc's default raises the threshold as
    # tensors are freed and then keeps them in its heap: the peak would include freed memory)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore",
               MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"setting {setting} failed:\n{proc.stderr[-4000:]}")
    with open(result_path) as f:
        return json.load(f)


def mib(n: float) -> str:
    return f"{n / 2 ** 20:.0f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--only", choices=["memory", "logits", "budget"], action="append")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    if a.one:
        res = one(json.loads(a.one))
        if int(os.environ.get("RANK", "0")) == 0:
            with open(a.result, "w") as f:
                json.dump(res, f)
        return
    only = set(a.only or ["memory", "logits", "budget"])
    work = tempfile.mkdtemp(prefix="megarl_bench_scale_")
    common = dict(dir=work, repeats=a.repeats)
    results = {}
    if "memory" in only:
        print("update memory by parallel.recompute (50M Llama: 12 layers, vocabulary 8,000; 4 x 1024 tokens, "
              "micro-batches of 2 rows; log-probs chunked)")
        print(f"{'recompute':<10} {'peak MiB':>9} {'vs none':>8} {'seconds':>8} {'vs none':>8}")
        rows = []
        for rc in ("none", "selective", "full"):
            r = launch(dict(common, what="update", model="50m", lengths="fixed", rows=4, mbs=2, recompute=rc, chunk=256))
            rows.append(r)
            print(f"{rc:<10} {mib(r['peak_bytes']):>9} {rows[0]['peak_bytes'] / r['peak_bytes']:>7.2f}x "
                  f"{r['seconds']:>8.2f} {r['seconds'] / rows[0]['seconds']:>7.2f}x", flush=True)
        results["memory"] = rows
    if "logits" in only:
        print("\nlog-probs: whole logits vs the output layer 256 positions at a time (Llama, vocabulary "
              "151,936, hidden 512; 4 x 1024 tokens)")
        print(f"{'pass':<10} {'chunk':>6} {'peak MiB':>9} {'seconds':>8}")
        rows = []
        for what in ("log_probs", "update"):
            for chunk in (0, 256):
                r = launch(dict(common, what=what, model="152k", lengths="fixed", rows=4, mbs=2 if what == "update" else 4,
                                chunk=chunk))
                rows.append(r)
                print(f"{what:<10} {chunk:>6} {mib(r['peak_bytes']):>9} {r['seconds']:>8.2f}", flush=True)
        logits_bytes = 4 * 1024 * 151936 * 4
        print(f"(the fp32 logits of the 4 rows: {mib(logits_bytes)} MiB; of one 2-row micro-batch: "
              f"{mib(logits_bytes / 2)} MiB)")
        results["logits"] = rows
    if "budget" in only:
        print("\nupdate seconds, padded rows vs a token budget (15M Llama, 32 rows, lengths 8-1024 heavy-tailed)")
        print(f"{'micro-batches':<22} {'computed tokens':>16} {'seconds':>8} {'speed-up':>9}")
        rows = []
        for name, mbs, budget in (("4 rows, padded", 4, 0), ("2048-token budget", 4, 2048)):
            r = launch(dict(common, what="update", model="15m", lengths="tail", rows=32, mbs=mbs, budget=budget))
            rows.append(r)
            computed = r["padded_tokens"] if not budget else r["tokens"]
            print(f"{name:<22} {computed:>16} {r['seconds']:>8.2f} {rows[0]['seconds'] / r['seconds']:>8.2f}x",
                  flush=True)
        r = rows[0]
        print(f"(real tokens {r['tokens']}; the padded update computes {r['padded_tokens']} positions)")
        results["budget"] = rows
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
