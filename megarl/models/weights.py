"""Moving weights into and out of megatron shards, for any TP x PP (x EP x ETP) layout.

* :func:`load_hf_weights` fills this rank's shards from an HF safetensors checkpoint, reading
  only the slices this rank owns.
* :func:`iter_hf_tensors` is the collective stream of logical HF-named tensors out of the
  shards (gather over TP, broadcast over PP), one tensor at a time so the whole model is
  never materialised on one rank.  Export and the hybrid-engine weight sync both use it.
* :func:`export_hf` writes that stream as an HF checkpoint.

Routed experts of a mixture-of-experts model live on one EP rank each (``mapping.expert_owner``)
and are split over the expert tensor-parallel group: the owner EP rank gathers its ETP shards,
and for the stream every rank needs the tensor, so it is broadcast over the EP group (then over
PP, like everything else).  Every expert therefore appears in the stream exactly once, in the
canonical (global expert) order, whatever the layout.

All layout knowledge comes from :mod:`megarl.models.mapping`.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.models import mapping
from megarl.models.builder import padded_vocab_size
from megarl.models.hf_config import ModelSpec
from megarl.models.safetensors_io import CheckpointError, HFCheckpointReader, write_hf_checkpoint


def precision(model) -> str:
    """The dtype a model's forward computes in, by name (its parameters': ``float32``, ``bfloat16``)."""
    return str(next(unwrap(model).parameters()).dtype).removeprefix("torch.")


def unwrap(model):
    """The bare megatron module under DDP / Float16Module wrappers (of a list of model chunks: the
    first chunk's)."""
    model = as_chunks(model)[0]
    while hasattr(model, "module"):
        model = model.module
    return model


def as_chunks(model) -> list:
    """This rank's model chunks as a list, wrappers kept: the list of chunks under virtual pipeline
    stages (:func:`megarl.models.builder.build_model_chunks`), else ``[model]``."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def chunks_of(model) -> list:
    """The bare model chunks of this rank (:func:`as_chunks`, unwrapped)."""
    return [unwrap(m) for m in as_chunks(model)]


def _owner_stage(rule: mapping.ParamRule, spec: ModelSpec, pp: int, vpp: int = 1) -> int:
    """The PP rank holding ``rule``: layers go to global chunks of ``num_layers / (pp x vpp)``,
    and global chunk c lives on PP rank ``c mod pp`` (interleaved; c itself without virtual stages);
    or to stages of the uneven split this process was initialised with (megarl/models/stages.py)."""
    from megarl.models.stages import layer_stage
    from megarl.runtime import distributed as rt

    if rule.where == "first":
        return 0
    if rule.where == "last":
        return pp - 1
    return layer_stage(rule.layer, spec.num_layers, pp, vpp, *rt.stage_layers())


def _pp_tp():
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())


def _ep_etp():
    """``(ep rank, ep size, expert tp rank, expert tp size)``."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())


def _split_group(rule: mapping.ParamRule):
    """``(rank, size, process group)`` of the tensor-parallel group that splits ``rule``."""
    from megatron.core import parallel_state as ps

    if rule.tp_group == mapping.EXPERT_TP_GROUP:
        _, _, etp_rank, etp = _ep_etp()
        return etp_rank, etp, ps.get_expert_tensor_parallel_group()
    _, _, tp_rank, tp = _pp_tp()
    return tp_rank, tp, ps.get_tensor_model_parallel_group()


@torch.no_grad()
def load_hf_weights(model, hf_dir: str, spec: Optional[ModelSpec] = None, show_progress: bool = False) -> None:
    """Load an HF safetensors checkpoint into this rank's megatron shards.

    Each rank opens only the safetensors files holding tensors of its stage and reads only
    its TP slice of each.  Shapes are checked against the config first, so a checkpoint that
    disagrees with its ``config.json`` fails naming the file and tensor.
    """
    if isinstance(model, (list, tuple)):  # virtual pipeline stages: each chunk loads its own layers
        for chunk in model:
            load_hf_weights(chunk, hf_dir, spec, show_progress)
        return
    model = unwrap(model)
    spec = spec or model.megarl_spec
    opts = model.megarl_opts
    pp_rank, pp, tp_rank, tp = _pp_tp()
    padded = padded_vocab_size(spec, opts)
    reader = HFCheckpointReader(hf_dir)
    expected = mapping.hf_shapes(spec)
    config_path = os.path.join(hf_dir, "config.json")

    local = mapping.stage_param_names(model)
    params = dict(mapping.named_mapped_tensors(model))
    rules = {r.megatron_name: r for r in mapping.rules(spec)}
    if spec.tie_word_embeddings and not spec.value_head and "output_layer.weight" in local:
        # PP>1 with tied embeddings: the last stage keeps its own copy of the embedding.
        rules["output_layer.weight"] = mapping.ParamRule(
            "output_layer.weight", ("model.embed_tokens.weight",), mapping.VOCAB, where="last")

    def read(name, dim, start, stop):
        got = reader.shape(name)
        if tuple(got) != tuple(expected[name]):
            raise CheckpointError(
                f"{reader.path_of(name)}: tensor '{name}' has shape {list(got)} but "
                f"{config_path} implies {list(expected[name])}"
            )
        return reader.read(name, dim, start, stop)

    unknown = sorted(set(local) - set(rules))
    if unknown:
        raise mapping.MappingError(f"megatron parameters without a mapping rule: {unknown}")
    _refuse_unmapped_layers(reader, spec, config_path)
    items = sorted(local.items())
    it = items
    if show_progress:
        from tqdm import tqdm

        it = tqdm(items, desc=f"load {os.path.basename(os.path.normpath(hf_dir))}", unit="tensor")
    for canon, local_name in it:
        rule = rules[canon]
        r, n = (tp_rank, tp) if rule.tp_group == mapping.TP_GROUP else _split_group(rule)[:2]
        shard = mapping.shard_from_hf(rule, read, spec, r, n, padded)
        p = params[local_name]
        if tuple(shard.shape) != tuple(p.shape):
            raise mapping.MappingError(
                f"{canon}: mapped shard has shape {list(shard.shape)}, megatron parameter "
                f"'{local_name}' has {list(p.shape)}"
            )
        p.data.copy_(shard.to(device=p.device, dtype=p.dtype))


def _refuse_unmapped_layers(reader: HFCheckpointReader, spec: ModelSpec, config_path: str) -> None:
    """A checkpoint holding decoder layers past ``num_hidden_layers`` -- DeepSeek-V3's
    multi-token-prediction layers (``num_nextn_predict_layers``: ``model.layers.61.*``), which
    transformers skips on load too -- is refused naming them: megarl maps no MTP layer, and a
    load that skipped them would drop them from every export in silence."""
    extra = sorted({int(m.group(1)) for m in map(_HF_LAYER_RE.match, reader.names()) if m
                    and int(m.group(1)) >= spec.num_layers})
    if extra:
        n = spec.raw_config.get("num_nextn_predict_layers", 0)
        raise CheckpointError(
            f"{os.path.dirname(config_path)}: the checkpoint holds decoder layer(s) {extra} "
            f"(model.layers.{extra[0]}.*) past num_hidden_layers={spec.num_layers}"
            + (f": multi-token prediction (num_nextn_predict_layers={n})" if n else "")
            + "; megarl does not map them. Remove their tensors from the checkpoint to train without them")


_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _stage_params(model) -> Dict[str, torch.Tensor]:
    """``{canonical name: parameter}`` over this rank's chunks (names are global: no clashes)."""
    out = {}
    for chunk in chunks_of(model):
        params = dict(mapping.named_mapped_tensors(chunk))
        out.update({canon: params[name] for canon, name in mapping.stage_param_names(chunk).items()})
    return out


def _virtual_stages() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_virtual_pipeline_model_parallel_world_size() or 1


def _read_shard(param) -> torch.Tensor:
    """This rank's shard of ``param`` as the weight stream reads it: with a LoRA adapter beside it
    (``actor.lora``, megarl/models/lora.py) the merged ``W + s * B A``, computed shard by shard."""
    adapter = getattr(param, "megarl_lora", None)
    if adapter is None or not adapter.enabled:
        return param.detach().contiguous()
    return adapter.merged(param.detach())


def _merged_rules(model, spec: ModelSpec, merge, names: Optional[frozenset] = None):
    """Collective over the TP group (the expert TP group for a routed expert):
    ``(rule, owner stage, owner EP rank, merge(rule, TP shards) or None)`` for every rule in
    canonical order; the merge runs on the owner stage only, and for a routed expert only on
    its owner EP rank (``owner EP rank`` is None for everything else: every EP rank holds it)."""
    pp_rank, pp, _, _ = _pp_tp()
    ep_rank, ep, _, _ = _ep_etp()
    vpp = _virtual_stages()
    mine = _stage_params(model)
    for rule in mapping.rules(spec):
        if names is not None and not names.intersection(rule.hf_names):
            continue  # not asked for (every rank skips it alike: nothing is gathered)
        owner = _owner_stage(rule, spec, pp, vpp)
        ep_owner = mapping.expert_owner(rule, spec, ep)
        if owner != pp_rank or (ep_owner is not None and ep_owner != ep_rank):
            yield rule, owner, ep_owner, None
            continue
        p = mine.get(rule.megatron_name)
        if p is None:
            raise mapping.MappingError(
                f"{rule.megatron_name}: expected on pipeline stage {pp_rank}"
                + (f", expert-parallel rank {ep_rank}" if ep_owner is not None else "") + ", not found")
        shard = _read_shard(p)
        _, n, group = _split_group(rule)
        if n > 1 and rule.kind != mapping.REPLICATED:
            shards = [torch.empty_like(shard) for _ in range(n)]
            dist.all_gather(shards, shard, group=group)
        else:
            shards = [shard]
        yield rule, owner, ep_owner, merge(rule, shards)


@torch.no_grad()
def iter_hf_views(model, spec: Optional[ModelSpec] = None,
                  ) -> Iterator[Tuple[str, Tuple[int, ...], torch.Tensor]]:
    """Collective over the TP group: ``(hf_name, shape, view)`` for each logical tensor this
    rank's PP stage owns, in canonical order (see :func:`megarl.models.mapping.hf_views_from_shards`).

    Nothing is copied beyond the TP gather and nothing crosses PP stages or EP ranks: for readers
    of the weights in place (the manifest's checksums), which combine the stages' results
    themselves.  A routed expert is yielded only on its owner EP rank (its ETP shards gathered).
    """
    spec = spec or unwrap(model).megarl_spec
    for _rule, _owner, _ep_owner, views in _merged_rules(
            model, spec, lambda rule, shards: mapping.hf_views_from_shards(rule, shards, spec)):
        for name, (shape, view) in (views or {}).items():
            yield name, shape, view


@torch.no_grad()
def iter_hf_tensors(model, spec: Optional[ModelSpec] = None, dtype: Optional[torch.dtype] = None,
                    device: Optional[str] = "cpu",
                    out: Optional[Callable[[str, Tuple[int, ...], torch.Tensor], torch.Tensor]] = None,
                    names: Optional[frozenset] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Collective: yield ``(hf_name, full logical tensor)`` on every rank, in canonical order.

    All ranks of the model-parallel group must iterate this generator to the end together.
    The owner PP stage gathers the TP shards and merges them with the mapping; the merged
    HF tensors are then broadcast over the PP group.  Only one parameter's tensors are alive
    at a time.  Tensors are moved to ``device`` (``None``: left where they were gathered,
    e.g. on the GPU for a CUDA-IPC consumer) and cast to ``dtype`` when given.  ``out`` is
    passed to :func:`megarl.models.mapping.hf_from_shards`: where the tensors it has to build
    (the de-interleaved Q, K and V) are built, e.g. in their final place in a rollout engine.
    ``names``: only the parameters with one of these HF names (the same set on every rank).
    """
    from megatron.core import parallel_state as ps

    first = unwrap(model)
    spec = spec or first.megarl_spec
    pp_rank, pp, _, _ = _pp_tp()
    ep_rank, ep, _, _ = _ep_etp()
    shapes = mapping.hf_shapes(spec)
    pp_group = ps.get_pipeline_model_parallel_group()
    ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
    param_dtype = next(first.parameters()).dtype
    dev = next(first.parameters()).device
    for rule, owner, ep_owner, merged in _merged_rules(
            model, spec, lambda rule, shards: mapping.hf_from_shards(rule, shards, spec, out=out), names=names):
        # a mapped buffer (DeepSeek-V3's expert-score bias) is float32 whatever the weights are, and
        # stays so in the stream: the dtype megatron routes with and the checkpoints hold
        buffer = rule.megatron_name.endswith(mapping.MAPPED_BUFFERS)
        held_dtype = torch.float32 if buffer else param_dtype
        for name in rule.hf_names:
            t = merged[name] if merged is not None else None
            if ep_owner is not None and ep > 1 and owner == pp_rank:
                # a routed expert: from its EP rank to the other EP ranks of the owner stage
                t = t.contiguous() if ep_owner == ep_rank else torch.empty(shapes[name], dtype=held_dtype, device=dev)
                dist.broadcast(t, src=dist.get_global_rank(ep_group, ep_owner), group=ep_group)
            if pp > 1:
                if owner == pp_rank:
                    t = t.contiguous()
                else:
                    t = torch.empty(shapes[name], dtype=held_dtype, device=dev)
                dist.broadcast(t, src=dist.get_global_rank(pp_group, owner), group=pp_group)
            t = t.to(device=device or t.device, dtype=torch.float32 if buffer else (dtype or t.dtype))
            yield name, t
        del merged


def hf_config_for_export(spec: ModelSpec, dtype: torch.dtype) -> dict:
    cfg = dict(spec.raw_config)
    cfg["architectures"] = [spec.architecture]
    cfg["model_type"] = spec.family
    cfg["tie_word_embeddings"] = spec.tie_word_embeddings
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    cfg.pop("dtype", None)
    if spec.family in ("qwen2_moe", "qwen3_moe") and "num_experts" not in cfg and "num_local_experts" in cfg:
        # transformers 5 writes these families' num_experts as num_local_experts (its attribute_map);
        # transformers 4 (SGLang before 0.5.23) reads only num_experts, else builds its default 128/60
        cfg["num_experts"] = cfg["num_local_experts"]
    if spec.value_head:
        cfg["num_labels"] = 1
    return cfg


def export_hf(model, out_dir: str, tokenizer_dir: Optional[str] = None,
              dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 2 * 1024**3,
              show_progress: bool = False) -> None:
    """Collective: gather the shards and write an HF checkpoint on global rank 0."""
    model_ = unwrap(model)
    spec = model_.megarl_spec
    # default: the dtype the source checkpoint declared (a bf16 checkpoint trained in fp32 on
    # CPU goes back to bf16 exactly), else the parameters' own
    dtype = dtype or spec.checkpoint_dtype or next(model_.parameters()).dtype
    stream = iter_hf_tensors(model if isinstance(model, (list, tuple)) else model_, spec, dtype=dtype)
    rank0 = (not dist.is_initialized()) or dist.get_rank() == 0
    if show_progress and rank0:
        from tqdm import tqdm

        stream = tqdm(stream, total=len(mapping.hf_shapes(spec)), desc="export", unit="tensor")
    if rank0:
        write_hf_checkpoint(out_dir, stream, hf_config_for_export(spec, dtype),
                            max_shard_bytes=max_shard_bytes, tokenizer_dir=tokenizer_dir)
    else:
        for _ in stream:
            pass
    if dist.is_initialized():
        dist.barrier()
