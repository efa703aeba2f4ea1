"""megarl.rewards: rule rewards, composite, plug-ins and the runner's failure contract.

The contract under test: a failed reward is a status with ``total=None`` (never 0), retried
only when retrying can help (error / timeout), and becomes a number only in apply_penalties.
"""

import math
import sys
import threading
import time

import pytest

from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards import (
    BUILTIN_REWARDS,
    ExactNumericMatch,
    RegexFormat,
    RewardConfigError,
    RewardRunner,
    RewardSample,
    UserFunction,
    WeightedComposite,
    apply_penalties,
    build_reward_function,
    load_user_function,
)
from megarl.rewards.rules import extract_last_number


def sample(response: str, sid: str = "s0", **ground_truth) -> RewardSample:
    return RewardSample(
        sample_id=sid,
        prompt_id="p0",
        group_id="g0",
        prompt_text="what is 1 plus 2 ?",
        response_text=response,
        prompt_ids=(1, 2, 3),
        response_ids=(4, 5),
        finish_reason="eos",
        ground_truth=ground_truth,
    )


def assert_failed(rec: RewardRecord, status: RewardStatus) -> None:
    assert rec.status is status, rec
    assert rec.total is None and rec.total != 0, "a failure must never be a number"
    assert rec.error


def assert_no_failure_is_zero(records) -> None:
    for r in records:
        if r.status is not RewardStatus.OK:
            assert r.total is None


def assert_ok(rec: RewardRecord, total: float) -> None:
    assert rec.status is RewardStatus.OK and rec.error is None, rec
    assert rec.total == total


