"""Everything that lets megatron-core run on a machine without CUDA, in one place.

megatron-core has no supported CPU path: it hard-codes ``device="cuda"`` literals,
``torch.cuda.current_device()`` and ``torch.cuda.synchronize()`` in the pipeline schedules,
p2p communication, tensor-parallel mappings and RoPE.  megarl's tests prove TP/PP/DP layouts
on CPU with gloo, so we redirect those CUDA references to the CPU *only when CUDA is absent*.
On a CUDA machine :func:`install` returns immediately, the wrappers below are never installed
and every function here returns the CUDA behaviour; callers call each unconditionally.

What is patched and why, and what megarl asks of megatron differently on CPU:
docs/cpu.md.  The runtime's choice of process-group backend and compute device (gloo and the
CPU without CUDA) is :mod:`megarl.runtime.distributed`'s, by :func:`on_cpu`.
``tests/multiproc/test_cpu_compat.py`` fails loudly when a megatron-core upgrade changes the surface
patched here.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import warnings
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: "_CudaToCpuMode | None" = None

#: megatron-core versions these accommodations were verified against.
VERIFIED_MEGATRON_CORE = ("0.16.",)


def on_cpu() -> bool:
    """True when this process runs without CUDA (the CPU/gloo path)."""
    return not torch.cuda.is_available()


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=cuda`` to ``cpu``, drops ``pin_memory=True``, turns ``Tensor.cuda()``
    into identity and names a CPU tensor's type as its CUDA twin (``Tensor.type()`` with no
    argument: megatron's distributed optimizer sorts parameters by ``torch.cuda.FloatTensor``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name \
                else name
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):  # page-locked host memory is for copies to a GPU; there is none
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


#: megatron-core's entry points, as ``(module, "function")`` or ``(module, "Class.method")``:
#: every megatron call megarl makes goes through one of them, so the device-rewriting mode is on
#: whenever megatron code runs (what they call, p2p communication, tensor-parallel mappings,
#: RoPE, attention masks, grad-norm and DDP hooks included, runs inside).  Found by reading
#: megarl's ``megatron.core`` imports; a megatron call outside them that meets a CUDA literal
#: fails loudly on CPU ("Torch not compiled with CUDA enabled").  A function is also rebound
#: wherever a ``megatron.*`` or ``megarl.*`` module imported it by name before :func:`install`.
ENTRY_POINTS = (
    # parallel state (megarl.runtime.distributed)
    ("megatron.core.parallel_state", "initialize_model_parallel"),
    ("megatron.core.parallel_state", "destroy_model_parallel"),
    # the model-parallel RNG tracker (seed_megatron_rng)
    ("megatron.core.tensor_parallel.random", "initialize_rng_tracker"),
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed"),
    # the model: construction (initialisers, RoPE tables, tied embeddings), forward,
    # checkpoint layout (megarl.models.builder / megatron_ckpt)
    ("megatron.core.models.gpt.gpt_model", "GPTModel.__init__"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.forward"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.sharded_state_dict"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding._apply_scaling"),
    # DDP: construction (grad buffers), forward, grad sync and zeroing (megarl.models.optim)
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.__init__"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.forward"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.zero_grad_buffer"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.start_grad_sync"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.finish_grad_sync"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.scale_gradients"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.broadcast_params"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.start_param_sync"),
    # the optimizer: construction and every state-touching method (megarl.models.optim,
    # megarl.checkpointing.checkpoint); the methods of each optimizer class are in _OPTIMIZER_METHODS
    ("megatron.core.optimizer", "get_megatron_optimizer"),
    # fp16's loss scaler restored explicitly (megarl.models.optim.load_grad_scaler_states: it
    # moves the scale with .cuda())
    ("megatron.core.optimizer.grad_scaler", "DynamicGradScaler.load_state_dict"),
    # the pipeline schedules get_forward_backward_func returns (it reads these module globals)
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving"),
    # tensor-parallel helpers megarl calls directly (megarl.models.forward)
    ("megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy"),
    # dist_checkpointing (megarl.models.megatron_ckpt, megarl.checkpointing.checkpoint)
    ("megatron.core.dist_checkpointing.serialization", "save"),
    ("megatron.core.dist_checkpointing.serialization", "load"),
)

#: The methods of megatron's optimizer classes that run inside the mode (those a class defines).
_OPTIMIZER_METHODS = ("__init__", "step", "zero_grad", "state_dict", "load_state_dict", "sharded_state_dict",
                      "reload_model_params", "prepare_grads", "step_with_ready_grads", "get_grad_norm",
                      "clip_grad_norm", "count_zeros", "offload_to_cpu", "restore_from_cpu",
                      "save_parameter_state", "load_parameter_state")
_OPTIMIZER_MODULES = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer")

_SCOPE = threading.local()  # .depth: megatron entry points entered on this thread


def _push_mode() -> None:
    torch._C._push_on_torch_function_stack(_MODE)


def _pop_mode() -> None:
    top = torch._C._pop_torch_function_stack()
    if top is not _MODE:  # a mode pushed inside megatron code was left on the stack
        torch._C._push_on_torch_function_stack(top)
        raise RuntimeError(f"cpu_compat: leaving a megatron entry point with {top!r} above the "
                           "device-rewriting mode on the torch function stack")


class _MegatronScope:
    """Reentrant, per-thread: the outermost entry pushes the mode, its exit pops it."""

    __slots__ = ()

    def __enter__(self) -> None:
        depth = getattr(_SCOPE, "depth", 0)
        if depth == 0 and _MODE is not None:
            _push_mode()
        _SCOPE.depth = depth + 1

    def __exit__(self, *exc) -> bool:
        depth = _SCOPE.depth - 1
        _SCOPE.depth = depth
        if depth == 0 and _MODE is not None:
            _pop_mode()
        return False


_MEGATRON_SCOPE = _MegatronScope()


def megatron_scope() -> _MegatronScope:
    """``with megatron_scope(): ...`` runs a block with megatron's CUDA device literals landing on
    the CPU (the wrapped entry points do this themselves).  Reentrant and per thread; without
    :func:`install` (on CUDA) only a counter."""
    return _MEGATRON_SCOPE


def in_megatron_scope() -> bool:
    """True inside a megatron entry point (or :func:`megatron_scope`) on this thread."""
    return getattr(_SCOPE, "depth", 0) > 0


def _scoped(fn):
    """``fn`` run inside :func:`megatron_scope`; a call nested in another entry point goes straight
    through."""
    if getattr(fn, "_megarl_scoped", False):
        return fn

    @functools.wraps(fn)
    def entry_point(*args, **kwargs):
        depth = getattr(_SCOPE, "depth", 0)
        if depth:
            return fn(*args, **kwargs)
        _push_mode()
        _SCOPE.depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            _SCOPE.depth = 0
            _pop_mode()

    entry_point._megarl_scoped = True  # type: ignore[attr-defined]
    return entry_point


def _resolve(module_name: str, path: str):
    """``(owner, attribute name, current value)`` of an entry point."""
    owner = importlib.import_module(module_name)
    *classes, name = path.split(".")
    for c in classes:
        owner = getattr(owner, c)
    return owner, name, getattr(owner, name)


def _rebind_imported(name: str, original, wrapped) -> None:
    """Rebind ``name`` where a loaded megatron / megarl module imported ``original`` by name."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(("megatron.", "megarl.")):
            continue
        if getattr(mod, "__dict__", {}).get(name) is original:
            setattr(mod, name, wrapped)


