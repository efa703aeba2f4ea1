"""The CPU accommodations for megatron-core (megarl/runtime/cpu_compat.py) are pinned to the
megatron-core surface they patch: if an upgrade moves it, these tests fail loudly."""

import importlib.util
import inspect
import subprocess
import sys

import pytest

from megarl.runtime import cpu_compat


def _run_without_cuda(code: str) -> list:
    """The words ``code`` prints, run in a fresh interpreter that sees no CUDA device (it must
    exit 0: its stderr is the failure message)."""
    from tests._dist import subprocess_env

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(subprocess_env(), CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_megatron_core_version_is_verified():
    v = cpu_compat.megatron_core_version()
    assert v.startswith(cpu_compat.VERIFIED_MEGATRON_CORE), (
        f"megatron-core {v}: re-verify megarl/runtime/cpu_compat.py and update VERIFIED_MEGATRON_CORE")


def test_patched_surfaces_still_exist():
    from megatron.core import tensor_parallel
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules

    # the CUDA-only assert we route around is still there (else the patch can go): read from the
    # module's source file, which holds the original whether or not install() rebound the name
    src = inspect.getsource(clip_grads)
    assert "def clip_grad_by_total_norm_fp32(" in src and "torch.cuda.FloatTensor" in src
    assert hasattr(optimizer, "clip_grad_by_total_norm_fp32")
    assert "inference_rng_tracker" in inspect.signature(
        tensor_parallel.random.initialize_rng_tracker).parameters
    assert "num_tokens" in inspect.signature(finalize_model_grads).parameters
    params = inspect.signature(RotaryEmbedding._apply_scaling).parameters
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert k in params, k
    # the loss contract relies on the 3-tuple path not rescaling under calculate_per_token_loss
    src = inspect.getsource(schedules.forward_step_calc_loss)
    assert "if not config.calculate_per_token_loss" in src
    # megatron still hard-codes device="cuda" in the schedules and the local attention's causal
    # mask: the device rewrite is needed
    assert 'device="cuda"' in inspect.getsource(schedules)
    from megatron.core.transformer import utils as transformer_utils

    assert 'device="cuda"' in inspect.getsource(transformer_utils.get_default_causal_mask)


def test_moe_surfaces_still_need_the_accommodations():
    """The two MoE accommodations: the router GEMM still reads a ``te_general_gemm`` that only the
    transformer-engine import binds (else ``_patch_router_gemm`` can go), and the alltoall token
    dispatcher still creates a CUDA stream (else CPU runs need not fall back to allgather)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    src = inspect.getsource(moe_utils.RouterGatingLinearFunction.forward)
    assert "te_general_gemm is not None" in src and "torch.mm(" in src
    head = inspect.getsource(moe_utils).split("HAVE_TE = True", 1)[0]
    assert "te_general_gemm," in head and "except ImportError" in inspect.getsource(moe_utils)
    assert "torch.cuda.Stream()" in inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher.__init__)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="transformer-engine binds te_general_gemm itself")
def test_router_gemm_fails_without_the_accommodation_and_runs_with_it():
    """Without transformer-engine, megatron's router GEMM raises NameError until cpu_compat binds
    the name; with it, the router logits are the fp32 ``x @ W.T``."""
    code = (
        "import torch\n"
        "from megatron.core.transformer.moe import moe_utils\n"
        "x, w = torch.randn(3, 8), torch.randn(4, 8)\n"
        "try:\n"
        "    moe_utils.router_gating_linear(x, w, None, torch.float32)\n"
        "    print('no error')\n"
        "except NameError as e:\n"
        "    assert 'te_general_gemm' in str(e), e\n"
        "    print('NameError')\n"
        "from megarl.runtime import cpu_compat\n"
        "cpu_compat.install()\n"
        "y = moe_utils.router_gating_linear(x, w, None, torch.float32)\n"
        "assert torch.equal(y, torch.mm(x, w.t()))\n"
        "print('fixed')\n"
    )
    assert _run_without_cuda(code) == ["NameError", "fixed"]


def test_local_norm_refuses_sequence_parallel_and_the_stand_in_marks_it():
    """megatron's torch norm asserts ``not config.sequence_parallel`` (else the stand-in can go);
    ``cpu_layers.SequenceParallelTorchNorm`` builds the same norm, with its weight marked
    ``sequence_parallel`` (the flag finalize_model_grads sums over TP ranks by), and its outputs
    are the plain norm's."""
    code = (
        "import torch\n"
        "from megatron.core.transformer.transformer_config import TransformerConfig\n"
        "from megatron.core.transformer.torch_norm import WrappedTorchNorm\n"
        "cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization='RMSNorm',\n"
        "                        layernorm_epsilon=1e-6, tensor_model_parallel_size=2, sequence_parallel=True)\n"
        "try:\n"
        "    WrappedTorchNorm(config=cfg, hidden_size=8, eps=1e-6)\n"
        "    print('built')\n"
        "except AssertionError as e:\n"
        "    assert 'sequence parallel' in str(e), e\n"
        "    print('refused')\n"
        "from megarl.models.cpu_layers import SequenceParallelTorchNorm\n"
        "norm = SequenceParallelTorchNorm(config=cfg, hidden_size=8, eps=1e-6)\n"
        "assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True\n"
        "assert cfg.sequence_parallel is True  # the caller's config is untouched\n"
        "x = torch.randn(5, 8)\n"
        "assert torch.equal(norm(x), torch.nn.RMSNorm(8, eps=1e-6)(x))\n"
        "cfg.sequence_parallel = False\n"
        "assert not hasattr(SequenceParallelTorchNorm(config=cfg, hidden_size=8).weight, 'sequence_parallel')\n"
        "print('marked')\n"
    )
    assert _run_without_cuda(code) == ["refused", "marked"]


def test_moe_dispatcher_choice():
    """CPU: a mixture-of-experts config gets the allgather dispatcher; a dense one is untouched."""
    dense = {"num_layers": 2}
    assert "moe_token_dispatcher_type" not in cpu_compat.adjust_transformer_config(dense)
    moe = cpu_compat.adjust_transformer_config({"num_moe_experts": 4, "moe_token_dispatcher_type": "alltoall"})
    assert moe["moe_token_dispatcher_type"] == ("allgather" if cpu_compat.on_cpu() else "alltoall")


def test_install_is_inert_when_cuda_is_present():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "orig = torch.cuda.current_device\n"
        "from megarl.runtime import cpu_compat\n"
        "assert cpu_compat.install() is False\n"
        "assert torch.cuda.current_device is orig\n"
        "assert not cpu_compat._INSTALLED\n"
        "print('inert')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "inert" in out.stdout, out.stderr


CPU_ONLY = pytest.mark.skipif(not cpu_compat.on_cpu(),
                              reason="the CPU path is only exercised without CUDA (install() being inert on "
                                     "CUDA is tested above)")


def _mode_on_stack() -> bool:
    """Whether cpu_compat's device-rewriting mode is on this thread's torch function stack."""
    import torch

    n = torch._C._len_torch_function_stack()
    return any(torch._C._get_function_stack_at(i) is cpu_compat._MODE for i in range(n))


@CPU_ONLY
def test_cuda_device_literals_land_on_cpu_only_inside_megatron():
    import torch

    cpu_compat.install()
    assert cpu_compat._MODE is not None
    assert not _mode_on_stack() and not cpu_compat.in_megatron_scope()
    with pytest.raises((RuntimeError, AssertionError)):  # outside megatron the literal is real: no CUDA here
        torch.zeros(2, device="cuda")
    with cpu_compat.megatron_scope():
        assert _mode_on_stack() and cpu_compat.in_megatron_scope()
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.ones(1).to("cuda").device.type == "cpu"
        depth = torch._C._len_torch_function_stack()
        with cpu_compat.megatron_scope():  # reentrant: the mode is pushed once
            assert torch._C._len_torch_function_stack() == depth
        assert _mode_on_stack()
    assert not _mode_on_stack() and not cpu_compat.in_megatron_scope()
    with pytest.raises(ValueError):
        with cpu_compat.megatron_scope():
            raise ValueError("the mode goes away on the way out of an error too")
    assert not _mode_on_stack() and not cpu_compat.in_megatron_scope()
    assert torch.cuda.current_device() == "cpu"  # a plain function patch, not scoped


@CPU_ONLY
def test_scope_is_per_thread_and_composes_with_other_modes():
    import threading

    import torch
    from torch.overrides import TorchFunctionMode

    cpu_compat.install()
    seen = {}

    def other_thread():
        seen["scope"] = cpu_compat.in_megatron_scope()
        seen["on"] = _mode_on_stack()
        with cpu_compat.megatron_scope():
            seen["dev"] = torch.zeros(1, device="cuda").device.type

    with cpu_compat.megatron_scope():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert seen == {"scope": False, "on": False, "dev": "cpu"}

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    with Counting():  # a mode already on the stack: ours goes above it and leaves it in place
        with cpu_compat.megatron_scope():
            assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert not _mode_on_stack() and torch._C._len_torch_function_stack() == 1
    assert Counting.calls >= 1


def test_entry_points_exist():
    """Every megatron entry point the mode is scoped to is still there (installed or not: the
    wrapping is checked below, after an explicit install)."""
    for module, path in cpu_compat.ENTRY_POINTS:
        _owner, _name, fn = cpu_compat._resolve(module, path)
        assert callable(fn), (module, path)
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    for cls in (FP32Optimizer, ChainedOptimizer):
        for name in ("step", "zero_grad", "state_dict", "load_state_dict", "sharded_state_dict"):
            assert name in cls.__dict__, (cls, name)


@CPU_ONLY
def test_entry_points_are_wrapped_where_megarl_reaches_them():
    cpu_compat.install()
    # every entry point and every optimizer method the mode is scoped to
    for module, path in cpu_compat.ENTRY_POINTS:
        _owner, _name, fn = cpu_compat._resolve(module, path)
        assert getattr(fn, "_megarl_scoped", False), (module, path)
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    for cls in (FP32Optimizer, ChainedOptimizer):
        for name in ("step", "zero_grad", "state_dict", "load_state_dict", "sharded_state_dict"):
            assert getattr(cls.__dict__[name], "_megarl_scoped", False), (cls, name)
    # the MoE router GEMM reads te_general_gemm, which install() binds on CPU
    from megatron.core.transformer.moe import moe_utils

    assert "te_general_gemm" in vars(moe_utils)
    # megatron's layer classes stay megatron's: the stand-ins are subclasses (models/cpu_layers.py)
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for fn in (DotProductAttention.forward, DotProductAttention.__init__, WrappedTorchNorm.__new__):
        assert fn.__module__.startswith("megatron.") and not hasattr(fn, "__wrapped__"), fn
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # re-exports (imported by name before install) are rebound too
    for fn in (tensor_parallel.vocab_parallel_cross_entropy, dist_checkpointing.save, dist_checkpointing.load,
               get_forward_backward_func(pp_size=1, vp_size=None),
               get_forward_backward_func(pp_size=2, vp_size=None)):
        assert getattr(fn, "_megarl_scoped", False), fn
    cpu_compat.install()  # idempotent: nothing is wrapped twice
    assert not getattr(tensor_parallel.vocab_parallel_cross_entropy.__wrapped__, "_megarl_scoped", False)


#: megatron-core names megarl imports that are not entry points (ENTRY_POINTS) and why that is
#: fine: they hold configuration or layer specs, answer parallel-state queries, are only
#: type-checked, or run inside an entry point.
_NOT_ENTRY_POINTS = {
    "megatron.core.parallel_state": "rank / group queries; initialize / destroy are entry points",
    "megatron.core.dist_checkpointing": "save / load are entry points",
    "megatron.core.distributed.DistributedDataParallel": "its methods are entry points",
    "megatron.core.distributed.DistributedDataParallelConfig": "configuration",
    "megatron.core.distributed.finalize_model_grads": "called by the schedule (an entry point)",
    "megatron.core.models.gpt.GPTModel": "its methods are entry points",
    "megatron.core.models.gpt.gpt_layer_specs": "layer specs",
    "megatron.core.optimizer.OptimizerConfig": "configuration",
    "megatron.core.optimizer.get_megatron_optimizer": "an entry point",
    "megatron.core.optimizer.clip_grads": "patched by cpu_compat",
    "megatron.core.optimizer.optimizer": "patched by cpu_compat",
    "megatron.core.optimizer.optimizer.MegatronOptimizer": "its subclasses' methods are entry points",
    "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler": "learning-rate arithmetic in Python",
    "megatron.core.packed_seq_params.PackedSeqParams": "a dataclass",
    "megatron.core.pipeline_parallel.get_forward_backward_func": "returns a schedule, an entry point",
    "megatron.core.tensor_parallel": "cpu_compat: random.* are entry points",
    "megatron.core.tensor_parallel.layers": "isinstance checks and parameter attributes",
    "megatron.core.tensor_parallel.layers.set_tensor_model_parallel_attributes": "parameter attributes (the LoRA "
                                                                                 "adapters' TP split)",
    "megatron.core.tensor_parallel.mappings": "the LoRA adapters' TP / SP region functions, called inside the "
                                              "model's forward (an entry point); no device literal",
    "megatron.core.transformer.mlp.apply_swiglu_sharded_factory": "a gated fc1 adapter's checkpoint sharding "
                                                                  "(applied by dist_checkpointing, an entry point)",
    "megatron.core.transformer.utils.make_sharded_tensors_for_checkpoint": "sharded-tensor descriptors of the LoRA "
                                                                           "adapters (checkpoint metadata)",
    "megatron.core.tensor_parallel.random": "patched by cpu_compat (activation recomputation)",
    "megatron.core.tensor_parallel.gather_from_sequence_parallel_region": "called by the value head inside the "
                                                                          "model's forward (an entry point)",
    "megatron.core.tensor_parallel.reduce_from_tensor_model_parallel_region": "an all-reduce with an identity "
                                                                               "backward; no device literal",
    "megatron.core.tensor_parallel.vocab_parallel_cross_entropy": "an entry point",
    "megatron.core.transformer.dot_product_attention.DotProductAttention": "isinstance checks; subclassed by "
                                                                           "models/cpu_layers.py (built in a spec)",
    "megatron.core.transformer.enums.AttnMaskType": "an enum",
    "megatron.core.transformer.moe.moe_utils": "patched by cpu_compat (the router GEMM)",
    "megatron.core.transformer.moe.moe_utils.clear_aux_losses_tracker": "empties megatron's aux-loss dict",
    "megatron.core.transformer.moe.moe_utils.get_moe_layer_wise_logging_tracker": "reads megatron's aux-loss dict",
    "megatron.core.transformer.moe.router.Router": "isinstance checks",
    "megatron.core.transformer.moe.router_replay.RouterReplayAction": "an enum (the replay runs inside the forward)",
    "megatron.core.transformer.transformer_config.TransformerConfig": "configuration",
    "megatron.core.transformer.torch_norm.WrappedTorchNorm": "subclassed by models/cpu_layers.py (sequence "
                                                             "parallelism; built in a spec)",
    "megatron.core.transformer.spec_utils.ModuleSpec": "layer specs",
    "megatron.core.transformer.transformer_block": "layer specs (cpu_layers.local_spec)",
    "megatron.core.optimizer.distrib_optimizer": "read (HAVE_APEX_OR_TE) and patched by cpu_compat (its step state)",
    "megatron.core.post_training.modelopt.layers.Linear": "a layer-spec class (MLA's duplicated down projections, "
                                                          "built inside GPTModel.__init__, an entry point)",
    "megatron.core.tensor_parallel.layers.ColumnParallelLinear": "an identity check in a layer spec",
    "megatron.core.tensor_parallel.ColumnParallelLinear": "an isinstance check (the output layer the fused "
                                                          "log-probs stand in for)",
    "megatron.core.tensor_parallel.copy_to_tensor_model_parallel_region": "the fused log-probs' stand-in output "
                                                                          "layer, called inside the model's forward "
                                                                          "(an entry point); no device literal",
    "megatron.core.transformer.multi_latent_attention": "patched by cpu_compat (its HAVE_TE flag)",
    "megatron.core.transformer.multi_latent_attention.MLASelfAttention": "isinstance checks and layer specs",
    "megatron.core.transformer.transformer_config.MLATransformerConfig": "configuration",
}


def test_megarl_reaches_megatron_through_known_names():
    """A new megatron import in megarl must be an entry point (ENTRY_POINTS) or listed above:
    megatron code outside the entry points runs without the device rewrite on CPU."""
    import ast
    import pathlib

    root = pathlib.Path(cpu_compat.__file__).parents[1]
    unknown = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("megatron")]
            else:
                continue
            unknown.update(f"{n} ({path.relative_to(root.parent)})" for n in names if n not in _NOT_ENTRY_POINTS)
    assert not unknown, f"megatron names megarl imports that are neither entry points nor listed: {sorted(unknown)}"


