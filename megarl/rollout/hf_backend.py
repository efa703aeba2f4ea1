"""hf rollout backend: a transformers model built from the exported HF config, fed by the stream.

The CPU default and the embedded default.  Two model instances are held (double buffering):
the *active* one serves generate(), the *standby* one receives the next version's tensors.
load_weights() writes into the standby and verifies the manifest; activate() swaps the two
pointers under a lock (write, synchronise, verify the manifest, and only then switch the
active version atomically).  A bad stream therefore never touches what is being served: the
engine stays on v.  The standby's tensors are looked up by their checkpoint names
(:meth:`_Slot.targets`).

Generation reuses transformers ``generate`` (or, with ``retire_finished``, the decode loop of
megarl/rollout/hf_retiring.py) and its logits warpers; megarl adds two logits processors around
them (:func:`_logits_processors` says which and why).  Routed experts (MoE) are recorded as they
are dispatched (:class:`_RoutingRecorder`).
"""

from __future__ import annotations

import copy
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
from megarl.experience.schema import SampleRouting, compact_expert_dtype
from megarl.rollout.manifest_receiver import ManifestReceiver
from megarl.rollout.weight_stream import ManifestMismatchError, TensorManifest
from megarl.splitmix import shr, splitmix64
from megarl.versions import PolicyVersion

__all__ = ["HFRolloutEngine"]


@dataclass
class _Slot:
    """A model instance and the verified version it holds (None = contents undefined)."""

    model: torch.nn.Module
    version: PolicyVersion | None = None
    manifest: TensorManifest | None = None
    _targets: dict[str, torch.Tensor] | None = None

    def targets(self) -> dict[str, torch.Tensor]:
        """The model's logical tensors by HF name (the parameters themselves, looked up once).

        The standby's tensors are looked up by their checkpoint names
        (``weight_stream.hf_logical_tensors``): a mixture-of-experts layer's routed experts, which
        transformers 5 holds fused, are per-expert views into the fused tensors, so the megatron stream
        (one tensor per expert, from whichever EP rank holds it) lands in place and is checksummed there.
        """
        if self._targets is None:
            from megarl.rollout.weight_stream import hf_logical_tensors

            self._targets = dict(hf_logical_tensors(self.model))
        return self._targets

    def move(self, device) -> None:
        """Move the model; ``.to()`` gives its parameters new storage, so the targets are looked up again."""
        self.model.to(device)
        self._targets = None


class _RawLogProbRecorder:
    """First processor: sees the raw float32 logits; keeps them and their logsumexp.

    Only (batch,) reductions per step: log p(token) = logit[token] - logsumexp(logits) is
    gathered for the chosen token, a full (batch, vocab) log_softmax is never materialised.
    """

    def __init__(self):
        self.raw: torch.Tensor | None = None
        self.raw_lse: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.raw, self.raw_lse = scores, torch.logsumexp(scores, dim=-1)
        return scores  # the warpers below return new tensors; ``raw`` stays unmodified


