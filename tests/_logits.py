"""Full-vocabulary logits of a megatron model, for the parity tests that compare them with
another engine's (training never needs them whole: megarl's log-prob passes stay vocab-parallel)."""

from __future__ import annotations

import torch

from megarl.models.forward import forward_only, unwrap
from megarl.models.vocab_parallel import gather_vocab


def full_logits(model, tokens: torch.Tensor, micro_batch_size: int = 0) -> torch.Tensor:
    """Full-vocabulary logits ``(b, s, vocab)`` for ``tokens`` on every rank."""
    V = unwrap(model).megarl_spec.vocab_size
    outs = forward_only(model, list(tokens.split(micro_batch_size or tokens.shape[0], 0)),
                        lambda out, _t: gather_vocab(out, V).float())
    return torch.cat(outs, 0)


def transformers_log_probs(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 log-prob of each next token of ``tokens`` ``(b, s - 1)``: the reference the
    parity tests hold megarl's models to."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = m(tokens).logits.float()
    return torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
