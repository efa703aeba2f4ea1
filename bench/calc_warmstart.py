"""The calculator recipe's warm start, measured with the real session code.

    python bench/calc_warmstart.py [--out /tmp/calc_model --tool-demos 0.15 --tool-only-steps 900 --steps 1000 ...]
    python bench/calc_warmstart.py --model DIR            # measure a built model, build nothing

Builds the tiny model with ``python -m megarl.tinymodel --task calculator ...`` (the command
``megarl.train`` runs for a recipe with ``data.task.name: calculator``; timed), loads it in the hf
rollout engine and runs :func:`megarl.rollout.agent.run_agent_rollouts` with the calculator
environment and :class:`megarl.envs.render.EnvTurnRenderer` on held-out 4-6-digit addition
(``calculator.make_rows("heldout", seed, n)``).  Prints:

- ``greedy_with_tool``: greedy accuracy when the tool is available (what the RL run starts from);
- ``greedy_no_tool``: greedy accuracy answering in one turn (``max_turns=1``: a call is wrong),
  the no-tool baseline;
- ``sampled_tool_call_rate``: the share of temperature-1 trajectories that call the tool;
- ``sampled_accuracy`` and ``sampled_accuracy_given_call`` (and ``greedy_accuracy_given_call``):
  what reinforcing calls pays;
- ``call_exact_rate``: the share of calls whose expression is the row's problem (operands copied);
- ``build_s``: the build's seconds.

A trajectory's calls are counted from its decoded policy turns (``calculator.find_calls``):
the session's ``tool_calls`` counts messages of role ``tool``, and this model's tool results
come as ``tool_role`` messages (``user`` in the tiny vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build(out: str, args) -> float:
    """Build the calculator tiny model into ``out`` with the tinymodel CLI; return its seconds."""
    cmd = [sys.executable, "-m", "megarl.tinymodel", "--out", out, "--steps", str(args.steps), "--lr", str(args.lr),
           "--batch", str(args.batch), "--seed", str(args.seed), "--task", "calculator",
           "--task-arg", f"demos={args.tool_demos}", "--task-arg", f"min_digits={args.digits[0]}",
           "--task-arg", f"max_digits={args.digits[1]}", "--task-arg", f"tool_role={args.tool_role}",
           "--task-arg", f"only_steps={args.tool_only_steps}", "--target-accuracy", str(args.target_accuracy),
           "--task-arg", f"mixture_steps={args.tool_mixture_steps}", "--overwrite"]
    for flag in ("hidden_size", "num_layers", "intermediate_size"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    return time.time() - t0


def load_engine(model_dir: str):
    """The hf rollout engine serving ``model_dir``'s weights, as ``python -m megarl.eval`` loads it."""
    from megarl.commands.evaluate import load_engine as eval_engine
    from megarl.data.tokenizer import TokenizerContract

    contract = TokenizerContract.from_pretrained(model_dir)
    return contract, eval_engine(model_dir, contract, "cpu")


def sessions(contract, engine, rows, *, tool_role: str, temperature: float, n: int, max_turns: int, seed: int,
             max_new_tokens: int = 20, max_total_tokens: int = 80):
    """The calculator sessions of ``rows`` (``n`` trajectories each) and their decoded policy turns."""
    from megarl.envs.calculator import CalculatorEnv
    from megarl.envs.render import EnvTurnRenderer
    from megarl.rollout.agent import AgentLimits, run_agent_rollouts
    from megarl.rollout.protocol import SamplingParams

    tok = contract.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731  (as megarl.eval)
    prompts = [(r["id"], tuple(contract.encode_prompt([{"role": "user", "content": r["prompt"]}]))) for r in rows]
    trajs = run_agent_rollouts(engine, prompts, rows, lambda: CalculatorEnv(tool_role=tool_role),
                               EnvTurnRenderer(contract),
                               SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=n, seed=seed),
                               AgentLimits(max_turns=max_turns, max_total_tokens=max_total_tokens),
                               decode=decode, step_timeout_s=10.0, max_workers=4)
    return trajs, [[decode(g.response_ids) for g in t.generated] for t in trajs]


