"""What the roles share: the LR schedule, and teacher-forced forwards in the experience layout."""

from __future__ import annotations

import torch


def lr_scheduler(optimizer, o, total_steps: int):
    """megatron's ``OptimizerParamScheduler`` for the config's ``OptimSettings`` section ``o``
    (the same object :func:`megarl.models.optim.wrap_for_training` built the optimizer from):
    warmup then constant / linear / cosine decay.

    Steps are optimizer steps (one per mini-batch per PPO epoch).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warm = max(int(o.lr_warmup_steps), 0)
    decay = max(total_steps, warm + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warm else o.lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=warm, lr_decay_steps=decay, lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay, wd_incr_style="constant",
    )


def freeze(model) -> None:
    """A frozen role's model (one module, or its list of virtual-pipeline chunks): eval mode,
    no gradients."""
    from megarl.models.weights import as_chunks

    for chunk in as_chunks(model):
        chunk.eval()
        for p in chunk.parameters():
            p.requires_grad_(False)


@torch.no_grad()
def copy_weights(src_model, dst_model, skip=()) -> None:
    """Copy ``src_model``'s parameters into ``dst_model``'s, built at the same layout (chunk by
    chunk under virtual pipeline stages); names starting with one of ``skip`` are zeroed instead.
    A parameter with no counterpart of the same shape is an error naming it."""
    from megarl.models.weights import chunks_of

    src_chunks, dst_chunks = chunks_of(src_model), chunks_of(dst_model)
    if len(src_chunks) != len(dst_chunks):
        raise ValueError(f"copy_weights: {len(src_chunks)} model chunk(s) into {len(dst_chunks)}")
    for src_chunk, dst_chunk in zip(src_chunks, dst_chunks, strict=True):
        src = dict(src_chunk.named_parameters())
        for name, p in dst_chunk.named_parameters():
            if name.startswith(tuple(skip)):
                p.zero_()
            elif name in src and src[name].shape == p.shape:
                p.copy_(src[name].detach())
            else:
                raise ValueError(f"parameter {name} {tuple(p.shape)} has no counterpart in the source model")


def step_tensors(prompt_ids: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor,
                 length: int | None = None) -> dict[str, torch.Tensor]:
    """Experience layout -> the actor's right-aligned rows, padded to ``length`` columns.

    Returns ``tokens (b, L)``, ``prompt_lens (b,)``, ``response_lens (b,)``.
    """
    from megarl.models.forward import right_align

    tokens, plen, rlen = right_align(prompt_ids, response_ids, attention_mask)
    if length is not None:
        if tokens.shape[1] > length:
            raise ValueError(f"rows of {tokens.shape[1]} tokens do not fit the step length {length}")
        tokens = torch.nn.functional.pad(tokens, (0, length - tokens.shape[1]))
    return {"tokens": tokens, "prompt_lens": plen, "response_lens": rlen}


def sequence_length(attention_mask: torch.Tensor) -> int:
    """Longest real row of a batch (prompt + response tokens)."""
    return int(attention_mask.sum(1).max())


class HostOffload:
    """``onload()`` / ``offload()`` for a trainable role whose ``offloader`` (an ActorOffloader, or
    None when the role stays resident) moves params, grads and optimizer state; both idempotent."""

    offloader = None

    def onload(self) -> None:
        if self.offloader is not None and self.offloader.is_offloaded:
            self.offloader.onload()

    def offload(self) -> None:
        if self.offloader is not None and not self.offloader.is_offloaded:
            self.offloader.offload()
