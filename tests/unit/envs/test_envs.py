"""Environments (megarl/envs): the protocol and its loader, the concurrent pool with timeouts and
error statuses, the built-in calculator and two_turn environments, and the rollout.agent config."""

import copy
import os
import time

import pytest

from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config
from megarl.envs.calculator import NOT_A_NUMBER, CalculatorEnv, demonstration, evaluate, find_calls, make_rows
from megarl.envs.protocol import EnvConfigError, EnvStatus, Message, StepOutcome, check_outcome, load_environment
from megarl.envs.runner import EnvironmentPool, EnvPoolError
from megarl.envs.two_turn import TwoTurnEnv, digit_feedback
from tests.plugins import faulty_envs

from tests._dist import ROOT
GRPO = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
FAULTY = "tests.plugins.faulty_envs:FaultyEnv"


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(autouse=True, scope="module")
def _release_hung_threads():
    faulty_envs.RELEASE.clear()
    yield
    faulty_envs.RELEASE.set()


# ---- calculator --------------------------------------------------------------------------------


def test_calculator_syntax_is_tiny_vocabulary_and_survives_decoding(tiny_tok):
    """The call and the tool's answers encode without <unk>; the policy's decoded text (one
    token per digit, spaces between) is parsed back to the same expression."""
    unk = tiny_tok.unk_token_id
    for text in ("[ 12345 + 678 ]", "[ ( 12 - 3 ) * 4 ] [ 5 + 6 ]", NOT_A_NUMBER, "13023", "-5"):
        assert unk not in tiny_tok.encode(text, add_special_tokens=False), text
    ids = tiny_tok.encode("[ 12345 + 678 ]", add_special_tokens=False) + [tiny_tok.convert_tokens_to_ids("<|end|>")]
    decoded = tiny_tok.decode(ids)
    assert decoded == "[ 1 2 3 4 5 + 6 7 8 ] <|end|>"
    assert find_calls(decoded) == [" 1 2 3 4 5 + 6 7 8 "] and evaluate(find_calls(decoded)[0]) == 13023


@pytest.mark.parametrize("expr,value", [
    ("1 2 + 3 * ( 4 - 1 )", 21), ("-5 + 2", -3), ("99999 * 99999", 9999800001), ("( ( 7 ) )", 7),
    ("12 +", None), ("2 ** 3", None), ("1e5", None), ("", None), ("( 1 + 2", None), ("1 2 3 4 5 6 7 8 9 0 1 2 3", None),
    (" + ".join(["1"] * 17), None),  # 33 tokens: over the limit
])
def test_evaluate(expr, value):
    assert evaluate(expr) == value


def test_calculator_episode_tool_calls_then_answer():
    env = CalculatorEnv()
    assert env.reset({"prompt": "what is 12345 plus 678 ?", "answer": "13023"}) == ()
    out = env.step("[ 1 2 3 4 5 + 6 7 8 ] <|end|>")
    assert out == StepOutcome((Message("tool", "13023"),), {}, False, False, {"tool_calls": 1.0, "tool_errors": 0.0})
    out = env.step("[ 1 + 1 ] [ 2 * ]")  # parallel calls, one malformed
    assert out.observation == (Message("tool", "2"), Message("tool", NOT_A_NUMBER))
    assert out.info == {"tool_calls": 2.0, "tool_errors": 1.0} and not out.done
    out = env.step("1 3 0 2 3 <|end|>")
    assert out == StepOutcome((), {"correct": 1.0}, True, False)

    env.reset({"answer": "13023"})
    assert env.step("1 3 0 2 4 <eos>").reward_components == {"correct": 0.0}
    env.reset({"answer": "13023"})
    assert env.step("the answer is 13023").reward_components == {"correct": 0.0}  # the task's exact rule
    with pytest.raises(ValueError, match="integer 'answer'"):
        env.reset({"answer": "thirteen"})


def test_calculator_call_budget():
    env = CalculatorEnv(tool_role="user", max_calls=2)
    env.reset({"answer": "3"})
    out = env.step("[ 1 + 2 ] [ 1 + 2 ] [ 1 + 2 ]")
    assert [m.content for m in out.observation] == ["3", "3", NOT_A_NUMBER]
    assert {m.role for m in out.observation} == {"user"}