def _wrap_entry_points() -> None:
    for module_name, path in ENTRY_POINTS:
        owner, name, fn = _resolve(module_name, path)
        wrapped = _scoped(fn)
        if wrapped is fn:
            continue
        setattr(owner, name, wrapped)
        if isinstance(owner, type(sys)):  # a module-level function: also where it was imported
            _rebind_imported(name, fn, wrapped)
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    for module_name in _OPTIMIZER_MODULES:
        for cls in list(vars(importlib.import_module(module_name)).values()):
            if isinstance(cls, type) and issubclass(cls, MegatronOptimizer):
                for name in _OPTIMIZER_METHODS:
                    if name in cls.__dict__:
                        setattr(cls, name, _scoped(cls.__dict__[name]))


def _noop(*_args, **_kwargs):
    return None


def install() -> bool:
    """Install the CPU accommodations once per process; returns True if installed.

    Does nothing (and returns False) when CUDA is available.
    """
    global _INSTALLED, _MODE
    if not on_cpu():
        return False
    if _INSTALLED:
        return True
    # megatron warns once per module that TE/apex are absent; on CPU that is the design.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = _noop  # type: ignore[assignment]
    torch.cuda.empty_cache = _noop  # type: ignore[assignment]
    _MODE = _CudaToCpuMode()
    _wrap_entry_points()
    _patch_grad_clipping()
    _patch_router_gemm()
    _patch_checkpoint_rng()
    _patch_distributed_optimizer_step_state()
    _INSTALLED = True
    return True


