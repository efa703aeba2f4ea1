#!/usr/bin/env python
"""Plot runs' metrics: one PNG per stage plus a summary of the headline curves.

    tools/plot_metrics.py RUN_DIR [RUN_DIR ...] [--out DIR]

Reads ``RUN_DIR/metrics.jsonl`` (RUN_DIR may also be the file itself): one JSON object per line
with an integer ``"iteration"`` and numeric metrics named ``"<stage>/<name>"``
(``rollout/reward_mean``, ``update/kl_ref``, ``eval/accuracy`` ...).  A metric may be absent or
null on some lines (``eval/*`` every few iterations); other keys and non-numeric values are
ignored; if an iteration is logged twice (a resumed run) the later value wins.

Several runs (``runs/grpo_arith_tiny-*/``) are overlaid: every panel draws one curve per run that
has the metric, each run in the same colour in every panel, with a legend naming the runs by
their directory.

Writes into ``--out`` (default ``RUN_DIR/plots/`` for one run, ``./plots/`` for several):

* ``<stage>.png``: a grid of small line plots, one per metric of that stage, x = iteration
  (with markers where a metric has few points);
* ``summary.png``: ``rollout/reward_mean``, ``eval/accuracy``, ``update/kl_ref`` (else
  ``update/approx_kl``) and ``e2e/iteration_s``, those that are present;
* ``drift.png`` (when the run measured it): repeated 4-grams, the correlation of reward with
  length, reward earned by the format without the answer, beside length, reward and KL.

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
#: (title, candidates) for drift.png: what reward hacking and degenerate outputs look like
DRIFT = (
    ("repeated 4-grams", ("rollout/repetition_4gram",)),
    ("corr(reward, length)", ("rollout/reward_length_corr",)),
    ("format without answer", ("rollout/format_without_answer_share",)),
    ("response length", ("rollout/response_len_mean",)),
    ("reward (rollout)", ("rollout/reward_mean",)),
    ("KL to reference", ("update/kl_ref", "update/approx_kl")),
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


def _draw(ax, curves: list, title: str) -> None:
    """One panel: ``curves`` is ``[(label, colour, {iteration: value}), ...]``, one per run."""
    from matplotlib.ticker import MaxNLocator

    for label, colour, values in curves:
        xs, ys = _points(values)
        few = len(xs) <= MARKER_MAX_POINTS
        ax.plot(xs, ys, linewidth=1.2, marker="o" if few else None, markersize=3 if few else 0,
                color=colour, label=label)
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
    if stem in ("summary", "drift"):
        stem = f"{stem}-stage"
    base, k = stem, 2
    while stem in taken:
        stem, k = f"{base}-{k}", k + 1
    taken.add(stem)
    return stem


def _colours(n: int) -> list:
    """One colour per run, the same in every panel (matplotlib's default cycle, then tab20)."""
    from matplotlib import colormaps, rcParams

    cycle = rcParams["axes.prop_cycle"].by_key().get("color", [])
    if n <= len(cycle):
        return list(cycle[:n])
    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(n)]


