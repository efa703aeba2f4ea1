"""megarl model checkpoints in megatron-core ``dist_checkpointing`` format.

A directory holds::

    megarl_model.json   format tag, layout it was saved at, vocab padding, dtype
    config.json         the HF config the model was built from (the ModelSpec source)
    tokenizer files     copied from the source checkpoint
    dist/               megatron-core dist_checkpointing (torch_dist), loadable at any TP/PP

:func:`load_model` accepts either an HF directory or such a directory, so tools take "a
checkpoint" without the user saying which kind.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist

from megarl.models.builder import BuildOptions, build_model, build_model_chunks, recompute_options, virtual_stages
from megarl.models.hf_config import ModelConfigError, load_spec
from megarl.models.safetensors_io import CheckpointError, copy_tokenizer_files, read_format_json
from megarl.models.weights import chunks_of, load_hf_weights, unwrap
from megarl.runtime import cpu_compat

FORMAT = "megarl-megatron-v1"
META_NAME = "megarl_model.json"
DIST_DIR = "dist"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_megatron_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_NAME))


def read_meta(path: str) -> dict:
    return read_format_json(os.path.join(path, META_NAME), FORMAT, "megarl checkpoint metadata")


def save_megatron_checkpoint(model, out_dir: str, tokenizer_dir: Optional[str] = None) -> None:
    """Collective: write this model (all ranks' shards) as a dist checkpoint in ``out_dir``."""
    from megatron.core import dist_checkpointing, parallel_state as ps

    inner = unwrap(model)
    spec, opts = inner.megarl_spec, inner.megarl_opts
    dist_dir = os.path.join(out_dir, DIST_DIR)
    rank0 = (not dist.is_initialized()) or dist.get_rank() == 0
    if rank0:
        if os.path.isdir(dist_dir):  # the caller agreed to replace it (tools: --overwrite)
            import shutil

            shutil.rmtree(dist_dir)
        stale_meta = os.path.join(out_dir, META_NAME)
        if os.path.exists(stale_meta):
            os.remove(stale_meta)
        os.makedirs(dist_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            cfg = dict(spec.raw_config, architectures=[spec.architecture])
            json.dump(cfg, f, indent=2, sort_keys=True)
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, out_dir)
    if dist.is_initialized():
        dist.barrier()
    adapters_only = _has_frozen_base(model)  # actor.lora: the base is model.path's, never saved again
    sd = chunked_sharded_state_dict(model)
    dist_checkpointing.save(_trainable_entries(sd) if adapters_only else sd, dist_dir)
    if rank0:
        meta = {
            "format": FORMAT,
            "saved_tp": ps.get_tensor_model_parallel_world_size(),
            "saved_pp": ps.get_pipeline_model_parallel_world_size(),
            "vocab_multiple": opts.vocab_multiple,
            "dtype": str(next(inner.parameters()).dtype).replace("torch.", ""),
        }
        if spec.moe is not None:  # the expert layout it was saved at (it loads at any EP / ETP)
            meta.update(saved_ep=opts.ep, saved_etp=opts.resolved_etp)
        if adapters_only:
            meta["weights"] = "trainable"
        # Written last: its presence marks a complete checkpoint.
        with open(os.path.join(out_dir, META_NAME), "w") as f:
            json.dump(meta, f, indent=2)
    if dist.is_initialized():
        dist.barrier()


def load_megatron_checkpoint(model, ckpt_dir: str) -> None:
    """Collective: fill ``model`` (any TP/PP) from a dist checkpoint written at any TP/PP."""
    from megatron.core import dist_checkpointing

    meta = read_meta(ckpt_dir)
    dist_dir = os.path.join(ckpt_dir, DIST_DIR)
    if not os.path.isdir(dist_dir):
        raise CheckpointError(f"{dist_dir}: missing (megarl checkpoint without its dist/ folder)")
    adapters_only = meta.get("weights") == "trainable"
    if adapters_only and not _has_frozen_base(model):
        raise CheckpointError(f"{ckpt_dir}: holds only the LoRA adapters of a run (actor.lora); build the base from "
                              "its model.path with the same actor.lora and resume, or load an export")
    want = chunked_sharded_state_dict(model)
    state = dist_checkpointing.load(_trainable_entries(want) if adapters_only else want, dist_dir)
    chunks = chunks_of(model)
    states = [state] if len(chunks) == 1 else [state[f"model{i}"] for i in range(len(chunks))]
    for inner, sd in zip(chunks, states, strict=True):
        missing, unexpected = inner.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if adapters_only:  # the frozen base stays as model.path built it
            trainable = {n for n, p in inner.named_parameters() if p.requires_grad}
            missing = [k for k in missing if k in trainable]
        if missing:
            raise CheckpointError(f"{dist_dir}: checkpoint lacks parameters {missing}")


def _has_frozen_base(model) -> bool:
    """A LoRA actor (megarl/models/lora.py): some parameters train, the others are a frozen base."""
    flags = {p.requires_grad for c in chunks_of(model) for p in c.parameters()}
    return flags == {True, False}


def _trainable_entries(sd: dict) -> dict:
    """The entries of a sharded state dict (nested per model chunk) whose tensor trains."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _trainable_entries(v)
        elif getattr(getattr(v, "data", None), "requires_grad", False):
            out[k] = v
    return out


def chunked_sharded_state_dict(model) -> dict:
    """megatron's sharded state dict of this rank's model; under virtual pipeline stages one entry
    per chunk (``model0``, ``model1``, ..., as megatron-LM's own checkpoints).  Every tensor is
    keyed by its global layer number, so a checkpoint loads at any TP / PP / virtual stages."""
    chunks = chunks_of(model)
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def load_model(path: str, tp: int = 1, pp: int = 1, dtype: Optional[torch.dtype] = None,
               vocab_multiple: Optional[int] = None, show_progress: bool = False,
               ep: Optional[int] = None, etp: Optional[int] = None, moe_aux_loss_coeff: float = 0.0,
               moe_z_loss_coeff: Optional[float] = None, sequence_parallel: bool = False, recompute=None):
    """Build the megatron model for ``path`` (HF or megarl checkpoint) at this TP/PP/EP and load it.

    megatron parallel state must already be initialised at ``tp``/``pp`` (and ``ep`` / ``etp``;
    None: the sizes the parallel state holds, used by a mixture-of-experts model only).
    ``moe_aux_loss_coeff`` / ``moe_z_loss_coeff``: the router's training losses (a trained
    mixture-of-experts model only; refused on a dense one, megarl/models/moe_losses.py).
    ``sequence_parallel``: megatron's sequence parallelism at tp > 1 (``parallel.sequence_parallel``);
    ``recompute``: a ``parallel.recompute`` section (activation recomputation of a trained model).
    Under virtual pipeline stages (``rt.initialize(vpp=...)``) the result is this rank's list of
    model chunks (:func:`megarl.models.builder.build_model_chunks`).
    """
    from megatron.core import parallel_state as ps

    spec = load_spec(path)
    if spec.moe is not None:
        ep = ps.get_expert_model_parallel_world_size() if ep is None else ep
        etp = ps.get_expert_tensor_parallel_world_size() if etp is None else etp
    else:
        ep, etp = 1, None
        if moe_aux_loss_coeff or moe_z_loss_coeff is not None:
            raise ModelConfigError(f"{path} is a dense model ({spec.architecture}): it has no router for "
                                   "moe_aux_loss_coeff / moe_z_loss_coeff")
    moe_losses = dict(moe_aux_loss_coeff=moe_aux_loss_coeff, moe_z_loss_coeff=moe_z_loss_coeff,
                      sequence_parallel=sequence_parallel, **recompute_options(recompute))
    meta = read_meta(path) if is_megatron_checkpoint(path) else None
    if dtype is None:
        # CPU: fp32 only (megatron's half-precision paths need CUDA); GPU: what the checkpoint says
        saved = _DTYPES.get(meta["dtype"]) if meta else spec.checkpoint_dtype
        dtype = cpu_compat.model_dtype(saved or torch.bfloat16)
    if meta is not None:
        opts = BuildOptions(tp=tp, pp=pp, params_dtype=dtype,
                            vocab_multiple=vocab_multiple or meta["vocab_multiple"],
                            init_weights=False, ep=ep, etp=etp, **moe_losses)
        model = _build(spec, opts)
        load_megatron_checkpoint(model, path)
    else:
        opts = BuildOptions(tp=tp, pp=pp, params_dtype=dtype,
                            vocab_multiple=vocab_multiple or 128, init_weights=False, ep=ep, etp=etp,
                            **moe_losses)
        model = _build(spec, opts)
        load_hf_weights(model, path, spec, show_progress=show_progress)
    return model


def _build(spec, opts):
    """One model, or under virtual pipeline stages (``parallel.vpp``) this rank's list of chunks."""
    return build_model_chunks(spec, opts) if virtual_stages() > 1 else build_model(spec, opts)
