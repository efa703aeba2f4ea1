"""torchrun worker: load each tiny family at --tp/--pp and save full logits + log-probs."""

import argparse
import os

import torch

from megarl.models.builder import BuildOptions, build_model
from megarl.models.forward import teacher_forced_log_probs
from tests._logits import full_logits
from megarl.models.hf_config import load_spec
from megarl.models.weights import load_hf_weights
from megarl.runtime import distributed as rt

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=1)
p.add_argument("--pp", type=int, default=1)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--families", nargs="+", required=True)
a = p.parse_args()

rt.initialize(tp=a.tp, pp=a.pp)
tokens = torch.load(os.path.join(a.data, "tokens.pt"))
for fam in a.families:
    hf_dir = os.path.join(a.data, fam)
    spec = load_spec(hf_dir)
    model = build_model(spec, BuildOptions(tp=a.tp, pp=a.pp))
    load_hf_weights(model, hf_dir)
    logits = full_logits(model, tokens, micro_batch_size=2)
    lp = teacher_forced_log_probs(model, tokens, micro_batch_size=3)
    # ragged rows padded (sorted by length) and packed (algo.pack_sequences): same log-probs
    lengths = torch.tensor([19, 4, 11, 1, 16])[: tokens.shape[0]].clamp(max=tokens.shape[1])
    padded = teacher_forced_log_probs(model, tokens, micro_batch_size=2, lengths=lengths)
    packed = teacher_forced_log_probs(model, tokens, micro_batch_size=2, lengths=lengths, pack=True)
    if rt.is_main():
        torch.save({"logits": logits, "log_probs": lp, "padded_log_probs": padded, "packed_log_probs": packed},
                   os.path.join(a.out, f"{fam}_tp{a.tp}_pp{a.pp}.pt"))
rt.shutdown()
