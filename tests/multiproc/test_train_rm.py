"""``python -m megarl.train_rm``: real runs on the tiny model over the built-in preference pairs.

One uninterrupted run is the reference for three contracts at once:

* exact resume: the same run stopped after a checkpoint and resumed ends bitwise equal (export
  weights, every metric row); a resume against other training pairs is refused;
* layout: at TP=2, PP=2 and DP=2 (with micro-batches) the first step's loss and gradient norm are
  the single-process ones, and the exported weights agree within the Adam bound;
* the export: transformers' ``AutoModelForSequenceClassification`` scores the held-out pairs as
  megarl's reward-model role does, and its pair accuracy is the run's reported one.
"""

import json
import os
import sys

import pytest
import torch

from tests._dist import ROOT, free_port
from tests._tolerance import LAYOUT_FP32_VALUE, NET_FP32_LOGPROB, adam_weights_tol, within
from tests._train_runs import run_to_exit

RECIPE = os.path.join(ROOT, "configs", "train_rm", "arith_tiny.yaml")
LR = 3e-4


def _cmd(assets, pairs_dir, run_dir, nproc=1, *extra):
    head = [sys.executable, "-m", "megarl.train_rm"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), "-m", "megarl.train_rm"]
    return head + ["--config", RECIPE, f"model.path={assets['model']}", "data.max_tokens=64",
                   f"data.train_path={pairs_dir}/train.jsonl", f"data.heldout_path={pairs_dir}/heldout.jsonl",
                   "data.builtin_train_n=64", "data.builtin_heldout_n=24", "trainer.steps=4", "trainer.pairs_per_step=8",
                   "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.loggers=[jsonl]",
                   f"optim.lr={LR}", "optim.lr_warmup_steps=0", "optim.lr_decay_style=constant",
                   f"trainer.run_dir={run_dir}", *extra]


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("time", "train/seconds")} for line in f]


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(run_dir, "export", "model.safetensors"))


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    d = tmp_path_factory.mktemp("rm")
    run_to_exit(_cmd(assets, d, d / "ref"))
    return d


def test_resume_is_exact_and_refuses_other_pairs(assets, reference, tmp_path):
    run = tmp_path / "stopped"
    out = run_to_exit(_cmd(assets, reference, run, 1, "trainer.stop_after=2"))
    assert "stopping after step 2" in out.stdout and not (run / "export").exists()
    out = run_to_exit(_cmd(assets, reference, run))
    assert "resuming from" in out.stdout and "at step 2" in out.stdout
    ref = reference / "ref"
    assert _rows(run) == _rows(ref)  # every step's loss, accuracy, grad norm, lr and held-out numbers
    a, b = _weights(ref), _weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "score.weight" in a and a["score.weight"].abs().sum() > 0  # the head trained
    # negative control: the same run over other training pairs may not continue this checkpoint
    other = tmp_path / "other_pairs"
    other.mkdir()
    lines = open(reference / "train.jsonl").read().splitlines()
    (other / "train.jsonl").write_text("\n".join(lines[1:] + lines[:1]) + "\n")
    (other / "heldout.jsonl").write_text(open(reference / "heldout.jsonl").read())
    cmd = _cmd(assets, other, run, 1, "data.builtin=null", "trainer.steps=6")
    bad = run_to_exit(cmd, expect=2)
    assert "train_sha256" in bad.stderr and "differ" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"], ["trainer.micro_batch_pairs=2"]],
                         ids=["tp2", "pp2", "dp2"])
def test_layouts_train_the_same_model(assets, reference, tmp_path, layout):
    run_to_exit(_cmd(assets, reference, tmp_path / "run", 2, *layout))
    ref, got = _rows(reference / "ref"), _rows(tmp_path / "run")
    # step 1 is a forward and a backward from the same weights: the loss and the gradient norm
    # are the one network's in two layouts (a loss divided per rank instead of by the global pair
    # count would double the DP gradient norm)
    assert within(abs(ref[0]["train/loss"] - got[0]["train/loss"]), LAYOUT_FP32_VALUE, "train_rm/step1_loss")
    assert within(abs(ref[0]["train/grad_norm"] - got[0]["train/grad_norm"]) / ref[0]["train/grad_norm"],
                  LAYOUT_FP32_VALUE, "train_rm/step1_grad_norm"), (ref[0], got[0])
    a, b = _weights(reference / "ref"), _weights(tmp_path / "run")
    err = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert within(err, adam_weights_tol(LR, 4, 1.0), "train_rm/weights"), err


