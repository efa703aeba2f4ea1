"""The evaluation command: a model on a prompt file, scored by a reward.

    python -m megarl.eval --model runs/<run>/export/iter_200 --data heldout.jsonl \\
        [--config RECIPE.yaml] [--reward FN] [--n N] [--k 1 4 16] [--out results.jsonl] [key=value ...]
    python -m megarl.eval --model DIR --data FILE.jsonl --env calculator [--n N] [key=value ...]

``--model`` is an HF model directory (a megarl export ``export/iter_<k>``, any HF checkpoint), a
megarl megatron checkpoint (``megarl_model.json``) or a training checkpoint
(``checkpoints/iter_<k>``: its ``actor/``); the last two are converted to HF in a temporary
directory first (through megatron, in a world of one) and need ``--tokenizer`` when they carry no
tokenizer files.  The recipe (``--config``, e.g. the run's own ``<run_dir>/config.yaml``) gives the
data fields, the chat template, the reward and the ``eval`` settings; ``--reward`` replaces
``reward.fn`` (its kwargs and components reset; a recipe's agent is turned off: single-turn).  The rows are checked against the reward first,
like training does (``data.on_missing_fields``).

``--env`` evaluates with an environment (multi-turn sessions, the tool available).  What is
reported, and why it reproduces training's held-out accuracy: :func:`evaluate_model`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter

from megarl.errors import MegarlError, cli_main

__all__ = ["main", "evaluate_model", "load_engine"]


class EvalError(MegarlError, ValueError):
    """A model directory, data file or option the evaluation cannot use."""


def _is_training_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) and os.path.isdir(os.path.join(path, "actor"))


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def resolve_model(path: str, tokenizer: str | None, workdir: str) -> tuple[str, str]:
    """``(HF model dir, tokenizer dir)`` for ``--model``: an HF directory as is; a megarl
    megatron checkpoint (or a training checkpoint's ``actor/``) converted into ``workdir``."""
    from megarl.data.hub import is_hub_id, resolve_source
    from megarl.models.megatron_ckpt import is_megatron_checkpoint

    if is_hub_id(path):  # e.g. Qwen/Qwen2.5-0.5B-Instruct: its snapshot in the local Hub cache
        path = resolve_source("--model", path).path
    if tokenizer is not None and is_hub_id(tokenizer):
        tokenizer = resolve_source("--tokenizer", tokenizer, weights=False).path
    if not os.path.isdir(path):
        raise EvalError(f"--model {path}: not a directory (an HF export, HF checkpoint or megarl checkpoint, "
                        "or a Hub id)")
    src = os.path.join(path, "actor") if _is_training_checkpoint(path) else path
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise EvalError(f"--model {path}: no config.json (expected an HF or megarl checkpoint)")
    tok = tokenizer or (src if _has_tokenizer(src) else None)
    if not is_megatron_checkpoint(src):
        if tok is None:
            raise EvalError(f"--model {path}: has no tokenizer files; give --tokenizer DIR (or model.tokenizer=DIR)")
        return src, tok
    if tok is None:
        raise EvalError(f"--model {path}: a megarl checkpoint without tokenizer files; give --tokenizer DIR "
                        "(e.g. the run's model.path or an export/iter_<k>)")
    # a megatron checkpoint: build it once in a world of one and write it as HF
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.weights import export_hf
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    out = os.path.join(workdir, "hf")
    export_hf(load_model(src), out, tokenizer_dir=tok)
    print(f"converted the megarl checkpoint {src} to HF in {out}", flush=True)
    return out, tok


def load_engine(model_dir: str, tok, device: str, retire_finished: bool = False):
    """The hf rollout engine on ``model_dir``, serving its weights as one verified version
    (``retire_finished``: the engine's decode that retires finished rows)."""
    from megarl.models.safetensors_io import CheckpointError
    from megarl.rollout.served_checkpoint import serve_checkpoint

    try:
        return serve_checkpoint(model_dir, tok, device, retire_finished=retire_finished)
    except CheckpointError as e:
        raise EvalError(f"--model: {e}") from None


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(n, start + size)


def evaluate_model(cfg, model_dir: str, tokenizer_dir: str, data_path: str, *, limit: int | None = None,
                   batch_size: int = 256, device: str = "cpu", out: str | None = None, log=print) -> dict:
    """Evaluate ``model_dir`` on ``data_path`` under ``cfg`` (a :class:`~megarl.config.TrainConfig`);
    returns the metrics and writes the per-row results to ``out`` (JSONL) when given.

    ``--env`` (``rollout.agent.env``: a built-in environment or ``pkg.mod:Class``; its arguments as
    ``rollout.agent.env_args.KEY=VALUE`` overrides) evaluates with the environment: every candidate
    is a multi-turn session (the tool available), scored by the environment's reward, through the
    same session code as training's agent rollouts and its held-out evaluation.  Reported besides the
    accuracy: mean turns, the tool-call rate, and the accuracy with and without a tool call; the
    per-row results carry each candidate's turns and tool calls.

    Reported: the greedy accuracy (temperature 0, one candidate per prompt, over the scored prompts)
    and, with ``--n``/``eval.samples_per_prompt`` N > 1, N samples per prompt at ``eval.temperature``:
    pass@k (Chen et al. 2021) and maj@k for each k of ``--k``/``eval.k`` (default 1 and N), see
    megarl/evaluation/estimators.py; per source when the rows carry ``eval.source_field``.  Greedy
    decoding goes through the same engine (the hf rollout backend), request batching and scorer as
    training's held-out evaluation, so an export evaluated on the same prompts reproduces the
    training's accuracy exactly (``--limit eval.n`` and a batch that holds them all).
    """
    from megarl.control.assembly import evaluation_scorer
    from megarl.control.placement import Placement
    from megarl.data.prompts import load_configured_dataset
    from megarl.data.tokenizer import TokenizerContract
    from megarl.control.candidates import evaluate_prompts
    from megarl.rewards.dataset_fields import check_datasets_against_reward, drop_rows_missing_fields
    from megarl.evaluation.estimators import (accuracy_metrics, episode_metrics, per_source_metrics, result_row,
                                              sampled_metrics)
    from megarl.rewards.declarations import extract_answer, normalised_text
    from megarl.rollout.protocol import SamplingParams

    e, d = cfg.eval, cfg.data
    check_datasets_against_reward(cfg, [("--data", data_path, d.heldout_split, d.heldout_subset)])
    tok = TokenizerContract.load(tokenizer_dir, cfg.model.chat_template)
    data = load_configured_dataset(d, tok, data_path, split=d.heldout_split, subset=d.heldout_subset)
    data = drop_rows_missing_fields(cfg, data)
    records = list(data.records[:limit] if limit else data.records)
    engine = load_engine(model_dir, tok, device)
    if cfg.rollout.agent.env:  # every candidate a session with the environment (the tool available)
        from megarl.control.assembly import agent_engine

        engine, report = agent_engine(cfg, tok, engine)
        log(f"--env {cfg.rollout.agent.env}: chat template {report.rule}")
    counters: Counter = Counter()
    scorer, runner, fn = evaluation_scorer(cfg, tok, counters, os.devnull)
    answer_of = (lambda text: extract_answer(fn, text)) if fn is not None else normalised_text
    placement = Placement(num_groups=1, group_index=0, is_group_leader=True)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    max_new = e.max_new_tokens or cfg.rollout.max_new_tokens
    n = e.samples_per_prompt
    ks = sorted(set(e.k or [1, n]))

    def run(sampling, tag):
        outcomes = []
        for lo, hi in _chunks(len(records), batch_size):
            got = evaluate_prompts(records[lo:hi], [f"eval/{tag}/{i:05d}" for i in range(lo, hi)], engine=engine,
                                   placement=placement, scorer=scorer, sampling=sampling,
                                   max_retries=cfg.rollout.max_retries, counters=counters, decode=decode,
                                   source_field=e.source_field)
            for j, p in enumerate(got):
                p.index = lo + j
            outcomes.extend(got)
        return outcomes

    t0 = time.perf_counter()
    try:
        greedy = run(SamplingParams(temperature=0.0, max_new_tokens=max_new, n=1), "greedy")
        m = accuracy_metrics(greedy, e.success_threshold)
        m.update(per_source_metrics(greedy, lambda ps, prefix: accuracy_metrics(ps, e.success_threshold, prefix)))
        m.update(episode_metrics(greedy, e.success_threshold))
        sampled = None
        if n > 1:
            sp = SamplingParams(temperature=e.temperature, top_p=e.top_p, max_new_tokens=max_new, n=n, seed=e.seed)
            sampled = run(sp, "sampled")
            m.update(sampled_metrics(sampled, e.success_threshold, ks, answer_of))
            m.update(episode_metrics(sampled, e.success_threshold, "eval/sampled/"))
            m.update(per_source_metrics(sampled, lambda ps, prefix: sampled_metrics(ps, e.success_threshold, ks,
                                                                                    answer_of, prefix)))
    finally:
        if runner is not None:
            runner.close()
    m["eval/seconds"] = time.perf_counter() - t0
    m["eval/dropped_missing_fields"] = data.stats.get("dropped_missing_fields", 0)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            for i, g in enumerate(greedy):
                row = result_row(g, e.success_threshold, answer_of, model=model_dir, mode="greedy")
                if sampled is not None:
                    s = result_row(sampled[i], e.success_threshold, answer_of)
                    row["samples"] = {k: s[k] for k in ("responses", "rewards", "statuses", "correct", "answers",
                                                        "finish_reasons", "errors", "turns", "tool_calls") if k in s}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return m


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan (nothing scored)" if math.isnan(v) else f"{v:.4f}"
    return str(v)


@cli_main
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m megarl.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF export / HF checkpoint / megarl (training) checkpoint dir")
    p.add_argument("--data", required=True,
                   help="prompt source (.jsonl / .parquet, a `datasets` directory or Hub dataset: split "
                        "data.heldout_split) with the fields the reward reads")
    p.add_argument("--config", help="a recipe or a run's config.yaml (data fields, reward, eval settings)")
    p.add_argument("--reward", help="reward.fn: a builtin name or 'pkg.mod:callable' (kwargs reset)")
    p.add_argument("--env", help="rollout.agent.env: evaluate with this environment (calculator, two_turn or "
                                 "'pkg.mod:Class'; arguments as rollout.agent.env_args.KEY=VALUE); scored by it")
    p.add_argument("--tokenizer", help="tokenizer dir (default: model.tokenizer, else the model dir)")
    p.add_argument("--n", type=int, help="samples per prompt for pass@k / maj@k (eval.samples_per_prompt)")
    p.add_argument("--k", type=int, nargs="+",
                   help="the k of pass@k / maj@k (eval.k; default 1 and N); key=value overrides go before it")
    p.add_argument("--limit", type=int, help="only the first LIMIT rows (default: all)")
    p.add_argument("--batch-size", type=int, default=256, help="prompts per generate call (default 256)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--out", help="per-row results (JSONL)")
    p.add_argument("--metrics-out", help="the metrics as one JSON object")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. eval.max_new_tokens=512)")
    args = p.parse_args(argv)

    from megarl.commands.run_checks import check_evaluation
    from megarl.config import ConfigError, load_config

    pre = [f"model.path={args.model}", f"data.train_path={args.data}"]
    if args.reward:  # single-turn: a recipe's agent is off (the no-tool baseline of an agent recipe)
        pre += [f"reward.fn={args.reward}", "reward.kwargs={}", "reward.components=[]"]
    if args.env and args.reward:
        raise EvalError("--env scores each episode by the environment; --reward cannot be given with it")
    if args.env:
        pre += [f"rollout.agent.env={args.env}", "reward.fn=null", "reward.kwargs={}", "reward.components=[]"]
    if args.n is not None:
        pre.append(f"eval.samples_per_prompt={args.n}")
    if args.k:
        pre.append(f"eval.k=[{','.join(str(k) for k in args.k)}]")
    cfg = load_config(args.config, pre + list(args.overrides))
    if args.reward:  # (a merged {} override would keep the recipe's env_args: cleared here)
        cfg.rollout.agent.env, cfg.rollout.agent.env_args = "", {}
    check_evaluation(cfg)
    if cfg.reward.fn is None and cfg.reward.model.path is None and not cfg.rollout.agent.env:
        raise ConfigError("reward.fn: nothing scores the samples; give --reward FN")
    for name, v in (("--limit", args.limit), ("--batch-size", args.batch_size)):
        if v is not None and v < 1:
            raise EvalError(f"{name} must be >= 1, got {v}")
    from megarl.data.prompts import check_source

    check_source(args.data)  # a file, a directory of files, a `datasets` directory or a Hub dataset
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.reward.model.path:  # the reward model is a megatron role: a world of one
        from megarl.runtime import distributed as rt

        rt.initialize(tp=1, pp=1)
    workdir = tempfile.mkdtemp(prefix="megarl-eval-")
    try:
        model_dir, tok_dir = resolve_model(args.model, args.tokenizer or cfg.model.tokenizer, workdir)
        m = evaluate_model(cfg, model_dir, tok_dir, args.data, limit=args.limit, batch_size=args.batch_size,
                           device=device, out=args.out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    width = max(len(k) for k in m)
    for k in sorted(m):
        print(f"{k:<{width}}  {_fmt(m[k])}")
    if args.out:
        print(f"per-row results: {args.out}")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in m.items()}, f, indent=1)
    sys.stdout.flush()
    return m


if __name__ == "__main__":
    main()
