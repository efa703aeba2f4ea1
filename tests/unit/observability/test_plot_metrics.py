"""tools/plot_metrics.py: one PNG per stage plus summary.png from a metrics.jsonl with gaps and
nulls; bad input is one ``error:`` line naming path:line and exit status 2."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests._dist import ROOT
TOOL = os.path.join(ROOT, "tools", "plot_metrics.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

import matplotlib  # noqa: F401  (a declared dependency: a missing one must fail, not skip)


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _synthetic(n=30):
    recs = []
    for it in range(n):
        r = {
            "iteration": it,
            "time": 1700000000.0 + it,           # no stage: ignored
            "run_id": "demo",                    # not numeric: ignored
            "rollout/reward_mean": 0.1 + 0.02 * it,
            "rollout/response_len_mean": 100 + 3 * math.sin(it),
            "prep/ref_logprob_s": 1.5,
            "update/kl_ref": 0.001 * it,
            "update/grad_norm": None if it % 7 == 3 else 1.0 / (1 + it),   # nulls
            "update/lr": 1e-6,
            "e2e/iteration_s": 30.0 + (it % 3),
            "e2e/tokens_per_s": 1000 + it,
        }
        if it % 5 == 0:                           # gaps: eval every 5 iterations
            r["eval/accuracy"] = 0.2 + 0.01 * it
            r["eval/pass_at_1"] = None if it == 10 else 0.3
        if it == 12:
            del r["rollout/response_len_mean"]
        recs.append(r)
    return recs


def _check_png(path):
    assert os.path.isfile(path), path
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == PNG_MAGIC, f"{path} is not a PNG"
    assert os.path.getsize(path) > 5000, f"{path} is suspiciously small"


def test_plots_every_stage_and_summary(tmp_path):
    run = tmp_path / "run1"
    run.mkdir()
    recs = _synthetic()
    recs.insert(10, "")                           # blank lines are fine
    _write(run / "metrics.jsonl", recs)

    proc = _run(run)
    assert proc.returncode == 0, proc.stderr
    out = run / "plots"
    want = {f"{s}.png" for s in ("rollout", "prep", "update", "e2e", "eval")} | {"summary.png"}
    assert set(os.listdir(out)) == want
    printed = set(proc.stdout.split())
    assert printed == {str(out / name) for name in want}
    for name in want:
        _check_png(out / name)


def test_out_dir_and_partial_headline(tmp_path):
    # Only approx_kl (the kl_ref fallback) among the headline metrics, an unknown stage, a
    # metric that is always null, a resumed run that re-logs iteration 2, and a last line the
    # writer has not finished.
    run = tmp_path / "run2"
    run.mkdir()
    recs = [{"iteration": i, "update/approx_kl": 0.01 * i, "custom/thing": i * i,
             "update/always_null": None} for i in range(4)]
    recs.append({"iteration": 2, "update/approx_kl": 0.5})
    text = "".join(json.dumps(r) + "\n" for r in recs) + '{"iteration": 4, "update/appr'
    (run / "metrics.jsonl").write_text(text)
    out = tmp_path / "elsewhere" / "figs"

    proc = _run(run / "metrics.jsonl", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["custom.png", "summary.png", "update.png"]
    for name in os.listdir(out):
        _check_png(out / name)
    assert "metrics.jsonl:6: incomplete last line" in proc.stderr
    assert "update/always_null" in proc.stderr
    assert not (run / "plots").exists()


def _assert_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])


def test_missing_file(tmp_path):
    _assert_error(_run(tmp_path), "metrics.jsonl", "not found")
    _assert_error(_run(tmp_path / "nope"), "nope", "not found")


def test_bad_json_line_named(tmp_path):
    recs = _synthetic(5)
    recs[2] = '{"iteration": 2, "rollout/reward_mean": 0.3,,}'
    _write(tmp_path / "metrics.jsonl", recs)
    _assert_error(_run(tmp_path), f"{tmp_path / 'metrics.jsonl'}:3:", "not valid JSON")
    assert not (tmp_path / "plots").exists()


@pytest.mark.parametrize("bad, what", [
    ('[1, 2]', "expected a JSON object"),
    ('{"rollout/reward_mean": 1.0}', 'integer "iteration"'),
    ('{"iteration": "3", "rollout/reward_mean": 1.0}', 'integer "iteration"'),
    ('{"iteration": 1.5, "rollout/reward_mean": 1.0}', 'integer "iteration"'),
])
def test_bad_record_named(tmp_path, bad, what):
    _write(tmp_path / "metrics.jsonl", [{"iteration": 0, "rollout/reward_mean": 0.0}, bad])
    _assert_error(_run(tmp_path), "metrics.jsonl:2:", what)


def test_no_numeric_metrics(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"iteration": i, "note": "x", "rollout/status": "ok",
                                         "eval/accuracy": None} for i in range(3)])
    _assert_error(_run(tmp_path), "metrics.jsonl", "no numeric")
    (tmp_path / "metrics.jsonl").write_text("")
    _assert_error(_run(tmp_path), "no numeric")


def _load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_metrics_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _two_runs(tmp_path):
    """runs/tiny-a (30 iterations) and runs/tiny-b (20 iterations, eval elsewhere, its own
    metric, approx_kl instead of kl_ref): what `runs/grpo_arith_tiny-*/` expands to."""
    a, b = tmp_path / "runs" / "tiny-a", tmp_path / "runs" / "tiny-b"
    a.mkdir(parents=True)
    b.mkdir()
    _write(a / "metrics.jsonl", _synthetic(30))
    _write(b / "metrics.jsonl", [
        {"iteration": it, "rollout/reward_mean": 0.5 - 0.01 * it, "update/approx_kl": 0.02 * it,
         "update/only_b": float(it), **({"eval/accuracy": 0.9} if it % 4 == 0 else {})}
        for it in range(20)])
    return a, b


def test_several_runs_are_overlaid_with_a_legend(tmp_path):
    a, b = _two_runs(tmp_path)
    proc = subprocess.run([sys.executable, TOOL, "runs/tiny-a/", "runs/tiny-b/"], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "plots"                      # several runs: ./plots, no run's own plots/
    want = {f"{s}.png" for s in ("rollout", "prep", "update", "e2e", "eval")} | {"summary.png"}
    assert set(os.listdir(out)) == want and not (a / "plots").exists() and not (b / "plots").exists()
    assert set(proc.stdout.split()) == {os.path.join("plots", name) for name in want}
    for name in want:
        _check_png(out / name)

    # what the panels draw: each run's own values, one colour per run in every panel
    tool = _load_tool()
    runs = [(label, tool.read_metrics(str(d / "metrics.jsonl"))) for label, d in (("tiny-a", a), ("tiny-b", b))]
    figs = tool.build_figures(runs, "2 runs")
    assert set(figs) == {name[:-4] for name in want}

    def curves(stem, title):
        ax = next(ax for ax in figs[stem].axes if ax.get_visible() and ax.get_title() == title)
        return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()), ln.get_color()) for ln in ax.lines}

    reward = curves("rollout", "reward_mean")
    assert reward["tiny-a"][:2] == (list(range(30)), [0.1 + 0.02 * it for it in range(30)])
    assert reward["tiny-b"][:2] == (list(range(20)), [0.5 - 0.01 * it for it in range(20)])
    assert reward["tiny-a"][2] != reward["tiny-b"][2]
    assert set(curves("update", "only_b")) == {"tiny-b"}       # a metric of one run only
    assert curves("update", "only_b")["tiny-b"][2] == reward["tiny-b"][2]
    # summary: the KL panel takes each run's own KL (kl_ref for a, the approx_kl fallback for b)
    kl = curves("summary", "KL to reference\nupdate/kl_ref")
    assert kl["tiny-a"][1] == [0.001 * it for it in range(30)]
    assert kl["tiny-b"][1] == [0.02 * it for it in range(20)]
    acc = curves("summary", "accuracy (eval)\neval/accuracy")
    assert acc["tiny-a"][0] == list(range(0, 30, 5)) and acc["tiny-b"][0] == list(range(0, 20, 4))
    for fig in figs.values():                    # one figure legend naming both runs
        assert [[t.get_text() for t in leg.get_texts()] for leg in fig.legends] == [["tiny-a", "tiny-b"]]

    # a single run keeps its legend-free figures; bad input among several is still one error line
    assert all(not fig.legends for fig in tool.build_figures(runs[:1], "tiny-a").values())
    _assert_error(_run(a, tmp_path / "runs" / "nope"), "nope", "not found")
    _assert_error(_run(a, a / "metrics.jsonl"), "given twice")


def test_run_labels_tell_runs_apart():
    tool = _load_tool()
    assert tool.run_labels(["runs/x-1/", "runs/x-2"]) == ["x-1", "x-2"]
    assert tool.run_labels(["/e/a/run1", "/e/b/run1"]) == ["a/run1", "b/run1"]
