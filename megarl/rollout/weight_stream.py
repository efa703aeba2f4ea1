"""The weight stream between the actor and a rollout engine: manifests and buckets.

The actor side produces logical tensors in HuggingFace naming and layout (full tensors, e.g.
``model.layers.0.self_attn.q_proj.weight``) as an iterable of ``(hf_name, tensor)`` pairs; the
rollout engine consumes them in buckets of a configured byte size.  Both sides describe what
they hold with a :class:`TensorManifest` (name, shape, dtype, a checksum of the bytes per tensor,
plus one hash over all), so the engine can prove, before it activates a version, that every
tensor of that version arrived intact.  The order is: write the parameters, synchronise the
device, verify the manifest, and only then switch the active-version pointer atomically.

The per-tensor checksum (:func:`tensor_checksum`) is computed with torch ops where the tensor
lives -- on the GPU for a GPU actor or engine -- and only a few KiB per tensor reach the host.
It is an integrity check against transport and layout bugs, not a cryptographic hash; files on
disk keep sha256 (``megarl.checkpointing.checkpoint``).

Nothing here knows about megatron or about a particular engine; the megatron source of the
stream (gather over TP, broadcast over PP, mapping to HF names) plugs in as the iterable.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from megarl.runtime.host_memory import host_bytes, host_span

__all__ = [
    "ManifestMismatchError",
    "TensorEntry",
    "TensorManifest",
    "ManifestDiff",
    "tensor_checksum",
    "iter_buckets",
    "hf_logical_tensors",
    "FlattenedTensorBucket",
    "flatten_bucket_by_dtype",
    "get_flattened_tensor_bucket_class",
]

HASH_PREFIX = "sha256:"
CHECKSUM_PREFIX = "wsum64:"
# Words per checksum row (8 KiB): a row and the weights stay in L1 while the host GEMV runs, and
# the part hashed on the host is 1/1024 of the bytes.
CHECKSUM_ROW_WORDS = 1024


class ManifestMismatchError(RuntimeError):
    """The received tensors do not match the expected manifest (missing, extra or different)."""

    def __init__(self, message: str, diff: "ManifestDiff | None" = None):
        super().__init__(message)
        self.diff = diff


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """A checksum of the tensor's bytes in its own dtype, computed on the tensor's device.

    The bytes are read as little-endian int64 words (zero-padded to whole words) laid out
    row-major in rows of ``R = CHECKSUM_ROW_WORDS`` words; the words that do not fill a last row
    form the tail ``t``.  With fixed odd 64-bit weights ``c_j`` (splitmix64 of ``j``) and exact
    int64 arithmetic modulo 2**64, every full row ``i`` gives one weighted sum::

        s_i = sum_j c_j * w[i*R + j]   (mod 2**64)

    and the checksum is ``sha256(nbytes, s, t)`` on the host over those ``n/R + |t|`` words (a
    few KiB per tensor).  What it guarantees (property-tested):

    * any change confined to one word -- every single flipped bit, any bits of one value --
      changes its row's sum: ``c_j`` is odd, so ``c_j * d != 0 (mod 2**64)`` for ``d != 0``;
    * any two distinct words exchanged between rows change both rows' sums (same argument);
    * rows are hashed in order, so rows moved, dropped or duplicated change the checksum;
    * other patterns inside one row (a shard misplaced within 8 KiB) are caught unless
      ``sum_j c_j d_j`` happens to vanish, as for a random linear test (about 2**-50 for data
      that is not built against these fixed weights);
    * it is a function of the bytes alone: sums modulo 2**64 are exact and associative, so
      CPU, GPU, any reduction order and any TP/PP layout that yields the same logical tensor
      give the same checksum (a run resumed at another layout proves its weights with it).

    Not a cryptographic hash: a deliberate forgery is easy.  Cost: one read of the bytes (on
    CPU a numpy int64 matrix-vector product over a zero-copy view, ~13 GB/s on one core, faster than a
    ``copy_``; on an accelerator a multiply-and-reduce in torch, memory-bound), against sha256's
    ~1.5 GB/s on one host core plus a device-to-host copy.
    """
    t = tensor.detach()
    nbytes = t.numel() * t.element_size()
    if not t.is_contiguous():
        in_place = _block_row_sums(t)
        if in_place is not None:
            return _finish(nbytes, *in_place)
        t = t.contiguous()
    return _finish(nbytes, *_row_sums(t, nbytes))


def _block_row_sums(t: torch.Tensor, on_host: "bool | None" = None) -> "tuple[int, bytes, bytes] | None":
    """The row sums of a non-contiguous ``t`` read in place, when ``t[0], t[1], ...`` are each
    contiguous and a whole number of checksum rows (a Q, K or V inside megatron's fused QKV:
    one block per query group, e.g. 128 x 4096 bf16 = 128 rows): rows then never straddle two
    blocks, so the blocks' row sums in order are those of ``t.contiguous()``.  Else None.
    ``on_host`` (default: ``t`` is on the CPU) picks numpy or the accelerator's torch path."""
    if t.dim() < 2 or t.numel() == 0:
        return None
    elt = t.element_size()
    inner = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != inner:
            return None
        inner *= size
    row = 8 * CHECKSUM_ROW_WORDS
    block = inner * elt
    if block % row or (t.stride(0) * elt) % 8 or t.data_ptr() % 8 or t.stride(0) < inner:
        return None
    blocks, rows = t.shape[0], block // row
    if not (t.device.type == "cpu" if on_host is None else on_host):
        sums = b"".join(_row_sums_device(t[g], block)[1] for g in range(blocks))
        return blocks * rows, sums, b""
    import numpy as np

    span = (blocks - 1) * t.stride(0) * elt + block
    words = np.frombuffer(host_span(t.data_ptr(), span), dtype=np.int64)
    grid = np.lib.stride_tricks.as_strided(words, shape=(blocks, rows, CHECKSUM_ROW_WORDS),
                                           strides=(t.stride(0) * elt, row, 8), writeable=False)
    return blocks * rows, np.einsum("gij,j->gi", grid, _host_weights()).tobytes(), b""


