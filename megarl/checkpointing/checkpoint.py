"""Training-position checkpoints: everything needed to continue the same run, published atomically.

A checkpoint is taken at ACTOR_COMMITTED(v), the boundary where no sealed experience is waiting
to be consumed (so ``unconsumed_experience`` records that explicitly), into
``<run_dir>/checkpoints/iter_<k>/``; its files, one by one: docs/design.md, "Checkpoints".

Publishing: everything is written into ``.tmp-iter_<k>-<nonce>/``, fsynced, renamed to
``iter_<k>``, and only then does ``latest`` (a one-line file, replaced atomically) point at it.
A directory without a verifying MANIFEST is never chosen; a crash mid-write leaves the previous
checkpoint selected.  The last ``keep`` checkpoints are kept.

Nothing untrusted is executed on load: JSON and safetensors are plain data; the torch
distributed checkpoint files (``*.distcp``, ``.metadata``) unpickle their metadata, so they are
read only after every file's sha256 matched the MANIFEST written at publish.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import uuid
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from megarl.hashing import file_sha256
from megarl.models.safetensors_io import CheckpointError, read_format_json

LATEST = "latest"
MANIFEST = "MANIFEST.json"
STATE = "state.json"
# v2: policy versions name their weights by the on-device checksum manifest (wsum64), so a
# v1 checkpoint's weight_manifest_hash can no longer be re-derived from its weights.
FORMAT = "megarl-training-position-v2"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- logical digests (bitwise comparison across runs and layouts) ------------------------------


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes in its own dtype, C-contiguous, on CPU.

    Hashing the raw bytes (not the values) is what makes "bitwise equal" checkable: a single
    flipped bit anywhere changes the hash.  Works for every dtype (bf16 has no numpy type, so
    the bytes are taken through a uint8 view).  What is compared across runs and written next
    to files stays sha256; the weight stream uses the cheaper on-device
    ``megarl.rollout.weight_stream.tensor_checksum``.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return "sha256:" + hashlib.sha256(b"").hexdigest()
    from megarl.runtime.host_memory import host_bytes

    return "sha256:" + hashlib.sha256(host_bytes(t)).hexdigest()


def optimizer_digests(optimizer) -> Dict[str, str]:
    """sha256 per (parameter index, state key) of this rank's optimizer state, in a stable order."""
    out: Dict[str, str] = {}
    sd = optimizer.state_dict()
    # megatron's ChainedOptimizer (an MoE model at EP > 1: the dense and the expert parameters have
    # optimizers of their own) gives one state dict per optimizer: keyed "<i>/<pid>.<key>"
    parts = [("", sd)] if isinstance(sd, dict) else [(f"{i}/", d) for i, d in enumerate(sd)]
    for prefix, part in parts:
        state = part.get("state", part.get("optimizer", {}).get("state", {}))
        for pid in sorted(state, key=lambda x: (str(type(x)), x)):
            for key, v in sorted(state[pid].items()):
                if torch.is_tensor(v):
                    out[f"{prefix}{pid}.{key}"] = tensor_digest(v)
    return out


# ---- RNG ---------------------------------------------------------------------------------------


