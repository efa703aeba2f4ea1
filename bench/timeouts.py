#!/usr/bin/env python
"""How close to their bounds the trainer's time-outs end on this machine: the numbers the tests
do not assert (they assert only that a bound holds and that nothing waits for what it bounds).

    python bench/timeouts.py [--repeats 5]

* the reward runner on threads: a call that hangs, ``timeout_s=0.2``, retried once; seconds
  from the start until ``score`` returns with the timeout and the other sample scored, and the
  overshoot past the two attempts' 0.4 s;
* the reward runner on processes (``reward.isolation=process``, ``math_verify``): a pathological
  answer that parses for minutes, ``timeout_s=2``; seconds past the timeout until ``score``
  returns (the kill, ``kill_grace_s`` 0.5, and the replacement worker's fork), and the largest
  gap a trainer thread that sleeps 20 ms saw meanwhile (a scorer holding the trainer's GIL would
  make it the whole timeout).

Printed as medians and maxima over ``--repeats``; this machine's, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

PATHOLOGICAL = r"The answer is \boxed{9^{9^{9^{9}}}}"


def _sample(text: str, sid: str):
    from megarl.rewards import RewardSample

    return RewardSample(sample_id=sid, prompt_id="p", group_id="g", prompt_text="1 + 2 =", response_text=text,
                        prompt_ids=(1,), response_ids=(2,), finish_reason="eos", ground_truth={"answer": "3"})


def thread_runner_overshoot() -> float:
    from megarl.experience.schema import RewardRecord
    from megarl.rewards import RewardRunner

    release = threading.Event()

    class Hangs:
        name, version = "hangs", "hangs/1"

        def __call__(self, s):
            if s.sample_id == "slow":
                release.wait(60)
            return RewardRecord(total=1.0, scorer_version=self.version)

    t0 = time.monotonic()
    with RewardRunner(Hangs(), timeout_s=0.2, max_retries=1, backoff_s=0.01, max_workers=1) as r:
        recs = r.score([_sample("x", "slow"), _sample("x", "fast")])
    took = time.monotonic() - t0
    release.set()
    assert recs[1].total == 1.0
    return took


def process_runner_overshoot(timeout_s: float = 2.0) -> tuple[float, float]:
    from megarl.rewards import RewardRunner, build_reward_function

    spec = {"fn": "math_verify", "kwargs": {}}
    with RewardRunner(build_reward_function("math_verify", {}), timeout_s=timeout_s, max_retries=0, max_workers=2,
                      isolation="process", spec=spec, kill_grace_s=0.5) as r:
        r.score([_sample(r"\boxed{3}", "warm")])  # the pool is up
        beats, stop = [], threading.Event()

        def heartbeat():
            while not stop.is_set():
                beats.append(time.monotonic())
                time.sleep(0.02)

        hb = threading.Thread(target=heartbeat, daemon=True)
        hb.start()
        t0 = time.monotonic()
        r.score([_sample(PATHOLOGICAL, "hog")])
        took = time.monotonic() - t0
        stop.set()
        hb.join()
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    return took - timeout_s, max(gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    thread = [thread_runner_overshoot() for _ in range(a.repeats)]
    proc = [process_runner_overshoot() for _ in range(a.repeats)]
    out = {
        "thread_runner_s": {"median": statistics.median(thread), "max": max(thread), "bound": 0.4},
        "process_runner_past_timeout_s": {"median": statistics.median(x for x, _ in proc),
                                          "max": max(x for x, _ in proc)},
        "trainer_thread_max_gap_s": {"median": statistics.median(g for _, g in proc), "max": max(g for _, g in proc)},
    }
    print(f"threads:   hung call timed out twice (0.4 s of timeouts) and returned in "
          f"{out['thread_runner_s']['median']:.3f} s (max {out['thread_runner_s']['max']:.3f})")
    print(f"processes: returned {out['process_runner_past_timeout_s']['median']:.3f} s past timeout_s=2 "
          f"(max {out['process_runner_past_timeout_s']['max']:.3f}); a 20 ms sleeper's largest gap "
          f"{out['trainer_thread_max_gap_s']['median']:.3f} s (max {out['trainer_thread_max_gap_s']['max']:.3f})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
