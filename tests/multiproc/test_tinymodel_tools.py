"""The tiny model's warm-start sources (megarl/builtin/tasks: calculator, two_turn, arithmetic) and
their settings (data.task.args), the build command and the cache check.

A tool-use demonstration is the token list an agent session builds for the solved conversation,
with loss exactly on the policy tokens (the call and the answer), never on the tool's output;
the default build's sequences are the ones it always had; the task's keys are validated by name."""

from __future__ import annotations

import os

import pytest
import torch

from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
from megarl.builtin.tasks.calculator import tool_sequences
from megarl.builtin.warmstart import is_demo, prompt_answer_sequences, training_tensors
from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config
from megarl.data.tokenizer import TokenizerContract

from tests._dist import ROOT
GRPO = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
CALC = os.path.join(ROOT, "configs", "grpo_calc_tiny.yaml")

# tiny-vocabulary ids (megarl/builtin/tiny_tokenizer.py): <bos> 2, <eos> 3, <|user|> 5,
# <|assistant|> 6, <|end|> 7, digits 0-9 are 8-17, + 18, ? 31, [ 38, ] 39, what 70, is 71, plus 75
BOS, EOS, USER, ASSISTANT, END, PLUS, Q, LB, RB, WHAT, IS, WPLUS = 2, 3, 5, 6, 7, 18, 31, 38, 39, 70, 71, 75


def d(*digits):
    return [8 + k for k in digits]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(path)
    return TokenizerContract.from_pretrained(str(path))


ROW = {"prompt": "what is 1234 plus 56789 ?", "answer": "58023"}
PROMPT = [BOS, USER, WHAT, IS, *d(1, 2, 3, 4), WPLUS, *d(5, 6, 7, 8, 9), Q, END, ASSISTANT]
CALL = [LB, *d(1, 2, 3, 4), PLUS, *d(5, 6, 7, 8, 9), RB, END]  # policy turn 0
TOOL = [USER, *d(5, 8, 0, 2, 3), END, ASSISTANT]  # the tool's result as a user message + next prompt
ANSWER = [*d(5, 8, 0, 2, 3), END]  # policy turn 1


def test_demonstration_is_the_session_layout_with_loss_on_policy_tokens_only(tok):
    prompts, responses, masks = tool_sequences(tok, [ROW], share=1.0, tool_role="user")
    assert prompts == [PROMPT] and responses == [CALL + TOOL + ANSWER]
    assert masks == [[1.0] * len(CALL) + [0.0] * len(TOOL) + [1.0] * len(ANSWER)]
    tokens, mask = training_tensors(0, prompts, responses, masks)
    assert tokens.tolist() == [PROMPT + CALL + TOOL + ANSWER]
    # mask[t] weighs predicting token t + 1: exactly the call's and the answer's positions
    p, c, t = len(PROMPT), len(CALL), len(TOOL)
    want = set(range(p, p + c)) | set(range(p + c + t, p + c + t + len(ANSWER)))
    assert {i + 1 for i in torch.nonzero(mask[0]).flatten().tolist()} == want
    assert mask.shape == (1, len(tokens[0]) - 1) and float(mask.sum()) == len(want)


def test_direct_answer_rows_and_the_demonstration_share(tok):
    """A non-demonstration row of the calculator build is the prompt and the answer through
    <|end|> (as a session answering at once), with loss on its first token only (the decision
    not to call); demonstrations are evenly spaced, the first ``demos_first`` rows all
    demonstrations."""
    prompts, responses, masks = tool_sequences(tok, [ROW], share=0.0)
    assert prompts == [PROMPT] and responses == [ANSWER] and masks == [[1.0] + [0.0] * (len(ANSWER) - 1)]
    assert [i for i in range(12) if is_demo(i, 0.25)] == [3, 7, 11]
    rows = [ROW] * 10
    _, responses, _ = tool_sequences(tok, rows, share=0.25, demos_first=4)
    assert [r[0] == LB for r in responses] == [True] * 4 + [False, False, False, True, False, False]


def _old_build_batch(tok, problems, pad):
    """The warm start's batch exactly as the build wrote it before the calculator build."""
    prompts, answers = [], []
    for p in problems:
        prompts.append(tok.encode_prompt([{"role": "user", "content": p["prompt"]}]))
        answers.append(list(tok.tokenizer.encode(p["answer"], add_special_tokens=False)) + [tok.eos_token_id])
    rows = [p + a for p, a in zip(prompts, answers)]
    L = max(len(r) for r in rows)
    tokens = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), L - 1)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        tokens[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p) - 1:len(p) + len(a) - 1] = 1
    return tokens, mask


