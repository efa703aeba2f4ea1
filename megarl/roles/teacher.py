"""On-policy distillation's teacher: a frozen model teacher-forced on the student's samples.

Eval mode, no optimizer, never refreshed, at the actor's TP/PP; offloaded to the host between its
forwards when configured (GPU time-slicing), like the reference.  Its log-probs of the sampled
tokens are the record's ``teacher_log_probs`` (producer role ``teacher``), never an old or a
reference log-prob.  Its identity is the content of its weights (a run origin: a resume with
another teacher is refused).  It must read the actor's token ids: :func:`check_teacher_tokenizer`
refuses another tokenizer before the model loads.
"""

from __future__ import annotations

import os

from megarl.errors import ConfigError
from megarl.roles.frozen import FrozenRole

__all__ = ["Teacher", "check_teacher_tokenizer"]


def check_teacher_tokenizer(path: str, actor_tokenizer_hash: str, chat_template) -> None:
    """Token-level distillation compares two models' log-probs of the same token ids: the
    teacher's tokenizer (at ``teacher.path``) must be the actor's.  Raises ConfigError naming
    ``teacher.path`` otherwise (or when the path is no checkpoint)."""
    from megarl.data.tokenizer import TokenizerContract

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"teacher.path: {path!r} is not an HF checkpoint (no config.json)")
    try:
        contract = TokenizerContract.load(path, chat_template)
    except Exception as e:  # noqa: BLE001 - any tokenizer load failure is this one config error
        raise ConfigError(f"teacher.path: {path!r} has no tokenizer the actor's could be compared with ({e})") from e
    if contract.hash != actor_tokenizer_hash:
        raise ConfigError(f"teacher.path: {path!r} has another tokenizer than the actor's (hash {contract.hash} != "
                          f"{actor_tokenizer_hash}); on-policy distillation compares log-probs of the same token ids")


class Teacher(FrozenRole):
    def __init__(self, path: str, tp: int, pp: int, vocab_multiple: int = 128, offload: bool = False,
                 sequence_parallel: bool = False, log_prob_chunk: int = 0):
        # labelled by its weights once identified (RunPersistence.record_origins)
        super().__init__(path, tp, pp, "teacher", vocab_multiple=vocab_multiple, offload=offload,
                         sequence_parallel=sequence_parallel, log_prob_chunk=log_prob_chunk)