@CPU_ONLY
def test_megatron_forward_runs_inside_the_mode(tmp_path, megatron_world):
    """A model built and run through megatron's entry points: the mode is on the stack inside the
    forward (megatron's causal mask for ``attention_mask=None`` is ``torch.ones(..., device="cuda")``,
    transformer/utils.py) and gone after it."""
    import torch

    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.models.forward import teacher_forced_log_probs
    from megarl.models.micro_batches import position_ids_for
    from megarl.models.megatron_ckpt import load_model

    model = load_model(make_tiny_hf_checkpoint(str(tmp_path / "llama"), "llama", seed=3, vocab_size=300))
    assert not _mode_on_stack() and not cpu_compat.in_megatron_scope()
    seen = []

    def hook(_module, _args):
        seen.append((_mode_on_stack(), cpu_compat.in_megatron_scope(), torch.zeros(1, device="cuda").device.type))

    handle = model.decoder.register_forward_pre_hook(hook)
    try:
        tokens = torch.randint(1, 300, (2, 7))
        logits = model(tokens, position_ids_for(tokens), None)
        assert not _mode_on_stack() and not cpu_compat.in_megatron_scope()
        lp = teacher_forced_log_probs(model, tokens)
    finally:
        handle.remove()
    assert seen == [(True, True, "cpu")] * 2
    assert logits.device.type == "cpu" and torch.isfinite(lp).all()
    assert not _mode_on_stack() and not cpu_compat.in_megatron_scope()