def test_default_build_sequences_unchanged(tok):
    from megarl.builtin.tasks import arithmetic
    from megarl.builtin.warmstart import WarmStartRun
    from megarl.data.tasks.arithmetic import make_problems

    source = arithmetic.WarmStart(tok, arithmetic.Settings(), WarmStartRun(steps=2, batch=64, seed=0, lr=2e-3))
    problems = make_problems("train", 0, 128, digits=(1, 2))
    # golden: the first rows of the default build (seed 0): 15 plus 75 = 90, ...
    prompts, answers = prompt_answer_sequences(tok, problems[:3])
    assert prompts[0] == [BOS, USER, WHAT, IS, *d(1, 5), WPLUS, *d(7, 5), Q, END, ASSISTANT]
    assert answers[:3] == [[*d(9, 0), EOS], [*d(1, 0, 3), EOS], [*d(5), EOS]]
    for step in range(2):
        tokens, mask = source.batch(step)
        old_tokens, old_mask = _old_build_batch(tok, problems[step * 64:(step + 1) * 64], tok.pad_token_id)
        assert torch.equal(tokens, old_tokens) and torch.equal(mask, old_mask)


@pytest.mark.parametrize("overrides,key", [
    (["data.task.args.demos=1.5"], "data.task.args.demos"),
    (["data.task.args.demos=0"], "data.task.args.demos"),  # the calculator build is its demonstrations
    (["data.task.args.only_steps=-1"], "data.task.args.only_steps"),
    (["data.task.args.min_digits=0"], "data.task.args.min_digits"),
    (["data.task.args.min_digits=7"], "data.task.args.min_digits"),  # above max_digits=6
    (["data.task.args.tool_role=assistant"], "data.task.args.tool_role"),
    (["data.task.args.two_turn=0.2"], "data.task.args: task calculator takes no two_turn"),
    (["data.task.args.demos=high"], "data.task.args.demos: expects float"),
    # with a target (the recipe's 0.25) the onset phase stops on it: it needs at least one check
    (["data.task.args.only_steps=0"], "data.task.args.only_steps"),
    (["data.task.args.only_steps=1901"], "data.task.args.only_steps"),
    (["data.task.args.only_steps=1850"], "data.task.args.mixture_steps"),
    (["data.task.name=null"], "data.task.args: is set"),  # settings of no task
])
def test_task_keys_validated_by_name(overrides, key):
    with pytest.raises(ConfigError) as e:
        check_run(load_config(CALC, overrides), 1)
    assert str(e.value).startswith(key), str(e.value)


def test_task_settings_default_and_accepted():
    from megarl.builtin.tasks import task_settings

    cfg = load_config(GRPO, [])
    assert (cfg.data.task.name, cfg.data.task.args) == ("arithmetic", {})
    s = task_settings("arithmetic", cfg.data.task.args)
    assert (s.digits, s.op_tuple, s.validation) == ((1, 2), ("plus",), "heldout")
    s = task_settings("calculator", load_config(CALC, []).data.task.args)
    assert (s.demos, s.only_steps, s.mixture_steps, s.digits, s.tool_role) == (0.15, 1500, 100, (4, 6), "user")
    cfg = load_config(CALC, ["data.task.args.only_steps=3000", "model.tiny.warmstart_target_accuracy=null"])
    assert check_run(cfg, 1) == 1  # without a target there is no onset phase to fit
    with pytest.raises(ConfigError, match=r"^model\.build_tiny: is true but data\.task\.name is null"):
        check_run(load_config(GRPO, ["data.task.name=null"]), 1)


def test_builder_command_names_the_task_and_its_settings(tmp_path, monkeypatch):
    """ensure_builtin_model's command: every model.tiny.* setting, the task, and each of the
    task's settings (its defaults included) as --task-arg."""
    import subprocess

    from megarl.commands import startup

    seen = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, env=None: seen.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    base = [f"model.path={tmp_path / 'm'}", "model.build_tiny=true"]
    startup.ensure_builtin_model(load_config(GRPO, base))
    startup.ensure_builtin_model(load_config(CALC, base + ["data.task.args.only_steps=9"]))
    startup.ensure_builtin_model(load_config(GRPO, base + ["data.task.args.validation=train-mix",
                                                         "model.tiny.warmstart_adam_beta2=0.98"]))
    default, calc, mix = seen
    common = ["--hidden-size", "128", "--num-layers", "4", "--num-heads", "4", "--num-kv-heads", "2",
              "--intermediate-size", "256"]
    assert default[2:] == ["megarl.tinymodel", "--out", str(tmp_path / "m"), "--task", "arithmetic", *common,
                           "--steps", "2000", "--lr", "0.002", "--batch", "64", "--adam-beta2", "0.999",
                           "--target-accuracy", "0.3", "--heldout-n", "200", "--seed", "0", "--overwrite",
                           "--task-arg", "min_digits=1", "--task-arg", "max_digits=2", "--task-arg", "ops=plus",
                           "--task-arg", "validation=heldout"]
    assert calc[2:7] == ["megarl.tinymodel", "--out", str(tmp_path / "m"), "--task", "calculator"]
    assert calc[calc.index("--overwrite") + 1:] == [
        "--task-arg", "min_digits=4", "--task-arg", "max_digits=6", "--task-arg", "ops=plus", "--task-arg", "demos=0.15",
        "--task-arg", "only_steps=9", "--task-arg", "mixture_steps=100", "--task-arg", "tool_role=user"]
    assert mix == [x.replace("0.999", "0.98").replace("validation=heldout", "validation=train-mix") for x in default]