def test_calculator_call_reward_on_the_tool_turn():
    """call_reward: a tool turn whose every call evaluates earns it (component tool_call); a turn
    with a bad call earns nothing; the answer turn is scored as without it."""
    env = CalculatorEnv(tool_role="user", call_reward=0.25)
    env.reset({"answer": "3"})
    assert env.step("[ 1 + 2 ]").reward_components == {"tool_call": 0.25}
    assert env.step("[ 1 + ]").reward_components == {}
    assert env.step("3").reward_components == {"correct": 1.0}
    env = CalculatorEnv(tool_role="user")  # the default: tool steps have no reward components
    env.reset({"answer": "3"})
    assert env.step("[ 1 + 2 ]").reward_components == {}


def test_demonstration_messages():
    row = make_rows("train", 0, 1)[0]
    a, b = (int(x) for x in row["prompt"].split()[2::2])  # "what is A plus B ?"
    assert 1000 <= min(a, b) and max(a, b) < 10**6 and int(row["answer"]) == a + b
    demo = demonstration(row)
    assert demo == (Message("user", row["prompt"]), Message("assistant", f"[ {a} + {b} ]"),
                    Message("tool", row["answer"]), Message("assistant", row["answer"]))
    # the demonstration is a winning episode of the environment itself
    env = CalculatorEnv()
    env.reset(row)
    assert env.step(demo[1].content).observation == (demo[2],)
    assert env.step(demo[3].content).reward_components == {"correct": 1.0}
    assert demonstration(row, use_tool=False) == (demo[0], demo[3])
    with pytest.raises(ValueError, match="row's answer"):
        demonstration({"prompt": "what is 2 times 3 ?", "answer": "5"})


# ---- two_turn ----------------------------------------------------------------------------------


@pytest.mark.parametrize("guess,feedback,frac", [
    ("351", "3 5 _", 2 / 3), ("357", "3 5 7", 1.0), ("35", "_ _ _", 0.0), (None, "_ _ _", 0.0), ("753", "_ 5 _", 1 / 3),
])
def test_digit_feedback(guess, feedback, frac):
    assert digit_feedback(guess, "357") == (feedback, pytest.approx(frac))


def test_two_turn_reward_depends_on_both_turns():
    env = TwoTurnEnv(guess_weight=0.5)
    env.reset({"answer": "357"})
    out = env.step("3 5 1 <|end|>")
    assert out.observation == (Message("user", "3 5 _"),) and out.reward_components == {"guess": pytest.approx(1 / 3)}
    assert not out.done
    assert env.step("3 5 7 <|end|>") == StepOutcome((), {"correct": 1.0}, True, False)
    with pytest.raises(RuntimeError, match="ended"):
        env.step("1")
    env.reset({"answer": "357"})
    assert env.step("hello").reward_components == {"guess": 0.0}
    assert env.step("3 5 8").reward_components == {"correct": 0.0}


# ---- loading -----------------------------------------------------------------------------------


def test_load_environment_builtin_and_dotted_and_errors_name_the_key():
    make = load_environment("calculator", max_calls=3)
    env = make()
    assert isinstance(env, CalculatorEnv) and env.max_calls == 3 and make() is not env
    assert isinstance(load_environment(FAULTY, tag="x")(), faulty_envs.FaultyEnv)
    for spec, kwargs, key, what in [
        ("calculater", {}, "rollout.agent.env:", "neither a built-in environment"),
        ("no_such_module_xyz:Env", {}, "rollout.agent.env:", "cannot import module"),
        ("tests.plugins.faulty_envs:Missing", {}, "rollout.agent.env:", "has no attribute"),
        ("tests.plugins.faulty_envs:RELEASE", {}, "rollout.agent.env:", "not a class or factory"),
        ("calculator", {"max_call": 3}, "rollout.agent.env_args:", "does not accept ['max_call']"),
        ("calculator", {"max_calls": 0}, "rollout.agent.env_args:", "max_calls must be an int >= 1"),
        ("calculator", {"call_reward": float("inf")}, "rollout.agent.env_args:", "call_reward must be a finite number"),
        ("two_turn", {"guess_weight": float("nan")}, "rollout.agent.env_args:", "guess_weight"),
    ]:
        with pytest.raises(EnvConfigError) as e:
            load_environment(spec, **kwargs)
        assert str(e.value).startswith(key) and what in str(e.value), str(e.value)


def test_check_outcome_accepts_tuples_and_mapping_messages():
    out = check_outcome(([{"role": "tool", "content": "7"}], {"r": 1}, False, True))
    assert out == StepOutcome((Message("tool", "7"),), {"r": 1.0}, False, True)
    for bad, what in [(StepOutcome((), {"r": float("inf")}, True, False), "finite"),
                      (StepOutcome("text", {}, True, False), "tuple of Message"),
                      (StepOutcome((), {}, 1, False), "terminated must be a bool"),
                      (StepOutcome((), {}, True, False, {"n": "x"}), "info"), (None, "expected a StepOutcome")]:
        with pytest.raises(ValueError, match=what):
            check_outcome(bad)


