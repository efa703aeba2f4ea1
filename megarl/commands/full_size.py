"""The full-size proof of a recipe without its hardware (``python -m megarl.plan``).

Every rank of the recipe's layout is brought up in this one process in turn, on a fake process
group (torch's ``fake`` backend: collectives do nothing, no memory, no GPU) with megatron's
parallel state at the recipe's TP / PP / CP / EP / expert-TP / virtual stages.  For each distinct
position in the layout (data-parallel replicas hold the same shards; one is built) the rank's
model is built at full size on PyTorch's meta device by megarl's own builder, and each of its
parameters is mapped from the HF checkpoint by megarl's own mapping (``shard_from_hf``, the
function the real load calls) reading slices of meta tensors of the checkpoint's shapes.  Then:

* each rank's model builds, and each mapped shard has the parameter's shape;
* every HF tensor is covered exactly once by the shards that hold it: the slices the ranks read
  along its split dimension tile it with no gap and no overlap (a replicated tensor is read whole);
* the parameters over all positions add up to the checkpoint's count (plus the vocabulary
  padding megatron adds, and the output layer's copy of tied embeddings on the last stage);
* memory per rank of the heaviest position, per phase of the time slice: the update (the actor's
  weights, fp32 gradients, optimizer state -- sharded over DP with the distributed optimizer --,
  activations under the recipe's recompute and micro-batches, the reference when it stays on the
  device) and the generation (the engine's weights at ``rollout.tp`` and its KV share,
  ``rollout.mem_fraction_static``), against ``--device-gib``;
* what a real launch would refuse (heads or query groups against TP, experts against EP, layers
  against PP x VPP, an architecture the mapping does not cover) is refused here by name.

The checkpoint itself is never read: only its ``config.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from megarl.errors import MegarlError

GiB = 1024**3


class PlanError(MegarlError):
    """The recipe's model does not map onto its layout at full size; the message names what."""


@dataclasses.dataclass
class Position:
    """One distinct place in the layout: its ranks' coordinates and what its model holds."""

    rank: int  # the first global rank found at this position
    pp: int
    tp: int
    ep: int
    etp: int
    cp: int
    params: int  # parameters this rank holds (its shard sizes)
    expert_params: int  # of which routed experts'


@dataclasses.dataclass
class PlanReport:
    world: int
    positions: List[Position]
    hf_params: int  # the checkpoint's parameter count (from config.json)
    covered: int  # HF tensors covered exactly once
    held: int  # parameters over all positions, logical (each TP shard once, each EP rank's experts once)
    padding: int  # vocabulary rows megatron adds (zero), and a tied embedding's copy on the last stage
    memory: Dict[str, Dict[str, float]]  # phase -> part -> GiB on the heaviest rank
    device_gib: float
    seconds: float
    lines: List[str]


def _gpu_device(dev) -> bool:
    if isinstance(dev, int):  # torch.cuda.current_device()
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, torch.device) and dev.type == "cuda"


class _OnMeta(torch.overrides.TorchFunctionMode):
    """While a plan's model is built, a tensor meant for a GPU stays on the meta device
    (``device=cuda`` in a factory, ``Tensor.cuda()``, ``.to(cuda)``; megatron moves a tied
    embedding's copy with ``.cuda()``): the full-size model takes no memory, on a machine with a
    GPU or without."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _gpu_device(kwargs.get("device")):
            kwargs["device"] = "meta"
        if kwargs.get("pin_memory") and not torch.cuda.is_available():  # megatron's CP index pins; no GPU here
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _gpu_device(args[1]):
            args = (args[0], "meta", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _device_index_without_cuda():
    """``torch.cuda.current_device()`` answering "meta" on a machine without CUDA while a plan's
    model is built (multi-latent attention builds its RoPE tables on it, whatever
    ``use_cpu_initialization`` says, some inside ``with torch.device(...)``)."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "meta"
    try:
        yield
    finally:
        torch.cuda.current_device = original