def _parameters(fn) -> list:
    """What a caller sees of ``fn``'s signature: each parameter's name, kind and default."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_local_attention_thd_surface():
    """The THD path of the stand-in for megatron's local attention (``cpu_layers.LocalAttention``):
    megatron still refuses packed sequences there (else the stand-in can go), its forward is the
    one the subclass overrides, it hands the core attention ``[t, heads, dim]`` for THD, and
    applies RoPE per ``cu_seqlens`` sequence without transformer-engine."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.models.cpu_layers import LocalAttention

    original = DotProductAttention.forward
    assert "Packed sequence is not supported by DotProductAttention" in inspect.getsource(original)
    assert list(inspect.signature(original).parameters) == [
        "self", "query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias", "packed_seq_params"]
    assert _parameters(LocalAttention.forward) == _parameters(original)
    src = inspect.getsource(attention.Attention.forward)
    assert "query = query.squeeze(1)" in src and "core_attn_out.reshape(core_attn_out.size(0), 1, -1)" in src
    assert "cu_seqlens" in inspect.signature(rope_utils._apply_rotary_pos_emb_thd).parameters


@CPU_ONLY
def test_recompute_needs_the_accommodations_and_runs_with_them():
    """Activation recomputation on CPU (parallel.recompute): megatron's checkpoint saves the CUDA
    RNG state (no CUDA here), its backward re-runs megatron code from the autograd engine, where
    the device-rewriting mode an entry point pushed is not on the stack (a ``device="cuda"``
    tensor there fails), and ``CheckpointWithoutOutput()`` believes FP8 is on (``fp8 is not
    None``) and reads transformer-engine's FP8 state.  Each is shown failing first."""
    code = (
        "import torch\n"
        "from megatron.core.tensor_parallel import random\n"
        "try:\n"
        "    random._get_cuda_rng_state()\n"
        "    print('rng-state')\n"
        "except (AssertionError, RuntimeError):\n"
        "    print('no-rng-state')\n"
        "print('fp8' if random.CheckpointWithoutOutput().fp8 else 'no-fp8')\n"
        "from megarl.runtime import cpu_compat\n"
        "cpu_compat.install()\n"
        "cpu_compat.seed_megatron_rng(3)\n"
        "def step():\n"
        "    x = torch.randn(4, requires_grad=True)\n"
        "    fn = lambda t: t * torch.arange(4.0, device='cuda')  # megatron code's device literal\n"
        "    with cpu_compat.megatron_scope():\n"
        "        random.checkpoint(fn, False, x).sum().backward()\n"
        "    return x.grad\n"
        "wrapped = random.CheckpointFunction.__dict__['backward']\n"
        "random.CheckpointFunction.backward = staticmethod(wrapped.__func__.__wrapped__)\n"
        "try:\n"
        "    step()\n"
        "    print('recomputed-in-mode')\n"
        "except (AssertionError, RuntimeError):\n"
        "    print('recompute-outside-mode')\n"
        "random.CheckpointFunction.backward = wrapped\n"
        "assert torch.equal(step(), torch.arange(4.0))\n"
        "assert random._get_cuda_rng_state() is None and not random.CheckpointWithoutOutput().fp8\n"
        "print('fixed')\n"
    )
    assert _run_without_cuda(code) == ["no-rng-state", "fp8", "recompute-outside-mode", "fixed"]


