"""sglang rollout backend: an in-process ``sglang.Engine`` per inference group, on GPU.

Written against SGLang 0.5.3 .. 0.5.23 (``setup.py`` extra ``gpu``; the Docker image pins 0.5.23).
What each call relies on is recorded, per release, in ``docker/sglang_api/sglang-<v>.json`` (read
from the release's source by ``docker/sglang_api/record.py``), and
``tests/unit/rollout/test_sglang_api_contract.py`` drives this class against a fake engine built from those
records.  Every rank of the group constructs :class:`SGLangRolloutEngine` and calls every method;
the group's first rank owns the engine.  Log-probs are **raw** (``processed_log_probs`` is None).

Differences from the hf backend, stated rather than hidden: SGLang updates weights in place (no
second copy of the model fits next to the KV cache), so once the first bucket of v+1 has been
handed over, v is gone.  Every tensor is checked against the expected manifest *before* it is
handed over (a corrupted tensor is never loaded), generate() is refused from the first bucket
until activate(), and a failed load leaves the engine with no active version (the control plane
must reload one) unless nothing had been handed over yet, in which case it stays on v.

Beside it: :mod:`megarl.rollout.sglang_release` (what each release offers and answers),
:mod:`megarl.rollout.sglang_outputs` (generate() inputs and outputs, pure functions) and
:mod:`megarl.rollout.sglang_group` (the collectives of an inference group).  What each SGLang call
relies on, release by release: docs/gpu.md, "SGLang calls, release by release".
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence

import torch

from megarl.rollout.protocol import (
    ActivationReport,
    EngineAsleepError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    LoadReport,
    RolloutBusyError,
    RolloutError,
    SamplingParams,
    candidate_seed,
)
from megarl.rollout.lifecycle import VersionLifecycle
from megarl.rollout.manifest_receiver import ManifestReceiver
from megarl.models.safetensors_io import model_dir_eos_token_ids
from megarl.rollout.sglang_group import InferenceGroup
from megarl.rollout.sglang_outputs import (
    MoELayout,
    moe_layout_from_config,
    result_from_sglang_output,
    routed_experts_from_sglang_output,
    sglang_sampling_params,
)
from megarl.rollout.sglang_release import (
    KV_CACHE,
    LOG_PROB_ENV_VARS,
    TRAINER_ENV_VARS,
    WEIGHTS,
    WeightUpdateRejectedError,
    call_success,
    captures_logical_ids,
    generate_accepts,
    import_sglang,
    patch_torch_reductions,
    refuse_dropped_layers,
    refuse_unnamed_architecture,
    restore_env,
    sglang_serializer,
    supports_sampling_seed,
    weight_checker_request,
)
from megarl.rollout.weight_stream import (
    ManifestMismatchError,
    TensorManifest,
    flatten_bucket_by_dtype,
    get_flattened_tensor_bucket_class,
)
from megarl.versions import PolicyVersion

__all__ = ["SGLangRolloutEngine", "WeightsNotWrittenError", "VERIFY_WRITES", "create_engine"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
           "float32": torch.float32, "float": torch.float32}



class WeightsNotWrittenError(RolloutError):
    """A load the engine reported as successful left engine parameters unwritten."""


#: when a load proves every engine parameter was written (SGLangRolloutEngine ``verify_writes``)
VERIFY_WRITES = ("first", "every", "never")


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"sglang backend: dtype must be one of {sorted(_DTYPES)} (or a torch.dtype), got {dtype!r}; "
                         "the weight stream is cast to it, so it cannot be 'auto'")
    return _DTYPES[dtype]



# ---- the engine ---------------------------------------------------------------------------------


def create_engine(model_dir, **kwargs) -> "SGLangRolloutEngine":
    """The backend's entry in :data:`megarl.rollout.BACKENDS`: a clear error for a missing sglang
    before any GPU or distributed set-up, then the engine."""
    import_sglang()
    return SGLangRolloutEngine(model_dir, **kwargs)


class SGLangRolloutEngine(InferenceGroup):
    """One SGLang engine per inference group; every rank of the group constructs this object and
    calls every method (SPMD), the group's first rank owns ``sglang.Engine``.

    Args:
        model_path: exported HF model dir (config.json; weights are replaced by the stream, the
            engine starts with ``load_format="dummy"`` so nothing is read from disk).
        tp_size: SGLang tensor parallel size == number of ranks in ``group``.
        group: torch.distributed process group of this inference group (None when tp_size == 1
            and no torch.distributed): its ranks are the GPUs base_gpu_id .. base_gpu_id+tp-1.
        eos_token_ids: the tokenizer contract's eos ids.  Together with the model dir's own eos
            ids (which SGLang stops on regardless) they are sent as stop ids and reported as
            FinishReason.EOS (:attr:`eos_token_ids`).
        dtype: the engine's dtype, and so the dtype the weight stream is cast to (:attr:`dtype`).
        deterministic_inference: start SGLang with ``enable_deterministic_inference`` so that
            per-candidate seeds are honoured (slower decoding; see docs/gpu.md).
        device: where incoming tensors are staged for the hand-over (default: the current CUDA
            device; the CPU contract test uses ``"cpu"`` with a fake engine).
        engine_kwargs: extra ``ServerArgs`` (e.g. ``attention_backend``, ``enable_memory_saver``).
    """

    log_prob_spaces = frozenset({"raw"})

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        tp_size: int = 1,
        group=None,
        eos_token_ids: Sequence[int] = (),
        dtype: str | torch.dtype = "bfloat16",
        mem_fraction_static: float = 0.5,
        seed: int = 0,
        deterministic_inference: bool = False,
        device: str | torch.device | None = None,
        engine_kwargs: dict | None = None,
        return_routed_experts: bool = False,
        verify_writes: str = "first",
        lora: dict | None = None,
    ):
        sglang = import_sglang()
        if verify_writes not in VERIFY_WRITES:
            raise ValueError(f"sglang backend: verify_writes={verify_writes!r}; choose from {', '.join(VERIFY_WRITES)}")
        self.verify_writes = verify_writes
        self._loads_verified = 0
        import torch.distributed as dist

        self.group = group
        self.tp_size = tp_size
        self.rank_in_group = dist.get_rank(group) if group is not None else 0
        group_size = dist.get_world_size(group) if group is not None else 1
        if group_size != tp_size:
            raise ValueError(f"sglang backend: inference group has {group_size} ranks but tp_size={tp_size}")
        self.src_global_rank = dist.get_global_rank(group, 0) if group is not None else 0
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.dtype = _torch_dtype(dtype)
        self.contract_eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.model_eos_token_ids = model_dir_eos_token_ids(model_path)
        self.eos_token_ids = tuple(dict.fromkeys(self.contract_eos_token_ids + self.model_eos_token_ids))
        for var in LOG_PROB_ENV_VARS:  # raw log-probs; must precede the schedulers' spawn
            os.environ[var] = "1"
        kwargs = dict(
            model_path=os.fspath(model_path),
            tp_size=tp_size,
            base_gpu_id=self.device.index or 0,
            enable_memory_saver=True,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=str(self.dtype).removeprefix("torch."),
            mem_fraction_static=mem_fraction_static,
            random_seed=seed,
            log_level="error",
        )
        if deterministic_inference:
            kwargs["enable_deterministic_inference"] = True
        #: ``actor.lora.engine: adapter``: ``{"rank", "target_modules"}`` (HF module names); the
        #: engine applies the adapter itself (:meth:`load_adapter`), on the base it was loaded with
        self.lora = dict(lora) if lora else None
        if self.lora:
            kwargs.update(enable_lora=True, max_lora_rank=int(self.lora["rank"]),
                          lora_target_modules=list(self.lora["target_modules"]), max_loras_per_batch=1)
        self._base_hash: str | None = None  # the manifest hash of the base a whole load left (adapter mode)
        self._adapter: str | None = None  # the active version's adapter name
        self._staged_adapter: str | None = None
        self._adapter_loads = 0
        kwargs.update(engine_kwargs or {})
        self.moe_layout: MoELayout | None = None
        config_path = os.path.join(os.fspath(model_path), "config.json")
        with open(config_path, encoding="utf-8") as f:
            model_config = json.load(f)
        refuse_unnamed_architecture(model_config, config_path)
        refuse_dropped_layers(model_config, config_path)
        if return_routed_experts:
            if not generate_accepts("return_routed_experts"):
                raise RolloutError(f"sglang backend: return_routed_experts needs SGLang >= 0.5.7 (Engine.generate "
                                   f"takes return_routed_experts); installed: {getattr(sglang, '__version__', '?')}")
            self.moe_layout = moe_layout_from_config(model_config)
            if self.moe_layout is None:
                raise RolloutError(f"sglang backend: return_routed_experts, but {model_path} is a dense model")
            if kwargs.get("ep_num_redundant_experts") and not captures_logical_ids():
                raise RolloutError("sglang backend: this SGLang release records physical expert ids; with "
                                   "ep_num_redundant_experts they are not the model's experts")
            kwargs["enable_return_routed_experts"] = True
        self.deterministic = bool(kwargs.get("enable_deterministic_inference")) or kwargs.get("rl_on_policy_target") is not None
        self._engine, error, status = None, None, (True, "", False)
        if self.rank_in_group == 0:
            saved = {k: os.environ.get(k) for k in TRAINER_ENV_VARS}
            try:
                self._engine = sglang.Engine(**kwargs)
                # the weight-update session API (0.5.21+): every rank must take the same branches
                status = (True, "", all(hasattr(self._engine, m) for m in ("begin_weight_update", "end_weight_update")),
                          self._weight_checker_problem() if verify_writes != "never" else None)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
                error, status = e, (False, f"{type(e).__name__}: {e}", False, None)
            finally:
                restore_env(saved)
        ok, message, self._has_session, checker_problem = self._broadcast(status)
        if error is not None:
            raise error
        if not ok:
            raise RolloutError(f"SGLang Engine() failed on the inference group's first rank: {message}")
        self._has_weight_checker = verify_writes != "never" and checker_problem is None
        if verify_writes != "never" and checker_problem is not None:
            raise RolloutError(f"sglang backend: verify_writes={verify_writes!r} needs SGLang's weight checker with "
                               "per-parameter checksums (Engine.tokenizer_manager.check_weights(CheckWeightsReqInput("
                               f"action='checksum')), SGLang 0.5.23); installed: {getattr(sglang, '__version__', '?')}: "
                               f"{checker_problem}. Set rollout.verify_engine_weights=never to load without proving "
                               "every parameter was written")
        self._with_seed = self.deterministic and supports_sampling_seed()
        self._versions = VersionLifecycle()
        self._staged_manifest: TensorManifest | None = None
        self._released: tuple[str, ...] = ()  # memory-saver tags released by sleep(), resumed by wake()
        self.last_load_error: str | None = None  # why the last load failed (None: it did not)
        self._barrier()

    # ---- versions ----

    @property
    def active_version(self) -> PolicyVersion | None:
        return self._versions.active

    @property
    def asleep(self) -> bool:
        return bool(self._released)

    def staging_target(self, name: str) -> torch.Tensor | None:
        """Always None: tensors are handed to SGLang's own loader (flattened per-dtype buckets
        over CUDA IPC), never built in the engine's parameters by the producer."""
        return None

    def load_weights(
        self,
        version: PolicyVersion,
        named_tensor_buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
        expected_manifest: TensorManifest,
    ) -> LoadReport:
        rx = ManifestReceiver(version, expected_manifest)
        if self.asleep:
            raise EngineAsleepError(f"load_weights({version.short_id}): engine is asleep; wake() first")
        self._versions.refuse_second_load(version)
        if self.device.type == "cuda":  # it rewrites CUDA IPC handles' device index; a CPU tensor has none
            patch_torch_reductions()
        serializer = sglang_serializer()
        bucket_cls = get_flattened_tensor_bucket_class()  # SGLang's own, never megarl's (weight_stream)
        self._versions.begin_load(version)
        self._staged_manifest = None
        self._base_hash, self._staged_adapter = None, None
        verify = self.verify_writes == "every" or (self.verify_writes == "first" and not self._loads_verified)
        written_before: dict[str, str] | None = None  # group rank 0: checksums of the reset parameters
        rx.start()
        session = False  # a weight-update session is open on the engine (group rank 0)
        try:
            for bucket in rx.buckets(named_tensor_buckets):
                self._check_bucket(rx, bucket)  # verify before handing anything to the engine
                on_device = [(n, t.to(self.device, non_blocking=True)) for n, t in bucket]
                flat = flatten_bucket_by_dtype(on_device, bucket_cls=bucket_cls)
                payloads = [
                    serializer.serialize(
                        {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()},
                        output_str=True,
                    )
                    for b in flat.values()
                ]
                gathered = self._gather_payloads(payloads)
                self._versions.loaded_in_place()  # from here v is no longer what the engine holds
                if verify and rx.n_buckets == 1:  # every parameter to random values, and their checksums
                    def reset():
                        nonlocal written_before
                        self._check_weights("reset_tensors")
                        written_before = self._check_weights("checksum")
                        return True, ""

                    self._leader_call("check_weights(reset_tensors, checksum)", reset, RolloutError)
                if not session and self._has_session:
                    session = True  # end_weight_update is owed even if begin fails half-way
                    self._leader_call("begin_weight_update()", lambda: call_success(
                        self._engine.begin_weight_update(), "begin_weight_update"))
                # every rank keeps its flattened tensors alive until this returned (slime)
                self._leader_call(f"update_weights_from_tensor (bucket {rx.n_buckets})",
                                  lambda g=gathered: self._hand_over(g))
                del flat, payloads, on_device, gathered
                if self.device.type == "cuda":
                    torch.cuda.ipc_collect()
            if session:
                session = False
                self._leader_call("end_weight_update()", lambda: call_success(
                    self._engine.end_weight_update(), "end_weight_update"))
            diff = rx.compare()
            if not diff.ok:
                raise ManifestMismatchError(f"{version.short_id}: stream incomplete: {diff.describe()}", diff)
            if verify and rx.n_buckets:
                self._leader_call("check_weights(checksum) after the update",
                                  lambda: self._unwritten(written_before, version), WeightsNotWrittenError)
                self._loads_verified += 1
            self.flush_cache()
            self._versions.stage(version)
            self._staged_manifest = rx.received
            self._base_hash = rx.received.global_hash
            self.last_load_error = None
        except BaseException as e:
            self.last_load_error = f"{version.short_id}: {type(e).__name__}: {e}"
            if session and self.rank_in_group == 0:  # close it, or the next begin is refused
                try:
                    self._engine.end_weight_update()
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    pass
            raise
        finally:  # on failure before any hand-over v is still active; after it, none is (reload)
            self._versions.end_load()
        return rx.report()

    def _check_bucket(self, rx: ManifestReceiver, bucket) -> None:
        """Every rank of the group checks its copy of one bucket against the expected manifest;
        all raise if any rank found a bad tensor (one all-reduce), so none hands it over."""
        error = None
        try:
            for name, tensor in bucket:
                rx.checked(name, tensor)
        except ManifestMismatchError as e:
            error = e
        if not self._all_ok(error is None):
            raise error or ManifestMismatchError(
                f"{rx.version.short_id}: another rank of the inference group rejected bucket {rx.n_buckets}"
            )

    def _gather_payloads(self, payloads: list) -> list | None:
        """Every TP rank's serialized payloads at the group's first rank (None elsewhere), once
        the tensors they point to are complete."""
        self._synchronize()
        gathered = [None] * self.tp_size if self.rank_in_group == 0 else None
        if self.group is not None:
            import torch.distributed as dist

            dist.gather_object(payloads, gathered, dst=self.src_global_rank, group=self.group)
        else:
            gathered = [payloads]
        return gathered

    def _hand_over(self, gathered) -> tuple[bool, str]:
        """Group rank 0: every dtype bucket of one stream bucket into the engine, checking each
        call's ``success``."""
        counts = {len(p) for p in gathered}
        if len(counts) != 1:
            return False, f"TP ranks sent different numbers of dtype buckets: {counts}"
        for i in range(counts.pop()):
            ok, message = call_success(self._engine.update_weights_from_tensor(
                named_tensors=[per_rank[i] for per_rank in gathered],
                load_format="flattened_bucket",
                flush_cache=False,
            ), "update_weights_from_tensor")
            if not ok:
                return False, message
        return True, ""

    def _weight_checker_problem(self) -> str | None:
        """Group rank 0, at start: None when the engine's weight checker returns every
        parameter's checksum (asked once here), else why not -- 0.5.3 has no checker, 0.5.7's
        answers ``CheckWeightsReqOutput`` and has no ``checksum`` action."""
        if weight_checker_request() is None or not hasattr(getattr(self._engine, "tokenizer_manager", None),
                                                           "check_weights"):
            return "it has no weight checker"
        try:
            sums = self._check_weights("checksum")
        except RolloutError as e:
            return str(e)
        return None if sums else "its weight checker returned no parameter checksums"

    def _check_weights(self, action: str) -> dict[str, str]:
        """Group rank 0: SGLang's weight checker; ``checksum`` returns every parameter's checksum
        by engine name (suffixed with the TP rank when there are several)."""
        request = weight_checker_request()
        out = self._engine.loop.run_until_complete(
            self._engine.tokenizer_manager.check_weights(request(action=action), None))
        if not (isinstance(out, tuple) and len(out) == 4):
            raise RolloutError(f"SGLang check_weights(action={action!r}) answered {type(out).__name__} "
                               f"({str(out)[:200]}), not (success, message, ranks, per_engine_checksum)")
        ok, message, ranks, _ = out
        if not ok:
            raise RolloutError(f"SGLang check_weights(action={action!r}) failed: {message}")
        sums = {}
        for rank in ranks or ():
            info = rank["parallelism_info"]
            info = info[0] if isinstance(info, list) else info  # 0.5.23: one entry per runner role (the target)
            for name, digest in rank["checksums"].items():
                sums[name if info["tp_size"] == 1 else f"{name} (tp rank {info['tp_rank']})"] = digest
        return sums

    def _unwritten(self, before: dict[str, str] | None, version: PolicyVersion) -> tuple[bool, str]:
        """Group rank 0, after an update: (ok, message naming every parameter it left as reset)."""
        if not before:
            return False, "the weight checker returned no parameter checksums before the update"
        after = self._check_weights("checksum")
        same = sorted(n for n, digest in before.items() if after.get(n) == digest)
        if same:
            return False, (f"{version.short_id}: the update reported success but left {len(same)} of {len(before)} engine "
                           f"parameters unwritten (the model's loader skipped names it has no parameter for): "
                           f"{', '.join(same[:12])}{' ...' if len(same) > 12 else ''}")
        return True, ""

    def activate(self, version: PolicyVersion) -> ActivationReport:
        self._versions.require_staged(version)
        self.flush_cache()
        previous, self._adapter = self._adapter, self._staged_adapter
        self._staged_adapter = None
        self._versions.activate(version)
        if previous is not None and previous != self._adapter:  # the older adapter is served no more
            self._leader_call(f"unload_lora_adapter({previous})", lambda: self._lora_status(
                self._engine.unload_lora_adapter(previous)), RolloutError)
        return ActivationReport(version.short_id, self._staged_manifest.global_hash, True, True)

    # ---- teacher forcing ----

    def teacher_force(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> tuple[PolicyVersion, list[torch.Tensor]]:
        """Raw log-probs of ``responses`` after ``prompts`` under the active version
        (:class:`~megarl.rollout.protocol.TeacherForcingEngine`): SGLang's input-token log-probs
        from ``logprob_start_len = len(prompt) - 1`` (its first entry, the prompt's last token, has
        none), at temperature 1 in the raw log-prob space (``LOG_PROB_ENV_VARS``), one token
        generated and dropped.  Every rank of the group gets the rows."""
        if len(prompts) != len(responses):
            raise InvalidRequestError(f"teacher_force: {len(prompts)} prompts for {len(responses)} responses")
        for i, p in enumerate(prompts):
            if not p:
                raise InvalidRequestError(f"teacher_force: row {i} has an empty prompt")
        self._versions.refuse_while_loading("teacher_force")
        if self.asleep:
            raise EngineAsleepError("teacher_force refused: engine is asleep; wake() first")
        version = self._versions.require_active("teacher_force", " (none loaded)")
        rows = [i for i, r in enumerate(responses) if len(r)]
        out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.float32) for _ in prompts]

        def score():
            extra = {"lora_path": [self._adapter] * len(rows)} if self._adapter is not None else {}
            outs = self._engine.generate(
                input_ids=[list(prompts[i]) + list(responses[i]) for i in rows],
                sampling_params=[{"max_new_tokens": 1, "temperature": 1.0}] * len(rows),
                return_logprob=True, logprob_start_len=[len(prompts[i]) - 1 for i in rows], **extra)
            values = []
            for i, o in zip(rows, outs, strict=True):
                entries = o["meta_info"]["input_token_logprobs"][1:]
                ids = [int(e[1]) for e in entries]
                if ids != [int(t) for t in responses[i]]:
                    raise RolloutError(f"teacher_force: row {i}: SGLang scored tokens {ids[:8]}..., not the "
                                       f"response {list(responses[i])[:8]}...")
                values.append([float(e[0]) for e in entries])
            return values

        values = self._leader_result("teacher_force", score, run=bool(rows))
        for i, v in zip(rows, values or [], strict=True):
            out[i] = torch.tensor(v, dtype=torch.float32)
        return version, out

    # ---- LoRA adapters (actor.lora.engine: adapter) ----

    @staticmethod
    def _lora_status(out) -> tuple[bool, str]:
        if not hasattr(out, "success"):
            raise RolloutError(f"SGLang's LoRA call returned {out!r}; expected a LoRAUpdateOutput (success, "
                               "error_message) -- has the API changed?")
        return bool(out.success), str(getattr(out, "error_message", ""))

    def load_adapter(self, version: PolicyVersion, tensors, config: dict, base_manifest_hash: str,
                     expected_manifest: TensorManifest) -> LoadReport:
        """:class:`~megarl.rollout.protocol.ServesAdapters`: ``version`` as the loaded base plus
        ``tensors`` (peft format), loaded under a new adapter name through SGLang's
        ``LoadLoRAAdapterFromTensorsReqInput`` with each tensor's sha256, which every TP worker
        checks where it deserialised it.  The adapter in use until :meth:`activate` keeps serving."""
        import time

        from megarl.rollout.sglang_release import adapter_sha256, load_adapter_request

        t0 = time.perf_counter()
        if self.lora is None:
            raise RolloutError(f"load_adapter({version.short_id}): the engine was not started with LoRA "
                               "(actor.lora.engine=adapter)")
        if self.asleep:
            raise EngineAsleepError(f"load_adapter({version.short_id}): engine is asleep; wake() first")
        self._versions.refuse_second_load(version)
        if self._base_hash is None or self._base_hash != base_manifest_hash:
            raise ManifestMismatchError(f"{version.short_id}: the adapter is for the base {base_manifest_hash}, the "
                                        f"engine holds {self._base_hash or 'no verified base'}; load the base first")
        self._versions.begin_load(version)
        name = f"megarl-{version.short_id}-{self._adapter_loads}"
        try:
            def load():
                request = load_adapter_request(name, tensors, config, self.tp_size,
                                               {k: adapter_sha256(t) for k, t in tensors.items()})
                out = self._engine.loop.run_until_complete(
                    self._engine.tokenizer_manager.load_lora_adapter_from_tensors(request, None))
                return self._lora_status(out)

            self._leader_call(f"load_lora_adapter_from_tensors({name})", load, WeightUpdateRejectedError)
            self._adapter_loads += 1
            self._versions.stage(version)
            self._staged_manifest, self._staged_adapter = expected_manifest, name
            self.last_load_error = None
        except BaseException as e:
            self.last_load_error = f"{version.short_id}: {type(e).__name__}: {e}"
            raise
        finally:
            self._versions.end_load()
        return LoadReport(version.short_id, expected_manifest.global_hash, len(tensors),
                          sum(t.numel() * t.element_size() for t in tensors.values()), 1, time.perf_counter() - t0)

    def flush_cache(self) -> None:
        status = (True, "")
        if self.rank_in_group == 0:
            out = self._engine.flush_cache()
            if getattr(out, "success", True) is False:
                status = (False, f"SGLang flush_cache failed: {out}")
        ok, message = self._broadcast(status)
        if not ok:
            raise RolloutError(message)

    # ---- memory ----

    def sleep(self, release_weights: bool = True) -> None:
        """Release KV cache (and weights) for the actor's turn.  Released weights are gone: the
        active version is cleared and the next version must be loaded after wake().  Calling it
        again while asleep releases only what is not released yet."""
        if self._versions.loading is not None:
            raise RolloutBusyError("sleep(): engine is loading")
        wanted = (KV_CACHE, WEIGHTS) if release_weights else (KV_CACHE,)
        tags = tuple(t for t in wanted if t not in self._released)
        if tags:
            self._leader_call(f"release_memory_occupation(tags={list(tags)})", lambda: (
                self._engine.release_memory_occupation(tags=list(tags)), (True, ""))[1], RolloutError)
        self._released += tags
        if WEIGHTS in self._released:
            self._versions.release()
            self._base_hash = None  # an adapter needs its base loaded again

    def wake(self) -> None:
        """Resume exactly the tags sleep() released (resuming others kills SGLang's scheduler, and
        with it this process); a no-op when awake."""
        tags = list(self._released)
        if tags:
            self._leader_call(f"resume_memory_occupation(tags={tags})", lambda: (
                self._engine.resume_memory_occupation(tags=tags), (True, ""))[1], RolloutError)
        self._released = ()

    def close(self) -> None:
        """Nothing to stop here: SGLang's schedulers end with this process.  (:meth:`shutdown`
        stops them now, but SGLang's ``Engine.shutdown`` kills every child process of its caller,
        reward workers included, so the trainer does not call it.)"""

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # ---- generation ----

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """All ranks of the group call with the same requests; rank 0 runs, results are broadcast."""
        self._versions.refuse_while_loading("generate")
        if self.asleep:
            raise EngineAsleepError("generate refused: engine is asleep; wake() first")
        why = f"; last load failed: {self.last_load_error}" if self.last_load_error else ""
        self._versions.require_active("generate", f" (none loaded, or released{why})")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"duplicate request_id in one generate call: {sorted(ids)}")
        if sampling.return_routed_experts and self.moe_layout is None:
            raise InvalidRequestError("return_routed_experts: the engine was not started with "
                                      "return_routed_experts=True (SGLang's enable_return_routed_experts)")
        version_id = self._versions.active.short_id
        rows = [(r, c) for r in requests for c in r.candidates(sampling.n)]
        seeds = [candidate_seed(sampling.seed, r.request_id, c) for r, c in rows]

        def sample():
            extra = {"return_routed_experts": True} if sampling.return_routed_experts else {}
            if self._adapter is not None:  # the active version is the base plus this adapter
                extra["lora_path"] = [self._adapter] * len(rows)
            outs = self._engine.generate(
                input_ids=[list(r.prompt_ids) for r, _ in rows],
                sampling_params=[sglang_sampling_params(sampling, s, self._with_seed, self.eos_token_ids)
                                 for s in seeds],
                return_logprob=True,
                **extra,
            )
            honoured = self._with_seed and not sampling.greedy
            results = [
                result_from_sglang_output(o, r, c, sampling, self.eos_token_ids, version_id, s if honoured else None)
                for o, (r, c), s in zip(outs, rows, seeds, strict=True)
            ]
            if sampling.return_routed_experts:
                results = [dataclasses.replace(res, routed_experts=routed_experts_from_sglang_output(
                    o["meta_info"], len(res.prompt_ids) + len(res.response_ids) - 1, self.moe_layout,
                    f"{res.request_id}/{res.candidate_index}"))
                    if res.finish_reason is not FinishReason.ABORT else res
                    for o, res in zip(outs, results, strict=True)]
            return results

        results = self._leader_result("generate", sample, run=bool(rows))
        return results or []