# ---- the pool ----------------------------------------------------------------------------------


def test_pool_runs_calculators_concurrently_in_order():
    rows = [{"answer": str(100 + i)} for i in range(5)]
    with EnvironmentPool(load_environment("calculator"), step_timeout_s=5.0, max_workers=3) as pool:
        res = pool.reset(rows)
        assert [r.status for r in res] == [EnvStatus.OK] * 5 and all(r.outcome.observation == () for r in res)
        res = pool.step([4, 0, 2], ["[ 100 + 4 ]", "1 0 0", "1 0 3"])
        assert [r.status for r in res] == [EnvStatus.OK] * 3
        assert res[0].outcome.observation == (Message("tool", "104"),)
        assert res[1].outcome.reward_components == {"correct": 1.0} and res[1].outcome.terminated
        assert res[2].outcome.reward_components == {"correct": 0.0}
        with pytest.raises(EnvPoolError, match="environment 0 refuses further steps: its episode ended"):
            pool.step([0], ["1"])
        with pytest.raises(EnvPoolError, match="index twice"):
            pool.step([1, 1], ["1", "2"])
        with pytest.raises(EnvPoolError, match="out of range"):
            pool.step([5], ["1"])
        assert pool.refused(4) is None and pool.step([4], ["1 0 4"])[0].outcome.reward_components == {"correct": 1.0}
        m = pool.metrics()
        assert m["env/calculator/calls"] == 9 and m["env/calculator/errors"] == 0
        assert m["env/calculator/tool_calls"] == 1.0 and m["env/calculator/tool_errors"] == 0.0  # from info
        assert m["env/calculator/latency_p99_s"] >= m["env/calculator/latency_p50_s"] >= 0
        assert pool.metrics()["env/calculator/calls"] == 0  # a window
    with pytest.raises(EnvPoolError, match="closed"):
        pool.step([1], ["1"])


def test_failing_environments_are_statuses_never_rewards():
    """An environment that raises, hangs or returns garbage gives error / timeout / invalid with
    its reason and no outcome; a hung one is abandoned and refuses further steps; the others go
    on, even on a single worker (the hung worker is replaced)."""
    modes = ["ok", "raise", "hang", "nan", "wrong_type", "bad_message", "bool_flag", "reset_raise", "reset_hang"]
    pool = EnvironmentPool(load_environment(FAULTY), step_timeout_s=0.3, max_workers=1)
    res = pool.reset([{"mode": m} for m in modes])
    assert [r.status for r in res] == [EnvStatus.OK] * 7 + [EnvStatus.ERROR, EnvStatus.TIMEOUT]
    assert res[0].outcome.observation == (Message("system", "faulty ready"),)
    assert res[7].error == "ConnectionError: sandbox refused the connection (injected)"
    assert "step_timeout_s=0.3" in res[8].error and res[8].latency_s >= 0.3
    res = pool.step(range(7), ["a"] * 7)
    got = {m: (r.status, r.outcome, r.error) for m, r in zip(modes, res)}
    assert got["ok"][0] is EnvStatus.OK and got["ok"][1].observation == (Message("tool", "A"),)
    assert got["raise"] == (EnvStatus.ERROR, None, "RuntimeError: environment crashed (injected)")
    assert got["hang"][:2] == (EnvStatus.TIMEOUT, None) and "abandoned" in got["hang"][2]
    assert got["nan"][:2] == (EnvStatus.INVALID, None) and "reward_components['correct'] = nan" in got["nan"][2]
    assert got["wrong_type"][:2] == (EnvStatus.INVALID, None) and "returned dict" in got["wrong_type"][2]
    assert got["bad_message"][:2] == (EnvStatus.INVALID, None) and "observation[0]" in got["bad_message"][2]
    assert got["bool_flag"][:2] == (EnvStatus.INVALID, None) and "terminated must be a bool" in got["bool_flag"][2]
    for i, why in [(2, "timeout"), (1, "error"), (3, "invalid"), (7, "error"), (8, "timeout")]:
        with pytest.raises(EnvPoolError, match=f"environment {i} refuses further steps: an earlier call gave {why}"):
            pool.step([i], ["b"])
    # the healthy one still steps, on the replaced worker, to its end
    assert pool.step([0], ["b"])[0].outcome.reward_components == {"steps": 2.0}
    m = pool.metrics()
    assert pool.name == "FaultyEnv" and m["env/FaultyEnv/calls"] == 9 + 7 + 1
    assert {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.rsplit("/", 1)[1] in ("errors", "timeouts", "invalid")} \
        == {"errors": 2.0, "timeouts": 2.0, "invalid": 4.0}
    pool.close()


