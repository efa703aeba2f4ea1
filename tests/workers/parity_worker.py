"""torchrun worker: load each tiny family at --tp/--pp and save full logits + log-probs."""

import argparse
import os

import torch

from megarl.models.builder import BuildOptions, build_model
from megarl.models.forward import forward_only, scalar_values, teacher_forced_log_probs
from megarl.models.vocab_parallel import token_log_probs_from_logits
from megarl.models.micro_batches import PackedMicroBatch
from megarl.roles.critic import value_head_spec
from tests._logits import full_logits
from megarl.models.hf_config import load_spec
from megarl.models.weights import load_hf_weights, unwrap
from megarl.runtime import distributed as rt

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=1)
p.add_argument("--pp", type=int, default=1)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--families", nargs="+", required=True)
p.add_argument("--sp", action="store_true", help="sequence parallelism (tp > 1); no packed pass under it")
a = p.parse_args()

rt.initialize(tp=a.tp, pp=a.pp)
tokens = torch.load(os.path.join(a.data, "tokens.pt"))
for fam in a.families:
    hf_dir = os.path.join(a.data, fam)
    spec = load_spec(hf_dir)
    model = build_model(spec, BuildOptions(tp=a.tp, pp=a.pp, sequence_parallel=a.sp))
    load_hf_weights(model, hf_dir)
    # what a decoder layer hands the next: [s/tp, b, h] under sequence parallelism, [s, b, h] without
    shapes, hooks = [], [layer.register_forward_hook(lambda mod, args, output: shapes.append(tuple(
        (output[0] if isinstance(output, tuple) else output).shape))) for layer in unwrap(model).decoder.layers]
    logits = full_logits(model, tokens, micro_batch_size=2)
    for h in hooks:
        h.remove()
    lp = teacher_forced_log_probs(model, tokens, micro_batch_size=3)
    # ragged rows padded (sorted by length) and packed (algo.pack_sequences): same log-probs
    lengths = torch.tensor([19, 4, 11, 1, 16])[: tokens.shape[0]].clamp(max=tokens.shape[1])
    padded = teacher_forced_log_probs(model, tokens, micro_batch_size=2, lengths=lengths)
    out = {"logits": logits, "log_probs": lp, "padded_log_probs": padded, "layer_output_shapes": shapes}
    if a.sp:
        # the value head (critic, reward model) sees [s/tp, b, h] under sequence parallelism: the
        # same randomly initialised value-head model (build_model seeds every build alike) with
        # and without it, on the same (odd-length) rows
        vspec = value_head_spec(spec)
        values = {sp: scalar_values(build_model(vspec, BuildOptions(tp=a.tp, pp=a.pp, sequence_parallel=sp)), tokens,
                                    micro_batch_size=2, lengths=lengths) for sp in (False, True)}
        out["values"], out["values_sp"] = values[False], values[True]
    else:
        out["packed_log_probs"] = teacher_forced_log_probs(model, tokens, micro_batch_size=2, lengths=lengths, pack=True)
    if a.pp > 1:
        # forward-only passes are pipelined: every micro-batch in one schedule call, of differing
        # widths (and packed ones), each result what a call of its own gives
        widths = [19, 4, 11, 16]
        mbs = [tokens[i:i + 1, :w] for i, w in enumerate(widths)] + [tokens[:2, :7]]
        if not a.sp:
            mbs += [PackedMicroBatch.from_rows(tokens[:3, :12], torch.tensor([12, 5, 9]))]
        V = spec.vocab_size

        def on_output(o, t):
            return token_log_probs_from_logits(o[:, :-1], t[:, 1:], V)

        together = forward_only(model, mbs, on_output)
        alone = [forward_only(model, [mb], on_output)[0] for mb in mbs]
        out["pipelined_equals_alone"] = [torch.equal(x, y) for x, y in zip(together, alone)]
    if rt.is_main():
        torch.save(out, os.path.join(a.out, f"{fam}_tp{a.tp}_pp{a.pp}{'_sp' if a.sp else ''}.pt"))
rt.shutdown()