def test_calculator_build_records_its_settings(tmp_path):
    """A (very short) calculator build through the real CLI: tiny_model.json names the task,
    the tool settings, and the no-tool held-out accuracy on the calculator's operands."""
    import json
    import subprocess
    import sys

    from tests._dist import subprocess_env

    out = tmp_path / "calc"
    subprocess.run([sys.executable, "-m", "megarl.tinymodel", "--out", str(out), "--steps", "3", "--batch", "8",
                    "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1",
                    "--intermediate-size", "64", "--task", "calculator", "--task-arg", "demos=0.5",
                    "--task-arg", "only_steps=1", "--task-arg", "min_digits=4", "--task-arg", "max_digits=5"],
                   check=True, env=subprocess_env(), capture_output=True, timeout=300, cwd=ROOT)
    info = json.loads((out / "tiny_model.json").read_text())
    assert info["task"] == {"name": "calculator", "digits": [4, 5], "ops": ["plus"]}
    assert info["tool"] == {"demos": 0.5, "digits": [4, 5], "role": "user", "only_steps": 1}
    assert info["warmstart"]["steps"] == 3 and 0.0 <= info["heldout_accuracy_greedy"] <= 1.0
    bad = subprocess.run([sys.executable, "-m", "megarl.tinymodel", "--out", str(tmp_path / "x"), "--task", "calculator",
                          "--task-arg", "demos=2"], env=subprocess_env(), capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert bad.returncode != 0 and "--task-arg demos: must be in (0, 1], got 2" in bad.stderr, bad.stderr[-2000:]


def test_two_turn_demonstrations_teach_the_second_turn_not_the_wrong_guess(tok):
    """The two-turn build: the arithmetic sequences with a share replaced by guess-feedback-answer
    conversations laid out as a session builds them; loss on the guess's <|end|> and on the
    answer, never on the feedback or the guess's digits."""
    from megarl.builtin.tasks.two_turn import two_turn_sequences
    from megarl.data.tasks.arithmetic import make_problems

    probs = make_problems("train", 0, 40, digits=(1, 2), ops=("plus",))
    prompts, responses, masks = two_turn_sequences(tok, probs, 0.25, seed=0)
    plain_p, plain_r = prompt_answer_sequences(tok, probs)
    demos = [i for i in range(40) if is_demo(i, 0.25)]
    assert len(demos) == 10
    for i in range(40):
        if i not in demos:  # an arithmetic row as the default build has it, loss on all of it
            assert (prompts[i], responses[i], masks[i]) == (plain_p[i], plain_r[i], [1.0] * len(plain_r[i]))
            continue
        r, m = responses[i], masks[i]
        ends = [t for t, x in enumerate(r) if x == END]
        assert len(ends) == 3 and r[-1] == END  # guess, feedback message, answer each end at <|end|>
        guess_end, feedback_end = ends[0], ends[1]
        assert r[guess_end + 1] == USER and r[feedback_end + 1] == ASSISTANT
        answer = list(tok.tokenizer.encode(probs[i]["answer"], add_special_tokens=False))
        assert r[feedback_end + 2:-1] == answer  # the right answer after the feedback
        assert m == [0.0] * guess_end + [1.0] + [0.0] * (feedback_end + 1 - guess_end) + [1.0] * (len(answer) + 1)
    guesses = [tok.tokenizer.decode(responses[i][:[t for t, x in enumerate(responses[i]) if x == END][0]])
               for i in demos]
    right = sum(g.replace(" ", "") == probs[i]["answer"] for g, i in zip(guesses, demos))
    assert 0 < right < len(demos)  # some guesses right, some one digit off


def test_a_cache_built_by_other_settings_is_refused_naming_the_key(tmp_path):
    """The tiny model and the task files under MEGARL_CACHE are reused only when they are what
    these settings build: a build by other model.tiny.* settings (or an older megarl) and a task
    file of other data.task settings are refused, naming the setting or the file, before
    anything trains on them."""
    import json

    import pytest

    from megarl.builtin.warmstart import MARKER
    from megarl.commands import startup
    from megarl.errors import MegarlError

    model = tmp_path / "m"
    model.mkdir()
    cfg = load_config(GRPO, [f"model.path={model}", "model.build_tiny=true",
                             f"data.train_path={tmp_path / 'train.jsonl'}", f"data.heldout_path={tmp_path / 'held.jsonl'}"])
    info = {k: v for k, v in startup._tiny_settings(cfg).items() if "." not in k}
    info["warmstart"] = {k.split(".", 1)[1]: v for k, v in startup._tiny_settings(cfg).items() if k.startswith("warmstart.")}
    info["task"] = {"name": "arithmetic", "digits": [1, 2], "ops": ["plus"]}
    (model / MARKER).write_text(json.dumps(info))
    startup.ensure_builtin_model(cfg)  # the same settings: reused, nothing built
    info["warmstart"]["target_accuracy"] = None  # a build that ran a fixed step count
    (model / MARKER).write_text(json.dumps(info))
    with pytest.raises(MegarlError, match=r"model\.tiny\.warmstart_target_accuracy: the cached build has None, the config 0\.3"):
        startup.ensure_builtin_model(cfg)
    info["warmstart"]["target_accuracy"] = 0.3
    (model / MARKER).write_text(json.dumps(info))
    mix = load_config(GRPO, [f"model.path={model}", "model.build_tiny=true", "data.task.args.validation=train-mix",
                             f"data.train_path={tmp_path / 'train.jsonl'}", f"data.heldout_path={tmp_path / 'held.jsonl'}"])
    with pytest.raises(MegarlError, match=r"data\.task\.args\.validation: the cached build has None, "
                                          r"the config 'train-mix'"):
        startup.ensure_builtin_model(mix)  # a build stopped on held-out problems is not a train-mix build
    del info["warmstart"]["max_steps"]  # a build of an older megarl
    (model / MARKER).write_text(json.dumps(info))
    with pytest.raises(MegarlError, match=r"model\.tiny\.warmstart_steps: the cached build has None"):
        startup.ensure_builtin_model(cfg)

    startup.ensure_builtin_task(cfg)  # writes both files
    startup.ensure_builtin_task(cfg)  # and takes them again as they are
    held = [json.loads(line) for line in open(tmp_path / "held.jsonl")]
    assert len({r["prompt"] for r in held}) == len(held) == 200  # the evaluation set: distinct problems
    other = load_config(GRPO, [f"data.train_path={tmp_path / 'train.jsonl'}", f"data.heldout_path={tmp_path / 'held.jsonl'}",
                               "data.task.args.max_digits=3"])
    with pytest.raises(MegarlError, match=r"data\.task: .*train\.jsonl holds another train split"):
        startup.ensure_builtin_task(other)


#: a child that runs ``python -m megarl.tinymodel ARGS`` with the validation accuracies scripted
#: (argv[1], one per check) and every optimizer step's learning rate and demonstration count
#: recorded: the build's control flow with real steps, its measure replaced
_SCRIPTED_BUILD = """
import json, sys
import megarl.models.optim as optim
import megarl.builtin.warmstart as tm
import megarl.tinymodel as cli
script = iter(json.loads(sys.argv[1]))
tm.teacher_forced_accuracy = lambda model, tokens, mask, vocab_size: next(script)
seen, real = [], optim.train_step
def spy(ddp, opt, micro_batches, loss_fn):
    mask = micro_batches[0]["mask"]
    seen.append([opt.param_groups[0]["lr"], int((mask.sum(-1) > 1).sum())])  # a direct answer weighs 1 token
    return real(ddp, opt, micro_batches, loss_fn)
optim.train_step = spy
try:
    cli.main(sys.argv[2:])
finally:
    print("SEEN " + json.dumps(seen), flush=True)
"""


def test_calculator_build_stops_its_onset_phase_on_validation_then_runs_the_tail(tmp_path):
    """With a target the calculator build's onset phase (demonstrations only, the full rate) ends
    at the first check that reaches it; then exactly steps - tool_only_steps steps follow, the
    rate decaying (cosine, to lr / 10), their last tool_mixture_steps the mixture; tiny_model.json
    records where the phase ended.  Negative control: a phase that never reaches the target
    fails naming data.task.args.only_steps, and leaves no model."""
    import json
    import math
    import subprocess
    import sys

    from tests._dist import subprocess_env

    def build(out, accuracies, extra):
        cmd = [sys.executable, "-c", _SCRIPTED_BUILD, json.dumps(accuracies), "--out", str(out), "--batch", "8",
               "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1",
               "--intermediate-size", "64", "--task", "calculator", "--task-arg", "demos=0.5", "--task-arg",
               "min_digits=4", "--task-arg", "max_digits=5", "--lr", "1e-3", "--target-accuracy", "0.9",
               "--check-every", "4", "--validation-n", "16", "--task-arg", "mixture_steps=4", *extra]
        p = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
        seen = [json.loads(line[5:]) for line in p.stdout.splitlines() if line.startswith("SEEN ")]
        return p, seen[0] if seen else None

    p, seen = build(tmp_path / "calc", [0.0, 0.5, 0.95, 0.0], ["--steps", "24", "--task-arg", "only_steps=16"])
    assert p.returncode == 0, p.stderr[-2000:]
    # 12 steps of demonstrations only (the third check reached 0.9), then a tail of 24 - 16 = 8:
    # 4 more demonstrations and 4 of the mixture (half of each batch), the rate decaying over it
    assert [demos for _, demos in seen] == [8] * 16 + [4] * 4
    tail = [1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert [lr for lr, _ in seen] == pytest.approx([1e-3] * 12 + tail, rel=1e-12)
    info = json.loads((tmp_path / "calc" / "tiny_model.json").read_text())
    assert (info["warmstart"]["steps"], info["warmstart"]["tool_onset_steps"]) == (20, 12)
    assert info["warmstart"]["validation_accuracy"] == 0.95
    assert info["tool"] == {"demos": 0.5, "digits": [4, 5], "role": "user", "only_steps": 16, "mixture_steps": 4}
    assert "tool-use validation accuracy 0.950 >= target 0.9 at step 12" in p.stdout

    p, seen = build(tmp_path / "never", [0.1, 0.2], ["--steps", "12", "--task-arg", "only_steps=8"])
    assert p.returncode != 0 and len(seen) == 8 and not (tmp_path / "never").exists()
    assert ("within only_steps 8 (data.task.args.only_steps), its onset phase; its best tool-use "
            "validation accuracy was 0.200 at step 8") in p.stderr, p.stderr[-2000:]


def test_arithmetic_validation_set_has_the_evaluation_mix_and_is_never_trained_on():
    """The arithmetic build stops on train-split problems with exactly the evaluation set's mix
    of kinds (op, operand digit counts), which its own draws exclude.  Negative control: the
    held-out validation it replaces holds almost none of the one-by-two-digit sums that are about
    half of the evaluation set."""
    from collections import Counter

    from megarl.builtin.tasks.arithmetic import train_mix_validation_problems, validation_problems
    from megarl.builtin.warmstart import EVALUATION_SEED
    from megarl.data.tasks.arithmetic import make_problems, problem_key, problem_split, problem_stratum

    evaluation = make_problems("heldout", EVALUATION_SEED, 200, digits=(1, 2), distinct=True)
    val = train_mix_validation_problems(256, 200, (1, 2), ("plus",))
    keys = [problem_key(r) for r in val]
    assert len(set(keys)) == 256
    assert all(problem_split(*(lambda a, op, b: (int(a), op, int(b)))(*k.split())) == "train" for k in keys)
    ev_mix, val_mix = Counter(map(problem_stratum, evaluation)), Counter(map(problem_stratum, val))
    assert set(val_mix) == set(ev_mix)
    for kind, c in ev_mix.items():  # largest remainders: each kind within one problem of its share
        assert abs(val_mix[kind] - 256 * c / 200) < 1, (kind, val_mix[kind], c)
    one_by_two = ev_mix[("plus", 1, 2)] / 200
    assert one_by_two > 0.4 and abs(val_mix[("plus", 1, 2)] / 256 - one_by_two) < 0.01
    old = Counter(map(problem_stratum, validation_problems(256, 200, (1, 2), ("plus",))))
    assert old[("plus", 1, 2)] / 256 < 0.1  # what the held-out validation measured instead
    # the build's training draws never hold a validation problem, and otherwise repeat problems
    draws = make_problems("train", 0, 20_000, digits=(1, 2), distinct=False, exclude=val)
    assert not set(keys) & {problem_key(r) for r in draws}
    assert len({problem_key(r) for r in draws}) < 20_000
    unexcluded = make_problems("train", 0, 20_000, digits=(1, 2))
    assert set(keys) & {problem_key(r) for r in unexcluded}  # without the exclusion they would be trained on