def test_export_scores_as_transformers_reads_it(assets, reference):
    from transformers import AutoModelForSequenceClassification

    from megarl.data.preference import read_pairs, render_pairs
    from megarl.data.tokenizer import TokenizerContract

    from megarl.config.loading import load_config
    from megarl.config.rm_schema import RMTrainConfig
    from megarl.roles.reward_model import recorded_scorer_prompt

    export = reference / "ref" / "export"
    cfg = json.load(open(export / "config.json"))
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["num_labels"] == 1
    # the recipe's model is reference-guided: the export records the user turn it was trained on
    prompt = load_config(RECIPE, [], schema=RMTrainConfig).data.prompt
    assert "{answer}" in prompt and recorded_scorer_prompt(str(export)) == (True, prompt)
    contract = TokenizerContract.load(str(export), None)
    pairs = render_pairs(contract, read_pairs(str(reference / "heldout.jsonl"), "heldout"), 64, "max", prompt)
    assert contract.decode(pairs[0][0]).count(" answer : ") == 1
    rows = [side for p in pairs for side in p]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), contract.pad_token_id)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    hf = AutoModelForSequenceClassification.from_pretrained(str(export), dtype=torch.float32).eval()
    with torch.no_grad():
        s_hf = hf(input_ids=ids, attention_mask=(torch.arange(L)[None] < torch.tensor([len(r) for r in rows])[:, None]
                                                 ).long()).logits[:, 0]
    code = ("import json, sys, torch\n"
            "from megarl.runtime import distributed as rt\nfrom megarl.roles.reward_model import RewardModel\n"
            "rt.initialize()\nrows = json.load(open(sys.argv[2]))\n"
            "print(json.dumps(RewardModel(sys.argv[1], 1, 1, vocab_multiple=16).score(rows).tolist()))\n")
    (reference / "rows.json").write_text(json.dumps(rows))
    out = run_to_exit([sys.executable, "-c", code, str(export), str(reference / "rows.json")])
    s_rm = torch.tensor(json.loads(out.stdout.strip().splitlines()[-1]))
    # two implementations of one fp32 network (transformers against megatron): the log-prob budget
    assert within(float((s_hf - s_rm).abs().max()), NET_FP32_LOGPROB, "train_rm/export_vs_transformers")
    summary = json.load(open(reference / "ref" / "rm_summary.json"))
    acc = float((s_hf[0::2] > s_hf[1::2]).float().mean())
    assert summary["eval/pair_accuracy"] == pytest.approx(acc, abs=1e-6) and summary["init"] == "causal_lm"


def test_bad_input_is_one_error_line_before_any_model_loads(assets, reference, tmp_path):
    """A head of neither format (for train_rm and for reward.models), a pair file without
    chosen / rejected, a batch that does not split over DP: exit 2, one ``error:`` line naming
    the key or file, before a weight is read."""
    import json as _json

    bad_head = tmp_path / "qa_model"
    bad_head.mkdir()
    c = _json.load(open(os.path.join(assets["model"], "config.json")))
    (bad_head / "config.json").write_text(_json.dumps(dict(c, architectures=["LlamaForQuestionAnswering"])))
    no_keys = tmp_path / "pairs.jsonl"
    no_keys.write_text('{"prompt": "q", "good": "a", "bad": "b"}\n')
    no_answer = tmp_path / "pairs_without_answer.jsonl"
    no_answer.write_text('{"prompt": "what is 1 plus 2 ?", "chosen": "3", "rejected": "4"}\n')
    ppo_dry = [sys.executable, "-m", "megarl.train", "--config", os.path.join(ROOT, "configs", "ppo_arith_tiny.yaml"),
               "--dry-run", f"model.path={assets['model']}", "model.build_tiny=false", "data.task.build=false",
               f"data.train_path={assets['train']}", f"data.heldout_path={assets['heldout']}"]
    export = reference / "ref" / "export"
    cases = [
        (_cmd(assets, reference, tmp_path / "a", 1, f"model.path={bad_head}"), 2, "model.path: ",
         "LlamaForQuestionAnswering"),
        (_cmd(assets, reference, tmp_path / "b", 1, "data.builtin=null", f"data.train_path={no_keys}"), 2,
         f"{no_keys}:1: no chosen / rejected key", "good"),
        # a reference-guided model's template: never the response; every row carries its fields
        (_cmd(assets, reference, tmp_path / "d", 1, "data.prompt='{prompt} {response}'"), 2,
         "data.prompt: {response} is not the user turn's"),
        (_cmd(assets, reference, tmp_path / "e", 1, "data.builtin=null", f"data.train_path={no_answer}"), 2,
         f"{no_answer}:1: data.prompt reads the row's ['answer']"),
        # torchrun reports its workers' exit status 2 as its own 1
        (_cmd(assets, reference, tmp_path / "c", 2, "trainer.pairs_per_step=7"), 1, "trainer.pairs_per_step: 7", "dp=2"),
        ([sys.executable, "-m", "megarl.train", "--config", os.path.join(ROOT, "configs", "ppo_arith_tiny.yaml"), "--dry-run",
          f"model.path={assets['model']}", "model.build_tiny=false", "data.task.build=false",
          f"data.train_path={assets['train']}", f"data.heldout_path={assets['heldout']}",
          f"reward.models=[{{name: judge, path: {assets['model']}}}]"], 2,
         "reward.models[0].path: ", "LlamaForCausalLM, not a reward model"),
        # a reference-guided export read without its template would score inputs it never saw
        (ppo_dry + [f"reward.models=[{{name: rm, path: {export}}}]"], 2, "reward.models[0].prompt: None, but ",
         "was trained reading the user turn as '{prompt} answer : {answer}'"),
    ]
    for cmd, rc, *words in cases:
        out = run_to_exit(cmd, expect=rc)
        errors = [line for line in out.stderr.splitlines() if "error:" in line]
        assert len(errors) >= 1 and all(w in errors[0] for w in words), out.stderr[-2000:]
        assert "Loading" not in out.stdout + out.stderr and not (tmp_path / "a" / "checkpoints").exists()
