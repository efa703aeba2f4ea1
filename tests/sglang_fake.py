"""A fake SGLang built from a recorded description of a release's API, for CPU tests.

``docker/sglang_api/sglang-<version>.json`` (recorded from the release's source by
``docker/sglang_api/record.py``) says which ``Engine`` methods exist and with which parameter
names, what they return, whether ``update_weights_from_tensor`` needs a weight-update session,
which memory tags exist and what resuming an unreleased one does, which ``ServerArgs`` and
``sampling_params`` names are accepted, how ``FlattenedTensorBucket`` lays out a bucket, which
classes the serializer admits, which environment variables ``Engine()`` sets in its caller, and
what its weight checker does (actions, request fields, the shape of the answer).
:class:`FakeSGLang` turns that into importable ``sglang.*`` modules whose ``Engine`` enforces
every one of those rules, so ``SGLangRolloutEngine`` runs unmodified against it.  Only the
engine (its scheduler processes, kernels and model) is fake: the fake "model" emits tokens from a
hash of the weights it holds, so a test can tell which weights the engine serves.

Where SGLang's behaviour was not read from source the fake is stricter than SGLang and says so
(releasing an already released tag is treated as fatal).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import inspect
import io
import json
import os
import pickle
import random
import sys
import types
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_DIR = os.path.join(ROOT, "docker", "sglang_api")


def recorded_versions() -> list[str]:
    names = [f[len("sglang-"):-len(".json")] for f in os.listdir(API_DIR) if f.startswith("sglang-") and f.endswith(".json")]
    return sorted(names, key=lambda v: tuple(int(p) for p in v.split(".") if p.isdigit()))


def load_description(version: str) -> dict:
    with open(os.path.join(API_DIR, f"sglang-{version}.json"), encoding="utf-8") as f:
        return json.load(f)


class SchedulerDied(BaseException):
    """What SGLang does to its caller when a scheduler raises: it signals the parent process
    (SIGQUIT), which dies.  A BaseException so that nothing in the code under test can catch it."""


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


def _returns(desc: dict, method: str) -> str:
    return desc["engine"]["methods"][method].get("returns", "None").split(" (")[0]


class FakeSGLang:
    """``sglang.*`` modules for one recorded release; :meth:`install` puts them in sys.modules."""

    def __init__(self, desc: dict):
        self.desc = desc
        self.engines: list = []
        self.modules: dict[str, types.ModuleType] = {}
        self._build()

    # ---- modules -----------------------------------------------------------------------------

    def _module(self, name: str) -> types.ModuleType:
        if name not in self.modules:
            mod = types.ModuleType(name)
            mod.__fake__ = True
            self.modules[name] = mod
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(self._module(parent), child, mod)
        return self.modules[name]

    def _build(self):
        d = self.desc
        root = self._module("sglang")
        root.__version__ = d["sglang_version"]
        bucket_mod = self._module(d["flattened_bucket"]["module"])
        meta_cls, bucket_cls = _bucket_classes(d["flattened_bucket"])
        for cls in (meta_cls, bucket_cls):  # picklable by reference, as SGLang's own classes
            cls.__module__, cls.__qualname__ = bucket_mod.__name__, cls.__name__
            setattr(bucket_mod, cls.__name__, cls)
        self.bucket_cls = bucket_cls
        ser_mod = self._module(d["serializer"]["module"])
        self.patched = []
        ser_mod.MultiprocessingSerializer = _serializer_class(d, bucket_mod.__name__, self.patched)
        patch = self._module(d["patch_torch"]["module"])
        setattr(patch, d["patch_torch"]["function"], lambda: self.patched.append(True))
        sp_mod = self._module("sglang.srt.sampling.sampling_params")
        sp_mod.SamplingParams = _sampling_params_class(d["sampling_params"]["fields"])
        checker = d.get("weight_checker")
        if checker is not None:
            io_mod = self._module(checker["request"]["module"])
            io_mod.CheckWeightsReqInput = _check_weights_request_class(checker["request"]["fields"])
        engine_mod = self._module(d["engine"]["module"])
        engine_cls = _engine_class(self)
        engine_cls.__module__, engine_cls.__qualname__ = engine_mod.__name__, "Engine"
        engine_mod.Engine = engine_cls
        root.Engine = engine_cls

    def install(self, monkeypatch=None) -> "FakeSGLang":
        for name, mod in self.modules.items():
            if monkeypatch is not None:
                monkeypatch.setitem(sys.modules, name, mod)
            else:
                sys.modules[name] = mod
        return self

    @property
    def engine(self):
        """The one engine created (tests that make several use :attr:`engines`)."""
        assert len(self.engines) == 1, f"{len(self.engines)} engines were created"
        return self.engines[0]


# ---- FlattenedTensorBucket as the release lays it out ----------------------------------------


def _bucket_classes(spec: dict):
    fields = spec["metadata_fields"]
    byte_offsets = spec["offsets"] == "bytes"

    class FlattenedTensorMetadata:
        def __init__(self, *args, **kwargs):
            for k, v in zip(fields, args):
                setattr(self, k, v)
            for k, v in kwargs.items():
                if k not in fields:
                    raise TypeError(f"FlattenedTensorMetadata has no field {k!r}")
                setattr(self, k, v)

    class FlattenedTensorBucket:
        supports_multi_dtypes = spec["multi_dtype"]

        def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
            if named_tensors is not None:
                if not named_tensors:
                    raise ValueError("Cannot create empty tensor bucket")
                if not byte_offsets and len({t.dtype for _, t in named_tensors}) != 1:
                    raise ValueError("this release's bucket holds one dtype")
                flat, meta, idx = [], [], 0
                for name, t in named_tensors:
                    f = t.flatten().view(torch.uint8) if byte_offsets else t.flatten()
                    meta.append(FlattenedTensorMetadata(name=name, shape=t.shape, dtype=t.dtype, start_idx=idx,
                                                        end_idx=idx + f.numel(), numel=f.numel()))
                    flat.append(f)
                    idx += f.numel()
                self.flattened_tensor, self.metadata = torch.cat(flat), meta
            else:
                self.flattened_tensor, self.metadata = flattened_tensor, metadata

        def get_flattened_tensor(self):
            return self.flattened_tensor

        def get_metadata(self):
            return self.metadata

        def reconstruct_tensors(self):
            out = []
            for m in self.metadata:
                t = self.flattened_tensor[m.start_idx:m.end_idx]
                out.append((m.name, (t.view(m.dtype) if byte_offsets else t).reshape(m.shape)))
            return out

    return FlattenedTensorMetadata, FlattenedTensorBucket


# ---- MultiprocessingSerializer: plain pickle (no CUDA IPC on CPU), the release's admission rule --


def _serializer_class(desc: dict, bucket_module: str, patched: list):
    safe = desc["serializer"]["safe_unpickler"]
    allowed_sglang = set(desc["serializer"]["allowed_sglang_globals"])
    prefixes = tuple(p for p in desc["serializer"].get("allowed_module_prefixes", ()) if p.startswith("sglang."))

    class _SafeUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            ok = (module in ("builtins", "collections", "copyreg", "_codecs") or module == "torch"
                  or module.startswith("torch.") or f"{module}.{name}" in allowed_sglang
                  or (module + ".").startswith(prefixes))
            if not ok:
                raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
            return super().find_class(module, name)

    class MultiprocessingSerializer:
        @staticmethod
        def serialize(obj, output_str: bool = False):
            if patched and any(t.device.type == "cpu" for t in _tensors(obj)):
                # monkey_patch_torch_reductions reduces every tensor as a CUDA one (its device index
                # from the IPC handle): seen on 0.5.23 with a CPU tensor
                raise IndexError("tuple index out of range")
            data = pickle.dumps(obj)
            return base64.b64encode(data).decode("utf-8") if output_str else data

        @staticmethod
        def deserialize(data):
            if isinstance(data, str):
                data = base64.b64decode(data, validate=True)
            return (_SafeUnpickler(io.BytesIO(data)) if safe else pickle.Unpickler(io.BytesIO(data))).load()

    return MultiprocessingSerializer


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _sampling_params_class(fields: list[str]):
    class SamplingParams:
        __struct_fields__ = tuple(fields)

        def __init__(self, **kwargs):
            unknown = set(kwargs) - set(fields)
            if unknown:
                raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
            self.__dict__.update(kwargs)

    return SamplingParams


# ---- Engine ----------------------------------------------------------------------------------


def _engine_class(fake: FakeSGLang):
    desc = fake.desc
    attrs = {}
    for name, spec in desc["engine"]["methods"].items():
        if name == "__init__":
            continue
        attrs[name] = _method(name, spec["params"], getattr(FakeEngine, "_" + name))
    return type("Engine", (FakeEngine,), dict(attrs, _fake=fake))


def _method(name: str, params: list[str], impl):
    sig = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for p in params])

    def method(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)  # TypeError on a name this release does not have
        self = bound.arguments.pop("self")
        if self.closed:
            raise RuntimeError(f"Engine.{name} after shutdown()")
        if self.killed_by is not None:
            raise SchedulerDied(f"Engine.{name}: this engine's schedulers were killed by {self.killed_by}")
        self.calls.append((name, dict(bound.arguments)))
        return impl(self, **bound.arguments)

    method.__name__ = name
    method.__signature__ = sig
    return method


class FakeEngine:
    """Base of the generated ``Engine``: the state one engine (all its schedulers) holds."""

    _fake: FakeSGLang

    def __init__(self, **kwargs):
        d = self._fake.desc
        unknown = set(kwargs) - set(d["server_args"]["fields"])
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        for key, value in d["parent_env_overrides"]["vars"].items():  # _set_envs_and_config
            os.environ[key] = "0" if value == "<computed>" else str(value)
        self.kwargs = kwargs
        self.tp_size = kwargs.get("tp_size", 1)
        self.deterministic = bool(kwargs.get("enable_deterministic_inference")) or kwargs.get("rl_on_policy_target") is not None
        with open(os.path.join(kwargs["model_path"], "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        if not config.get("architectures"):  # 0.5.23: a TypeError in its model registry, seen
            raise TypeError("'NoneType' object is not iterable")
        self.vocab_size = int(config["vocab_size"])
        self.config = config
        self.routed: list[torch.Tensor] = []  # what generate(return_routed_experts=True) returned
        self.model_eos = _eos_ids(config.get("eos_token_id"))
        gen = os.path.join(kwargs["model_path"], "generation_config.json")
        if os.path.isfile(gen) and "generation_config.json eos_token_id" in d["eos"]["engine_stops_on"]:
            with open(gen, encoding="utf-8") as f:
                self.model_eos |= _eos_ids(json.load(f).get("eos_token_id"))
        self.weights: dict[str, torch.Tensor] = {}
        self.weights_state = "dummy"  # load_format=dummy: random weights until an update
        self.offloaded: set[str] = set()
        self.session: dict | None = None
        self.calls: list[tuple[str, dict]] = []
        self.fail_next_update: str | None = None  # a test makes the next update answer success=False
        self.closed = False
        self.killed_by: str | None = None
        self.loop = asyncio.new_event_loop()  # Engine.loop: what the tokenizer manager's coroutines run on
        self.tokenizer_manager = _TokenizerManager(self)
        self._fake.engines.append(self)

    # -- the weight checker (utils/weight_checker.py, 0.5.7+) --

    def _parameters(self) -> dict[str, tuple]:
        """The engine model's parameters: the HF checkpoint names of the config (SGLang's own
        fuse q/k/v and gate/up; the backend compares checksums by whatever names come back)."""
        from megarl.models.hf_config import spec_from_hf_config
        from megarl.models.mapping import hf_shapes

        return hf_shapes(spec_from_hf_config(self.config))

    def check_weights(self, action: str):
        """(success, message, per-TP-rank checksum payloads or None), as the schedulers answer.
        ``reset_tensors`` sets every parameter to random values (what an update leaves unwritten
        keeps them); ``checksum`` hashes every parameter (one that was never written, a constant
        of its name: the dummy load format's random weights)."""
        actions = self._fake.desc["weight_checker"]["actions"]
        if action not in actions:
            return False, f"Unsupported action={action!r}", None  # WeightChecker.handle raises; the scheduler reports it
        if action == "reset_tensors":
            dtype = getattr(torch, str(self.kwargs.get("dtype", "bfloat16")).replace("auto", "float32"))
            gen = torch.Generator().manual_seed(len(self.calls))
            for name, shape in self._parameters().items():
                self.weights[name] = torch.randn(shape, generator=gen).to(dtype)
            self.weights_state = "reset"  # random values: served as such until an update lands
        if action != "checksum":
            return True, "Success.", None
        sums = {}
        for name in self._parameters():
            t = self.weights.get(name)
            raw = (name.encode() + b"/dummy") if t is None else t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            sums[name] = hashlib.sha256(raw).hexdigest()[:16]
        overall = hashlib.sha256("".join(f"{n}{c}" for n, c in sorted(sums.items())).encode()).hexdigest()
        return True, "Success.", [
            {"checksums": dict(sums), "per_gpu_checksum": overall,
             "parallelism_info": {"role": "target", "tp_rank": r, "tp_size": self.tp_size, "dp_rank": 0, "dp_size": 1,
                                  "pp_rank": 0, "pp_size": 1, "rank": r, "size": self.tp_size}}
            for r in range(self.tp_size)]

    # -- weights --

    def _begin_weight_update(self, selector="all"):
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = {"loaded": False}
        return True, "Success"

    def _end_weight_update(self):
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    def _update_weights_from_tensor(self, named_tensors=None, load_format=None, flush_cache=True):
        d = self._fake.desc
        if d["weight_update_session"]["required_for_update_weights_from_tensor"] and self.session is None:
            return False, d["weight_update_session"]["rejection_message"]
        if load_format != "flattened_bucket":
            raise NotImplementedError(f"the fake loads load_format='flattened_bucket' only, got {load_format!r}")
        if not isinstance(named_tensors, list) or len(named_tensors) != self.tp_size:
            raise SchedulerDied(f"flattened_bucket wants one payload per TP rank ({self.tp_size}), got {named_tensors!r:.80}")
        if GPU_WEIGHTS in self.offloaded:
            raise SchedulerDied("weights written while their memory is released (illegal memory access)")
        if self.fail_next_update is not None:
            message, self.fail_next_update = self.fail_next_update, None
            return False, message
        serializer = sys.modules[d["serializer"]["module"]].MultiprocessingSerializer
        payload = serializer.deserialize(named_tensors[0])  # each rank reads its own copy
        bucket = self._fake.bucket_cls(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"])
        for name, tensor in bucket.reconstruct_tensors():
            self.weights[name] = tensor.clone()
        self.weights_state = "loaded"
        if self.session is not None:
            self.session["loaded"] = True
        return True, "Success"

    def _flush_cache(self):
        return FlushCacheReqOutput(success=True)

    # -- memory --

    def _tags(self, tags, default_key):
        d = self._fake.desc["memory"]
        tags = list(tags) if tags else list(d[default_key])
        unknown = set(tags) - set(d["tags"].values())
        if unknown:
            raise SchedulerDied(f"memory saver has no tag {sorted(unknown)} in this release")
        return tags

    def _release_memory_occupation(self, tags=None):
        for tag in self._tags(tags, "release_default"):
            if tag in self.offloaded:  # not read from SGLang's source: the fake is stricter
                raise SchedulerDied(f"release of tag {tag!r}, which is already released")
            self.offloaded.add(tag)
            if tag == GPU_WEIGHTS:
                self.weights_state = "released"  # no CPU backup: the content is gone
        return None

    def _resume_memory_occupation(self, tags=None):
        d = self._fake.desc["memory"]
        for tag in self._tags(tags, "resume_default"):
            if tag not in self.offloaded:
                raise SchedulerDied(f"KeyError: {tag!r} (offload_tags.remove in {d['resume_source']}; "
                                    f"the scheduler then signals the parent: {d['scheduler_exception_kills_parent']})")
            self.offloaded.remove(tag)
        return None

    # -- generation --

    def _generate(self, input_ids=None, sampling_params=None, return_logprob=None, return_routed_experts=None,
                  **others):
        used = {k: v for k, v in others.items() if v is not None}
        if used:
            raise NotImplementedError(f"the fake does not emulate {sorted(used)}")
        if self.offloaded:
            raise SchedulerDied(f"generate with released memory {sorted(self.offloaded)}")
        if not (isinstance(input_ids, list) and all(isinstance(p, list) for p in input_ids)):
            raise TypeError("the fake serves batched token ids only")
        if not isinstance(sampling_params, list) or len(sampling_params) != len(input_ids):
            raise TypeError("one sampling_params dict per prompt")
        sp_cls = sys.modules["sglang.srt.sampling.sampling_params"].SamplingParams
        digest = self._weights_digest()
        outs = [self._one(prompt, sp_cls(**params), params, digest, bool(return_logprob))
                for prompt, params in zip(input_ids, sampling_params)]
        # the capturer exists only on an engine started with the server flag; without it the
        # request option returns nothing (managers/scheduler_components/batch_result_processor.py)
        if return_routed_experts and self.kwargs.get(self._fake.desc["routed_experts"]["server_flag"] or "-"):
            for prompt, out in zip(input_ids, outs):
                out["meta_info"]["routed_experts"] = self._routing(prompt, out["output_ids"], digest)
        return outs

    def _routing(self, prompt, tokens, digest):
        """Top-k ids of tokens [0, seqlen - 1) for every decoder layer (zeros in dense layers), int32,
        encoded as the release's tokenizer manager hands it over with skip_tokenizer_init."""
        from megarl.rollout.sglang_outputs import moe_layout_from_config

        spec = self._fake.desc["routed_experts"]
        layout = moe_layout_from_config(self.config)
        rows = len(prompt) + len(tokens) - 1
        ids = torch.zeros(rows, layout.num_hidden_layers, layout.top_k, dtype=torch.int32)
        for t in range(rows):
            for layer in layout.moe_layers:
                rng = random.Random(hashlib.sha256(digest + repr((prompt, tokens[:t], layer)).encode()).digest())
                ids[t, layer] = torch.tensor(rng.sample(range(layout.num_experts), layout.top_k), dtype=torch.int32)
        self.routed.append(ids)
        if spec["encoding_with_skip_tokenizer_init"] == "base64":
            return base64.b64encode(ids.numpy().tobytes()).decode("utf-8")
        return ids

    def _weights_digest(self) -> bytes:
        if self.weights_state != "loaded":
            return self.weights_state.encode()
        h = hashlib.sha256()
        for name in sorted(self.weights):
            t = self.weights[name].contiguous().reshape(-1)
            h.update(name.encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        return h.digest()

    def _one(self, prompt, sp, params, digest, return_logprob):
        d = self._fake.desc
        stop = set(self.model_eos) | set(params.get("stop_token_ids") or ())
        greedy = params.get("temperature", 1.0) == 0.0
        seed = params.get("sampling_seed")
        if greedy:
            stream = b"greedy"
        elif self.deterministic and seed is not None and d["sampling_seed"]["requires_enable_deterministic_inference"]:
            stream = str(seed).encode()
        else:  # a seed is ignored without deterministic inference: draws differ call to call
            stream = str(random.getrandbits(64)).encode()
        tokens, logprobs, finish = [], [], None
        for step in range(int(params.get("max_new_tokens", 128))):
            h = int.from_bytes(hashlib.sha256(digest + stream + repr((prompt, step)).encode()).digest()[:8], "little")
            if stop and h % 4 == 0:
                token = sorted(stop)[(h >> 3) % len(stop)]
            else:
                token = h % self.vocab_size
            tokens.append(token)
            logprobs.append(-((h >> 16) % 1000) / 250.0 - 0.01)
            if not params.get("ignore_eos") and token in stop:
                finish = {"type": "stop", "matched": token}
                break
        if finish is None:
            finish = {"type": "length", "length": len(tokens)}
        meta = {"finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(tokens)}
        if return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(logprobs, tokens)]
        return {"output_ids": tokens, "meta_info": meta}

    def _shutdown(self):
        # entrypoints/engine.py: kill_process_tree(os.getpid(), include_parent=False) -- every
        # child process of the caller, so the schedulers of any other engine it started die too
        # (seen on 0.5.23: a second engine's scheduler, and the test process with it)
        self.closed = True
        self.loop.close()
        for other in self._fake.engines:
            if other is not self and not other.closed:
                other.killed_by = "another engine's shutdown() in the same process (kill_process_tree of its caller)"


GPU_WEIGHTS = "weights"


@dataclass
class CheckWeightsReqOutput:
    success: bool
    message: str


class _TokenizerManager:
    """``Engine.tokenizer_manager``: only ``check_weights``, where the release has the checker,
    answering in the release's recorded shape (0.5.23: ``(success, message, ranks,
    per_engine_checksum)``; 0.5.7: ``CheckWeightsReqOutput``)."""

    def __init__(self, engine: FakeEngine):
        self._engine = engine
        checker = engine._fake.desc.get("weight_checker")
        if checker is not None:
            self.check_weights = self._check_weights
            self._tuple = checker["tokenizer_manager_returns"].startswith("Tuple")

    async def _check_weights(self, obj, request=None):
        engine = self._engine
        if engine.killed_by is not None:
            raise SchedulerDied(f"check_weights: this engine's schedulers were killed by {engine.killed_by}")
        engine.calls.append(("check_weights", {"action": obj.action}))
        ok, message, ranks = engine.check_weights(obj.action)
        if not self._tuple:
            return CheckWeightsReqOutput(success=ok, message=message)
        overall = None if ranks is None else hashlib.sha256(
            "".join(r["per_gpu_checksum"] for r in ranks).encode()).hexdigest()
        return ok, message, ranks, overall


def _check_weights_request_class(fields: list[str]):
    class CheckWeightsReqInput:
        def __init__(self, **kwargs):
            unknown = set(kwargs) - set(fields)
            if unknown:
                raise TypeError(f"CheckWeightsReqInput got unexpected keyword arguments {sorted(unknown)}")
            if "action" not in kwargs:
                raise TypeError("CheckWeightsReqInput needs action")
            self.__dict__.update(kwargs)

    return CheckWeightsReqInput


def _eos_ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}
