#!/usr/bin/env python
"""Plot a run's metrics: one PNG per stage plus a summary of the headline curves.

    tools/plot_metrics.py RUN_DIR [--out DIR]

Reads ``RUN_DIR/metrics.jsonl`` (RUN_DIR may also be the file itself): one JSON object per line
with an integer ``"iteration"`` and numeric metrics named ``"<stage>/<name>"``
(``rollout/reward_mean``, ``update/kl_ref``, ``eval/accuracy`` ...).  A metric may be absent or
null on some lines (``eval/*`` every few iterations); other keys and non-numeric values are
ignored; if an iteration is logged twice (a resumed run) the later value wins.

Writes into ``--out`` (default ``RUN_DIR/plots/``):

* ``<stage>.png``: a grid of small line plots, one per metric of that stage, x = iteration
  (with markers where a metric has few points);
* ``summary.png``: ``rollout/reward_mean``, ``eval/accuracy``, ``update/kl_ref`` (else
  ``update/approx_kl``) and ``e2e/iteration_s``, those that are present.

Prints the paths written.  A last line without its newline that does not parse (the run is
still writing it) is skipped with a note; any other bad line is an error naming ``path:line``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.errors import MegarlError, cli_main  # noqa: E402

#: (title, candidates in order of preference) for summary.png.
HEADLINE = (
    ("reward (rollout)", ("rollout/reward_mean",)),
    ("accuracy (eval)", ("eval/accuracy",)),
    ("KL to reference", ("update/kl_ref", "update/approx_kl")),
    ("iteration seconds", ("e2e/iteration_s",)),
)
#: Up to this many points a curve is drawn with markers (sparse metrics such as eval/*).
MARKER_MAX_POINTS = 40
GRID_COLS = 4


class MetricsError(MegarlError, ValueError):
    pass


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_metrics(path: str) -> dict:
    """``{metric: {iteration: value}}`` from a metrics.jsonl; nulls and non-finite values dropped."""
    if not os.path.isfile(path):
        raise MetricsError(f"{path}: metrics file not found")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MetricsError(f"{path}: cannot read: {e}") from None

    series: dict = defaultdict(dict)
    seen_keys: set = set()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not line.endswith("\n"):
                print(f"note: {path}:{lineno}: incomplete last line skipped (run still writing?)",
                      file=sys.stderr)
                continue
            raise MetricsError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise MetricsError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        it = rec.get("iteration")
        if not isinstance(it, int) or isinstance(it, bool):
            raise MetricsError(f'{path}:{lineno}: expected an integer "iteration", got {it!r}')
        for key, value in rec.items():
            if "/" not in key or key.startswith("/"):
                continue
            if value is None or _is_number(value):
                seen_keys.add(key)
            if _is_number(value) and math.isfinite(value):
                series[key][it] = float(value)

    if not series:
        raise MetricsError(f'{path}: no numeric "<stage>/<name>" metrics found')
    empty = sorted(seen_keys - set(series))
    if empty:
        print(f"note: no values to plot for: {', '.join(empty)}", file=sys.stderr)
    return dict(series)


def _points(values: dict):
    xs = sorted(values)
    return xs, [values[x] for x in xs]


def _draw(ax, values: dict, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    xs, ys = _points(values)
    few = len(xs) <= MARKER_MAX_POINTS
    ax.plot(xs, ys, linewidth=1.2, marker="o" if few else None, markersize=3 if few else 0)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _figure(n: int, cols: int):
    from matplotlib.figure import Figure

    cols = max(1, min(cols, n))
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(3.4 * cols, 2.5 * rows + 0.4), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    for i, ax in enumerate(flat[:n]):
        if i + cols >= n:  # bottom plot of its column
            ax.set_xlabel("iteration", fontsize=8)
    return fig, flat[:n]


def _file_stem(stage: str, taken: set) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stage).strip(".") or "stage"
    if stem == "summary":
        stem = "summary-stage"
    base, k = stem, 2
    while stem in taken:
        stem, k = f"{base}-{k}", k + 1
    taken.add(stem)
    return stem


def plot(series: dict, out_dir: str, title: str) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise MetricsError("matplotlib is required: pip install matplotlib") from None

    os.makedirs(out_dir, exist_ok=True)
    by_stage: dict = defaultdict(list)
    for key in sorted(series):
        stage, name = key.split("/", 1)
        by_stage[stage].append((name, key))

    written, taken = [], {"summary"}
    for stage in sorted(by_stage):
        metrics = by_stage[stage]
        fig, axes = _figure(len(metrics), GRID_COLS)
        for ax, (name, key) in zip(axes, metrics):
            _draw(ax, series[key], name)
        fig.suptitle(f"{title}: {stage}", fontsize=11)
        path = os.path.join(out_dir, _file_stem(stage, taken) + ".png")
        fig.savefig(path, dpi=100)
        written.append(path)

    headline = []
    for label, candidates in HEADLINE:
        key = next((k for k in candidates if k in series), None)
        if key is not None:
            headline.append((f"{label}\n{key}", key))
    if headline:
        fig, axes = _figure(len(headline), 2)
        for ax, (label, key) in zip(axes, headline):
            _draw(ax, series[key], label)
        fig.suptitle(f"{title}: summary", fontsize=11)
        path = os.path.join(out_dir, "summary.png")
        fig.savefig(path, dpi=100)
        written.append(path)
    else:
        wanted = ", ".join(c for _, cands in HEADLINE for c in cands)
        print(f"note: no headline metric ({wanted}); summary.png not written", file=sys.stderr)
    return written


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run directory holding metrics.jsonl (or the metrics file itself)")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/plots/)")
    args = p.parse_args(argv)

    if os.path.isfile(args.run_dir):
        metrics_path, run_dir = args.run_dir, os.path.dirname(os.path.abspath(args.run_dir))
    else:
        if not os.path.isdir(args.run_dir):
            raise MetricsError(f"{args.run_dir}: run directory not found")
        metrics_path, run_dir = os.path.join(args.run_dir, "metrics.jsonl"), args.run_dir
    out_dir = args.out or os.path.join(run_dir, "plots")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise MetricsError(f"{out_dir}: --out exists and is not a directory")

    series = read_metrics(metrics_path)
    title = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    for path in plot(series, out_dir, title):
        print(path)


if __name__ == "__main__":
    main()