@contextlib.contextmanager
def _fake_rank(rank: int, world: int, layout):
    """This process as global ``rank`` of ``world`` on a fake process group, with megatron's
    parallel state at ``layout`` (a ParallelLayout)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    try:  # torch's fake process group (its own tests' tool): collectives that do nothing
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise PlanError(f"torch {torch.__version__} has no fake process group "
                        f"(torch.testing._internal.distributed.fake_pg): {e}") from e
    if dist.is_initialized():
        raise PlanError("the full-size plan brings up its own fake world; run it in a process of its own "
                        "(python -m megarl.plan), not under torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.resolved_etp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            create_gloo_process_groups=False)
        yield ps
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


class _SliceRecorder:
    """``read(name, dim, start, stop)`` as the mapping calls it: a meta tensor of the slice's
    shape, each read recorded (``dim`` None: the whole tensor)."""

    def __init__(self, shapes: Dict[str, Tuple[int, ...]]):
        self.shapes = shapes
        self.reads: Dict[str, set] = defaultdict(set)

    def __call__(self, name: str, dim: Optional[int], start: int, stop: int) -> torch.Tensor:
        if name not in self.shapes:
            raise PlanError(f"the mapping reads '{name}', which the checkpoint's config.json does not imply")
        shape = list(self.shapes[name])
        if dim is not None:
            if not 0 <= start < stop <= shape[dim]:
                raise PlanError(f"the mapping reads '{name}' [{start}:{stop}] along dim {dim} of {shape[dim]}")
            shape[dim] = stop - start
        self.reads[name].add((dim, start, stop) if dim is not None else None)
        return torch.empty(shape, device="meta")


def _coverage(shapes: Dict[str, Tuple[int, ...]], reads: Dict[str, set]) -> List[str]:
    """What is wrong with how the positions' reads tile each HF tensor (empty: each covered once)."""
    problems = []
    for name, shape in shapes.items():
        got = reads.get(name)
        if not got:
            problems.append(f"'{name}' {list(shape)} is read by no rank")
            continue
        if None in got:
            if len(got) > 1:
                problems.append(f"'{name}' is read whole by some ranks and in slices by others")
            continue
        dims = {d for d, _, _ in got}
        if len(dims) > 1:
            problems.append(f"'{name}' is sliced along dims {sorted(dims)}")
            continue
        (dim,) = dims
        at = 0
        for _, a, b in sorted(got, key=lambda r: (r[1], r[2])):
            if a != at:
                problems.append(f"'{name}' [{at}:{a}] along dim {dim} is read by no rank" if a > at
                                else f"'{name}' [{a}:{min(b, at)}] along dim {dim} is read by two shards")
            at = max(at, b)
        if at != shape[dim]:
            problems.append(f"'{name}' [{at}:{shape[dim]}] along dim {dim} is read by no rank")
    return problems


def _positions(world: int, layout, build, on_model) -> Tuple[List[Position], int]:
    """Bring up every rank once.  A model is built (``build()``, on meta) once per pipeline stage
    -- the TP, EP, expert-TP, CP and DP ranks of a stage hold parameters of the same shapes; an EP
    rank's experts are named by the global index of its first one at mapping, from the rank's own
    parallel state -- and each distinct (PP, TP, EP, expert-TP, CP) position maps its shards on it
    (``on_model(chunks)``).  Returns the positions and the number of models built."""
    built: Dict[tuple, list] = {}
    seen, out = set(), []
    for rank in range(world):
        with _fake_rank(rank, world, layout) as ps:
            key = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                   ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank(),
                   ps.get_context_parallel_rank())
            if key in seen:
                continue
            seen.add(key)
            stage = key[0]
            if stage not in built:
                built[stage] = build()
            chunks = built[stage]
            on_model(chunks)  # (a CP rank holds CP rank 0's dense shards, but its EP rank's experts)
            params = sum(p.numel() for c in chunks for p in c.parameters())
            experts = sum(p.numel() for c in chunks for n, p in c.named_parameters() if ".experts." in n)
            out.append(Position(rank, *key, params=params, expert_params=experts))
    return out, len(built)