def counter_uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform in [0, 1) per row: splitmix64 of (row seed, step), all rows at once.

    A counter-based draw: row i's number at step t depends on ``seeds[i]`` and ``t`` only, never
    on the other rows of the batch or on how many were drawn before, so a candidate regenerated
    alone with its seed repeats its tokens.  int64 arithmetic wraps modulo 2**64, as splitmix64
    (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014) needs.
    """
    return shr(splitmix64(seeds, step + 1), 11).double() * (1.0 / (1 << 53))


class _SeededTokenChooser:
    """Last processor: chooses each row's token and records its raw/processed log-probs.

    Sampling: inverse CDF with one uniform per row and step from :func:`counter_uniforms` of
    the row's seed, an exact draw from p at the cost of one cumsum (a per-entry noise tensor,
    Gumbel-style, costs ~10% of a small model's step in RNG alone); filtered entries have
    p = 0 and are never chosen.  Greedy: argmax of the raw logits.
    """

    def __init__(self, recorder: _RawLogProbRecorder, seeds: list[int] | None, size: int | None = None):
        self.recorder = recorder
        # None = greedy; candidate seeds are 63-bit (``protocol.candidate_seed``)
        self.seeds = None if seeds is None else torch.tensor(seeds, dtype=torch.int64)
        self.raw_steps: list[torch.Tensor] = []
        self.processed_steps: list[torch.Tensor] = []
        #: the batch's rows scored in this step (None: all): a decode that retires finished rows
        #: (megarl/rollout/hf_retiring.py) runs the live ones; the steps are recorded over all
        #: ``size`` rows (0 where a row had retired), and the chosen tokens left in ``last_tokens``
        self.rows: torch.Tensor | None = None
        self.size = size
        self.last_tokens: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seeds = self.seeds if self.rows is None or self.seeds is None else self.seeds[self.rows.cpu()]
        if seeds is None:
            tokens = scores.argmax(dim=-1, keepdim=True)
        else:
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            cdf = (scores - lse).exp_().cumsum_(dim=-1)
            u = counter_uniforms(seeds, len(self.raw_steps)).to(scores.device, cdf.dtype)
            # first index whose cdf exceeds u: never a zero-probability (filtered) entry
            u = (u * cdf[:, -1])[:, None]
            tokens = torch.searchsorted(cdf, u, right=True).clamp_max_(scores.shape[-1] - 1)
            self.processed_steps.append(self._all_rows((scores.gather(1, tokens) - lse).squeeze(1)))
        raw = self.recorder.raw
        self.raw_steps.append(self._all_rows(raw.gather(1, tokens).squeeze(1) - self.recorder.raw_lse))
        self.last_tokens = tokens.squeeze(1)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, tokens, 0.0)
        return out

    def _all_rows(self, values: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return values
        full = values.new_zeros(self.size)
        full[self.rows] = values
        return full


_EXPERTS_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")


def moe_experts_modules(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, experts module)`` of every MoE layer, in layer order (empty for a
    dense model).  The experts module is the one a sparse MoE block hands
    ``(hidden_states, top_k_index, top_k_weights)`` to (transformers 5 Qwen2-MoE, Qwen3-MoE,
    Mixtral)."""
    found = []
    for name, module in model.named_modules():
        m = _EXPERTS_MODULE.search(name)
        if m is not None and hasattr(module, "num_experts"):
            found.append((int(m.group(1)), module))
    return sorted(found, key=lambda x: x[0])


class _RoutingRecorder:
    """Forward pre-hooks on the experts modules: the ``top_k_index`` of every call, per layer.

    Routed experts (MoE, ``SamplingParams.return_routed_experts``): a forward pre-hook on every MoE
    layer's experts module (``model.layers.<i>.mlp.experts`` in Qwen2-MoE, Qwen3-MoE and Mixtral:
    ``experts(hidden_states, top_k_index, top_k_weights)``) records ``top_k_index`` as it is handed to
    the experts, so what is recorded is what was dispatched, whatever the router's softmax / top-k
    order and ties.  With the KV cache the prefill call gives the prompt's routing and each decode
    call one token's; the last sampled token is never fed, so it has none (as in SGLang).
    """

    def __init__(self, layers: list[tuple[int, torch.nn.Module]]):
        self.layers = layers
        self.calls: list[list[torch.Tensor]] = [[] for _ in layers]
        self._handles = []

    def __enter__(self):
        for j, (_, module) in enumerate(self.layers):
            def hook(mod, args, kwargs, j=j):
                idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
                self.calls[j].append(idx.detach().to("cpu", copy=True))
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def per_position(self, batch: int, width: int, generated: int) -> torch.Tensor:
        """``(batch, width + generated - 1, layers, top_k)`` int64: the prefill's ``width`` positions,
        then one per decode call.  Raises if the calls are not one prefill plus ``generated - 1``
        single-token steps (a generation strategy this recorder does not know)."""
        out = []
        for j, calls in enumerate(self.calls):
            if len(calls) != generated:
                raise RolloutError(f"routing recorder: layer {self.layers[j][0]} saw {len(calls)} forward calls, "
                                   f"expected 1 prefill + {generated - 1} decode steps")
            k = calls[0].shape[-1]
            steps = [c.reshape(batch, -1, k) for c in calls]
            if steps[0].shape[1] != width or any(t.shape[1] != 1 for t in steps[1:]):
                raise RolloutError(f"routing recorder: layer {self.layers[j][0]} calls have token counts "
                                   f"{[t.shape[1] for t in steps]}, expected [{width}, 1, 1, ...]")
            out.append(torch.cat(steps, dim=1))
        return torch.stack(out, dim=2)


