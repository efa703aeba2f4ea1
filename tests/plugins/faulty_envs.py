"""A user environment, loaded by dotted path, that fails by design: the row's ``mode`` says how.

``ok`` echoes the action as a tool message and ends after two steps; ``raise`` raises in step;
``hang`` blocks in step until :data:`RELEASE` is set (the test sets it when done, so abandoned
threads exit); ``sleep`` takes ``row["sleep_s"]`` then answers; ``barrier`` waits in step until
``row["parties"]`` steps wait together (:data:`BARRIERS`, keyed by ``row["barrier"]``; broken
after ``row["wait_s"]``): steps run one after another never get there; ``nan`` / ``wrong_type`` /
``bad_message`` / ``bool_flag`` return garbage; ``reset_raise`` / ``reset_hang`` fail in reset;
``close_hang`` hangs in ``close()``, which the others record in :data:`CLOSED`.
"""

import threading
import time

from megarl.envs.protocol import Message, StepOutcome

RELEASE = threading.Event()
CLOSED = []  # tags of the instances whose close() returned
BARRIERS: dict = {}  # name -> threading.Barrier shared by the steps of that row
_BARRIERS_LOCK = threading.Lock()


class FaultyEnv:
    def __init__(self, tag: str = "faulty"):
        self.tag = tag
        self.mode = None
        self.steps = 0

    def reset(self, row):
        self.mode, self.sleep_s = row["mode"], row.get("sleep_s", 0.0)
        if self.mode == "barrier":
            with _BARRIERS_LOCK:
                self.barrier = BARRIERS.setdefault(row["barrier"], threading.Barrier(row["parties"]))
            self.wait_s = row["wait_s"]
        if self.mode == "reset_raise":
            raise ConnectionError("sandbox refused the connection (injected)")
        if self.mode == "reset_hang":
            RELEASE.wait(30)
        return (Message("system", f"{self.tag} ready"),)

    def step(self, action):
        self.steps += 1
        m = self.mode
        if m == "raise":
            raise RuntimeError("environment crashed (injected)")
        if m == "hang":
            RELEASE.wait(30)
        if m == "sleep":
            time.sleep(self.sleep_s)
        if m == "barrier":
            self.barrier.wait(self.wait_s)  # BrokenBarrierError (an error status) if not concurrent
        if m == "nan":
            return StepOutcome((), {"correct": float("nan")}, True, False)
        if m == "wrong_type":
            return {"observation": "text"}
        if m == "bad_message":
            return StepOutcome(("just a string",), {}, False, False)
        if m == "bool_flag":
            return StepOutcome((), {}, "yes", False)
        done = self.steps >= 2
        return StepOutcome(() if done else (Message("tool", action.upper()),), {"steps": float(self.steps)},
                           terminated=done, truncated=False)

    def close(self):
        if self.mode == "close_hang":
            RELEASE.wait(30)
        CLOSED.append(self.tag)


class FlakyCalculator:
    """The built-in calculator, failing on chosen rows the way a real tool service does: the
    row's answer modulo 7 picks it -- 0 raises at every step, 1 hangs past any step timeout
    (``hang_s``), 2 returns garbage; the others are the calculator itself."""

    def __init__(self, tool_role: str = "user", hang_s: float = 3.0):
        from megarl.envs.calculator import CalculatorEnv

        self.env, self.hang_s, self.kind = CalculatorEnv(tool_role=tool_role), hang_s, None

    @staticmethod
    def failure(answer) -> str | None:
        return {0: "raise", 1: "hang", 2: "garbage"}.get(int(answer) % 7)

    def reset(self, row):
        self.kind = self.failure(row["answer"])
        return self.env.reset(row)

    def step(self, action):
        if self.kind == "raise":
            raise ConnectionError("calculator service refused the connection (injected)")
        if self.kind == "hang":
            time.sleep(self.hang_s)
        if self.kind == "garbage":
            return StepOutcome((), {"correct": float("inf")}, terminated=True, truncated=False)
        return self.env.step(action)