# --- numbers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, want",
    [
        ("1 2 3", 123),
        ("the answer is 1 2 3 <eos>", 123),
        ("-4", -4),
        ("= - 4", -4),
        ("10 - 3", 3),  # binary minus is not a sign
        ("1,234", 1234),
        ("1 , 2 3 4", 1234),  # tiny-tokenizer decoding of 1,234
        ("-1,234.5", -1234.5),
        ("1 2 . 5", 12.5),
        ("1, 2, 3", 3),  # a list, not thousands groups
        ("1,000, 2,000", 2000),
        ("so it is 5.", 5),
        ("first 7 then 8", 8),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_last_number_golden(text, want):
    got = extract_last_number(text)
    assert (got is None and want is None) or got == want


@pytest.mark.parametrize(
    "response, answer, want",
    [
        ("1 2 3", "123", 1.0),
        ("1 2 3", 123, 1.0),
        ("-4", "-4", 1.0),
        ("the total is 1,234", "1234", 1.0),
        ("1234", "1,234", 1.0),
        ("0.1", 0.1, 1.0),
        ("0.5", "1/2", None),  # not a number: invalid ground truth
        ("124", "123", 0.0),
        ("no number", "123", 0.0),  # no answer is wrong, not invalid
    ],
)
def test_exact_numeric(response, answer, want):
    rec = ExactNumericMatch()(sample(response, answer=answer))
    if want is None:
        assert_failed(rec, RewardStatus.INVALID)
        assert "'answer'" in rec.error
    else:
        assert_ok(rec, want)
        assert dict(rec.components) == {"exact_numeric": want}
        assert rec.scorer_version.startswith("exact_numeric/")


def test_exact_numeric_missing_answer_and_tolerance():
    rec = ExactNumericMatch()(sample("42", solution="42"))
    assert_failed(rec, RewardStatus.INVALID)
    assert "'answer'" in rec.error and "solution" in rec.error
    assert_ok(ExactNumericMatch(answer_key="solution")(sample("42", solution="42")), 1.0)
    assert_ok(ExactNumericMatch(tolerance=0.01)(sample("3.14", answer="3.1416")), 1.0)
    assert_ok(ExactNumericMatch(tolerance=0.001)(sample("3.14", answer="3.1416")), 0.0)
    with pytest.raises(RewardConfigError, match="tolerance"):
        ExactNumericMatch(tolerance=-1)
    assert ExactNumericMatch(tolerance=0.01).version != ExactNumericMatch().version


# --- math_verify -------------------------------------------------------------------------------


def test_math_verify_equivalence_wrong_and_invalid():
    mv = build_reward_function("math_verify", {}, [])
    assert_ok(mv(sample("so \\boxed{\\frac{1}{2}}", answer="0.5")), 1.0)
    assert_ok(mv(sample("so \\boxed{\\frac{1}{3}}", answer="0.5")), 0.0)
    assert_ok(mv(sample("I do not know", answer="0.5")), 0.0)
    assert_ok(mv(sample("$x^2$", answer="x^{2}")), 1.0)  # bare LaTeX ground truth parses via $...$
    # a bare LaTeX tuple is the whole tuple, not its first number (bare, math-verify reads just 3)
    tup = r"\left( 3, \frac{\pi}{2} \right)"
    assert_ok(mv(sample(r"so \boxed{\left( 3, \frac{\pi}{2} \right)}", answer=tup)), 1.0)
    assert_ok(mv(sample(r"so \boxed{3}", answer=tup)), 0.0)
    assert dict(mv(sample("0.5", answer="1/2")).components) == {"math_verify": 1.0}
    assert_failed(mv(sample("0.5", answer="")), RewardStatus.INVALID)
    assert_failed(mv(sample("0.5")), RewardStatus.INVALID)
    assert "math-verify==" in mv.version


def test_math_verify_runs_off_the_main_thread():
    """Its signal.alarm timeouts are disabled, so a worker thread can call it."""
    with RewardRunner(build_reward_function("math_verify", {}, []), timeout_s=20, max_workers=2) as runner:
        recs = runner.score([sample("\\boxed{\\frac{1}{2}}", "a", answer="0.5"), sample("\\boxed{2}", "b", answer="0.5")])
    assert [r.total for r in recs] == [1.0, 0.0], recs


# --- regex / arithmetic ------------------------------------------------------------------------


def test_regex_format():
    boxed = RegexFormat(r"\\boxed\{[^}]+\}")
    assert_ok(boxed(sample("answer \\boxed{3}")), 1.0)
    assert_ok(boxed(sample("answer 3")), 0.0)
    full = RegexFormat(r"[0-9 ]+", full_match=True)
    assert_ok(full(sample("1 2 3")), 1.0)
    assert_ok(full(sample("1 2 3 apples")), 0.0)
    assert_ok(RegexFormat("ANSWER", flags="i")(sample("the answer")), 1.0)
    assert dict(full(sample("1")).components) == {"regex": 1.0}
    with pytest.raises(RewardConfigError, match=r"'\(unclosed'"):
        RegexFormat("(unclosed")
    with pytest.raises(RewardConfigError, match="flag"):
        RegexFormat("a", flags="q")


def test_arithmetic_delegates_to_the_task_rule():
    ar = build_reward_function("arithmetic", {}, [])
    assert_ok(ar(sample("3 5 7 <eos>", answer="357")), 1.0)
    assert_ok(ar(sample("357 apples", answer="357")), 0.0)
    assert_failed(ar(sample("357", answer="3.5")), RewardStatus.INVALID)
    assert_failed(ar(sample("357")), RewardStatus.INVALID)


def test_running_sum_delegates_to_the_task_rule():
    rs = build_reward_function("running_sum", {}, [])
    assert rs.required_fields == ("answer",)
    assert_ok(rs(sample("a 3 + 0 = 3 , b 5 + 3 = 8 so 8 <eos>", answer="8")), 1.0)
    assert_ok(rs(sample("a 3 + 0 = 3 , b 5 + 3 = 9 so 9", answer="8")), 0.0)
    assert_ok(rs(sample("8", answer=8)), 0.0)  # no "so": not an answer
    assert_failed(rs(sample("so 8", answer="-8")), RewardStatus.INVALID)
    assert_failed(rs(sample("so 8")), RewardStatus.INVALID)
    assert rs.extract_answer("a 3 + 0 = 3 so 0 3 <eos>") == "3" and rs.extract_answer("3") is None


# --- composite ---------------------------------------------------------------------------------


def test_composite_total_and_components():
    comp = WeightedComposite([("correct", 1.0, ExactNumericMatch()), ("format", 0.25, RegexFormat(r"^[0-9 ]+$"))])
    rec = comp(sample("1 2 3", answer="123"))
    assert_ok(rec, 1.25)
    assert dict(rec.components) == {"correct": 1.0, "format": 1.0}
    # a part with several components is prefixed: "<part>/<component>"
    nested = WeightedComposite([("all", 2.0, comp), ("num", -1.0, ExactNumericMatch())])
    rec = nested(sample("1 2 3", answer="123"))
    assert_ok(rec, 2.0 * 1.25 - 1.0)
    assert dict(rec.components) == {"all/correct": 1.0, "all/format": 1.0, "num": 1.0}
    assert ExactNumericMatch().version in comp.version and RegexFormat(r"^[0-9 ]+$").version in comp.version


def test_composite_failure_propagates_and_names_the_part():
    comp = WeightedComposite([("format", 0.1, RegexFormat("x")), ("correct", 1.0, ExactNumericMatch())])
    rec = comp(sample("1 2 3"))  # no ground truth: the 'correct' part is invalid
    assert_failed(rec, RewardStatus.INVALID)
    assert "'correct'" in rec.error

    def boom(s):
        raise KeyError("oops")

    rec = WeightedComposite([("ok", 1.0, RegexFormat("1")), ("bad", 1.0, UserFunction(boom, "boom"))])(sample("1"))
    assert_failed(rec, RewardStatus.ERROR)
    assert "'bad'" in rec.error and "KeyError" in rec.error
    with pytest.raises(RewardConfigError, match="twice"):
        WeightedComposite([("a", 1.0, RegexFormat("1")), ("a", 1.0, RegexFormat("2"))])
    with pytest.raises(RewardConfigError, match="weight"):
        WeightedComposite([("a", float("nan"), RegexFormat("1"))])


# --- build_reward_function / plug-ins --------------------------------------------------------


def user_half(s):
    """A plug-in returning a bare float."""
    return 0.5


def user_scaled(s, scale=1.0):
    return {"total": scale * len(s.response_text), "components": {"len": float(len(s.response_text))}}


class UserScorer:
    name = "user_scorer"
    version = "user_scorer/7"

    def __init__(self, bonus=0.0):
        self.bonus = bonus

    def __call__(self, s):
        return 1.0 + self.bonus


def test_build_builtins_and_composite_from_config():
    assert set(BUILTIN_REWARDS) >= {"exact_numeric", "math_verify", "regex", "arithmetic", "running_sum", "http",
                                    "code_exec", "composite"}
    fn = build_reward_function(
        "composite",
        {},
        [
            {"name": "correct", "fn": "exact_numeric", "weight": 1.0, "kwargs": {"tolerance": 0.0}},
            {"name": "format", "fn": "regex", "weight": 0.5, "kwargs": {"pattern": "^[0-9 ]+$"}},
        ],
    )
    rec = fn(sample("4 2", answer=42))
    assert_ok(rec, 1.5)
    assert dict(rec.components) == {"correct": 1.0, "format": 1.0}


def test_build_errors_name_the_key():
    with pytest.raises(RewardConfigError, match=r"reward\.fn: unknown reward 'foo'; builtins: .*pkg\.mod:callable"):
        build_reward_function("foo", {}, [])
    with pytest.raises(RewardConfigError, match=r"reward\.kwargs: .*toleranse"):
        build_reward_function("exact_numeric", {"toleranse": 0.1}, [])
    comps = [{"name": "a", "fn": "exact_numeric"}, {"name": "b", "fn": "regex", "kwargs": {"patern": "x"}}]
    with pytest.raises(RewardConfigError, match=r"reward\.components\[1\]\.kwargs: .*patern"):
        build_reward_function("composite", {}, comps)
    with pytest.raises(RewardConfigError, match=r"reward\.components\[0\]: unknown key.*wieght"):
        build_reward_function("composite", {}, [{"name": "a", "fn": "regex", "wieght": 1, "kwargs": {"pattern": "x"}}])
    with pytest.raises(RewardConfigError, match=r"reward\.components\[0\]\.kwargs: regex pattern '\['"):
        build_reward_function("composite", {}, [{"name": "a", "fn": "regex", "kwargs": {"pattern": "["}}])
    with pytest.raises(RewardConfigError, match=r"reward\.components is only used"):
        build_reward_function("regex", {"pattern": "x"}, comps)
    with pytest.raises(RewardConfigError, match=r"reward\.components must list"):
        build_reward_function("composite", {}, [])


def test_plugin_loaded_from_this_module_by_dotted_path():
    fn = build_reward_function(f"{__name__}:user_half", {}, [])
    assert_ok(fn(sample("x")), 0.5)
    assert dict(fn(sample("x")).components) == {"user_half": 0.5}
    fn = build_reward_function(f"{__name__}:user_scaled", {"scale": 2.0}, [])
    rec = fn(sample("abc"))
    assert_ok(rec, 6.0)
    assert dict(rec.components) == {"len": 3.0}
    with pytest.raises(RewardConfigError, match=r"reward\.kwargs: .*user_scaled.*bogus"):
        build_reward_function(f"{__name__}:user_scaled", {"bogus": 1}, [])
    cls = build_reward_function(f"{__name__}:UserScorer", {"bonus": 0.5}, [])
    rec = cls(sample("x"))
    assert_ok(rec, 1.5)
    assert rec.scorer_version == "user_scorer/7" and dict(rec.components) == {"user_scorer": 1.5}


def test_plugin_loaded_from_a_module_on_sys_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "from megarl.experience.schema import RewardRecord\n"
        "def score(s):\n"
        "    return RewardRecord(total=2.0, components={'x': 2.0}, scorer_version='mine/1')\n"
        "VALUE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rec = build_reward_function("my_rewards_mod:score", None, None)(sample("y"))
    assert_ok(rec, 2.0)
    assert rec.scorer_version == "mine/1"
    with pytest.raises(RewardConfigError, match=r"'my_rewards_mod:nope'.*no attribute 'nope'"):
        load_user_function("my_rewards_mod:nope")
    with pytest.raises(RewardConfigError, match=r"'my_rewards_mod:VALUE'.*not a callable"):
        load_user_function("my_rewards_mod:VALUE")
    with pytest.raises(RewardConfigError, match=r"'no_such_module_xyz:f'.*cannot import"):
        load_user_function("no_such_module_xyz:f")
    with pytest.raises(RewardConfigError, match=r"reward\.fn: .*'no_such_module_xyz:f'"):
        build_reward_function("no_such_module_xyz:f", {}, [])
    with pytest.raises(RewardConfigError, match="pkg.mod:callable"):
        load_user_function("just_a_module")
    sys.modules.pop("my_rewards_mod", None)


@pytest.mark.parametrize(
    "value, why",
    [
        (float("nan"), "non-finite"),
        (float("inf"), "non-finite"),
        ("1.0", "str"),
        (None, "NoneType"),
        ({"components": {"a": 1.0}}, "without 'total'"),
        ({"total": float("nan")}, "finite"),
        ({"total": 1.0, "extra": 1}, "unknown keys"),
        ({"total": 1.0, "components": {"a": "x"}}, "components"),
    ],
)
def test_user_function_bad_returns_are_errors_not_zero(value, why):
    rec = UserFunction(lambda s: value, "u")(sample("x"))
    assert_failed(rec, RewardStatus.ERROR)
    assert why in rec.error and "'u'" in rec.error


def test_user_function_good_returns():
    assert_ok(UserFunction(lambda s: 1, "u")(sample("x")), 1.0)
    rec = UserFunction(lambda s: {"total": 0.0}, "u")(sample("x"))
    assert_ok(rec, 0.0)
    assert dict(rec.components) == {"u": 0.0}


# --- runner ------------------------------------------------------------------------------------


class Calls:
    """A thread-safe call counter wrapping a behaviour ``body(n, sample)`` (n = 1-based call)."""

    name = "calls"
    version = "calls/1"

    def __init__(self, body):
        self.body, self.n, self.lock = body, 0, threading.Lock()

    def __call__(self, s):
        with self.lock:
            self.n += 1
            n = self.n
        return self.body(n, s)


def ok(total=1.0):
    return RewardRecord(total=total, components={"v": total}, scorer_version="calls/1")


def test_runner_exception_is_error_after_all_retries():
    def raise_always(n, s):
        raise RuntimeError(f"scorer broke on call {n}")

    fn = Calls(raise_always)
    with RewardRunner(fn, timeout_s=5, max_retries=2, backoff_s=0.01) as runner:
        (rec,) = runner.score([sample("x")])
    assert fn.n == 3  # 1 + max_retries
    assert_failed(rec, RewardStatus.ERROR)
    assert rec.error.startswith("RuntimeError: scorer broke on call 3") and "attempt 3 of 3" in rec.error
    assert rec.scorer_version == "calls/1"
    c = runner.counters
    assert (c["calls"], c["error"], c["retries"], c["failed"], c["ok"]) == (3, 3, 2, 1, 0)


def test_runner_timeout_is_timeout_and_does_not_block_other_samples():
    """'slow' hangs until released (HANG_S after the start, so a runner that waited for it would
    return only then): the runner times it out, replaces its worker and scores 'fast'.  How long
    past timeout_s the runner takes is measured by bench/timeouts.py, not asserted here."""
    HANG_S = 30.0
    release = threading.Event()

    def body(n, s):
        if s.sample_id == "slow":
            release.wait()
        return ok()

    fn = Calls(body)
    timer = threading.Timer(HANG_S, release.set)
    timer.start()
    t0 = time.monotonic()
    try:
        with RewardRunner(fn, timeout_s=0.2, max_retries=1, backoff_s=0.01, max_workers=1) as runner:
            recs = runner.score([sample("x", "slow"), sample("x", "fast")])
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        timer.cancel()
    assert_failed(recs[0], RewardStatus.TIMEOUT)
    assert "timeout_s=0.2" in recs[0].error and "attempt 2 of 2" in recs[0].error
    assert_ok(recs[1], 1.0)  # the one worker hung, was replaced, and 'fast' still ran
    assert elapsed < HANG_S, f"the runner waited for the hung call ({elapsed:.2f}s)"
    assert (runner.counters["timeout"], runner.counters["retries"], runner.counters["ok"]) == (2, 1, 1)
    assert_no_failure_is_zero(recs)


def test_runner_fails_once_then_succeeds():
    def flaky(n, s):
        if n == 1:
            raise ConnectionError("flaky")
        return ok(0.0)

    fn = Calls(flaky)
    runner = RewardRunner(fn, timeout_s=5, max_retries=2, backoff_s=0.01)
    (rec,) = runner.score([sample("x")])
    runner.close()
    assert_ok(rec, 0.0)  # a real score of 0 is fine: it is ok
    assert fn.n == 2
    assert runner.counters["retries"] == 1 and runner.counters["error"] == 1 and runner.counters["ok"] == 1
    assert runner.counters["failed"] == 0


def test_runner_invalid_is_not_retried_and_order_is_kept():
    fn = Calls(lambda n, s: ExactNumericMatch()(s))
    samples = [sample("1", "a", answer="1"), sample("2", "b"), sample("3", "c", answer="4")] * 3
    samples = [RewardSample(**{**s.__dict__, "sample_id": f"{s.sample_id}{i}"}) for i, s in enumerate(samples)]
    with RewardRunner(fn, max_retries=2, backoff_s=0.0, max_workers=3) as runner:
        recs = runner.score(samples)
    assert fn.n == len(samples)  # invalid (no ground truth) is final: no retry
    assert [r.status.value for r in recs] == ["ok", "invalid", "ok"] * 3
    assert [r.total for r in recs] == [1.0, None, 0.0] * 3
    assert runner.counters["invalid"] == 3 and runner.counters["retries"] == 0
    assert_no_failure_is_zero(recs)


def test_runner_non_record_return_is_error():
    with RewardRunner(lambda s: 1.0, max_retries=0) as runner:
        (rec,) = runner.score([sample("x")])
    assert_failed(rec, RewardStatus.ERROR)
    assert "UserFunction" in rec.error


def test_runner_rejects_bad_settings():
    for kwargs, key in [
        ({"timeout_s": 0}, "timeout_s"),
        ({"max_retries": -1}, "max_retries"),
        ({"max_workers": 0}, "max_workers"),
        ({"backoff_s": math.inf}, "backoff_s"),
    ]:
        with pytest.raises(RewardConfigError, match=key):
            RewardRunner(ok, **kwargs)


def test_apply_penalties_only_where_configured():
    recs = [
        ok(0.5),
        RewardRecord(total=None, scorer_version="v1", status="error", error="boom"),
        RewardRecord(total=None, scorer_version="v2", status="timeout", error="slow"),
        RewardRecord(total=None, scorer_version="v3", status="invalid", error="no answer field"),
    ]
    out = apply_penalties(recs, {"error": -1.0, "timeout": None})
    assert out[0] is recs[0]
    assert_ok(out[1], -1.0)
    assert dict(out[1].components) == {"penalty/error": -1.0} and out[1].scorer_version == "v1"
    assert out[2] is recs[2] and out[3] is recs[3]  # None / unconfigured: still failures
    assert_no_failure_is_zero(out)
    out = apply_penalties(recs, {"invalid": 0.0})
    assert_ok(out[3], 0.0)  # zero only because the user asked for it
    assert dict(out[3].components) == {"penalty/invalid": 0.0}
    assert out[1] is recs[1]
    assert apply_penalties(recs, {}) == recs
    with pytest.raises(RewardConfigError, match=r"reward\.penalties: unknown key 'errors'"):
        apply_penalties(recs, {"errors": -1.0})
    with pytest.raises(RewardConfigError, match=r"reward\.penalties\.error"):
        apply_penalties(recs, {"error": float("nan")})
