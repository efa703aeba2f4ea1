"""An environment for backend checks of multi-turn sessions: it answers the first action with one
tool message and ends the episode at the second, so every session that ends its first turn takes
exactly two policy turns (tests/gpu/test_sglang_backend.py, tests/sglang_real/test_engine_cpu.py)."""

from __future__ import annotations


class EchoTool:
    def reset(self, row):
        self.steps = 0
        return ()

    def step(self, action):
        from megarl.envs.protocol import Message, StepOutcome

        self.steps += 1
        if self.steps >= 2:
            return StepOutcome((), {"done": 1.0}, terminated=True, truncated=False)
        return StepOutcome((Message("tool", "4 2"),), {}, terminated=False, truncated=False)