def _row_sums(t: torch.Tensor, nbytes: int) -> "tuple[int, bytes, bytes]":
    """(number of full rows, their sums as int64 bytes, the tail words' bytes) of contiguous ``t``."""
    if t.device.type == "cpu":
        return _row_sums_host(t, nbytes)
    return _row_sums_device(t, nbytes)


def _finish(nbytes: int, m: int, sums: bytes, tail: bytes) -> str:
    h = hashlib.sha256(f"{nbytes}|{m}|".encode())
    h.update(sums)
    h.update(tail)
    return CHECKSUM_PREFIX + h.hexdigest()


def _row_sums_host(t: torch.Tensor, nbytes: int) -> "tuple[int, bytes, bytes]":
    """:func:`_row_sums` of a contiguous CPU tensor with numpy: a few numpy calls instead
    of ~15 torch dispatches (which dominate for the many small tensors of a model).  The
    matrix-vector product is ``einsum``'s: its unrolled int64 sum-of-products loop reads
    12.5-13 GB/s on one core here, against 8.3 GB/s for ``@`` (numpy has no BLAS for integers) and
    5 GB/s for torch; the integers are the same, modulo 2**64.  The bytes are read through
    :func:`~megarl.runtime.host_memory.host_bytes` (``t`` stays referenced here)."""
    import numpy as np

    raw = np.frombuffer(host_bytes(t), dtype=np.uint8) if nbytes else np.zeros(0, dtype=np.uint8)
    if nbytes % 8 == 0 and t.data_ptr() % 8 == 0:
        words = raw.view(np.int64)
    else:  # odd-sized bf16/fp16/int8 tensors, odd offsets: a zero-padded copy
        words = np.zeros((nbytes + 7) // 8, dtype=np.int64)
        words.view(np.uint8)[:nbytes] = raw
    m = words.size // CHECKSUM_ROW_WORDS
    cut = m * CHECKSUM_ROW_WORDS
    sums = np.einsum("ij,j->i", words[:cut].reshape(m, CHECKSUM_ROW_WORDS), _host_weights()).tobytes() if m else b""
    return m, sums, words[cut:].tobytes()


def _row_sums_device(t: torch.Tensor, nbytes: int) -> "tuple[int, bytes, bytes]":
    """:func:`_row_sums` with torch ops on ``t``'s device (a GPU); only the row sums and
    the tail cross to the host.  No integer GEMV in CUDA: multiply and reduce in slices of rows
    (the same integers modulo 2**64), bounding the temporary to 64 MiB."""
    flat = t.reshape(-1)
    words = None
    if nbytes % 8 == 0 and flat.dtype != torch.bool:
        try:
            words = flat.view(torch.int64)
        except RuntimeError:  # storage offset not a multiple of 8 bytes
            pass
    if words is None:
        words = torch.zeros((nbytes + 7) // 8, dtype=torch.int64, device=flat.device)
        if nbytes:
            words.view(torch.uint8)[:nbytes].copy_(flat.view(torch.uint8))
    m = words.numel() // CHECKSUM_ROW_WORDS
    cut = m * CHECKSUM_ROW_WORDS
    sums = b""
    if m:
        grid = words[:cut].view(m, CHECKSUM_ROW_WORDS)
        c = _device_weights(grid.device)
        out = torch.empty(m, dtype=torch.int64, device=grid.device)
        step = max(1, (64 << 20) // (8 * CHECKSUM_ROW_WORDS))
        for i in range(0, m, step):
            torch.sum(grid[i:i + step] * c, dim=1, out=out[i:i + step])
        sums = out.cpu().numpy().tobytes()
    return m, sums, words[cut:].cpu().numpy().tobytes()


_WEIGHTS: dict = {}


def _host_weights():
    """The odd int64 weights ``c_j = splitmix64(0)_(j+1) | 1`` of :func:`tensor_checksum` (numpy)."""
    if "host" not in _WEIGHTS:
        from megarl.splitmix import GOLDEN, as_int64, mix64

        j = torch.arange(1, CHECKSUM_ROW_WORDS + 1, dtype=torch.int64)
        _WEIGHTS["host"] = (mix64(j * as_int64(GOLDEN)) | 1).numpy()
    return _WEIGHTS["host"]


def _device_weights(device: torch.device) -> torch.Tensor:
    if device not in _WEIGHTS:
        _WEIGHTS[device] = torch.from_numpy(_host_weights().copy()).to(device)
    return _WEIGHTS[device]


@dataclass(frozen=True)
class TensorEntry:
    """What one logical tensor is: enough to detect a wrong shape, dtype or value."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    checksum: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def line(self) -> str:
        return f"{self.name}|{self.dtype}|{list(self.shape)}|{self.checksum}"


@dataclass(frozen=True)
class ManifestDiff:
    """Differences between an expected and a received manifest, named tensor by tensor."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[tuple[str, str, str, str], ...]  # (name, field, expected, received)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self, limit: int = 8) -> str:
        parts = []
        if self.missing:
            parts.append(f"missing {len(self.missing)} tensor(s): {list(self.missing[:limit])}")
        if self.unexpected:
            parts.append(
                f"unexpected {len(self.unexpected)} tensor(s): {list(self.unexpected[:limit])}"
            )
        for name, fld, exp, got in self.mismatched[:limit]:
            parts.append(f"{name}: {fld} expected {exp}, received {got}")
        if len(self.mismatched) > limit:
            parts.append(f"... and {len(self.mismatched) - limit} more mismatched tensor(s)")
        return "; ".join(parts) if parts else "manifests match"


@dataclass
class TensorManifest:
    """Per-tensor (name, shape, dtype, checksum) plus one order-independent hash over all.

    Built incrementally with :meth:`add` on either side of the stream, in whatever order the
    tensors come (buckets, PP stages); :attr:`global_hash` sorts by name so the sender and the
    receiver agree regardless of order.
    """

    entries: dict[str, TensorEntry] = field(default_factory=dict)

    def add(self, name: str, tensor: torch.Tensor) -> TensorEntry:
        self._refuse_duplicate(name)  # before the checksum is computed for nothing
        return self.add_entry(TensorEntry(name=name, shape=tuple(int(s) for s in tensor.shape),
                                          dtype=_dtype_name(tensor.dtype), checksum=tensor_checksum(tensor)))

    def add_view(self, name: str, shape: tuple[int, ...], view: torch.Tensor) -> TensorEntry:
        """:meth:`add` for the tensor of ``shape`` whose elements are ``view``'s in row-major
        order, e.g. a strided view of Q inside a fused QKV: checksummed in place where it can
        be (:func:`tensor_checksum`), never reshaped into a copy here."""
        if view.numel() != math.prod(shape):
            raise ValueError(f"{name}: a view of {view.numel()} elements is not a tensor of shape {list(shape)}")
        return self.add_entry(TensorEntry(name=name, shape=tuple(int(s) for s in shape),
                                          dtype=_dtype_name(view.dtype), checksum=tensor_checksum(view)))

    def add_entry(self, entry: TensorEntry) -> TensorEntry:
        """Add an entry computed elsewhere (another pipeline stage's tensors)."""
        self._refuse_duplicate(entry.name)
        self.entries[entry.name] = entry
        return entry

    def _refuse_duplicate(self, name: str) -> None:
        if name in self.entries:
            raise ManifestMismatchError(f"tensor {name!r} added twice to the manifest (duplicate in the stream)")

    @classmethod
    def from_named_tensors(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> "TensorManifest":
        m = cls()
        for name, tensor in named_tensors:
            m.add(name, tensor)
        return m

    @property
    def global_hash(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.entries):
            h.update(self.entries[name].line().encode())
            h.update(b"\n")
        return HASH_PREFIX + h.hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def compare(self, received: "TensorManifest") -> ManifestDiff:
        """Diff ``received`` against ``self`` (the expectation)."""
        missing = tuple(sorted(set(self.entries) - set(received.entries)))
        unexpected = tuple(sorted(set(received.entries) - set(self.entries)))
        mismatched = []
        for name in sorted(set(self.entries) & set(received.entries)):
            exp, got = self.entries[name], received.entries[name]
            for fld in ("shape", "dtype", "checksum"):
                if getattr(exp, fld) != getattr(got, fld):
                    mismatched.append((name, fld, str(getattr(exp, fld)), str(getattr(got, fld))))
        return ManifestDiff(missing, unexpected, tuple(mismatched))

    def check_entry(self, name: str, tensor: torch.Tensor) -> TensorEntry:
        """Checksum one received tensor and check it against this (expected) manifest right away.

        Used by engines that cannot stage a full copy (sglang loads in place): a bad tensor
        is caught before it is handed to the engine, checked on the device it arrived on.
        """
        if name not in self.entries:
            raise ManifestMismatchError(
                f"received tensor {name!r} is not in the expected manifest "
                f"({len(self.entries)} tensors, hash {self.global_hash})"
            )
        exp = self.entries[name]
        got = TensorEntry(name, tuple(int(s) for s in tensor.shape), _dtype_name(tensor.dtype), tensor_checksum(tensor))
        for fld in ("shape", "dtype", "checksum"):
            if getattr(exp, fld) != getattr(got, fld):
                raise ManifestMismatchError(
                    f"tensor {name!r}: {fld} expected {getattr(exp, fld)}, received {getattr(got, fld)}"
                )
        return got

    def to_dict(self) -> dict:
        return {
            "global_hash": self.global_hash,
            "tensors": [
                {"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "checksum": e.checksum}
                for e in (self.entries[n] for n in sorted(self.entries))
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "TensorManifest":
        m = cls()
        for t in data["tensors"]:
            m.entries[t["name"]] = TensorEntry(t["name"], tuple(t["shape"]), t["dtype"], t["checksum"])
        if "global_hash" in data and data["global_hash"] != m.global_hash:
            raise ManifestMismatchError(
                f"manifest dict global_hash {data['global_hash']} does not match its tensors "
                f"(recomputed {m.global_hash})"
            )
        return m

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


#: ``(first, second)`` name suffixes of tensors an engine takes only together, in one load call:
#: SGLang's DeepSeek-V2/V3 loader fuses a layer's ``q_a_proj`` and ``kv_a_proj_with_mqa`` into one
#: parameter (``fused_qkv_a_proj_with_mqa``) from a cache that lives for one ``load_weights`` call
#: (``deepseek_common/deepseek_weight_loader.py``); split over two, neither is written
#: (megarl's check after the load names the parameter).  The mapping streams them next to each other.
TRAVEL_TOGETHER = (("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),)


def _travels_with(previous: str, name: str) -> bool:
    for first, second in TRAVEL_TOGETHER:
        if previous.endswith(first) and name.endswith(second) and \
                previous[:-len(first)] == name[:-len(second)]:
            return True
    return False


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into lists of at most ``bucket_bytes`` bytes.

    A tensor larger than the bucket travels alone.  Tensors are not copied: the producer owns
    them until the consumer has taken the bucket (same contract as verl's
    ``get_named_tensor_buckets``, minus its defensive clone, which doubles peak memory).  A pair of
    :data:`TRAVEL_TOGETHER` tensors next to each other in the stream is never split over two buckets.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes and not _travels_with(bucket[-1][0], name):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def hf_logical_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The logical tensors of a transformers model in HF *checkpoint* naming, each exactly once.

    ``named_parameters()`` already drops tied duplicates (``lm_head.weight`` when
    ``tie_word_embeddings``), which is what the engine must receive: the tie is re-made by
    the engine's own model, sending both would be a second, possibly diverging, copy.
    Persistent buffers that are in the state_dict are included; non-persistent ones (rotary
    ``inv_freq``) are computed from the config and are not part of the weights.

    Mixture-of-experts models: transformers 5 holds each layer's routed experts fused
    (``mlp.experts.gate_up_proj`` ``[E, 2F, H]``, ``mlp.experts.down_proj`` ``[E, H, F]``) but
    checkpoints, megatron's stream and SGLang's loaders name them per expert; they are yielded as
    per-expert views into the fused parameters (:func:`_per_expert_views`), so what an engine
    receives and what it holds are named alike.
    """
    seen: set[int] = set()
    for name, p in model.named_parameters():
        seen.add(id(p))
        yield from _per_expert_views(model, name, p.detach())
    persistent = set(model.state_dict().keys())
    for name, b in model.named_buffers():
        if name in persistent and id(b) not in seen:
            yield name, b.detach()


_LAYER_MLP = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.mlp\.(?P<rest>.+)$")


def _per_expert_views(model: torch.nn.Module, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` for one parameter of a transformers model: itself, except in
    the MoE block of a Qwen2-MoE / Qwen3-MoE / Mixtral / DeepSeek-V3 layer.  There, the inverse of transformers'
    load-time conversion (``transformers/conversion_mapping.py``: ``MergeModulelist(dim=0)`` then
    ``Concatenate(dim=1)`` of gate and up; Mixtral also renames ``block_sparse_moe`` to ``mlp``):
    expert e's gate is ``gate_up_proj[e, :F]``, its up ``gate_up_proj[e, F:]``, its down
    ``down_proj[e]``, each a contiguous view, named as :data:`megarl.models.mapping.MOE_HF_NAMES`
    (the checkpoint's names, which the megatron mapping uses too)."""
    m = _LAYER_MLP.match(name)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    from megarl.models.hf_config import MOE_FAMILIES
    from megarl.models.mapping import MOE_HF_NAMES

    if m is None or model_type not in MOE_FAMILIES:
        yield name, t
        return
    names = MOE_HF_NAMES[MOE_FAMILIES[model_type][1]]
    block, rest = f"{m['layer']}.{names.block}", m["rest"]
    if rest not in ("experts.gate_up_proj", "experts.down_proj"):
        yield f"{block}.{rest}", t  # the router, the shared expert and its gate: renamed only
        return
    if t.dim() != 3:
        raise ValueError(f"{name}: fused experts of shape {list(t.shape)}, expected [experts, out, in]")
    half = t.shape[1] // 2
    for e in range(t.shape[0]):
        x = f"{block}.{names.expert.format(e=e)}"
        if rest == "experts.gate_up_proj":
            yield f"{x}.{names.gate}.weight", t[e, :half]
            yield f"{x}.{names.up}.weight", t[e, half:]
        else:
            yield f"{x}.{names.down}.weight", t[e]


# ---------------------------------------------------------------------------------------------
# Flattened buckets for engines in other processes (sglang): one contiguous tensor per dtype.
# ---------------------------------------------------------------------------------------------


@dataclass
class FlattenedTensorMetadata:
    """Where a tensor lives inside a :class:`FlattenedTensorBucket` (element offsets)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Tensors of one dtype concatenated into one 1-D tensor plus their metadata, for use inside
    one process (tests, tools).

    Why buckets: crossing to SGLang's scheduler processes costs one CUDA IPC handle per tensor;
    one flattened tensor per dtype costs one handle per bucket (slime
    ``update_weight_from_tensor.py::_send_to_colocated_engine``; verl follows slime).

    This class is **not** SGLang's wire format and is never handed to an engine: SGLang's own
    ``FlattenedTensorBucket`` (``sglang/srt/weight_sync/tensor_bucket.py``) changed layout between
    releases (element offsets per dtype up to 0.5.5; uint8 with byte offsets and mixed dtypes by
    0.5.20), and its ``MultiprocessingSerializer`` unpickles only SGLang's own classes (0.5.5+),
    so a payload built from this class could never be loaded.  The sglang backend always uses
    :func:`get_flattened_tensor_bucket_class`, which has no fallback to this one.
    """

    def __init__(
        self,
        named_tensors: list[tuple[str, torch.Tensor]] | None = None,
        flattened_tensor: torch.Tensor | None = None,
        metadata: list[FlattenedTensorMetadata] | None = None,
    ):
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("cannot create an empty FlattenedTensorBucket")
            dtypes = {t.dtype for _, t in named_tensors}
            if len(dtypes) != 1:
                raise ValueError(
                    f"a FlattenedTensorBucket holds one dtype, got {sorted(map(str, dtypes))}; "
                    "use flatten_bucket_by_dtype"
                )
            self.metadata = []
            flat = []
            idx = 0
            for name, t in named_tensors:
                f = t.detach().reshape(-1)
                self.metadata.append(
                    FlattenedTensorMetadata(name, t.shape, t.dtype, idx, idx + f.numel(), f.numel())
                )
                flat.append(f)
                idx += f.numel()
            self.flattened_tensor = torch.cat(flat, dim=0)
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("give either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor = flattened_tensor
            self.metadata = metadata

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (m.name, self.flattened_tensor[m.start_idx : m.end_idx].reshape(m.shape))
            for m in self.metadata
        ]


def get_flattened_tensor_bucket_class():
    """SGLang's own FlattenedTensorBucket (its location moved between releases, as slime's
    ``backends/megatron_utils/sglang.py`` records).  No fallback: only SGLang's class builds a
    payload the installed SGLang can load (see :class:`FlattenedTensorBucket`)."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket as cls  # type: ignore
        return cls
    except ImportError:
        pass
    try:
        from sglang.srt.model_executor.model_runner import FlattenedTensorBucket as cls  # type: ignore
        return cls
    except ImportError as e:
        raise ImportError(
            "SGLang's FlattenedTensorBucket is not importable (sglang.srt.weight_sync.tensor_bucket); "
            "flattened buckets for an engine must be built by the installed SGLang: "
            'pip install -e ".[gpu]" (or use the Dockerfile)'
        ) from e


def flatten_bucket_by_dtype(
    named_tensors: list[tuple[str, torch.Tensor]], bucket_cls=None
) -> dict[torch.dtype, "FlattenedTensorBucket"]:
    """One flattened bucket per dtype, in first-seen dtype order (``bucket_cls`` default:
    SGLang's, :func:`get_flattened_tensor_bucket_class`)."""
    bucket_cls = bucket_cls or get_flattened_tensor_bucket_class()
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named_tensors:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    return {dt: bucket_cls(named_tensors=nts) for dt, nts in by_dtype.items()}