def test_local_attention_context_parallel_surface():
    """The context-parallel stand-in: megatron's local attention still refuses cp > 1 (else the
    stand-in can go), the constructor's signature is the one ``LocalAttention`` forwards, and
    megatron still pins the index it picks each CP rank's RoPE rows with (the mode drops the
    pinning)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.models.cpu_layers import LocalAttention

    original = DotProductAttention.__init__
    assert "Context parallelism is only supported by TEDotProductAttention" in inspect.getsource(original)
    assert list(inspect.signature(original).parameters)[:2] == ["self", "config"]
    assert [p[0] for p in _parameters(LocalAttention.__init__)] == ["self", "config", "args", "k_channels",
                                                                    "v_channels", "kwargs"]
    assert "pin_memory=True" in inspect.getsource(rope_utils.get_pos_emb_on_this_cp_rank)
    # multi-latent attention passes k_channels / v_channels, which megatron's local attention does
    # not take (TE's does): LocalAttention takes them (else that part of the stand-in can go)
    assert "k_channels" not in inspect.signature(original).parameters


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="with transformer-engine MLA's HAVE_TE is true and right")
def test_mla_fails_without_the_accommodation_and_builds_with_it():
    """Without transformer-engine, megatron's multi-latent attention reads HAVE_TE as true (its
    guard imports megatron's TE extension, which imports without TE) and fails on
    ``isinstance(..., TELinear)``; ``cpu_compat.patch_mla_te_flag`` sets it false, and a tiny
    DeepSeek-V3 builds."""
    code = (
        "from megatron.core.transformer import multi_latent_attention as m\n"
        "print(m.HAVE_TE, isinstance(m.TELinear, type))\n"
        "from megarl.runtime import distributed as rt\n"
        "rt.initialize(tp=1, pp=1)\n"
        "print(m.HAVE_TE)\n"  # install() leaves it: the builder mends it before it builds MLA
        "from megarl.builtin.tiny_checkpoint import tiny_hf_config\n"
        "from megarl.models.builder import BuildOptions, build_model\n"
        "from megarl.models.hf_config import spec_from_hf_config\n"
        "spec = spec_from_hf_config(tiny_hf_config('deepseek_v3', hidden_size=32, num_heads=4).to_dict())\n"
        "model = build_model(spec, BuildOptions())\n"
        "print(m.HAVE_TE, type(model.decoder.layers[0].self_attention).__name__)\n"
    )
    assert _run_without_cuda(code) == ["True", "False", "True", "False", "MLASelfAttention"]


def test_local_norm_stand_in_surface():
    """``cpu_layers.SequenceParallelTorchNorm.__new__`` forwards megatron's torch norm's
    arguments: megatron's still starts ``(cls, config, hidden_size, eps=1e-5, ...)``."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megarl.models.cpu_layers import SequenceParallelTorchNorm

    theirs, ours = _parameters(WrappedTorchNorm.__new__), _parameters(SequenceParallelTorchNorm.__new__)
    assert theirs[:4] == ours[:4] and [p[0] for p in theirs[:4]] == ["cls", "config", "hidden_size", "eps"]
    assert ours[4][1] is inspect.Parameter.VAR_KEYWORD and len(ours) == 5


