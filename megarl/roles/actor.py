"""The actor: the trainable policy (megatron GPTModel + megatron DDP + optimizer + LR schedule).

It owns its weights, optimizer state and schedule, and answers three questions for the loop:
the log-probs of given experience under the current weights (old log-probs, before any update),
one optimizer step over micro-batches through megatron's schedule (so PP works), and the
manifest / HF export of the weights it holds.  It knows nothing of versions or ordering: the
control loop owns those.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from megarl.models.forward import response_log_probs
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import StepResult, train_step, wrap_for_training
from megarl.models.router_replay import RecordRouting
from megarl.models.weights import export_hf, precision, unwrap
from megarl.roles.common import HostOffload, lr_scheduler


class Actor(HostOffload):
    """Args: ``path`` HF or megarl checkpoint; ``optim`` an OptimSettings section;
    ``total_steps`` optimizer steps of the run (for LR decay); ``moe_aux_loss_coeff`` /
    ``moe_z_loss_coeff`` the router's losses of a mixture-of-experts policy (``actor.*``)."""

    def __init__(self, path: str, tp: int, pp: int, optim, total_steps: int, vocab_multiple: int = 128,
                 offload: bool = False, moe_aux_loss_coeff: float = 0.0, moe_z_loss_coeff: Optional[float] = None,
                 sequence_parallel: bool = False, overlap_grad_reduce: bool = False, recompute=None,
                 log_prob_chunk: int = 0, distributed_optimizer: Optional[bool] = None, lora=None, seed: int = 0):
        self.path = path
        self.log_prob_chunk = log_prob_chunk  # algo.log_prob_chunk, for the forward-only log-probs
        self.model = load_model(path, tp=tp, pp=pp, vocab_multiple=vocab_multiple,
                                moe_aux_loss_coeff=moe_aux_loss_coeff, moe_z_loss_coeff=moe_z_loss_coeff,
                                sequence_parallel=sequence_parallel, recompute=recompute)
        self.adapters, self.lora = [], lora if lora is not None and lora.rank else None
        if lora is not None and lora.rank:  # actor.lora: the base frozen, the adapters trained
            from megarl.models.lora import LoraSpec, apply_lora

            self.adapters = apply_lora(self.model, LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                                            targets=tuple(lora.target_modules), init=lora.init,
                                                            seed=seed))
        self.ddp, self.optimizer = wrap_for_training(self.model, optim, overlap_grad_reduce=overlap_grad_reduce,
                                                     use_distributed_optimizer=distributed_optimizer)
        self.scheduler = lr_scheduler(self.optimizer, optim, total_steps)
        self.spec = unwrap(self.model).megarl_spec
        self.steps = 0
        self.offloader = None
        if offload:
            from megarl.roles.offload import ActorOffloader

            # grads need not survive: train_step zeroes the grad buffer before accumulating
            self.offloader = ActorOffloader(self.ddp, self.optimizer, preserve_grads=False)

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def precision(self) -> str:
        """The dtype its forward computes in (the record's ``LogProbProducer.precision``)."""
        return precision(self.ddp)

    def log_probs(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor,
                  micro_batch_size: int, pack: bool = False, routing: Optional[RecordRouting] = None,
                  micro_batch_tokens: int = 0) -> torch.Tensor:
        """``(b, R)`` raw-space log-probs of the response tokens under the current weights
        (collective over the model-parallel group, eval mode, no grad); ``pack``: each
        micro-batch as one packed sequence (``algo.pack_sequences``); ``micro_batch_tokens``: packed
        micro-batches cut by that token budget; ``routing`` (MoE): the rows' recorded routing,
        replayed and / or compared."""
        return response_log_probs(self.ddp, prompt_ids, response_ids, attention_mask, micro_batch_size, pack=pack,
                                  routing=routing, micro_batch_tokens=micro_batch_tokens,
                                  log_prob_chunk=self.log_prob_chunk)

    def train_step(self, micro_batches: Sequence[Dict[str, torch.Tensor]],
                   loss_fn: Callable, after_optimizer_step: Optional[Callable[[], None]] = None,
                   replay_layers: Optional[Tuple[int, ...]] = None) -> StepResult:
        """One optimizer step; the LR schedule advances only when the step was applied.
        ``after_optimizer_step`` runs once the optimizer changed the weights, before the schedule
        advances (the fault-injection point of ``faults.fail_optimizer_step_at``).  ``replay_layers``:
        the micro-batches carry recorded routing for these MoE layers, replayed in every forward."""
        result = train_step(self.ddp, self.optimizer, micro_batches, loss_fn, replay_layers=replay_layers)
        if after_optimizer_step is not None:
            after_optimizer_step()
        if result.update_successful:
            self.scheduler.step(increment=1)
            self.steps += 1
        return result

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def export(self, out_dir: str, tokenizer_dir: Optional[str] = None) -> None:
        """Collective: the current weights as an HF checkpoint (rank 0 writes); with LoRA the
        merged weights, and the adapters alone in peft's format under ``<out_dir>/adapter``."""
        export_hf(self.ddp, out_dir, tokenizer_dir=tokenizer_dir)
        if self.lora is not None:
            import os

            from megarl.models.peft_export import export_peft_adapter

            export_peft_adapter(self.ddp, os.path.join(out_dir, "adapter"), rank=self.lora.rank,
                                alpha=self.lora.alpha, dropout=self.lora.dropout, base_model=self.path)