def _panel_figure(panels: list, runs: list, colours: list, cols: int, title: str):
    """A figure of ``panels`` (``[(panel title, [metric keys to try in order]), ...]``); each
    panel overlays the runs that have one of its keys (the first such key of each run)."""
    fig, axes = _figure(len(panels), cols)
    for ax, (panel_title, keys) in zip(axes, panels):
        curves = []
        for (label, series), colour in zip(runs, colours):
            key = next((k for k in keys if k in series), None)
            if key is not None:
                curves.append((label, colour, series[key]))
        _draw(ax, curves, panel_title)
    if len(runs) > 1:
        # one legend for the figure: every run, also one missing from the first panel
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=c, linewidth=1.2) for c in colours]
        fig.legend(handles, [label for label, _ in runs], loc="outside lower center",
                   ncols=min(len(runs), 4), fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


def _chosen(table, runs: list) -> list:
    """The panels of ``table`` some run has a metric for, titled by the key the first run that
    has one uses (kl_ref before approx_kl)."""
    out = []
    for label, candidates in table:
        present = [k for k in candidates if any(k in series for _, series in runs)]
        if present:
            out.append((f"{label}\n{present[0]}", list(candidates)))
    return out


def build_figures(runs: list, title: str) -> dict:
    """``{file stem: matplotlib Figure}`` for ``runs`` = ``[(label, series), ...]`` (series as
    :func:`read_metrics` returns them): one figure per stage present in any run, plus
    ``summary`` when a headline metric is present."""
    colours = _colours(len(runs))
    keys = sorted(set().union(*(series for _, series in runs)))
    by_stage: dict = defaultdict(list)
    for key in keys:
        stage, name = key.split("/", 1)
        by_stage[stage].append((name, [key]))

    figures, taken = {}, {"summary", "drift"}
    for stage in sorted(by_stage):
        figures[_file_stem(stage, taken)] = _panel_figure(by_stage[stage], runs, colours, GRID_COLS,
                                                          f"{title}: {stage}")

    headline = _chosen(HEADLINE, runs)
    drift = _chosen(DRIFT, runs)
    if any(k.startswith("rollout/repetition") for _, cands in drift for k in cands):
        figures["drift"] = _panel_figure(drift, runs, colours, 3, f"{title}: drift and reward hacking")
    if headline:
        figures["summary"] = _panel_figure(headline, runs, colours, 2, f"{title}: summary")
    else:
        wanted = ", ".join(c for _, cands in HEADLINE for c in cands)
        print(f"note: no headline metric ({wanted}); summary.png not written", file=sys.stderr)
    return figures


def plot(runs: list, out_dir: str, title: str) -> list:
    """Write :func:`build_figures` as ``<out_dir>/<stem>.png``; returns the paths written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise MetricsError("matplotlib is required: pip install matplotlib") from None

    figures = build_figures(runs, title)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for stem, fig in figures.items():
        path = os.path.join(out_dir, stem + ".png")
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def _locate(arg: str):
    """``(metrics.jsonl path, run directory)`` for a RUN_DIR argument (or the file itself)."""
    if os.path.isfile(arg):
        return arg, os.path.dirname(os.path.abspath(arg))
    if not os.path.isdir(arg):
        raise MetricsError(f"{arg}: run directory not found")
    return os.path.join(arg, "metrics.jsonl"), arg


def run_labels(run_dirs: list) -> list:
    """A legend label per run: its directory name, with parent directories added until the
    labels differ (two ``run1`` directories under different parents)."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
    depth = 1
    while True:
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            return labels
        depth += 1


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directory holding metrics.jsonl (or the metrics file itself); several are overlaid")
    p.add_argument("--out", default=None,
                   help="output directory (default RUN_DIR/plots/ for one run, ./plots/ for several)")
    args = p.parse_args(argv)

    located = [_locate(arg) for arg in args.run_dirs]
    seen: dict = {}
    for (metrics_path, _), arg in zip(located, args.run_dirs):
        real = os.path.realpath(metrics_path)
        if real in seen:
            raise MetricsError(f"{arg}: the same run as {seen[real]}, given twice")
        seen[real] = arg
    if len(located) == 1:
        default_out = os.path.join(located[0][1], "plots")
    else:
        default_out = "plots"
    out_dir = args.out or default_out
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise MetricsError(f"{out_dir}: --out exists and is not a directory")

    labels = run_labels([run_dir for _, run_dir in located])
    runs = [(label, read_metrics(metrics_path)) for label, (metrics_path, _) in zip(labels, located)]
    title = labels[0] if len(runs) == 1 else f"{len(runs)} runs"
    for path in plot(runs, out_dir, title):
        print(path)


if __name__ == "__main__":
    main()
