"""On-policy distillation's teacher served by an inference engine (``teacher.engine: hf | sglang``):
the teacher's checkpoint loaded into an engine of its own in-process through the verified weight path
(manifest, activate), and its prompt log-probs -- the engine's teacher forcing of the rollout's own
tokens -- are the record's ``teacher_log_probs`` (producer role ``teacher``).

slime offers the same choice (``--opd-type sglang|megatron``): a megatron teacher
(:class:`~megarl.roles.teacher.Teacher`) runs at the actor's layout and time-slices with it; a
served one holds the whole model on one rank and needs no megatron conversion of the teacher.
Both give the same log-probs within the dtype's tolerance
(``tests/e2e/test_train_e2e.py::test_on_policy_distillation_from_a_teacher_of_its_own``).

It runs where the rule runner and the judges run (rank 0) and every rank receives the rows, as
the engine's proximal log-probs do.  Its identity is the content of the weights it serves (the
verified manifest): a run origin, so a resume with another teacher is refused.
"""

from __future__ import annotations

import torch

from megarl.experience.packing import unpadded_rows
from megarl.rollout.protocol import RolloutError
from megarl.runtime.data_parallel import broadcast_object

__all__ = ["ServedTeacher"]


class ServedTeacher:
    """Args: ``path`` the teacher's HF checkpoint (the actor's tokenizer, checked before);
    ``contract`` the actor's TokenizerContract (eos and pad); ``device`` where the engine runs;
    ``rank0`` whether this rank holds the engine; ``offload``: the engine sleeps between forwards."""

    def __init__(self, path: str, contract, device: str, rank0: bool, offload: bool = False, backend: str = "hf",
                 mem_fraction_static: float = 0.2):
        from megarl.rollout.served_checkpoint import serve_checkpoint

        self.path, self.offload, self.backend = path, offload, backend
        self.engine = (serve_checkpoint(path, contract, device, run_id="teacher", backend=backend,
                                        mem_fraction_static=mem_fraction_static) if rank0 else None)
        if self.engine is not None and offload:
            self.engine.sleep()
        dtype = self.engine.dtype if self.engine is not None else None
        self._precision = broadcast_object(str(dtype).replace("torch.", "") if dtype is not None else None)
        self.version = "teacher"  # labelled by its weights once identified (RunPersistence.record_origins)

    @property
    def precision(self) -> str:
        """The dtype the engine computes in (the record's ``LogProbProducer.precision``)."""
        return self._precision

    def origin_id(self, identify) -> str:
        """What a resume must find again (collective): the engine's verified weight manifest."""
        mine = (None if self.engine is None
                else f"engine={self.backend} weights={self.engine.active_version.weight_manifest_hash}")
        return broadcast_object(mine)

    def batch_log_probs(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor,
                        micro_batch_size: int, pack: bool = False, micro_batch_tokens: int = 0) -> torch.Tensor:
        """``(B, R)`` the teacher's raw log-probs of every response token of the whole batch
        (zero past each row's end); collective over the world (every rank gets rank 0's rows).
        The micro-batch settings are the megatron forward's; the engine chunks by its own budget."""
        rows, failure = None, None
        if self.engine is not None:
            if self.offload:
                self.engine.wake()
            try:
                _, rows = self.engine.teacher_force(*unpadded_rows(prompt_ids, response_ids, attention_mask))
            except Exception as e:  # noqa: BLE001 - raised on every rank below, so none waits forever
                failure = f"{type(e).__name__}: {e}"
            finally:
                if self.offload:
                    self.engine.sleep()
        rows, failure = broadcast_object((rows, failure))
        if failure is not None:
            raise RolloutError(f"teacher.engine={self.backend}: the teacher's forward on rank 0 failed: {failure}")
        out = torch.zeros(response_ids.shape, dtype=torch.float32)
        for b, row in enumerate(rows):
            out[b, :len(row)] = row
        return out