def summarize(trajs, turns_text, rows, n: int) -> dict:
    """Accuracy, call rate, accuracy given a call, and how often a call is the row's problem."""
    from megarl.envs.calculator import evaluate, find_calls

    correct = [t.reward_components.get("correct", 0.0) == 1.0 for t in trajs]
    calls = [[c for text in texts for c in find_calls(text)] for texts in turns_text]
    called = [bool(c) for c in calls]
    exact = [evaluate(c) == int(rows[j // n]["answer"]) for j, cs in enumerate(calls) for c in cs]
    k = max(sum(called), 1)
    return {"accuracy": sum(correct) / len(trajs), "tool_call_rate": sum(called) / len(trajs),
            "accuracy_given_call": sum(c for c, d in zip(correct, called) if d) / k if any(called) else None,
            "call_exact_rate": sum(exact) / len(exact) if exact else None, "n_trajectories": len(trajs)}


def measure(model_dir: str, *, n_rows: int, samples: int, seed: int, tool_role: str, digits) -> dict:
    from megarl.envs.calculator import make_rows

    contract, engine = load_engine(model_dir)
    rows = make_rows("heldout", seed, n_rows, digits=tuple(digits))
    out = {}
    t0 = time.time()
    trajs, texts = sessions(contract, engine, rows, tool_role=tool_role, temperature=0.0, n=1, max_turns=3, seed=seed)
    g = summarize(trajs, texts, rows, 1)
    out.update(greedy_with_tool=g["accuracy"], greedy_tool_call_rate=g["tool_call_rate"],
               greedy_accuracy_given_call=g["accuracy_given_call"])
    trajs, texts = sessions(contract, engine, rows, tool_role=tool_role, temperature=0.0, n=1, max_turns=1, seed=seed)
    out["greedy_no_tool"] = summarize(trajs, texts, rows, 1)["accuracy"]
    trajs, texts = sessions(contract, engine, rows, tool_role=tool_role, temperature=1.0, n=samples, max_turns=3,
                            seed=seed)
    s = summarize(trajs, texts, rows, samples)
    out.update(sampled_tool_call_rate=s["tool_call_rate"], sampled_accuracy=s["accuracy"],
               sampled_accuracy_given_call=s["accuracy_given_call"], call_exact_rate=s["call_exact_rate"],
               sampled_trajectories=s["n_trajectories"], measure_s=time.time() - t0)
    example = next((t for t, x in zip(texts, trajs) if len(t) > 1), texts[0])
    out["example_sampled_turns"] = example
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="measure this built model (no build)")
    p.add_argument("--out", default="/tmp/megarl_calc_bench_model", help="where to build the model")
    # the defaults: the settings chosen for grpo_calc_tiny (the bench's table in the report)
    p.add_argument("--tool-demos", type=float, default=0.15)
    p.add_argument("--steps", type=int, default=1900)
    p.add_argument("--tool-only-steps", type=int, default=1500,
                   help="the onset phase's most steps (with --target-accuracy 0: exactly this many)")
    p.add_argument("--target-accuracy", type=float, default=0.25,
                   help="tool-use validation accuracy that ends the onset phase (0: a fixed step count)")
    p.add_argument("--tool-mixture-steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="the build's seed")
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--digits", type=int, nargs=2, default=(4, 6))
    p.add_argument("--tool-role", default="user")
    p.add_argument("--n", type=int, default=200, help="held-out rows")
    p.add_argument("--samples", type=int, default=4, help="temperature-1 trajectories per row")
    p.add_argument("--eval-seed", type=int, default=1)
    p.add_argument("--json", help="also write the numbers here")
    a = p.parse_args(argv)
    result = {}
    model = a.model
    if model is None:
        result["build_s"] = build(a.out, a)
        model = a.out
    with open(os.path.join(model, "tiny_model.json")) as f:
        info = json.load(f)
    result["settings"] = {"tool": info.get("tool"), "warmstart": info["warmstart"], "hidden_size": info["hidden_size"],
                          "num_layers": info["num_layers"]}
    result["build_no_tool_accuracy"] = info["heldout_accuracy_greedy"]
    result.update(measure(model, n_rows=a.n, samples=a.samples, seed=a.eval_seed, tool_role=a.tool_role,
                          digits=a.digits))
    for k, v in result.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
