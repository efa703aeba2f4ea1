"""User reward functions that fail by design, loaded by dotted path in end-to-end tests.

The failure depends on the prompt's position in the batch (``.../p000`` raises, ``.../p001``
hangs past any sane timeout), so a test knows exactly which groups must be dropped.
"""

import time

from megarl.data.tasks.arithmetic import score


def raise_or_hang(sample):
    if sample.group_id.endswith("/p000"):
        raise RuntimeError("verifier crashed (injected by the test)")
    if sample.group_id.endswith("/p001"):
        time.sleep(60.0)  # far past any reward.timeout_s a test sets: certain to be declared
    return score(sample.response_text, sample.ground_truth["answer"])


def digit_count_text(text: str) -> float:
    return float(sum(ch.isdigit() for ch in text))


def digit_count(sample):
    """A dense, model-independent reward (digits in the response) so that every group of an
    untrained model has a reward spread and the first update is not a zero step."""
    return digit_count_text(sample.response_text)


def flat_even_prompts(sample):
    """Zero reward spread for the even prompts of a round (p000, p002, ...), the candidate index
    (a spread by construction) otherwise: DAPO dynamic sampling must filter exactly the even
    groups."""
    if int(sample.group_id.rsplit("/p", 1)[1]) % 2 == 0:
        return 1.0
    return float(sample.sample_id.rsplit("/c", 1)[1])


def no_spread(sample):
    """The same reward for every sample: every group has zero spread, every advantage is 0, so
    the RL loss gives no gradient and an update moves the weights only by what is added beside
    it (the SFT term of ``algo.sft``)."""
    return 0.0
