"""torchrun worker: the hybrid engine end to end at --tp/--pp with the hf rollout backend.

On every layout: the actor's weight manifest (saved for cross-layout comparison), a sync
into an hf engine held by global rank 0, greedy and sampled generation, and the token /
log-prob contracts checked against the megatron actor teacher-forcing the rollout ids.
With --step: an actor optimizer step to v+1, the before/after-activation behaviour, a
fresh engine from an HF export of v+1, and a corrupted bucket driving the state machine to
FAILED while the engine stays on v+1.  Results are saved by rank 0 for the test to judge.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from megarl.config import OptimSettings
from megarl.control.state_machine import (
    ExportEvidence,
    IterationStateMachine,
    Phase,
    RolloutActivation,
    SealEvidence,
    UpdateEvidence,
)
from megarl.data.tokenizer import TokenizerContract
from megarl.experience.schema import check_mask_layout
from megarl.models.forward import gather_response, response_log_probs, right_align
from megarl.models.vocab_parallel import token_log_probs_from_logits
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import train_step, wrap_for_training
from megarl.models.weights import export_hf
from megarl.rollout.hf_backend import HFRolloutEngine
from megarl.rollout.protocol import GenerationRequest, SamplingParams
from tests._logits import full_logits
from megarl.rollout.weight_stream import ManifestMismatchError, TensorManifest, iter_buckets
from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine
from megarl.runtime import distributed as rt

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=1)
p.add_argument("--pp", type=int, default=1)
p.add_argument("--hf", required=True)
p.add_argument("--out", required=True)
p.add_argument("--eos", type=int, required=True)
p.add_argument("--step", action="store_true")
a = p.parse_args()

rt.initialize(tp=a.tp, pp=a.pp)
main = rt.is_main()
tag = f"tp{a.tp}_pp{a.pp}"
report = {}
tok = TokenizerContract.from_pretrained(a.hf)

actor = load_model(a.hf, tp=a.tp, pp=a.pp)
manifest0 = actor_manifest(actor)
v0 = make_version(actor, manifest0, run_id="test", optimizer_step=0, tokenizer_hash=tok.hash)
report["manifest"] = {n: e.checksum for n, e in manifest0.entries.items()}
report["manifest_hash"] = manifest0.global_hash

engine = HFRolloutEngine(a.hf, eos_token_ids=[a.eos]) if main else None
sync_actor_to_engine(actor, engine, v0, manifest0, bucket_bytes=64 * 1024)
if main:
    act = engine.activate(v0)
    assert act.manifest_verified and act.cache_flushed

prompts = [tok.encode_prompt([{"role": "user", "content": q}]) for q in
           ("what is 3 plus 4 ?", "compute 12 times 7 .", "solve : 100 minus 58 equals ?")]
requests = [GenerationRequest(f"p{i}", tuple(ids)) for i, ids in enumerate(prompts)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10, n=2, seed=123)


def generate(sampling):
    """Rank 0 generates; every rank gets the results (the actor forwards are collective)."""
    box = [engine.generate(requests, sampling) if main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def experience_tensors(results):
    """Experience layout: prompts left-padded, responses right-padded, masks."""
    P = max(len(r.prompt_ids) for r in results)
    R = max(len(r.response_ids) for r in results)
    B = len(results)
    prompt = torch.zeros(B, P, dtype=torch.long)
    resp = torch.zeros(B, R, dtype=torch.long)
    am = torch.zeros(B, P + R, dtype=torch.long)
    rm = torch.zeros(B, R, dtype=torch.long)
    for b, r in enumerate(results):
        prompt[b, P - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        resp[b, :len(r.response_ids)] = torch.tensor(r.response_ids)
        am[b, P - len(r.prompt_ids):P + len(r.response_ids)] = 1
        rm[b, :len(r.response_ids)] = 1
    return prompt, resp, am, rm, P


def contracts(results, sampling):
    prompt, resp, am, rm, P = experience_tensors(results)
    check_mask_layout(am, rm, P)
    lp = response_log_probs(actor, prompt, resp, am)
    tokens, plen, rlen = right_align(prompt, resp, am)
    logits = full_logits(actor, tokens)[:, :-1]
    resp_logits = gather_response(logits, plen, rlen, resp.shape[1])
    out = {"finish_reasons": [r.finish_reason.value for r in results],
           "versions": sorted({r.policy_version for r in results}),
           "raw_err": 0.0, "argmax_mismatch": 0, "processed_err": None,
           # the first response-mask 1 sits on the first sampled token of the actor sequence
           "first_action_ok": all(int(tokens[b, plen[b]]) == r.response_ids[0]
                                  for b, r in enumerate(results))}
    for b, r in enumerate(results):
        n = len(r.response_ids)
        out["raw_err"] = max(out["raw_err"], (lp[b, :n] - r.raw_log_probs).abs().max().item())
        if sampling.greedy:
            out["argmax_mismatch"] += int((resp_logits[b, :n].argmax(-1) != resp[b, :n]).sum())
        else:
            # processed space: softmax over the top-p nucleus of logits / T (HF TopP semantics)
            z = resp_logits[b, :n] / sampling.temperature
            sorted_z, order = z.sort(-1, descending=False)
            cum = sorted_z.softmax(-1).cumsum(-1)
            drop_sorted = cum <= (1 - sampling.top_p)
            drop_sorted[:, -1] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            z = z.masked_fill(drop, float("-inf"))
            want = z.log_softmax(-1).gather(-1, resp[b, :n, None])[:, 0]
            err = (want - r.processed_log_probs).abs().max().item()
            out["processed_err"] = max(out["processed_err"] or 0.0, err)
    return out


greedy0 = generate(GREEDY)
report["greedy"] = contracts(greedy0, GREEDY)
report["sampled"] = contracts(generate(SAMPLED), SAMPLED)
report["greedy0_ids"] = [list(r.response_ids) for r in greedy0]

if a.step:
    sm = IterationStateMachine(committed=v0)
    sm.begin_export()
    sm.begin_rollout_loading(ExportEvidence(manifest_hash=manifest0.global_hash))
    sm.mark_rollout_ready([RolloutActivation(v0.short_id, manifest0.global_hash, True, True)], 1)
    sm.begin_generating([v0.short_id])
    sm.seal_experience(SealEvidence(3, 3, 3, 3, frozenset({v0.short_id})))
    sm.begin_update()

    # push the actor towards a fixed continuation so its greedy output visibly changes
    target = torch.tensor([list(prompts[0]) + [40, 41, 42, 43, 44, 45]])
    ddp, opt = wrap_for_training(actor, OptimSettings(optimizer="sgd", lr=20.0, clip_grad=0.0))
    n_prompt = len(prompts[0])

    def loss_fn(output, mb):
        lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], actor.megarl_spec.vocab_size)
        return -lp[:, n_prompt - 1:].sum() / 6.0, {}

    res = train_step(ddp, opt, [{"tokens": target}], loss_fn)
    manifest1 = actor_manifest(ddp)
    v1 = v0.successor(manifest1.global_hash)
    sm.commit(v1, UpdateEvidence(ranks_succeeded=dist.get_world_size() if res.update_successful else 0,
                                 world_size=dist.get_world_size(), manifest_hash=manifest1.global_hash))

    sm.begin_export()
    sm.begin_rollout_loading(ExportEvidence(manifest_hash=manifest1.global_hash))
    sync_actor_to_engine(ddp, engine, v1, manifest1, bucket_bytes=64 * 1024)
    report["before_activation_ids"] = [list(r.response_ids) for r in generate(GREEDY)]
    report["before_activation_version"] = generate(GREEDY)[0].policy_version
    if main:
        act = engine.activate(v1)
        acts = [RolloutActivation(act.version_id, act.manifest_hash, act.manifest_verified, act.cache_flushed)]
    else:
        acts = [RolloutActivation(v1.short_id, manifest1.global_hash, True, True)]
    sm.mark_rollout_ready(acts, 1)
    greedy1 = generate(GREEDY)
    report["after_activation_ids"] = [list(r.response_ids) for r in greedy1]
    report["after_activation_version"] = greedy1[0].policy_version
    report["v0"], report["v1"] = v0.short_id, v1.short_id
    report["greedy1"] = contracts(greedy1, GREEDY)

    # a fresh engine loaded from an HF export of v+1
    export_dir = os.path.join(a.out, f"export_v1_{tag}")
    export_hf(ddp, export_dir)
    if main:
        from safetensors.torch import load_file

        exported = sorted(load_file(os.path.join(export_dir, "model.safetensors")).items())
        file_manifest = TensorManifest.from_named_tensors(exported)
        report["export_manifest_equal"] = file_manifest.global_hash == manifest1.global_hash
        fresh = HFRolloutEngine(export_dir, eos_token_ids=[a.eos])
        fresh.load_weights(v1, iter_buckets(exported, 64 * 1024), file_manifest)
        fresh.activate(v1)
        report["fresh_ids"] = [list(r.response_ids) for r in fresh.generate(requests, GREEDY)]

    # a corrupted bucket: one value flipped in transit
    sm.begin_generating([v1.short_id])
    sm.fail("test: abandon iteration to exercise a corrupted export")
    sm.recover(v1)
    sm.begin_export()
    sm.begin_rollout_loading(ExportEvidence(manifest_hash=manifest1.global_hash))
    seen = {"n": 0}

    def corrupt_second_bucket(bucket):
        seen["n"] += 1
        if seen["n"] != 2:
            return bucket
        name, t = bucket[0]
        t = t.clone()
        t.view(-1)[0] += 1.0
        return [(name, t)] + list(bucket[1:])

    error = None
    try:
        sync_actor_to_engine(ddp, engine, v1.retried(manifest1.global_hash), manifest1,
                             bucket_bytes=64 * 1024, transport=corrupt_second_bucket)
    except ManifestMismatchError as e:
        error = str(e)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    error = box[0]
    if error is not None:
        sm.fail(f"weight sync rejected: {error}")
    report["corrupt_error"] = error
    report["corrupt_phase"] = sm.state.phase.value
    report["phase_is_failed"] = sm.state.phase is Phase.FAILED
    after = generate(GREEDY)
    report["after_corrupt_ids"] = [list(r.response_ids) for r in after]
    report["after_corrupt_version"] = after[0].policy_version

if main:
    with open(os.path.join(a.out, f"rollout_{tag}.json"), "w") as f:
        json.dump(report, f, indent=1)
rt.shutdown()