def _patch_distributed_optimizer_step_state() -> None:
    """The distributed optimizer over a torch optimizer (no TE / apex) keeps Adam's ``step`` in
    every parameter's state, but a checkpoint's parameter state (``fully_reshardable``) holds the
    moments and the main weights only: ``_set_main_param_and_optimizer_states`` copies every key
    of the state from the loaded tensors and fails on ``step`` (``KeyError``), which
    ``load_state_dict`` has already set from the checkpoint's param groups -- as one tensor shared
    by every parameter, which torch's Adam then increments once per parameter per step (the bias
    correction of the next step goes wrong).  Each parameter gets its own copy of that step, and a
    missing ``step`` is copied onto itself.  Inert where megatron steps with TE's or apex's optimizer."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states
    if getattr(original, "_megarl_cpu", False) or distrib_optimizer.HAVE_APEX_OR_TE:
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                state["step"] = state["step"].clone()  # unshared: torch's Adam increments it in place
                tensors = dict(tensors, step=state["step"])
        return original(self, model_param, tensors)

    set_states._megarl_cpu = True
    cls._set_main_param_and_optimizer_states = set_states


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's ``clip_grad_by_total_norm_fp32`` minus its ``torch.cuda.FloatTensor`` assert.

    Same arithmetic: scale every grad by ``max_norm / (total_norm + 1e-6)`` when that is < 1.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _patch_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu


def _no_cuda_rng_state(*_args, **_kwargs):
    """megatron's ``_get_cuda_rng_state`` on a machine without CUDA: there is no CUDA generator
    to save (the CPU generator's state is saved beside it, and the model-parallel tracker's)."""
    return None


def _set_no_cuda_rng_state(new_state, *_args, **_kwargs) -> None:
    """megatron's ``_set_cuda_rng_state`` on a machine without CUDA: nothing to restore."""
    if new_state is not None:
        raise RuntimeError("a CUDA RNG state to restore on a machine without CUDA")


