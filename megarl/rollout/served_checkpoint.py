"""An hf rollout engine serving a checkpoint from disk as one verified version: what evaluates an
export (``python -m megarl.eval``) and what a generative judge generates with."""

from __future__ import annotations

import os


def serve_checkpoint(model_dir: str, tok, device: str, *, run_id: str = "eval", retire_finished: bool = False,
                     backend: str = "hf", mem_fraction_static: float = 0.2):
    """The hf engine (``backend="sglang"``: an SGLang engine of one rank, taking
    ``mem_fraction_static`` of the device) on ``model_dir`` with its safetensors loaded through
    the verified weight path (manifest, activate) under ``tok`` (a TokenizerContract): it stops
    on the contract's eos and the model dir's, pads with the contract's pad id."""
    from megarl.hashing import file_sha256
    from megarl.models.safetensors_io import HFCheckpointReader, model_dir_eos_token_ids
    from megarl.rollout import create_rollout_engine
    from megarl.rollout.weight_stream import TensorManifest, iter_buckets
    from megarl.versions import PolicyVersion

    eos = list(dict.fromkeys(([tok.eos_token_id] if tok.eos_token_id is not None else [])
                             + list(model_dir_eos_token_ids(model_dir))))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    if backend == "sglang":
        from megarl.rollout import sglang_cpu

        sglang_cpu.prepare()  # no CUDA device: SGLang's CPU engine (inert where CUDA exists)
        engine = create_rollout_engine("sglang", model_dir, eos_token_ids=eos, mem_fraction_static=mem_fraction_static,
                                       **sglang_cpu.backend_kwargs(),
                                       engine_kwargs={"enable_memory_saver": False, **sglang_cpu.engine_kwargs()})
    else:
        engine = create_rollout_engine("hf", model_dir, eos_token_ids=eos, pad_token_id=pad, device=device,
                                       retire_finished=retire_finished)
    reader = HFCheckpointReader(model_dir)  # CheckpointError names the directory
    tensors = [(name, reader.read(name).to(device=engine.device, dtype=engine.dtype)) for name in sorted(reader.keys())]
    manifest = TensorManifest.from_named_tensors(tensors)
    version = PolicyVersion(run_id=run_id, optimizer_step=0, update_attempt=0,
                            weight_manifest_hash=manifest.global_hash, tokenizer_hash=tok.hash,
                            model_config_hash=file_sha256(os.path.join(model_dir, "config.json")))
    engine.load_weights(version, iter_buckets(tensors, 1 << 30), manifest)
    engine.activate(version)
    return engine