def _spec_classes(node, out=None) -> set:
    """Every class named anywhere in a layer or block spec."""
    import dataclasses

    out = set() if out is None else out
    if isinstance(node, type):
        out.add(node)
    elif isinstance(node, (list, tuple)):
        for x in node:
            _spec_classes(x, out)
    elif dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _spec_classes(getattr(node, f.name), out)
    return out


def test_the_local_spec_gets_the_stand_ins(megatron_world):
    """megatron's local spec still names ``DotProductAttention`` and ``WrappedTorchNorm`` (else
    ``cpu_layers.local_spec`` silently substitutes nothing), a layer spec still becomes the block
    megatron's ``TransformerBlock`` derives (final norm: ``LayerNormImpl``), and the stand-ins
    take every place megatron's classes had."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block as tb
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.models.cpu_layers import LocalAttention, SequenceParallelTorchNorm, local_spec

    cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
    layer = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    assert {DotProductAttention, WrappedTorchNorm} <= _spec_classes(layer)
    derived = tb._get_block_submodules(cfg, layer)
    assert derived.layer_specs == [layer] * 2 and derived.layer_norm is tb.LayerNormImpl
    block = local_spec(layer, cfg)
    assert block == local_spec(derived, cfg) and len(block.layer_specs) == 2
    found = _spec_classes(block)
    assert {LocalAttention, SequenceParallelTorchNorm} <= found
    assert not found & {DotProductAttention, WrappedTorchNorm}, found
    assert _spec_classes(layer) >= {DotProductAttention, WrappedTorchNorm}  # megatron's spec is untouched


@CPU_ONLY
def test_pinned_allocations_land_in_plain_memory_inside_megatron():
    import torch

    with pytest.raises(RuntimeError, match="pin_memory"):
        torch.tensor([1, 2], device="cpu", pin_memory=True)
    cpu_compat.install()
    with cpu_compat.megatron_scope():
        t = torch.tensor([1, 2], device="cpu", pin_memory=True)
    assert t.tolist() == [1, 2] and not t.is_pinned()