def _logits_processors(sampling: SamplingParams, seeds, n_rows: int):
    """``(processors, chooser)``: the raw log-prob recorder, transformers' warpers for
    ``sampling`` (none when greedy), then the per-candidate seeded chooser, last.

    Generation reuses transformers ``generate`` (KV cache, EOS bookkeeping, padding) -- or, with
    ``retire_finished``, megarl/rollout/hf_retiring.py's decode loop, where a finished row leaves the
    batch and its KV cache -- and transformers' own
    logits warpers (Temperature/TopK/TopP); megarl only adds two logits processors around them: one
    records the raw logits' normaliser, the last one draws the token with a per-candidate
    ``torch.Generator`` (inverse-CDF sampling, exact for the processed distribution) and
    records its processed log-prob, then hands transformers a one-hot score so its greedy argmax
    takes that token.  Per-candidate generators make a candidate's tokens independent of what else
    is in the batch; recording inside the processors avoids keeping (steps x batch x vocab) scores.
    """
    from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    recorder = _RawLogProbRecorder()
    processors = [recorder]
    if not sampling.greedy:
        if sampling.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k >= 1:
            processors.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=sampling.top_p))
    chooser = _SeededTokenChooser(recorder, None if sampling.greedy else seeds, size=n_rows)
    processors.append(chooser)
    return processors, chooser


def _response_end(toks: list, max_new_tokens: int, eos_set: set, stop_set: set) -> tuple[int, FinishReason]:
    """``(length, reason)`` of one generated row: up to and including its first eos or stop
    token, else ``max_new_tokens`` (LENGTH)."""
    length, reason = min(len(toks), max_new_tokens), FinishReason.LENGTH
    for j, t in enumerate(toks[:max_new_tokens]):
        if t in eos_set:
            return j + 1, FinishReason.EOS
        if t in stop_set:
            return j + 1, FinishReason.STOP
    return length, reason


