"""torchrun worker: every tiny MoE family at one --tp/--ep/--etp layout, in one launch.

For each family: load the HF checkpoint at the layout, save teacher-forced log-probs (full rows
and ragged rows), export it back to HF (HF -> megatron shards -> HF), save a megatron dist
checkpoint, load that into a fresh model at the same layout and export again (HF -> megatron
checkpoint -> HF).  The test compares the exports with the source bitwise and the log-probs with
transformers'.

The body runs under ``if __name__ == "__main__"``: megatron's dist_checkpointing save starts a
``multiprocessing`` manager with the *spawn* method, which re-imports this file in the child;
unguarded, the child would run the worker again and wait forever in the process-group rendezvous.
"""

import argparse
import json
import os
import time

import torch

from megarl.models.forward import Routing, teacher_forced_log_probs
from megarl.models.router_replay import RoutingStats
from megarl.models.megatron_ckpt import load_model, save_megatron_checkpoint
from megarl.models.weights import export_hf
from megarl.runtime import distributed as rt
from tests._routing import forced_routing, moe_layer_indices


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--families", nargs="+", required=True)
    a = p.parse_args()

    t0 = time.time()
    rt.initialize(tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp)
    from megatron.core import parallel_state as ps  # noqa: E402

    tag = f"tp{a.tp}_pp{a.pp}_ep{a.ep}_etp{a.etp or a.tp}"
    tokens = torch.load(os.path.join(a.data, "tokens.pt"))
    lengths = torch.tensor([19, 4, 11, 1, 16])[: tokens.shape[0]].clamp(max=tokens.shape[1])
    held = {}
    train_refused = None  # TP > 1: did megatron refuse a training-mode forward (no sequence parallelism)?
    for fam in a.families:
        hf_dir = os.path.join(a.data, fam)
        model = load_model(hf_dir, tp=a.tp, pp=a.pp)
        inner = model
        # which global experts this rank holds (layer 0): rank e of the EP group holds a contiguous block
        from megarl.models import mapping

        names = mapping.stage_param_names(inner)
        held[fam] = sorted({int(n.split(".")[6]) for n in names if ".mlp.experts.local_experts." in n})
        if a.tp > 1 and fam == a.families[0]:
            # megatron-core trains MoE layers at TP > 1 only with sequence parallelism (config.py refuses it)
            from megarl.models.micro_batches import position_ids_for

            model.train()
            try:
                model(tokens[:1], position_ids_for(tokens[:1]), None)
                train_refused = False
            except ValueError as e:
                train_refused = "sequence parallelism" in str(e)
            model.eval()
        lp = teacher_forced_log_probs(model, tokens, micro_batch_size=3)
        ragged = teacher_forced_log_probs(model, tokens, micro_batch_size=2, lengths=lengths)
        # routing replay: a forced routing (not the router's choice) dispatched at this layout
        spec_moe = model.megarl_spec.moe
        forced = forced_routing(tokens.shape[0], tokens.shape[1], moe_layer_indices(model), spec_moe.top_k,
                                spec_moe.num_experts, lengths)
        stats = RoutingStats(forced.moe_layers)
        replayed = teacher_forced_log_probs(model, tokens, micro_batch_size=2, lengths=lengths,
                                            routing=Routing(forced, replay=True, stats=stats))
        replay_m = stats.reduce()  # every rank ran the same rows: no data-parallel sum
        saved = {"log_probs": lp, "ragged_log_probs": ragged, "replayed_log_probs": replayed, "replay": replay_m}
        if a.tp > 1:
            # sequence parallelism: each TP rank's routers see 1/tp of the (padded) sequence and
            # replay their part of the record; the comparisons are summed over the TP ranks
            sp_model = load_model(hf_dir, tp=a.tp, pp=a.pp, sequence_parallel=True)
            sp_stats = RoutingStats(forced.moe_layers)
            saved["replayed_log_probs_sp"] = teacher_forced_log_probs(
                sp_model, tokens, micro_batch_size=2, lengths=lengths,
                routing=Routing(forced, replay=True, stats=sp_stats))
            saved["replay_sp"] = sp_stats.reduce()
            saved["ragged_log_probs_sp"] = teacher_forced_log_probs(sp_model, tokens, micro_batch_size=2,
                                                                    lengths=lengths)
            del sp_model
        if rt.is_main():
            torch.save(saved, os.path.join(a.out, f"{fam}_{tag}.pt"))
        export_hf(model, os.path.join(a.out, f"{fam}_{tag}_export"))
        meg = os.path.join(a.out, f"{fam}_{tag}_meg")
        save_megatron_checkpoint(model, meg, tokenizer_dir=hf_dir)
        again = load_model(meg, tp=a.tp, pp=a.pp)
        export_hf(again, os.path.join(a.out, f"{fam}_{tag}_back"))
        del model, again

    import torch.distributed as dist  # noqa: E402

    placement = [None] * dist.get_world_size()
    dist.all_gather_object(placement, {"ep_rank": ps.get_expert_model_parallel_rank(),
                                       "etp_rank": ps.get_expert_tensor_parallel_rank(),
                                       "tp_rank": ps.get_tensor_model_parallel_rank(),
                                       "pp_rank": ps.get_pipeline_model_parallel_rank(), "experts": held,
                                       "train_refused": train_refused})
    if rt.is_main():
        with open(os.path.join(a.out, f"placement_{tag}.json"), "w") as f:
            json.dump({"ranks": placement, "seconds": time.time() - t0}, f)
    rt.shutdown()


if __name__ == "__main__":
    main()
