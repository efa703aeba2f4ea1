#!/usr/bin/env python
"""megarl GRPO and TRL's GRPOTrainer side by side, in one run, on this machine.

    pip install -e ".[bench]"          # TRL is a bench extra, never a runtime dependency
    python bench/vs_trl.py [--iterations 30] [--rounds 3] [--json vs_trl.json]

Both train the same start model (the built-in tiny Llama, built on first use) on the same task
(the built-in arithmetic train split, the same chat template), with the same reward (the exact
integer scorer), batch (B=16 prompts x G=8 samples per step), lengths (6 new tokens), learning
rate (5e-5, constant, Adam, grad clip 1.0), clipping (0.2 / 0.28), KL (k3 in the loss,
beta 0.001, frozen reference at the start model), token-mean loss aggregation, and number of
iterations (one optimizer step each).  Reported: seconds per iteration (median, first one left
out), sampled tokens per second, and the held-out accuracy of each one's final weights, both
scored by the same greedy evaluation (``evaluate`` below, n=200 held-out prompts).

This machine is a shared VM whose speed drifts by +-20 % between minutes, so the two trainers
run in ``--rounds`` alternating pairs (megarl first, then TRL first, ...); the headline ratio is
the median of the per-round ratios, each taken between two runs a minute apart.

Known differences, kept on purpose: TRL samples prompts with its own sampler (a different set
of prompts per step) and its own generation seeds; megarl checks and records far more per
iteration (manifests, versions, sealed experience).
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
RECIPE = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
B, G, NEW, LR, BETA, SEED = 16, 8, 6, 5e-5, 0.001, 1234


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def recipe_paths():
    from megarl.config import load_config

    cfg = load_config(RECIPE, [])
    return cfg.model.path, cfg.data.train_path, cfg.data.heldout_path


def run_megarl(work: str, iterations: int) -> dict:
    run_dir = os.path.join(work, "megarl")
    subprocess.run([sys.executable, "-m", "megarl.train", "--config", RECIPE, f"trainer.run_dir={run_dir}",
                    f"trainer.iterations={iterations}", "trainer.loggers=[jsonl]", "eval.every=0",
                    f"trainer.prompts_per_iteration={B}", f"rollout.n={G}", f"rollout.max_new_tokens={NEW}",
                    f"actor.optim.lr={LR}", f"algo.kl.beta={BETA}", f"trainer.seed={SEED}"],
                   check=True, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:iterations]
    return {"seconds_per_iteration": statistics.median(r["e2e/iteration_s"] for r in rows),
            "tokens_per_s": statistics.median(r["rollout/samples"] * r["rollout/response_len_mean"] / r["e2e/iteration_s"]
                                              for r in rows),
            "final_weights": os.path.join(run_dir, "export", f"iter_{iterations}")}


def trl_trainer(out: str, iterations: int, model_dir: str, train_path: str, callbacks=(), *, score=None,
                max_new: int = NEW, lr: float = LR, beta: float = BETA, **overrides):
    """TRL's GRPOTrainer set up like megarl's recipe (the module docstring lists what matches):
    the train split in the chat format, the task's scorer as the reward (``score(text, answer)``;
    default the arithmetic task's exact integer), B=16 prompts x G=8 samples per optimizer step,
    ``max_new`` new tokens, learning rate ``lr``, KL coefficient ``beta``.  ``overrides`` replace
    GRPOConfig fields (bench/async.py: the per-process batch and saving under torchrun).
    Returns ``(trainer, tokenizer)``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    if score is None:
        from megarl.data.tasks.arithmetic import score

    rows = [json.loads(line) for line in open(train_path)]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in rows])

    def reward(completions, answer, **_):
        return [score(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    reward.__name__ = getattr(score, "__module__", "task").rsplit(".", 1)[-1]
    settings = dict(
        output_dir=out, per_device_train_batch_size=B * G, num_generations=G, max_completion_length=max_new,
        learning_rate=lr, lr_scheduler_type="constant", beta=beta, epsilon=0.2, epsilon_high=0.28,
        loss_type="dapo", temperature=1.0, max_steps=iterations, num_iterations=1, max_grad_norm=1.0,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, seed=SEED,
        disable_dropout=True, dataloader_num_workers=0)
    settings.update(overrides)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=GRPOConfig(**settings), train_dataset=data,
                          processing_class=tok, callbacks=list(callbacks))
    return trainer, tok


def run_trl(work: str, iterations: int, model_dir: str, train_path: str) -> dict:
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.starts, self.times = {}, []

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    out = os.path.join(work, "trl")
    trainer, tok = trl_trainer(out, iterations, model_dir, train_path, callbacks=[clock])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    final = os.path.join(out, "final")
    trainer.save_model(final)
    tok.save_pretrained(final)
    per_it = statistics.median(clock.times[1:]) if len(clock.times) > 1 else clock.times[0]
    lengths = [float(h["completions/mean_length"]) for h in trainer.state.log_history if "completions/mean_length" in h]
    rate = statistics.median(B * G * n / t for n, t in zip(lengths[1:], clock.times[1:]))
    return {"seconds_per_iteration": per_it, "tokens_per_s": rate, "wall_s": wall, "final_weights": final}


def evaluate(model_dir: str, heldout_path: str, n: int = 200) -> float:
    """Greedy held-out accuracy of an HF checkpoint, the same way for both trainers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.data.tasks.arithmetic import score

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(heldout_path)][:n]
    correct = 0
    for r in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        correct += score(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), r["answer"])
    return correct / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="alternating megarl/TRL pairs (median ratio)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rounds = []
    with tempfile.TemporaryDirectory() as work:
        for k in range(args.rounds):
            here = os.path.join(work, f"round{k}")
            if k % 2 == 0:
                m = run_megarl(here, args.iterations)  # round 0 builds the tiny model and task first
                t = run_trl(here, args.iterations, *recipe_paths()[:2])
            else:
                t = run_trl(here, args.iterations, *recipe_paths()[:2])
                m = run_megarl(here, args.iterations)
            print(f"round {k + 1}/{args.rounds}: megarl {m['seconds_per_iteration']:.3f} s/iter, "
                  f"TRL {t['seconds_per_iteration']:.3f} s/iter", flush=True)
            if k == 0:  # both are seeded: every round trains the same weights
                model_dir, train_path, heldout_path = recipe_paths()
                start = evaluate(model_dir, heldout_path)
                m["heldout_accuracy"] = evaluate(m["final_weights"], heldout_path)
                t["heldout_accuracy"] = evaluate(t["final_weights"], heldout_path)
            rounds.append((m, t))

    def med(side, key):
        return statistics.median(r[side][key] for r in rounds)

    m = {"seconds_per_iteration": med(0, "seconds_per_iteration"), "tokens_per_s": med(0, "tokens_per_s"),
         "heldout_accuracy": rounds[0][0]["heldout_accuracy"], "rounds_seconds_per_iteration":
         [r[0]["seconds_per_iteration"] for r in rounds]}
    t = {"seconds_per_iteration": med(1, "seconds_per_iteration"), "tokens_per_s": med(1, "tokens_per_s"),
         "heldout_accuracy": rounds[0][1]["heldout_accuracy"], "rounds_seconds_per_iteration":
         [r[1]["seconds_per_iteration"] for r in rounds]}
    ratios = [a["seconds_per_iteration"] / b["seconds_per_iteration"] for a, b in rounds]
    res = {"iterations": args.iterations, "rounds": args.rounds, "batch": f"{B} prompts x {G} samples",
           "start_accuracy": start, "megarl": m, "trl": t, "round_ratios": ratios,
           "ratio_seconds_per_iteration": statistics.median(ratios)}
    import trl

    res["trl_version"] = trl.__version__
    print(f"{'trainer':<14}{'s/iter':>9}{'tokens/s':>10}{'held-out acc':>14}   (start {start:.3f}, {args.iterations} iterations, "
          f"B={B} x G={G}, {NEW} new tokens)")
    for name, r in (("megarl", m), (f"TRL {trl.__version__}", t)):
        print(f"{name:<14}{r['seconds_per_iteration']:>9.3f}{r['tokens_per_s']:>10.0f}{r['heldout_accuracy']:>14.3f}")
    print(f"megarl / TRL seconds per iteration: {res['ratio_seconds_per_iteration']:.2f}x, median of "
          f"{args.rounds} alternating rounds ({', '.join(f'{x:.2f}' for x in ratios)}) (target <= 1.0)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
