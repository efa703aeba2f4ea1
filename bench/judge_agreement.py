#!/usr/bin/env python
"""How a run trained on a generative judge (or a reward model) went, graded by the rule: the
held-out accuracy the rule gives at each evaluation, and how often the scorer's verdict on the
policy's own training samples disagrees with the rule's.

    python -m megarl.train --config configs/grpo_arith_judge_tiny.yaml trainer.run_dir=runs/judge
    python bench/judge_agreement.py runs/judge [--component arith_judge] [--rule arithmetic] [--json OUT]

Reads ``RUN/metrics.jsonl`` (``eval/accuracy``: the rule's, with ``eval.grader`` set) and the
sealed experience batches (``trainer.save_experience: true``): for every sample the component
``--component`` of its reward record (a verdict 1 / 0, or with ``--threshold`` a score above it
counted as yes) against ``--rule`` on the decoded response and the row's ground truth.  Prints
one row per tenth of the run: samples, the share the rule calls right, the share the scorer
calls right, and the disagreements split both ways (the scorer says right where the rule says
wrong: what a policy can exploit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--component", default="arith_judge", help="the reward component the scorer wrote")
    ap.add_argument("--rule", default="arithmetic", help="the reward function that grades (reward.fn names)")
    ap.add_argument("--threshold", type=float, default=0.5, help="a component above it counts as 'right'")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from megarl.config import load_config
    from megarl.data.tokenizer import TokenizerContract
    from megarl.experience.seal import load_sealed
    from megarl.rewards import build_reward_function

    cfg = load_config(os.path.join(a.run_dir, "config.yaml"), [])
    tok = TokenizerContract.load(cfg.model.tokenizer or cfg.model.path, cfg.model.chat_template)
    rule = build_reward_function(a.rule)
    with open(cfg.data.train_path) as fh:
        rows = {r["id"]: r for r in map(json.loads, fh)}
    with open(os.path.join(a.run_dir, "metrics.jsonl")) as fh:
        metrics = [json.loads(line) for line in fh if line.strip()]
    evals = [(m.get("iteration", m.get("step")), m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]

    root = os.path.join(a.run_dir, "experience")
    per_iter = []
    for d in sorted(os.listdir(root)):
        batch = load_sealed(os.path.join(root, d))
        f = batch.facts
        lens = f.response_mask.sum(1)
        c = {"rule": 0, "scorer": 0, "scorer_only": 0, "rule_only": 0, "n": 0, "no_verdict": 0}
        for i in range(f.batch_size):
            rec = f.rewards[i]
            if rec.status.value != "ok" or a.component not in (rec.components or {}):
                c["no_verdict"] += 1
                continue
            text = tok.decode(f.response_ids[i][: int(lens[i])].tolist(), skip_special_tokens=True)
            from megarl.rewards import RewardSample

            row = rows[f.prompt_id[i]]
            sample = RewardSample(sample_id="s", prompt_id=f.prompt_id[i], group_id="g", prompt_text=row["prompt"],
                                  response_text=text, prompt_ids=(), response_ids=(), finish_reason="stop",
                                  ground_truth={k: v for k, v in row.items() if k not in ("id", "prompt")})
            out = rule(sample)
            right = float(out if isinstance(out, (int, float)) else out.total) == 1.0
            says = rec.components[a.component] > a.threshold
            c["n"] += 1
            c["rule"] += right
            c["scorer"] += says
            c["scorer_only"] += says and not right
            c["rule_only"] += right and not says
        per_iter.append(c)

    print(f"{a.run_dir}: held-out accuracy by the rule (eval/accuracy): "
          + ", ".join(f"it {it}: {acc:.3f}" for it, acc in evals))
    print("iterations      samples  rule right  scorer right  scorer yes, rule no  scorer no, rule yes  no verdict")
    tenth = max(1, len(per_iter) // 10)
    table = []
    for lo in range(0, len(per_iter), tenth):
        part = per_iter[lo:lo + tenth]
        tot = {k: sum(p[k] for p in part) for k in part[0]}
        n = max(1, tot["n"])
        row = {"iterations": [lo + 1, lo + len(part)], **tot, "rule_right": tot["rule"] / n,
               "scorer_right": tot["scorer"] / n, "scorer_yes_rule_no": tot["scorer_only"] / n,
               "scorer_no_rule_yes": tot["rule_only"] / n}
        table.append(row)
        print(f"{lo + 1:5d}-{lo + len(part):<8d} {tot['n']:8d}  {row['rule_right']:10.3f}  {row['scorer_right']:12.3f}"
              f"  {row['scorer_yes_rule_no']:19.3f}  {row['scorer_no_rule_yes']:19.3f}  {tot['no_verdict']:10d}")
    tot = {k: sum(p[k] for p in per_iter) for k in per_iter[0]}
    disagree = (tot["scorer_only"] + tot["rule_only"]) / max(1, tot["n"])
    print(f"all {tot['n']} samples: the scorer and the rule disagree on {disagree:.3%} "
          f"({tot['scorer_only']} scorer-yes-rule-no, {tot['rule_only']} scorer-no-rule-yes)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"run_dir": a.run_dir, "evals": evals, "table": table, "disagreement": disagree,
                       "totals": tot}, fh, indent=1)


if __name__ == "__main__":
    main()
