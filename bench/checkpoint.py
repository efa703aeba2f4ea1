#!/usr/bin/env python
"""Training-position checkpoints: save / verify / load seconds and bytes, and what the
per-iteration version and manifest checks cost next to an iteration of the tiny recipe.

    python bench/checkpoint.py                 # tiny model + ~1B random model (needs ~18 GB RAM, ~15 GB disk)
    python bench/checkpoint.py --skip-1b       # tiny model only
    python bench/checkpoint.py --json out.json # also write the numbers as JSON

Part 1 builds an actor (megatron model + DDP + Adam, one optimizer step so Adam's moments
exist) from a random Llama-shaped HF checkpoint, then times ``megarl.checkpointing.checkpoint.save`` (model
and optimizer through megatron ``dist_checkpointing``, RNG, optimizer digests, sha256
MANIFEST, fsync, atomic publish) twice -- the first save pays dist_checkpointing's one-time
start-up -- then ``verify`` (sha256 of every file) and ``load_roles`` into the live actor.

Part 2 runs the built-in GRPO recipe (``configs/grpo_arith_tiny.yaml``) for a few iterations
and times the checks an iteration makes on top of its work: the weight manifest of the new
version at commit (the on-device checksum of every tensor), the engine-side manifest
verification (the same checksum again on the received tensors), and the sealed batch's content hash; their sum is
compared with the median iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.shapes import ONE_B, TINY_RECIPE  # noqa: E402


SIZES = {"tiny": TINY_RECIPE, "1b": ONE_B}


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bench_save_load(name: str, config: dict, workdir: str) -> dict:
    from megarl.builtin.tiny_checkpoint import write_random_hf_checkpoint
    from megarl.config import OptimSettings
    from megarl.models.vocab_parallel import token_log_probs_from_logits
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import train_step, wrap_for_training
    from megarl.roles.offload import ActorOffloader
    from megarl.checkpointing import checkpoint

    hf = os.path.join(workdir, f"hf-{name}")
    write_random_hf_checkpoint(hf, config)
    model = load_model(hf)
    ddp, opt = wrap_for_training(model, OptimSettings(optimizer="adam", lr=1e-4))
    n_params = sum(p.numel() for p in ddp.parameters())
    vocab = model.megarl_spec.vocab_size
    tokens = torch.randint(0, config["vocab_size"], (1, 8))

    def loss_fn(output, mb):
        loss = -token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], vocab).mean()
        return loss, {}

    train_step(ddp, opt, [{"tokens": tokens}], loss_fn)  # Adam's moments exist from here on
    # the gradients are not part of the position: drop them (RAM for the 1B run)
    ActorOffloader(ddp, opt, offload_params=False, offload_optimizer=False, preserve_grads=False).offload()
    shutil.rmtree(hf)

    root = os.path.join(workdir, f"ckpt-{name}")
    roles = {"actor": (ddp, opt)}
    state = {"run_id": "bench", "iteration": 0, "weight_manifests": {}}
    saves = []
    for it in (1, 2):
        t0 = time.perf_counter()
        path = checkpoint.save(root, it, dict(state, iteration=it), roles, keep=1)
        saves.append(time.perf_counter() - t0)
    nbytes = _du(path)
    parts = {d: _du(os.path.join(path, d)) for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))}
    t0 = time.perf_counter()
    checkpoint.verify(path)
    verify_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    checkpoint.load_roles(path, roles)
    load_s = time.perf_counter() - t0
    row = {"model": name, "parameters": n_params, "bytes": nbytes, "bytes_by_part": parts,
           "first_save_s": saves[0], "save_s": saves[1], "save_gb_per_s": nbytes / 1e9 / saves[1],
           "verify_s": verify_s, "load_s": load_s, "load_gb_per_s": nbytes / 1e9 / load_s}
    shutil.rmtree(root)
    del ddp, opt, model
    return row


def bench_iteration_checks(workdir: str, iterations: int) -> dict:
    """Run the tiny GRPO recipe; time the per-iteration checks against its iterations."""
    from megarl.experience.seal import content_hash, load_sealed

    run_dir = os.path.join(workdir, "run")
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "megarl.train", "--config", os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml"),
           f"trainer.run_dir={run_dir}", f"trainer.iterations={iterations}", "trainer.save_experience=true",
           "trainer.loggers=[jsonl]", "eval.every=0"]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:]  # skip warm-up
    iteration_s = statistics.median(r["e2e/iteration_s"] for r in rows)
    commit_s = statistics.median(r["e2e/stage_s/commit"] for r in rows)  # the new version's weight manifest
    # the engine-side verification checksums the same tensors again: time it on the export
    from megarl.rollout.weight_stream import TensorManifest
    from safetensors.torch import load_file

    weights = load_file(os.path.join(run_dir, "export", f"iter_{iterations}", "model.safetensors"))
    t0 = time.perf_counter()
    for _ in range(5):
        TensorManifest.from_named_tensors(sorted(weights.items()))
    verify_s = (time.perf_counter() - t0) / 5
    batch = load_sealed(os.path.join(run_dir, "experience", f"iter_{iterations - 1:06d}"))
    t0 = time.perf_counter()
    for _ in range(5):
        content_hash(batch)
    seal_s = (time.perf_counter() - t0) / 5
    checks = commit_s + verify_s + seal_s
    return {"iterations": iterations, "median_iteration_s": iteration_s, "commit_manifest_s": commit_s,
            "engine_verify_s": verify_s, "seal_hash_s": seal_s, "checks_s": checks,
            "checks_share_of_iteration": checks / iteration_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-1b", action="store_true")
    ap.add_argument("--iterations", type=int, default=8, help="tiny-recipe iterations for the overhead part")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = ap.parse_args()
    torch.manual_seed(0)
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    out = {"save_load": [], "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        for name in ["tiny"] + ([] if args.skip_1b else ["1b"]):
            row = bench_save_load(name, SIZES[name], work)
            out["save_load"].append(row)
            print(f"[checkpoint] {name}: {row['parameters'] / 1e6:.1f} M params, {row['bytes'] / 1e6:.1f} MB "
                  f"({', '.join(f'{k} {v / 1e6:.1f}' for k, v in sorted(row['bytes_by_part'].items()))} MB): "
                  f"save {row['save_s']:.2f} s ({row['save_gb_per_s']:.2f} GB/s; first save {row['first_save_s']:.2f} s), "
                  f"verify {row['verify_s']:.2f} s, load {row['load_s']:.2f} s ({row['load_gb_per_s']:.2f} GB/s)",
                  flush=True)
        chk = bench_iteration_checks(work, args.iterations)
        out["iteration_checks"] = chk
        print(f"[checks] tiny GRPO recipe, median iteration {chk['median_iteration_s'] * 1e3:.1f} ms: commit manifest "
              f"{chk['commit_manifest_s'] * 1e3:.2f} ms + engine verify {chk['engine_verify_s'] * 1e3:.2f} ms + seal hash "
              f"{chk['seal_hash_s'] * 1e3:.2f} ms = {chk['checks_s'] * 1e3:.2f} ms = "
              f"{100 * chk['checks_share_of_iteration']:.2f}% of an iteration (target < 2%)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