def plan(cfg, world: int, device_gib: float = 80.0) -> PlanReport:
    """The full-size proof of ``cfg`` at ``world`` ranks (module docstring).  Raises PlanError or
    the builder's named refusal where a real launch would fail."""
    from megarl.commands.activation_memory import activation_estimate
    from megarl.models import mapping
    from megarl.models.builder import BuildOptions, build_model, build_model_chunks, padded_vocab_size
    from megarl.models.hf_config import load_spec
    from megarl.runtime.distributed import ParallelLayout

    t0 = time.perf_counter()
    p = cfg.parallel
    spec = load_spec(cfg.model.path)
    layout = ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp)
    layout.validate(world)
    opts = BuildOptions(tp=p.tp, pp=p.pp, params_dtype=torch.float32, vocab_multiple=cfg.model.vocab_multiple,
                        init_weights=False, ep=p.ep, etp=p.etp, sequence_parallel=p.sequence_parallel)
    shapes = mapping.hf_shapes(spec)
    recorder = _SliceRecorder(shapes)
    padded = padded_vocab_size(spec, opts)
    logical = {"held": 0, "seen": set()}
    rules = {r.megatron_name: r for r in mapping.rules(spec)}  # once: DeepSeek-V3's are 45k

    def build():
        with torch.device("meta"), _OnMeta(), _device_index_without_cuda():
            return build_model_chunks(spec, opts) if p.vpp > 1 else [build_model(spec, opts)]

    def on_model(chunks):
        from megatron.core import parallel_state as ps

        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        for chunk in chunks:
            params = dict(mapping.named_mapped_tensors(chunk))
            local_rules = dict(rules)
            if spec.tie_word_embeddings and not spec.value_head:
                local_rules["output_layer.weight"] = mapping.ParamRule(
                    "output_layer.weight", ("model.embed_tokens.weight",), mapping.VOCAB, where="last")
            for canon, local in mapping.stage_param_names(chunk).items():
                rule = local_rules.get(canon)
                if rule is None:
                    raise PlanError(f"megatron parameter '{canon}' has no mapping rule for {spec.architecture}")
                expert = rule.tp_group == mapping.EXPERT_TP_GROUP
                r, n = (etp_rank, etp) if expert else (tp_rank, tp)
                shard = mapping.shard_from_hf(rule, recorder, spec, r, n, padded)
                if tuple(shard.shape) != tuple(params[local].shape):
                    raise PlanError(f"{canon}: the mapped shard is {list(shard.shape)}, megatron's parameter "
                                    f"'{local}' is {list(params[local].shape)} (rank {dist_rank()})")
                # the logical count: each distinct shard once (a replicated tensor as TP rank 0's; the
                # dense part held alike by every EP rank and every CP rank, an expert by its owner)
                split = getattr(params[local], "tensor_model_parallel", False)
                shard_key = (canon, r if split else 0)
                if shard_key not in logical["seen"]:
                    logical["seen"].add(shard_key)
                    logical["held"] += params[local].numel()

    from megarl.runtime import distributed as rt

    before = rt.stage_layers()
    rt.set_stage_layers(p.first_stage_layers, p.last_stage_layers)  # an uneven pipeline split, if any
    try:
        positions, models = _positions(world, layout, build, on_model)
    finally:
        rt.set_stage_layers(*before)
    problems = _coverage(shapes, recorder.reads)
    if problems:
        raise PlanError(f"{len(problems)} HF tensor(s) not covered exactly once at tp {p.tp} pp {p.pp} ep {p.ep}: "
                        + "; ".join(problems[:5]))
    from megarl.commands.engine_plan import engine_reads

    r = cfg.rollout
    problems = _coverage(shapes, engine_reads(spec, r.tp, r.ep))
    if problems:
        raise PlanError(f"SGLang at rollout.tp={r.tp} (rollout.ep={r.ep}) would not hold {len(problems)} HF tensor(s) "
                        "exactly once: " + "; ".join(problems[:5]))
    hf_params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    tied_copy = spec.vocab_size * spec.hidden_size if (spec.tie_word_embeddings and p.pp > 1) else 0
    padding = (padded - spec.vocab_size) * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    padding += tied_copy + ((padded - spec.vocab_size) * spec.hidden_size if tied_copy else 0)
    held = logical["held"]
    if held != hf_params + padding:
        raise PlanError(f"the positions hold {held:,} parameters; the checkpoint has {hf_params:,} "
                        f"(+ {padding:,} of vocabulary padding and tied copies)")
    memory = _memory(cfg, spec, world, positions, hf_params, device_gib, activation_estimate)
    name = str(spec.raw_config.get("dtype") or spec.raw_config.get("torch_dtype") or "bfloat16")
    lines = [f"full-size plan of {cfg.recipe}: {spec.architecture} from {cfg.model.path}/config.json, "
             f"{hf_params / 1e9:.2f} B parameters ({name.replace('torch.', '')})",
             f"  layout   world {world} = tp {p.tp} x pp {p.pp}{f' x vpp {p.vpp}' if p.vpp > 1 else ''} x cp {p.cp} "
             f"x dp {world // (p.tp * p.pp * p.cp)}"
             + (f"; experts over ep {p.ep} x expert tp {layout.resolved_etp}" if spec.moe is not None else "")
             + f"; {world} ranks brought up, {len(positions)} distinct positions mapped, {models} model(s) built "
             "on the meta device",
             f"  shards   every one of {len(shapes)} HF tensors covered exactly once; the positions hold "
             f"{held:,} = the checkpoint's {hf_params:,} + {padding:,} (vocabulary padding, tied copies)",
             f"  engine   SGLang at rollout.tp {r.tp}" + (f", rollout.ep {r.ep}" if r.ep > 1 else "")
             + f": its ranks' shards of the streamed tensors tile each of them once",
             f"  per rank {min(x.params for x in positions) / 1e9:.3f}-{max(x.params for x in positions) / 1e9:.3f} B "
             f"parameters"]
    for phase, parts in memory.items():
        total = sum(parts.values())
        lines.append(f"  {phase:<8} " + " + ".join(f"{k} {v:.1f}" for k, v in parts.items())
                     + f" = {total:.1f} GiB of {device_gib:g}" + ("" if total <= device_gib else "  DOES NOT FIT"))
    seconds = time.perf_counter() - t0
    lines.append(f"  proof took {seconds:.1f} s")
    return PlanReport(world, positions, hf_params, len(shapes), held, padding, memory, device_gib, seconds, lines)


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _memory(cfg, spec, world: int, positions: List[Position], model_params: int, device_gib: float,
            activation_estimate) -> Dict[str, Dict[str, float]]:
    """GiB on the heaviest position, per phase of the time slice (module docstring)."""
    from megarl.commands.dry_run import _DTYPE_BYTES

    p, r = cfg.parallel, cfg.rollout
    name = str(spec.raw_config.get("dtype") or spec.raw_config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    wb = _DTYPE_BYTES.get(name, 2)
    dp = world // (p.tp * p.pp * p.cp)
    expert_dp = world // (p.ep * (p.etp or p.tp) * p.pp)
    heavy = max(positions, key=lambda x: x.params)
    dense, experts = heavy.params - heavy.expert_params, heavy.expert_params
    state = (4 if wb < 4 else 0) + (8 if cfg.actor.optim.optimizer == "adam" else 0)
    # megarl's default on CUDA: the distributed optimizer (parallel.distributed_optimizer null)
    shard = p.distributed_optimizer is not False
    trained = heavy.params
    if cfg.actor.lora.rank:  # the base frozen: gradients and optimizer state for the adapters only
        from megarl.commands.dry_run import lora_params

        trained = lora_params(spec, cfg.actor.lora, p.tp, p.pp, ep=p.ep, etp=p.etp,
                              stage_layers=(p.first_stage_layers, p.last_stage_layers))[1]
        dense, experts = trained, 0
    opt = (dense / (dp if shard else 1) + experts / (expert_dp if shard else 1)) * state
    actor = {"weights": heavy.params * wb / GiB, "grads": trained * 4 / GiB, "optimizer": opt / GiB}
    update = dict(actor, activations=activation_estimate(cfg, spec, dp)["total"] / GiB)
    resident = {}
    if cfg.critic is not None and not cfg.critic.offload and not cfg.critic.lora.rank:
        # the critic's trunk is the actor's (its value head in place of the output layer): counted alike
        resident["critic"] = sum(actor.values())
    if cfg.reference.enabled and not cfg.reference.offload and not (cfg.actor.lora.rank and cfg.reference.path is None):
        resident["reference"] = heavy.params * wb / GiB
    update.update(resident)
    engine = model_params * wb / max(r.tp, 1) / GiB
    generate = {"engine weights": engine,
                "kv cache": max(r.mem_fraction_static * device_gib - engine, 0.0)}
    if not cfg.actor.offload:  # the actor stays on the device while the engine generates
        generate["actor"] = sum(actor.values())
    generate.update(resident)
    return {"update": update, "generate": generate}
