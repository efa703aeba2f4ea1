"""The PPO critic: a value-head megatron model V(s_t) with its own optimizer and schedule.

Initialised either from a value-head checkpoint (``critic.path``) or from the actor's starting
weights with a zero value head (the usual choice when no reward model is at hand: the trunk
already represents the task, and V starts at 0 for every state).  A reward model is a different
role even when it initialises the critic (InstructGPT): the critic trains, the RM never does.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Sequence

import torch

from megarl.models.builder import build_model, build_model_chunks, virtual_stages
from megarl.models.forward import gather_response, scalar_values
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import StepResult, train_step, wrap_for_training
from megarl.models.weights import unwrap
from megarl.roles.common import HostOffload, copy_weights, lr_scheduler, step_tensors


def value_head_spec(actor_spec):
    """The actor's architecture with a scalar head (HF ``*ForTokenClassification``, num_labels=1)."""
    arch = actor_spec.architecture.replace("ForCausalLM", "ForTokenClassification")
    return dataclasses.replace(actor_spec, architecture=arch, value_head=True, value_head_bias=False,
                               tie_word_embeddings=False)


class Critic(HostOffload):
    def __init__(self, cfg, actor_model, tp: int, pp: int, total_steps: int, vocab_multiple: int = 128,
                 sequence_parallel: bool = False, overlap_grad_reduce: bool = False, recompute=None,
                 distributed_optimizer: Optional[bool] = None, seed: int = 0):
        if cfg.path is not None:
            self.model = load_model(cfg.path, tp=tp, pp=pp, vocab_multiple=vocab_multiple,
                                    sequence_parallel=sequence_parallel, recompute=recompute)
            if not unwrap(self.model).megarl_spec.value_head:
                from megarl.errors import ConfigError

                raise ConfigError(f"critic.path: {cfg.path} is not a value-head checkpoint (expected an HF "
                                  "*ForTokenClassification or *ForSequenceClassification with num_labels=1: its "
                                  "per-token outputs are the values)")
            self.init = cfg.path
        else:
            actor = unwrap(actor_model)
            opts = dataclasses.replace(actor.megarl_opts, init_weights=False)
            spec = value_head_spec(actor.megarl_spec)
            self.model = build_model_chunks(spec, opts) if virtual_stages() > 1 else build_model(spec, opts)
            copy_weights(actor_model, self.model, skip=("output_layer.",))  # the trunk; V = 0 everywhere at the start
            self.init = "actor"
        lo = getattr(cfg, "lora", None)
        if lo is not None and lo.rank:  # critic.lora: adapters on the trunk, the value head trained whole
            from megarl.models.lora import LoraSpec, apply_lora
            from megarl.models.weights import chunks_of

            apply_lora(self.model, LoraSpec(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout,
                                            targets=tuple(lo.target_modules), init=lo.init, seed=seed + 1),
                       key="critic.lora")
            for chunk in chunks_of(self.model):
                for name, p in chunk.named_parameters():
                    if name.startswith("output_layer."):
                        p.requires_grad_(True)
        self.ddp, self.optimizer = wrap_for_training(self.model, cfg.optim, overlap_grad_reduce=overlap_grad_reduce,
                                                     use_distributed_optimizer=distributed_optimizer)
        self.scheduler = lr_scheduler(self.optimizer, cfg.optim, total_steps)
        self.value_clip = cfg.value_clip
        self.steps = 0
        self.version = f"critic-{self.steps}"
        self.offloader = None
        if cfg.offload:
            from megarl.roles.offload import ActorOffloader

            self.offloader = ActorOffloader(self.ddp, self.optimizer, preserve_grads=False)

    def values(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor,
               micro_batch_size: int, pack: bool = False, micro_batch_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """V(s_t) before each response token ``(b, R)`` and V(s_T) after the last one ``(b,)``.

        s_t is the prefix (prompt, response[:t]); its value is read at the position of its last
        token, ``prompt_len - 1 + t``, the same position that predicts response token t.
        ``pack``: each micro-batch as one packed sequence (``algo.pack_sequences``);
        ``micro_batch_tokens``: packed micro-batches cut by that token budget.
        """
        st = step_tensors(prompt_ids, response_ids, attention_mask)
        v = scalar_values(self.ddp, st["tokens"], micro_batch_size, lengths=st["prompt_lens"] + st["response_lens"],
                          pack=pack, micro_batch_tokens=micro_batch_tokens)
        R = response_ids.shape[1]
        per_token = gather_response(v, st["prompt_lens"], st["response_lens"], R)
        last = (st["prompt_lens"] + st["response_lens"] - 1).clamp(max=v.shape[1] - 1)
        bootstrap = v.gather(1, last[:, None].to(v.device))[:, 0]
        return per_token, bootstrap

    def train_step(self, micro_batches: Sequence[Dict[str, torch.Tensor]], loss_fn: Callable) -> StepResult:
        result = train_step(self.ddp, self.optimizer, micro_batches, loss_fn)
        if result.update_successful:
            self.scheduler.step(increment=1)
            self.steps += 1
            self.version = f"critic-{self.steps}"
        return result