def _rng_capture() -> tuple[Dict[str, torch.Tensor], dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np_state[1].astype(np.int64))
    py = random.getstate()
    meta = {"numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "python": [py[0], list(py[1]), py[2]]}
    return tensors, meta


def _rng_restore(tensors: Dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    n = meta["numpy"]
    np.random.set_state((n[0], tensors["numpy_keys"].numpy().astype(np.uint32), n[1], n[2], n[3]))
    p = meta["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


# ---- save --------------------------------------------------------------------------------------


#: the distributed optimizer's state in the canonical per-parameter layout (gathered on DP rank 0
#: at save, sliced per rank at load), so a checkpoint resumes at any TP / PP / DP; megatron-core
#: 0.16's default ('fully_sharded_model_space') is a flattened format its own dist_checkpointing
#: refuses ("ShardedTensor.flattened_range is not supported").  The plain optimizer ignores it.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _save_optimizer(model, optimizer, out_dir: str) -> None:
    from megatron.core import dist_checkpointing

    from megarl.models.megatron_ckpt import chunked_sharded_state_dict

    model_sd = chunked_sharded_state_dict(model)
    os.makedirs(out_dir, exist_ok=True) if _rank() == 0 else None
    _barrier()
    dist_checkpointing.save(optimizer.sharded_state_dict(model_sd, metadata=dict(OPTIMIZER_METADATA)), out_dir)


def _gather_grad_scalers(optimizer) -> list:
    """Collective: every rank's :func:`~megarl.models.optim.grad_scaler_states`, in rank order."""
    from megarl.models.optim import grad_scaler_states

    mine = grad_scaler_states(optimizer)
    if not dist.is_initialized():
        return [mine]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _restore_grad_scalers(optimizer, path: str) -> None:
    """The loss scalers from ``path`` (written by :func:`save`), explicitly: megatron's optimizer
    state carries a copy too, and keeps a fresh scaler without a word when it lacks one, so a
    resumed fp16 run would start again from 2**32 and skip its first steps as overflows.  At the
    saved world size each rank takes its own entry (after checking megatron restored the same);
    at another, each optimizer's scaler must have been one state on every saved rank."""
    from megarl.models.optim import grad_scaler_states, load_grad_scaler_states

    mine = grad_scaler_states(optimizer)
    if not os.path.isfile(path):
        if any(s is not None for s in mine):
            raise CheckpointError(f"{path}: missing; the optimizer has a loss scaler (fp16) and the checkpoint "
                                  "does not say its state (written by an older megarl?)")
        return
    with open(path) as f:
        per_rank = json.load(f)["per_rank"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(per_rank) == world:
        want = per_rank[_rank()]
        if len(want) == len(mine) and mine != want:
            raise CheckpointError(f"{path}: rank {_rank()}'s loss scalers {want}, but the optimizer state restored "
                                  f"{mine}: the checkpoint's two records disagree")
    else:
        want = []
        for i in range(len(mine)):
            seen = {json.dumps(r[i], sort_keys=True) for r in per_rank if i < len(r)}
            if len(seen) != 1:
                raise CheckpointError(f"{path}: optimizer {i}'s loss scaler was in {len(seen)} states across the "
                                      f"{len(per_rank)} saved ranks; resume at the saved world size ({len(per_rank)})")
            want.append(json.loads(seen.pop()))
    try:
        load_grad_scaler_states(optimizer, want, path)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def _load_optimizer(model, optimizer, in_dir: str) -> None:
    from megatron.core import dist_checkpointing

    from megarl.models.megatron_ckpt import chunked_sharded_state_dict

    from megarl.runtime.cpu_compat import prepare_optimizer_for_load

    model_sd = chunked_sharded_state_dict(model)
    prepare_optimizer_for_load(optimizer)
    loaded = dist_checkpointing.load(optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                  metadata=dict(OPTIMIZER_METADATA)), in_dir)
    optimizer.load_state_dict(loaded)


def save(root: str, iteration: int, state: dict, roles: dict, keep: int = 3,
         crash_before_publish: Optional[int] = None) -> str:
    """Collective: publish the training position of ``iteration`` under ``root``.

    ``roles``: name -> (model, optimizer or None) for ``actor``, ``critic``, ``reference``.
    ``state``: the JSON-able trainer state (see the module docstring).  Returns the final path.
    """
    from megarl.models.megatron_ckpt import save_megatron_checkpoint

    rank0 = _rank() == 0
    name = f"iter_{iteration:06d}"
    final = os.path.join(root, name)
    tmp = None
    if rank0:
        os.makedirs(root, exist_ok=True)
        tmp = os.path.join(root, f".tmp-{name}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
    if dist.is_initialized():
        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        tmp = box[0]
    digests: Dict[str, Dict[str, str]] = {}
    for role, (model, optimizer) in roles.items():
        save_megatron_checkpoint(model, os.path.join(tmp, role))
        if optimizer is not None:
            _save_optimizer(model, optimizer, os.path.join(tmp, f"{role}_optim"))
            scalers = _gather_grad_scalers(optimizer)
            if rank0:
                _write_json(os.path.join(tmp, f"{role}_grad_scaler.json"), {"per_rank": scalers})
    # RNG and optimizer digests are per rank
    from safetensors.torch import save_file

    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True) if rank0 else None
    _barrier()
    tensors, meta = _rng_capture()
    save_file(tensors, os.path.join(tmp, "rng", f"rank_{_rank()}.safetensors"))
    _write_json(os.path.join(tmp, "rng", f"rank_{_rank()}.json"), meta)
    local_digests = {role: optimizer_digests(opt) for role, (_, opt) in roles.items() if opt is not None}
    gathered = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, local_digests)
    else:
        gathered = [local_digests]
    _barrier()
    if rank0:
        digests = {"optimizer_per_rank": gathered, "weights": state.get("weight_manifests", {})}
        _write_json(os.path.join(tmp, "digests.json"), digests)
        _write_json(os.path.join(tmp, STATE), dict(state, format=FORMAT, iteration=iteration,
                                                   saved_at=time.strftime("%Y-%m-%dT%H:%M:%S")))
        files = {}
        for d, _, names in os.walk(tmp):
            for n in names:
                p = os.path.join(d, n)
                files[os.path.relpath(p, tmp)] = file_sha256(p)
        _write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "iteration": iteration, "files": files})
        _fsync_tree(tmp)
        if crash_before_publish == iteration:
            print(f"faults.crash_during_checkpoint_at={iteration}: dying before publishing {tmp}", flush=True)
            os._exit(86)  # fault injection (faults.crash_during_checkpoint_at): written, never published
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root, name)
        _prune(root, keep)
    _barrier()
    return final


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: str, keep: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("iter_"))
    for d in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    for d in os.listdir(root):  # half-written leftovers of crashed saves
        if d.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