def test_pool_steps_run_concurrently():
    """Each of the 4 steps waits at one barrier until all 4 are inside their step: they pass
    only if the pool runs them at the same time (one after another, the first would wait alone
    and break the barrier, an error status).  No wall-clock bound: the barrier's wait (20 s,
    under the 30 s step timeout) only bounds a failure."""
    rows = [{"mode": "barrier", "barrier": "concurrent4", "parties": 4, "wait_s": 20.0}] * 4
    with EnvironmentPool(load_environment(FAULTY), step_timeout_s=30.0, max_workers=4) as pool:
        pool.reset(rows)
        res = pool.step(range(4), ["x"] * 4)
    assert all(r.status is EnvStatus.OK for r in res), [(r.status, r.error) for r in res]
    # negative control: the same steps on a pool of one worker run one after another
    rows = [{"mode": "barrier", "barrier": "serial2", "parties": 2, "wait_s": 1.0}] * 2
    with EnvironmentPool(load_environment(FAULTY), step_timeout_s=30.0, max_workers=1) as pool:
        pool.reset(rows)
        res = pool.step(range(2), ["x"] * 2)
    assert all(r.status is EnvStatus.ERROR and "BrokenBarrierError" in r.error for r in res), \
        [(r.status, r.error) for r in res]


def test_reset_closes_the_previous_instances_and_a_hanging_close_blocks_nothing():
    faulty_envs.CLOSED.clear()
    pool = EnvironmentPool(load_environment(FAULTY, tag="old"), step_timeout_s=2.0, max_workers=1)
    pool.reset([{"mode": "close_hang"}, {"mode": "ok"}])
    pool.factory = load_environment(FAULTY, tag="new")
    t0 = time.monotonic()
    res = pool.reset([{"mode": "ok"}])  # on the only worker, while the first old close() hangs
    # the hanging close lasts until RELEASE (30 s at most): a reset that waited for it would
    # take that long; 15 s is half of it, a wide margin for a busy machine
    assert res[0].outcome.observation == (Message("system", "new ready"),) and time.monotonic() - t0 < 15.0
    pool.close()
    deadline = time.monotonic() + 15.0
    while faulty_envs.CLOSED != ["new"] and time.monotonic() < deadline:
        time.sleep(0.01)
    # the old "ok" instance is closed after the hanging one (same close thread): still waiting
    assert faulty_envs.CLOSED == ["new"]


# ---- config --------------------------------------------------------------------------------------


def test_agent_config_defaults_and_validation():
    cfg = load_config(GRPO, [])
    ag = cfg.rollout.agent
    assert (ag.env, ag.env_args, ag.max_turns, ag.max_total_tokens, ag.step_timeout_s, ag.max_workers) == \
        ("", {}, 4, 1024, 10.0, 8)
    check_run(copy.deepcopy(cfg), 1)
    ok = load_config(GRPO, ["rollout.agent.env=calculator", "rollout.agent.env_args.max_calls=2", "reward.fn=null"])
    assert ok.rollout.agent.env_args == {"max_calls": 2}
    check_run(ok, 1)
    check_run(load_config(GRPO, [f"rollout.agent.env={FAULTY}", "reward.fn=null"]), 1)
    for overrides, key, what in [
        (["rollout.agent.env=calculater"], "rollout.agent.env:", "neither a built-in"),
        (["rollout.agent.env=calculator", "rollout.agent.env_args.digits=3"], "rollout.agent.env_args:",
         "does not accept ['digits']"),
        (["rollout.agent.env_args.max_calls=2"], "rollout.agent.env_args:", "rollout.agent.env is empty"),
        (["rollout.agent.env=two_turn", "data.apply_chat_template=false"], "data.apply_chat_template:", "two_turn"),
        (["rollout.agent.env=two_turn"], "reward.fn:", "scores each episode by the environment"),
        (["rollout.agent.max_turns=0"], "rollout.agent.max_turns:", "must be >= 1"),
        (["rollout.agent.step_timeout_s=0"], "rollout.agent.step_timeout_s:", "must be > 0"),
        (["rollout.agent.max_workers=0"], "rollout.agent.max_workers:", "must be >= 1"),
        (["rollout.agent.max_total_tokens=0"], "rollout.agent.max_total_tokens:", "must be >= 1"),
    ]:
        with pytest.raises(ConfigError) as e:
            check_run(load_config(GRPO, overrides), 1)
        assert str(e.value).startswith(key) and what in str(e.value), (overrides, str(e.value))
