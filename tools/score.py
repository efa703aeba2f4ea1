#!/usr/bin/env python
"""Teacher-forced token log-probs of sequences under a model.

    tools/score.py --model DIR --input IN.jsonl --out OUT.jsonl [--tp N --pp N --ep N --etp N]

DIR is an HF or a megarl (megatron) checkpoint.  Each input line is ``{"token_ids": [...]}``;
the matching output line is ``{"token_logprobs": [...]}``: the log-prob of every token after
the first given the tokens before it (``len(token_ids) - 1`` values).
Run under ``torchrun --nproc-per-node TP*PP*DP``; lines are scored in length-sorted
micro-batches and written in input order.  With ``--ep`` (a mixture-of-experts model) the experts
are spread over EP data-parallel ranks, which must run the same micro-batches together (the
token dispatcher gathers over them): the batches are split over the expert-data-parallel groups.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.errors import MegarlError, cli_main  # noqa: E402


class InputError(MegarlError, ValueError):
    pass


def read_inputs(path: str, vocab_size: int) -> list:
    if not os.path.isfile(path):
        raise InputError(f"{path}: input file not found")
    seqs = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["token_ids"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InputError(f"{path}:{i}: expected a JSON object with key 'token_ids'") from None
            if not isinstance(ids, list) or len(ids) < 2 or not all(isinstance(t, int) for t in ids):
                raise InputError(f"{path}:{i}: 'token_ids' must be a list of >= 2 integers")
            bad = [t for t in ids if t < 0 or t >= vocab_size]
            if bad:
                raise InputError(f"{path}:{i}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
            seqs.append(ids)
    return seqs


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF or megarl checkpoint directory")
    p.add_argument("--input", required=True, help='JSONL, one {"token_ids": [...]} per line')
    p.add_argument("--out", required=True, help='JSONL, one {"token_logprobs": [...]} per line')
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (mixture-of-experts models)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from megarl.models.forward import teacher_forced_log_probs
    from megarl.models.hf_config import check_parallel_fit, load_spec
    from megarl.models.megatron_ckpt import load_model
    from megarl.runtime import distributed as rt

    spec = load_spec(args.model)
    check_parallel_fit(spec, args.tp, args.pp, where=os.path.join(args.model, "config.json"), ep=args.ep,
                       etp=args.etp)
    seqs = read_inputs(args.input, spec.vocab_size)
    rt.initialize(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    model = load_model(args.model, tp=args.tp, pp=args.pp)
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if spec.moe is not None and args.ep > 1:
        # the ranks of one EP group (same expert-data-parallel rank) score the same batches together
        dp, dp_rank = ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches = [order[i:i + args.micro_batch_size] for i in range(0, len(order), args.micro_batch_size)]
    mine = batches[dp_rank::dp]
    results = {}
    it = mine
    if rt.is_main():
        from tqdm import tqdm

        it = tqdm(mine, desc="score", unit="batch")
    for batch in it:
        L = max(len(seqs[i]) for i in batch)
        tokens = torch.zeros(len(batch), L, dtype=torch.long)
        for r, i in enumerate(batch):
            tokens[r, : len(seqs[i])] = torch.tensor(seqs[i])
        lp = teacher_forced_log_probs(model, tokens)
        for r, i in enumerate(batch):
            results[i] = lp[r, : len(seqs[i]) - 1].tolist()
    # DP ranks scored disjoint batches: gather them on rank 0 (all ranks keep lockstep).
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rt.is_main():
        merged = {}
        for part in gathered:
            merged.update(part)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            for i in range(len(seqs)):
                f.write(json.dumps({"token_logprobs": merged[i]}) + "\n")
        print(f"scored {len(seqs)} sequences -> {args.out}")
    rt.shutdown()


if __name__ == "__main__":
    main()