# ---- load --------------------------------------------------------------------------------------


def verify(path: str) -> dict:
    """Check every file against MANIFEST.json (sha256); return the manifest.  Raises naming the
    first file that is missing, extra or different."""
    manifest = read_format_json(os.path.join(path, MANIFEST), FORMAT,
                                "the checkpoint manifest; the checkpoint is incomplete")
    present = set()
    for d, _, names in os.walk(path):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), path)
            if rel != MANIFEST:
                present.add(rel)
    want = manifest["files"]
    for rel in sorted(set(want) | present):
        if rel not in want:
            raise CheckpointError(f"{os.path.join(path, rel)}: not in the checkpoint manifest (tampered?)")
        if rel not in present:
            raise CheckpointError(f"{os.path.join(path, rel)}: listed in the manifest but missing")
        got = file_sha256(os.path.join(path, rel))
        if got != want[rel]:
            raise CheckpointError(f"{os.path.join(path, rel)}: sha256 {got} != manifest {want[rel]} (corrupted or tampered)")
    return manifest


def find_latest(root: str) -> Optional[str]:
    """The checkpoint ``latest`` points at, or None when there is none yet."""
    p = os.path.join(root, LATEST)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    if not name.startswith("iter_") or not os.path.isdir(path):
        raise CheckpointError(f"{p}: points at {name!r}, which is not a checkpoint directory")
    return path


def read_state(path: str) -> dict:
    verify(path)
    with open(os.path.join(path, STATE)) as f:
        return json.load(f)


def load_roles(path: str, roles: dict) -> None:
    """Collective: fill each role's model (and optimizer) from the checkpoint (any TP/PP)."""
    from megarl.models.megatron_ckpt import load_megatron_checkpoint

    for role, (model, optimizer) in roles.items():
        load_megatron_checkpoint(model, os.path.join(path, role))
        if optimizer is not None:
            _load_optimizer(model, optimizer, os.path.join(path, f"{role}_optim"))
            _restore_grad_scalers(optimizer, os.path.join(path, f"{role}_grad_scaler.json"))


def restore_rng(path: str, same_layout: bool) -> None:
    """Per-rank RNG states; at a different layout each rank takes rank 0's (documented)."""
    from safetensors.torch import load_file

    r = _rank() if same_layout else 0
    tensors = load_file(os.path.join(path, "rng", f"rank_{r}.safetensors"))
    with open(os.path.join(path, "rng", f"rank_{r}.json")) as f:
        meta = json.load(f)
    _rng_restore(tensors, meta)