class HFRolloutEngine:
    """Rollout engine on a transformers causal LM.  See the module docstring for the design.

    Args:
        config_dir: an exported HF model directory with ``config.json`` (weights there, if any,
            are ignored: weights only arrive through load_weights).
        eos_token_ids: ids that end a response with FinishReason.EOS (default: the config's).
        pad_token_id: left-padding id for batching (any id; attention masks hide it).
        device, dtype: where and in which dtype the engine's models live; incoming tensors must
            already be in ``dtype`` (a dtype change would change the manifest hash).
        retire_finished: decode with finished rows dropped from the batch and its KV cache
            (megarl/rollout/hf_retiring.py; ``rollout.retire_finished``) instead of transformers'
            ``generate``, which computes every row until the last one ends.
    """

    log_prob_spaces = frozenset({"raw", "processed"})

    def __init__(
        self,
        config_dir: str | os.PathLike,
        *,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        retire_finished: bool = False,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        config_path = os.path.join(os.fspath(config_dir), "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"hf rollout engine: {config_path} not found (need an exported HF config)")
        self.config = AutoConfig.from_pretrained(os.fspath(config_dir))
        self.retire_finished = bool(retire_finished)
        #: decode work of the last generate call: steps, and rows computed over them
        self.last_decode = {"steps": 0, "row_steps": 0, "rows": 0}
        self.device = torch.device(device)
        self.dtype = dtype or getattr(self.config, "dtype", None) or torch.float32
        if isinstance(self.dtype, str):
            self.dtype = getattr(torch, self.dtype)
        with no_init_weights():  # weights are garbage until a verified load; never served
            model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        model.tie_weights()  # no_init_weights also skips the tying that init_weights does
        model.to(self.device).eval()

        if eos_token_ids is None:
            eos = self.config.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        if pad_token_id is None:
            pad_token_id = self.config.pad_token_id
            if pad_token_id is None:
                pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)

        self._lock = threading.Lock()
        self._active: _Slot | None = None  # the served model; its version is self._versions.active
        self._standby: _Slot | None = _Slot(model)
        self._versions = VersionLifecycle()
        self._generating = 0
        self._asleep = False
        self.cache_flushes = 0  # observable for tests/metrics

    # ---- versions ----------------------------------------------------------------------------

    @property
    def active_version(self) -> PolicyVersion | None:
        return self._versions.active

    def staging_target(self, name: str) -> torch.Tensor | None:
        """While :meth:`load_weights` runs: the standby tensor that will hold ``name`` (else None).

        A producer that has to build a tensor anyway (the de-interleaved Q, K and V of megatron's
        fused QKV) may build it here rather than in a buffer of its own, saving a copy; what
        lands is checked against the expected manifest like every other tensor.
        """
        slot = self._standby
        if self._versions.loading is None or slot is None:
            return None
        return slot.targets().get(name)

    def load_weights(
        self,
        version: PolicyVersion,
        named_tensor_buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
        expected_manifest: TensorManifest,
        keep_unsent: bool = False,
    ) -> LoadReport:
        """Stage ``version`` into the standby model and verify it against ``expected_manifest``.

        Raises ManifestMismatchError (naming the tensors) when a tensor is missing, unexpected,
        or differs in shape, dtype or bytes; the active version is untouched either way.
        ``keep_unsent`` (:class:`~megarl.rollout.protocol.KeepsUnsentTensors`): a tensor the
        stream does not hold keeps the standby's value, checksummed where it lies and compared
        like a received one.
        """
        rx = ManifestReceiver(version, expected_manifest)
        with self._lock:
            if self._asleep:
                raise EngineAsleepError(f"load_weights({version.short_id}): engine is asleep; wake() first")
            self._versions.refuse_second_load(version)
            if self._generating:
                raise RolloutBusyError(
                    f"load_weights({version.short_id}): {self._generating} generate call(s) in flight"
                )
            if self._standby is None:
                # after the first flip: the standby buffer is a copy of the active model (ties kept)
                self._standby = _Slot(copy.deepcopy(self._active.model))
            slot = self._standby
            slot.version, slot.manifest = None, None  # contents undefined from here on
            self._versions.begin_load(version)
        rx.start()
        try:
            targets = slot.targets()
            with torch.no_grad():
                for bucket in rx.buckets(named_tensor_buckets):
                    for name, tensor in bucket:
                        self._stage_tensor(rx, slot, targets, name, tensor)
                if keep_unsent:
                    for name in sorted(set(targets) - set(rx.received.entries)):
                        rx.kept(name, targets[name])
            diff = rx.compare()
            missing_in_model = sorted(set(targets) - set(rx.received.entries))
            if not diff.ok or missing_in_model:
                detail = diff.describe()
                if missing_in_model:
                    detail += f"; engine tensors never received: {missing_in_model[:8]}"
                raise ManifestMismatchError(
                    f"{version.short_id}: staged weights do not match the expected manifest: {detail}; "
                    f"engine stays on {self.active_version.short_id if self.active_version else 'no version'}",
                    diff,
                )
            if rx.received.global_hash != version.weight_manifest_hash:  # implied by diff.ok; belt and braces
                raise ManifestMismatchError(
                    f"{version.short_id}: received hash {rx.received.global_hash} != {version.weight_manifest_hash}"
                )
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            with self._lock:
                slot.version, slot.manifest = version, rx.received
                self._versions.stage(version)
        finally:
            with self._lock:
                self._versions.end_load()
        return rx.report()

    @staticmethod
    def _stage_tensor(rx: ManifestReceiver, slot: "_Slot", targets: dict, name: str, tensor: torch.Tensor) -> None:
        """One received tensor into the standby model's tensor of that name, checked by name,
        shape and dtype, then recorded as it landed."""
        rx.refuse_repeat(name)
        version = rx.version
        target = targets.get(name)
        if target is None:
            raise ManifestMismatchError(
                f"{version.short_id}: received tensor {name!r} which the engine model "
                f"({type(slot.model).__name__}) does not have"
            )
        if tuple(target.shape) != tuple(tensor.shape) or target.dtype != tensor.dtype:
            raise ManifestMismatchError(
                f"{version.short_id}: tensor {name!r} expected shape {tuple(target.shape)} "
                f"dtype {target.dtype}, received shape {tuple(tensor.shape)} dtype {tensor.dtype}"
            )
        if not (tensor.data_ptr() == target.data_ptr() and tensor.stride() == target.stride()):
            target.copy_(tensor)  # else built in place (staging_target)
        # hash what landed in the staging model, i.e. what will be served
        rx.landed(name, target, tensor)

    def activate(self, version: PolicyVersion) -> ActivationReport:
        """Atomically make the staged ``version`` the active one and flush caches."""
        with self._lock:
            self._versions.activate(version, ready=self._standby is not None and self._standby.version == version)
            self._active, self._standby = self._standby, self._active
            manifest = self._active.manifest
        self.flush_cache()
        return ActivationReport(
            version_id=version.short_id,
            manifest_hash=manifest.global_hash,
            manifest_verified=True,
            cache_flushed=True,
        )

    def flush_cache(self) -> None:
        """Drop every KV/prefix state.  This backend keeps KV only inside one generate() call
        (a fresh DynamicCache each time), so nothing can outlive a version change; the counter
        makes the flush observable."""
        self.cache_flushes += 1

    # ---- memory ------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Release memory for the actor's turn: drop the standby buffer and, on an accelerator,
        move the active model to host.  The active version stays valid."""
        with self._lock:
            if self._versions.loading is not None or self._generating:
                raise RolloutBusyError("sleep(): engine is loading or generating")
            self._standby = None if self._active is not None else self._standby
            self._versions.staged = None  # its buffer is dropped
            if self._active is not None and self.device.type != "cpu":
                self._active.move("cpu")
                torch.cuda.empty_cache()
            self._asleep = True

    def wake(self) -> None:
        with self._lock:
            if self._active is not None and self.device.type != "cpu":
                self._active.move(self.device)
            self._asleep = False

    def close(self) -> None:
        """Nothing to stop: the engine is this process's models."""

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        with self._lock:
            self._versions.refuse_while_loading("generate")
            if self._asleep:
                raise EngineAsleepError("generate refused: engine is asleep; wake() first")
            self._versions.require_active("generate", " (none has been activated)")
            slot = self._active
            self._generating += 1
        try:
            return self._generate(slot, requests, sampling)
        finally:
            with self._lock:
                self._generating -= 1

    def teacher_force(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_batch_tokens: int = 16384
    ) -> tuple[PolicyVersion, list[torch.Tensor]]:
        """Raw log-probs of ``responses`` after ``prompts`` under the active version
        (:class:`~megarl.rollout.protocol.TeacherForcingEngine`).  One forward per chunk of rows
        (at most ``max_batch_tokens`` padded tokens, right-padded: every row's positions start at
        0, as in its own forward), log softmax in float32 on each row's response positions only."""
        if len(prompts) != len(responses):
            raise InvalidRequestError(f"teacher_force: {len(prompts)} prompts for {len(responses)} responses")
        vocab = self.config.vocab_size
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            if not p:
                raise InvalidRequestError(f"teacher_force: row {i} has an empty prompt")
            bad = [t for t in (*p, *r) if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"teacher_force: row {i}: token ids {bad[:5]} outside [0, {vocab})")
        with self._lock:
            self._versions.refuse_while_loading("teacher_force")
            if self._asleep:
                raise EngineAsleepError("teacher_force refused: engine is asleep; wake() first")
            self._versions.require_active("teacher_force", " (none has been activated)")
            slot, version = self._active, self._versions.active
            self._generating += 1
        try:
            out: list[torch.Tensor] = [torch.zeros(0)] * len(prompts)
            order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
            start = 0
            while start < len(order):
                end = start + 1
                while end < len(order) and (end + 1 - start) * (len(prompts[order[end]]) + len(responses[order[end]])) \
                        <= max_batch_tokens:
                    end += 1
                rows = order[start:end]
                width = max(len(prompts[i]) + len(responses[i]) for i in rows)
                ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for j, i in enumerate(rows):
                    seq = list(prompts[i]) + list(responses[i])
                    ids[j, :len(seq)] = torch.tensor(seq, dtype=torch.long)
                    mask[j, :len(seq)] = 1
                with torch.inference_mode():
                    logits = slot.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
                    for j, i in enumerate(rows):
                        P, R = len(prompts[i]), len(responses[i])
                        rows_logits = logits[j, P - 1:P + R - 1].float()
                        target = torch.tensor(list(responses[i]), dtype=torch.long, device=rows_logits.device)
                        out[i] = (rows_logits.gather(-1, target[:, None])[:, 0]
                                  - torch.logsumexp(rows_logits, dim=-1)).cpu()
                start = end
            return version, out
        finally:
            with self._lock:
                self._generating -= 1

    def _refuse_invalid(self, requests: Sequence[GenerationRequest]) -> None:
        """Refuse a call with a repeated request id or a prompt token outside the vocabulary."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"duplicate request_id in one generate call: {sorted(ids)}")
        vocab = self.config.vocab_size
        for r in requests:
            bad = [t for t in r.prompt_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"request {r.request_id}: token ids {bad[:5]} outside [0, {vocab})")

    def _left_padded(self, rows, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)`` of the rows' prompts, left padded to ``width``."""
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, _) in enumerate(rows):  # left padding: every row's next token is at the end
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids):] = 1
        return input_ids, attention

    def _generate(
        self, slot: _Slot, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        from transformers import GenerationConfig, LogitsProcessorList

        if not requests:
            return []
        t_call = time.monotonic()
        self._refuse_invalid(requests)

        rows = [(r, c) for r in requests for c in r.candidates(sampling.n)]
        seeds = [candidate_seed(sampling.seed, r.request_id, c) for r, c in rows]
        width = max(len(r.prompt_ids) for r, _ in rows)
        input_ids, attention = self._left_padded(rows, width)
        processors, chooser = _logits_processors(sampling, seeds, len(rows))

        terminal = tuple(dict.fromkeys(self.eos_token_ids + sampling.stop_token_ids))
        gen_config = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=list(terminal) if terminal else None,
            pad_token_id=self.pad_token_id,
        )
        if sampling.return_routed_experts and self.retire_finished:
            raise InvalidRequestError("return_routed_experts: not recorded by the decode that retires finished rows "
                                      "(rollout.retire_finished); turn one of them off")
        moe = moe_experts_modules(slot.model) if sampling.return_routed_experts else []
        if sampling.return_routed_experts and not moe:
            raise InvalidRequestError(
                f"return_routed_experts: the engine's model ({type(slot.model).__name__}) has no MoE layers")
        recorder = _RoutingRecorder(moe)
        if self.retire_finished:
            from megarl.rollout.hf_retiring import decode_retiring

            generated, stats = decode_retiring(slot.model, input_ids.to(self.device), attention.to(self.device),
                                               LogitsProcessorList(processors), chooser, sampling.max_new_tokens,
                                               terminal, self.pad_token_id)
        else:
            with torch.no_grad(), recorder:
                out = slot.model.generate(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention.to(self.device),
                    generation_config=gen_config,
                    logits_processor=LogitsProcessorList(processors),
                )
            generated = out[:, width:].cpu()
            stats = {"steps": generated.shape[1], "row_steps": generated.shape[1] * len(rows),
                     "finished_at": [time.monotonic()] * len(rows)}  # generate returns every row at its end
        finished_at = stats.pop("finished_at")
        self.last_decode = dict(stats, rows=len(rows))
        routing = None
        if moe:
            routing = recorder.per_position(len(rows), width, generated.shape[1])
            num_experts = int(moe[0][1].num_experts)
            routing = routing.to(compact_expert_dtype(num_experts))
            moe_layers = tuple(i for i, _ in moe)
        raw = torch.stack(chooser.raw_steps, dim=1).float().cpu()
        processed = (
            torch.stack(chooser.processed_steps, dim=1).float().cpu()
            if sampling.transforms_distribution
            else None
        )

        eos_set, stop_set = set(self.eos_token_ids), set(sampling.stop_token_ids)
        results = []
        for i, (r, c) in enumerate(rows):
            toks = generated[i].tolist()
            length, reason = _response_end(toks, sampling.max_new_tokens, eos_set, stop_set)
            results.append(
                GenerationResult(
                    request_id=r.request_id,
                    candidate_index=c,
                    prompt_ids=r.prompt_ids,
                    response_ids=tuple(toks[:length]),
                    finish_reason=reason,
                    raw_log_probs=raw[i, :length].clone(),
                    processed_log_probs=None if processed is None else processed[i, :length].clone(),
                    policy_version=slot.version.short_id,
                    seed=None if sampling.greedy else seeds[i],
                    attempt=r.attempt,
                    latency_s=finished_at[i] - t_call,
                    routed_experts=None if routing is None else SampleRouting(
                        # prompt tokens (the prefill's last len(prompt) positions), then response
                        # tokens 0 .. length-2 (decode calls 1 .. length-1)
                        routing[i, width - len(r.prompt_ids): width + length - 1].clone(),
                        num_experts, moe_layers, "hf"),
                )
            )
        return results
