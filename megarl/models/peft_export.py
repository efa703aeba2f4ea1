"""The LoRA actor's adapters in peft's format (``adapter_config.json`` and
``adapter_model.safetensors``), loadable with ``peft.PeftModel.from_pretrained`` onto the base
checkpoint: the same policy as the merged export.

megatron fuses Q, K and V (and the gated MLP's gate and up) into one linear with one adapter;
the HF model has a linear for each.  Their delta ``s * B A x`` splits exactly: every HF linear of
a fused one takes the same ``A`` and its own rows of ``B``, de-interleaved by the same mapping as
the weight (:func:`megarl.models.mapping.hf_from_shards`); a row-parallel linear's ``A`` is
gathered over TP like its weight.  peft scales every module by ``lora_alpha / r``, as megarl does.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

import torch
import torch.distributed as dist

from megarl.models import mapping
from megarl.models.lora import adapters_of
from megarl.models.weights import unwrap

__all__ = ["export_peft_adapter", "gather_peft_tensors", "peft_config", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _tp_gather(t: torch.Tensor, group) -> List[torch.Tensor]:
    n = group.size() if group is not None else 1
    if n == 1:
        return [t.detach().contiguous()]
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return parts


def _peft_tensors(model) -> Dict[str, torch.Tensor]:
    """This rank's adapters as peft's ``{key: tensor}`` (collective over the TP group, and the
    expert TP group for a routed expert's), kept only where this rank is the first of the ranks
    holding the same tensors (TP and DP rank 0; for a routed expert's, expert TP and expert DP
    rank 0), so that every EP rank's experts are written once."""
    from megatron.core import parallel_state as ps

    spec = unwrap(model).megarl_spec
    by_name = {r.megatron_name: r for r in mapping.rules(spec)}
    dense_lead = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    expert_lead = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    out: Dict[str, torch.Tensor] = {}
    for ad in adapters_of(model):
        rule = by_name[f"{ad.name}.weight"]
        group = ad.expert_group if ad.expert_group is not None else ps.get_tensor_model_parallel_group()
        if ad.style == "column":
            a = ad.A.detach().float()
            parts = mapping.hf_from_shards(rule, _tp_gather(ad.B, group), spec)
            pairs = [(name, a, b.float()) for name, b in parts.items()]
        else:
            (name, a), = mapping.hf_from_shards(rule, _tp_gather(ad.A, group), spec).items()
            pairs = [(name, a.float(), ad.B.detach().float())]
        if not (expert_lead if ad.expert_group is not None else dense_lead):
            continue
        for hf_name, a, b in pairs:
            stem = "base_model.model." + hf_name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = a.contiguous().clone()
            out[f"{stem}.lora_B.weight"] = b.contiguous().clone()
    return out


def gather_peft_tensors(model, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Collective: every adapter of ``model`` (all pipeline stages, all EP ranks' experts) as peft's
    ``{key: tensor}`` in ``dtype``, the same on every rank (what the export writes and what an
    engine's LoRA backend loads)."""
    mine = _peft_tensors(model)
    every = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(every, mine)
    return {k: v.to(dtype) for part in every for k, v in (part or {}).items()}


def peft_config(tensors: Dict[str, torch.Tensor], *, rank: int, alpha: float, dropout: float,
                base_model: str) -> dict:
    """peft's ``adapter_config.json`` for ``tensors`` (its target modules: the HF linears they adapt)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "lora_dropout": dropout, "target_modules": sorted({k.split(".")[-3] for k in tensors}), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "base_model_name_or_path": base_model}


def export_peft_adapter(model, out_dir: str, *, rank: int, alpha: float, dropout: float,
                        base_model: str, dtype: torch.dtype = torch.float32) -> None:
    """Collective: the adapters of ``model`` (every pipeline stage's) written by global rank 0 to
    ``out_dir`` in peft's format, ``base_model`` the checkpoint they adapt."""
    from safetensors.torch import save_file

    tensors = gather_peft_tensors(model, dtype)
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(tensors, rank=rank, alpha=alpha, dropout=dropout, base_model=base_model)
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if dist.is_initialized():
        dist.barrier()