def _in_mode(fn):
    """``fn`` run with the device-rewriting mode on this thread's torch function stack, whatever
    the scope counter says: the autograd engine runs a Function's backward with the torch
    function stack it keeps for the backward pass, where the mode an entry point pushed is not."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        from torch.overrides import _get_current_function_mode_stack

        if _MODE is None or any(m is _MODE for m in _get_current_function_mode_stack()):
            return fn(*args, **kwargs)
        _push_mode()
        try:
            return fn(*args, **kwargs)
        finally:
            _pop_mode()

    call._megarl_in_mode = True  # type: ignore[attr-defined]
    return call


def _patch_checkpoint_rng() -> None:
    """Activation recomputation: ``tensor_parallel.random.CheckpointFunction`` saves the CUDA RNG
    state in its forward and restores it for the recompute in its backward (without CUDA the CPU
    generator and megatron's tracker are all there is), and its backward re-runs the layers --
    megatron code, with its ``device="cuda"`` causal mask -- from the autograd engine, outside
    the mode the entry point pushed (:func:`_in_mode`)."""
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = _no_cuda_rng_state
    random._set_cuda_rng_state = _set_no_cuda_rng_state
    original_init = random.CheckpointWithoutOutput.__init__
    if not getattr(original_init, "_megarl_no_fp8", False):
        # ``CheckpointWithoutOutput(fp8=False)`` sets ``self.fp8 = fp8 is not None`` -- True -- and
        # its forward then reads transformer-engine's FP8 state, a NameError without TE (the
        # selective recompute of "layernorm" and "moe_act" builds it so); no FP8 without TE
        @functools.wraps(original_init)
        def __init__(self, fp8=False):
            original_init(self, fp8)
            if not fp8:
                self.fp8 = False

        __init__._megarl_no_fp8 = True  # type: ignore[attr-defined]
        random.CheckpointWithoutOutput.__init__ = __init__
    for cls in (random.CheckpointFunction, random.CheckpointWithoutOutputFunction):
        backward = cls.__dict__["backward"]
        fn = backward.__func__ if isinstance(backward, staticmethod) else backward
        if not getattr(fn, "_megarl_in_mode", False):
            cls.backward = staticmethod(_in_mode(fn))


def _patch_router_gemm() -> None:
    """Bind ``moe_utils.te_general_gemm`` to None when transformer-engine did not bind it (the
    router's ``te_general_gemm is not None`` test then picks megatron's ``torch.mm`` path)."""
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None


def patch_mla_te_flag() -> None:
    """Set ``multi_latent_attention.HAVE_TE`` False when transformer-engine is not installed.

    Its import guard imports megatron's TE extension, which imports without TE and binds
    ``TELinear`` to a placeholder (not a class), so the flag reads True and MLA's constructor
    fails on ``isinstance(self.linear_proj, TELinear)``.  With the flag False it takes the path it
    takes without the extension.  Called by the builder before it builds multi-latent attention, not
    by :func:`install`: importing megatron's attention module must wait for SGLang's CPU stand-ins
    (``megarl.rollout.sglang_cpu.prepare``: SGLang's ``flash_mla`` raises ``OSError`` without CUDA)."""
    if not on_cpu():
        return
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None and not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def seed_megatron_rng(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker for this rank.

    On CUDA this is megatron's own ``model_parallel_cuda_manual_seed``.  On CPU the CUDA RNG
    states it needs do not exist; megatron's inference-mode tracker is a correct stand-in as
    long as dropout is 0, which :func:`megarl.models.builder` enforces on CPU.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if on_cpu():
        tensor_parallel.random.initialize_rng_tracker(
            inference_rng_tracker=True, force_reset=True
        )
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def use_transformer_engine(installed: bool) -> bool:
    """Whether to build with transformer-engine's layer spec, given whether TE is ``installed``.

    CUDA: ``installed``.  CPU: never (TE's kernels are CUDA-only; megatron's local spec realises
    the same function)."""
    return installed and not on_cpu()


def params_dtype_problem(dtype: torch.dtype) -> Optional[str]:
    """None when megatron can hold and train parameters in ``dtype`` here, else why not.

    CUDA: always None.  CPU: float32 only (megatron's bf16/fp16 paths type-check CUDA tensors)."""
    if on_cpu() and dtype != torch.float32:
        return "on CPU only float32 is supported (megatron's bf16/fp16 paths type-check CUDA tensors)"
    return None


def model_dtype(default: torch.dtype) -> torch.dtype:
    """The dtype to build a model in when the caller names none: ``default`` (what the
    checkpoint says) on CUDA; float32 on CPU (see :func:`params_dtype_problem`)."""
    return torch.float32 if on_cpu() else default


def adjust_transformer_config(kwargs: dict) -> dict:
    """megatron ``TransformerConfig`` keyword arguments for this machine.

    CUDA: ``kwargs`` unchanged.  CPU: ``use_cpu_initialization=True`` (megatron's device
    initialisers draw from the CUDA RNG tracker on a CUDA device), ``batch_p2p_sync=False``
    (it synchronises CUDA streams around batched p2p) and, for a mixture-of-experts model,
    ``moe_token_dispatcher_type="allgather"`` (the alltoall dispatcher creates a
    ``torch.cuda.Stream``; allgather gathers the tokens over the TP x EP group instead, the
    same function)."""
    if not on_cpu():
        return kwargs
    out = dict(kwargs, use_cpu_initialization=True, batch_p2p_sync=False)
    if out.get("num_moe_experts"):
        out["moe_token_dispatcher_type"] = "allgather"
    return out


def model_to_device(model):
    """The built model on the compute device: ``model.cuda()`` on CUDA; on CPU the model as
    megatron built it (``use_cpu_initialization`` put it on the CPU)."""
    return model if on_cpu() else model.cuda()


def use_distributed_optimizer(requested: Optional[bool]) -> bool:
    """Whether to wrap megatron's distributed optimizer; ``requested`` None means the default:
    yes on CUDA, no on CPU (a float32 CPU run can have it, sharding nothing worth the trouble
    on one machine; the tests prove it there)."""
    if requested is not None:
        return bool(requested)
    return not on_cpu()


def use_local_layer_stand_ins() -> bool:
    """Whether megatron's local attention and torch norm are built as megarl's stand-ins
    (``megarl/models/cpu_layers.py``: packed sequences, context and sequence parallelism without
    transformer-engine): on CPU yes; on CUDA no, megatron's own local layers (only
    transformer-engine's attention packs there)."""
    return on_cpu()


def prepare_optimizer_for_load(optimizer) -> None:
    """Before a checkpoint loads into megatron's distributed optimizer over a torch optimizer (no
    transformer-engine or apex: the CPU), give the torch optimizer the state a step leaves: its
    ``state_dict()`` reads each parameter's ``step`` and asserts they agree, and a fresh torch
    AdamW has none (``assert len(steps) == 1`` fails).  Zero moments and step 0, which the load
    overwrites; the parameters are not touched (a dummy step would move them).  Inert where
    megatron steps with TE's or apex's optimizer (it keeps the step in the param groups)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, distrib_optimizer.DistributedOptimizer) or inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                        state["exp_avg"] = torch.zeros_like(p.data)
                        state["exp_avg_sq"] = torch.zeros_like(p.data)


def megatron_core_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def check_megatron_version() -> None:
    """Fail loudly if megatron-core is a version these accommodations were not verified on."""
    v = megatron_core_version()
    if on_cpu() and not v.startswith(VERIFIED_MEGATRON_CORE):
        raise RuntimeError(
            f"megatron-core {v} is installed, but megarl's CPU accommodations "
            f"(megarl/runtime/cpu_compat.py) were verified on {VERIFIED_MEGATRON_CORE}; "
            "re-verify them (tests/multiproc/test_cpu_compat.py) before running on CPU"
        )
