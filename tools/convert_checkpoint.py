#!/usr/bin/env python
"""Convert model checkpoints between HuggingFace safetensors and megarl/megatron format.

    tools/convert_checkpoint.py hf-to-megatron --hf HF_DIR --out MEG_DIR [--tp N --pp N --ep N --etp N]
    tools/convert_checkpoint.py megatron-to-hf --megatron MEG_DIR --out HF_DIR [--tp N --pp N --ep N --etp N]

Run under ``torchrun --nproc-per-node TP*PP*DP`` (or as a plain process when all are 1); DP is 1
for a dense model and may be more for a mixture-of-experts one, whose experts are spread over
``--ep`` ranks taken from the data-parallel ones (the world must be divisible by ETP*EP*PP).
The megatron checkpoint is megatron-core ``dist_checkpointing`` and loads at any TP/PP/EP/ETP.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.errors import cli_main  # noqa: E402
from megarl.runtime.distributed import ParallelConfigError  # noqa: E402


def _check_world(tp: int, pp: int, ep: int = 1, etp=None) -> None:
    """A dense conversion runs on exactly TP*PP processes; with experts, on the smallest world
    that holds both layouts: lcm(TP*PP, ETP*EP*PP)."""
    import math

    world = int(os.environ.get("WORLD_SIZE", "1"))
    etp = tp if etp is None else etp
    need = math.lcm(tp * pp, etp * ep * pp)
    if world != need:
        flags = f"--tp {tp} --pp {pp}" + (f" --ep {ep} --etp {etp}" if ep != 1 or etp != tp else "")
        raise ParallelConfigError(
            f"{flags} needs exactly {need} processes, got WORLD_SIZE={world}; "
            f"run under 'torchrun --nproc-per-node {need}'"
        )


def _check_out(out: str, overwrite: bool, *sources: str) -> None:
    """Refuse to write over a checkpoint (or into the source) unless --overwrite is given."""
    from megarl.models.safetensors_io import CheckpointError

    real = os.path.realpath(out)
    for src in sources:
        if real == os.path.realpath(src):
            raise CheckpointError(f"--out {out} is the source checkpoint directory; choose another --out")
    if not os.path.isdir(out) or overwrite:
        return
    present = sorted(f for f in os.listdir(out)
                     if f in ("config.json", "megarl_model.json", "dist") or f.endswith(".safetensors")
                     or f.endswith(".safetensors.index.json"))
    if present:
        raise CheckpointError(f"--out {out} already holds a checkpoint ({', '.join(present[:4])}); "
                              "pass --overwrite to replace it or choose another directory")


def hf_to_megatron(args) -> None:
    from megarl.models.hf_config import check_parallel_fit, load_spec
    from megarl.models.megatron_ckpt import load_model, save_megatron_checkpoint
    from megarl.models.safetensors_io import HFCheckpointReader
    from megarl.runtime import distributed as rt

    spec = load_spec(args.hf)  # validate before any process group exists
    check_parallel_fit(spec, args.tp, args.pp, where=os.path.join(args.hf, "config.json"), ep=args.ep,
                       etp=args.etp)
    HFCheckpointReader(args.hf)
    _check_out(args.out, args.overwrite, args.hf)
    _check_world(args.tp, args.pp, args.ep, args.etp)
    rt.initialize(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    model = load_model(args.hf, tp=args.tp, pp=args.pp, vocab_multiple=args.vocab_multiple,
                       show_progress=rt.is_main())
    save_megatron_checkpoint(model, args.out, tokenizer_dir=args.hf)
    if rt.is_main():
        ep = f" ep={args.ep} etp={args.etp or args.tp}" if spec.moe is not None else ""
        print(f"wrote megatron checkpoint {args.out} (saved at tp={args.tp} pp={args.pp}{ep})")
    rt.shutdown()


def megatron_to_hf(args) -> None:
    from megarl.models.hf_config import check_parallel_fit, load_spec
    from megarl.models.megatron_ckpt import load_model, read_meta
    from megarl.models.weights import export_hf
    from megarl.runtime import distributed as rt

    read_meta(args.megatron)
    spec = load_spec(args.megatron)
    check_parallel_fit(spec, args.tp, args.pp, where=os.path.join(args.megatron, "config.json"), ep=args.ep,
                       etp=args.etp)
    _check_out(args.out, args.overwrite, args.megatron)
    _check_world(args.tp, args.pp, args.ep, args.etp)
    rt.initialize(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    model = load_model(args.megatron, tp=args.tp, pp=args.pp)
    export_hf(model, args.out, tokenizer_dir=args.megatron,
              max_shard_bytes=int(args.max_shard_gb * 1024**3), show_progress=rt.is_main())
    if rt.is_main():
        print(f"wrote HF checkpoint {args.out}")
    rt.shutdown()


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF safetensors -> megatron dist checkpoint")
    a.add_argument("--hf", required=True, help="HF checkpoint directory")
    a.add_argument("--out", required=True, help="output megatron checkpoint directory")
    a.add_argument("--vocab-multiple", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (must be divisible by every TP used)")
    b = sub.add_parser("megatron-to-hf", help="megatron dist checkpoint -> HF safetensors")
    b.add_argument("--megatron", required=True, help="megatron checkpoint directory")
    b.add_argument("--out", required=True, help="output HF checkpoint directory")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    for s in (a, b):
        s.add_argument("--tp", type=int, default=1, help="tensor parallel size")
        s.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
        s.add_argument("--ep", type=int, default=1, help="expert parallel size (mixture-of-experts models)")
        s.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
        s.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    args = p.parse_args(argv)
    {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf}[args.cmd](args)


if __name__ == "__main__":
    main()
