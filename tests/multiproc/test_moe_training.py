"""Mixture-of-experts training and weight sync at expert parallelism 2, in one torchrun launch
(tests/workers/moe_train_worker.py, 2 processes):

* layout equivalence: one GRPO update (the real Learner: two mini-batches with pad rows, AdamW,
  clipping) at EP=2 gives the weights of EP=1 within 1e-6, and the same grad norms; megatron's DDP
  reduces the experts' gradients over the expert-data-parallel group (size 1 at EP=2: each
  expert's gradient already holds every rank's tokens), the dense ones over DP;
* the old log-probs of ragged rows split over the DP ranks are the same at EP=2 (the EP ranks run
  different rows: the MoE micro-batches are widened alike, else the token dispatcher aborts);
* weight sync: the manifest is identical on every rank, every expert appears in it exactly once,
  in the canonical mapping order, and its hash at EP=2 equals EP=1's, TP=2's and PP=2's; the hf
  engine on each rank loads the EP=2 stream verified by it and serves exactly it (experts into
  transformers' fused ``gate_up_proj`` / ``down_proj``);
* end to end: ``megarl.train``'s entry point runs 2 GRPO iterations at ``parallel.ep=2``, the
  rollout engines' log-probs equal the EP=2 actor's, and the update moves the experts; a failed
  optimizer step is rolled back on both EP ranks and a corrupted weight load is refused; the run's
  checkpoint resumed at ``parallel.ep=1`` is refused in one line.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.models import mapping
from megarl.models.hf_config import spec_from_hf_config
from megarl.rollout.weight_stream import TensorManifest
from tests._dist import ROOT, torchrun
from tests._tolerance import LAYOUT_FP32_LOGPROB, adam_weights_tol, within

SMALL = dict(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2)


def _moe_with_tokenizer(out, tokenizer_dir):
    """A tiny Qwen3-MoE (4 experts, top-2) that speaks the tiny tokenizer of ``tokenizer_dir``."""
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        dense = json.load(f)
    make_tiny_hf_checkpoint(out, "qwen3_moe", seed=5, vocab_size=dense["vocab_size"], tokenizer_dir=tokenizer_dir,
                            **SMALL)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update({k: dense[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return out


@pytest.fixture(scope="module")
def launch(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_train")
    # qwen2_moe for the layout comparison: its shared expert and sigmoid gate are dense parameters
    # inside the MoE layer (replicated over EP, reduced over DP) next to the routed experts
    hf = make_tiny_hf_checkpoint(str(root / "qwen2_moe"), "qwen2_moe", seed=11, vocab_size=64, **SMALL)
    moe = _moe_with_tokenizer(str(root / "qwen3_moe"), assets["model"])
    run_dir = root / "run"
    train = ["--config", os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml"), f"model.path={moe}",
             "model.build_tiny=false", f"data.train_path={assets['train']}", f"data.heldout_path={assets['heldout']}",
             "data.task.build=false", f"trainer.run_dir={run_dir}", "trainer.iterations=2",
             "trainer.prompts_per_iteration=4", "rollout.n=4", "eval.n=8", "eval.every=2", "parallel.ep=2",
             "reward.fn=tests.plugins.faulty_rewards:digit_count", "algo.num_mini_batches=2",
             "algo.micro_batch_size=2", "algo.forward_micro_batch_size=3", "rollout.reuse_rollout_log_probs=false",
             "trainer.checkpoint_every=2",
             # iteration 1: the last rank's optimizer step fails once (rolled back on every rank, proven by
             # the EP-gathered manifest, retried) and the first load of v1 is corrupted (both engines refuse it)
             "faults.fail_optimizer_step_at=[1]", "faults.corrupt_weight_sync_at=[1]"]
    proc = torchrun("moe_train_worker.py", 2, "--hf", hf, "--out", str(root), "--train", *train)
    res = {tag: torch.load(root / f"{tag}.pt") for tag in ("ep1", "ep2", "tp2sp", "pp2", "ep2tok", "cp2ep2",
                                                            "cp2ep2tok", "resume_ep1")}
    res["stderr"] = proc.stderr
    return hf, res, run_dir, moe


def test_grpo_update_at_ep2_equals_ep1(launch):
    hf, res, _, _ = launch
    ep1, ep2 = res["ep1"], res["ep2"]
    assert (ep1["ep"], ep1["dp"], ep1["edp"]) == (1, 2, 2) and (ep2["ep"], ep2["dp"], ep2["edp"]) == (2, 2, 1)
    assert ep1["held_experts"] == [[0, 1, 2, 3]] * 2 and ep2["held_experts"] == [[0, 1], [2, 3]]
    # megatron DDP: expert grads in their own buffer reduced over expert-DP (size 1 at EP=2), dense over DP
    assert ep2["expert_buffer_groups"] == [1] and ep2["dense_buffer_groups"] == [2]
    assert ep1["expert_buffer_groups"] == [] and ep1["dense_buffer_groups"] == [2]  # ep=1: experts are dense params
    # the old log-probs of ragged rows over the DP ranks: bitwise the same forward at EP=2
    assert torch.equal(ep1["old_log_probs"], ep2["old_log_probs"])
    assert int((ep1["old_log_probs"] < 0).sum()) >= 24  # 12 rows of 1-3 response tokens, none left at 0
    initial = load_file(os.path.join(hf, "model.safetensors"))
    assert set(ep2["weights"]) == set(initial)
    assert ep1["metrics"]["update/optimizer_steps"] == ep2["metrics"]["update/optimizer_steps"] == 2
    experts = [k for k in initial if ".experts." in k]
    assert len(experts) == 2 * 4 * 3  # 2 layers x 4 experts x (gate, up, down)
    for name in experts:  # every expert moved (the comparison is not vacuous for any of them)
        assert (ep1["weights"][name] - initial[name]).abs().max() > 1e-5, name
    moved = max((ep1["weights"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3
    for k in initial:
        # two Adam steps (lr 3e-3) on gradients summed in another order (EP splits the experts,
        # DP reduces over other groups): tests/_tolerance.py's Adam bound, gradient terms <= ~1e-3
        err = (ep2["weights"][k] - ep1["weights"][k]).abs().max().item()
        assert within(err, adam_weights_tol(3e-3, 2, 1e-3), "moe_training/ep2_vs_ep1/weights"), \
            f"{k}: EP=2 differs from EP=1 by {err} after one GRPO update"
    # clipping was active (clip_grad=0.1 below both steps' norms): the global norm is layout-invariant too
    assert min(ep1["metrics"]["update/grad_norm"], ep1["metrics"]["update/grad_norm_max"]) > 0.1
    # norms and losses of fp32 gradients and log-probs summed in another order: relative 1e-5
    # (measured <= 1.2e-7)
    for key in ("update/grad_norm", "update/grad_norm_max", "update/pg_loss"):
        rel = abs(ep2["metrics"][key] - ep1["metrics"][key]) / abs(ep1["metrics"][key])
        assert within(rel, 1e-5, f"moe_training/ep2_vs_ep1/{key}_rel"), (key, rel)


def test_grpo_update_at_tp2_with_sequence_parallelism_equals_ep1(launch):
    """MoE training at TP=2 (parallel.sequence_parallel): the same GRPO update as TP=1, and the
    routers and norms -- replicated over TP, their gradients each TP rank's part of the sequence,
    summed -- identical on both TP ranks afterwards (Megatron-LM#619: router weights drifting
    apart under SP + TP + MoE)."""
    hf, res, _, _ = launch
    ep1, sp = res["ep1"], res["tp2sp"]
    assert (sp["ep"], sp["dp"]) == (1, 1)
    # one forward at another layout (TP splits heads, FFNs and experts' matmuls): fp32 noise
    err = (sp["old_log_probs"] - ep1["old_log_probs"]).abs().max().item()
    assert within(err, LAYOUT_FP32_LOGPROB, "moe_training/tp2sp_vs_ep1/old_log_probs"), err
    assert sp["metrics"]["update/optimizer_steps"] == 2
    initial = load_file(os.path.join(hf, "model.safetensors"))
    for k in initial:
        err = (sp["weights"][k] - ep1["weights"][k]).abs().max().item()
        assert within(err, adam_weights_tol(3e-3, 2, 1e-3), "moe_training/tp2sp_vs_ep1/weights"), \
            f"{k}: TP=2 with sequence parallelism differs from TP=1 by {err} after one GRPO update"
    for key in ("update/grad_norm", "update/grad_norm_max", "update/pg_loss"):
        rel = abs(sp["metrics"][key] - ep1["metrics"][key]) / abs(ep1["metrics"][key])
        assert within(rel, 1e-5, f"moe_training/tp2sp_vs_ep1/{key}_rel"), (key, rel)
    rank0, rank1 = sp["replicated_every_tp_rank"]
    assert any(".router." in n for n in rank0) and any("layernorm" in n for n in rank0), sorted(rank0)
    for n in rank0:
        assert torch.equal(rank0[n], rank1[n]), f"{n} differs across the TP ranks after the update"


def test_manifest_at_ep2_is_every_expert_once_in_canonical_order(launch):
    hf, res, _, _ = launch
    with open(os.path.join(hf, "config.json")) as f:
        canonical = mapping.hf_names_in_order(spec_from_hf_config(json.load(f)))
    initial = TensorManifest.from_named_tensors(load_file(os.path.join(hf, "model.safetensors")).items())
    for tag in ("ep1", "ep2", "tp2sp", "pp2"):
        r = res[tag]
        assert [n for n, _ in r["manifest0"]] == canonical, tag  # each name once, canonical order
        assert r["manifest0_every_rank"] == [initial.global_hash] * 2, tag  # identical on every rank
        assert dict(r["manifest0"]) == {n: e.checksum for n, e in initial.entries.items()}, tag
    ep2 = res["ep2"]
    assert [n for n, _ in ep2["manifest1"]] == canonical
    after = TensorManifest.from_named_tensors(ep2["weights"].items())  # what iter_hf_tensors streamed
    assert ep2["manifest1_every_rank"] == [after.global_hash] * 2
    assert dict(ep2["manifest1"]) == {n: e.checksum for n, e in after.entries.items()}


def test_hf_engine_on_every_rank_loads_the_ep2_stream(launch):
    _, res, _, _ = launch
    ep2 = res["ep2"]
    for k, manifest in (("0", dict(ep2["manifest0"])), ("1", dict(ep2["manifest1"]))):
        every = ep2[f"load{k}"]
        assert [r["num_tensors"] for r in every] == [len(manifest)] * 2
        assert len({r["manifest_hash"] for r in every}) == 1 and all(r["num_buckets"] > 1 for r in every)
        # bucket order is deterministic: the canonical order cut into buckets, the same on every rank
        # and at EP=1 (experts broadcast from their EP rank in place in the stream)
        assert [n for b in every[0]["buckets"] for n in b] == list(manifest)
        assert every[0]["buckets"] == every[1]["buckets"] == res["ep1"][f"load{k}"][0]["buckets"]
        # what each engine serves, named as the checkpoint (experts as views of the fused tensors)
        assert ep2[f"served{k}_every_rank"] == [manifest, manifest], f"v{k}"


def test_train_entry_point_at_ep2(launch):
    _, res, run_dir, moe = launch
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:
        assert r["update/optimizer_steps"] == 2 and r["update/grad_norm"] > 0, r["iteration"]
    # the engines (one per rank, loaded from the EP=2 stream) and the EP=2 actor agree token by token
    assert rows[0]["prep/rollout_actor_logprob_max_abs_err"] < 1e-4
    last = rows[1]
    assert (last["e2e/count/update_failures"], last["e2e/count/update_rollbacks"], last["e2e/count/update_retries"],
            last["e2e/count/weight_load_failures"]) == (1, 1, 1, 1)
    start = load_file(os.path.join(moe, "model.safetensors"))
    end = load_file(os.path.join(run_dir, "export", "iter_2", "model.safetensors"))
    assert set(end) == set(start)
    changed = [k for k in start if ".experts." in k and not torch.equal(start[k], end[k])]
    assert len(changed) == 2 * 4 * 3  # every expert of both EP ranks trained and exported once


def test_resume_at_another_ep_is_refused(launch):
    """The EP=2 run's checkpoint resumed at parallel.ep=1: one line naming both sizes, exit 2 (the
    optimizer state of an MoE model is two optimizers at EP > 1, one at EP = 1), nothing trained."""
    _, res, run_dir, _ = launch
    assert res["resume_ep1"]["exit_code"] == 2
    assert "error: resume from" in res["stderr"] and "saved at parallel.ep=2, resumed at parallel.ep=1" in res["stderr"]
    assert [json.loads(line)["iteration"] for line in open(run_dir / "metrics.jsonl")] == [0, 1]


def test_token_budget_at_ep2_equals_padded(launch):
    """algo.micro_batch_tokens at EP=2: the old log-probs and the GRPO update on packed token-budget
    micro-batches equal the padded ones at EP=2.  The two EP ranks hold different rows, so their
    packed micro-batches differ in length; the allgather token dispatcher (CPU) needs equal ones,
    and each is lengthened with filler tokens to the longer (without that, the 7-row pass fails
    in the all-gather: tried)."""
    hf, res, _, _ = launch
    ep2, tok = res["ep2"], res["ep2tok"]
    # packed against padded forwards: the same per-row maths, fp32 rounding at most
    for key in ("old_log_probs", "old_log_probs_7"):  # _7: the two ranks' packed micro-batches differ in length
        err = (tok[key] - ep2[key]).abs().max().item()
        assert within(err, LAYOUT_FP32_LOGPROB, f"moe_training/ep2tok_vs_ep2/{key}"), err
    assert int((ep2["old_log_probs_7"] < 0).sum()) >= 13
    assert tok["metrics"]["update/optimizer_steps"] == 2
    assert tok["metrics"]["update/tokens"] == ep2["metrics"]["update/tokens"]
    initial = load_file(os.path.join(hf, "model.safetensors"))
    for k in initial:
        err = (tok["weights"][k] - ep2["weights"][k]).abs().max().item()
        assert within(err, adam_weights_tol(3e-3, 2, 1e-3), "moe_training/ep2tok_vs_ep2/weights"), (k, err)
    # the same loss over the same global normaliser, summed in another order: relative 1e-6
    for key in ("update/grad_norm", "update/grad_norm_max", "update/pg_loss"):
        rel = abs(tok["metrics"][key] - ep2["metrics"][key]) / abs(ep2["metrics"][key])
        assert within(rel, 1e-6, f"moe_training/ep2tok_vs_ep2/{key}_rel"), (key, rel)


@pytest.mark.parametrize("tag", ["cp2ep2", "cp2ep2tok"])
def test_context_parallel_moe_equals_ep1(launch, tag):
    """parallel.cp=2 with the experts over EP=2 (world 2: megatron's EP group is the two CP ranks,
    which hold halves of the same rows), padded and on token-budget micro-batches (each packed
    sequence split on its own): the old log-probs, the GRPO update's norms, losses and every weight
    equal EP=1's; the weights' manifest and both engines' synced copies are the same as at EP=1."""
    hf, res, _, _ = launch
    ep1, cp = res["ep1"], res[tag]
    assert (cp["ep"], cp["dp"], cp["edp"]) == (2, 1, 1) and cp["held_experts"] == [[0, 1], [2, 3]]
    for key in ("old_log_probs", "old_log_probs_7"):
        err = (cp[key] - ep1[key]).abs().max().item()
        assert within(err, LAYOUT_FP32_LOGPROB, f"moe_training/{tag}_vs_ep1/{key}"), err
    assert cp["metrics"]["update/optimizer_steps"] == 2
    assert cp["metrics"]["update/tokens"] == ep1["metrics"]["update/tokens"]  # reported once per replica
    initial = load_file(os.path.join(hf, "model.safetensors"))
    for k in initial:
        err = (cp["weights"][k] - ep1["weights"][k]).abs().max().item()
        assert within(err, adam_weights_tol(3e-3, 2, 1e-3), f"moe_training/{tag}_vs_ep1/weights"), (k, err)
    for key in ("update/grad_norm", "update/grad_norm_max", "update/pg_loss"):
        rel = abs(cp["metrics"][key] - ep1["metrics"][key]) / abs(ep1["metrics"][key])
        assert within(rel, 1e-5, f"moe_training/{tag}_vs_ep1/{key}_rel"), (key, rel)
    assert cp["manifest0_hash"] == ep1["manifest0_hash"]
    assert len(set(cp["manifest1_every_rank"])) == 1


# ---- in process -------------------------------------------------------------------------------


def test_packing_is_accepted_at_ep2():
    """Packed micro-batches at EP=2 are lengthened to a common length per micro-batch over the EP
    group (the dispatcher's all-gather needs equal sizes): no longer refused."""
    from megarl.commands.run_checks import check_run
    from megarl.config import load_config

    recipe = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
    assert check_run(load_config(recipe, ["parallel.ep=2", "algo.pack_sequences=true"]), 2) == 2
    assert check_run(load_config(recipe, ["parallel.ep=2", "algo.micro_batch_tokens=256"]), 2) == 2


def test_engine_names_fused_experts_as_the_checkpoint(tmp_path):
    """transformers 5 fuses each layer's experts (``gate_up_proj`` [E, 2F, H], ``down_proj``
    [E, H, F]; Mixtral's block also renamed): the tensors an engine holds, named per expert, are
    bitwise the checkpoint's, for every family; and the exported config names the experts for
    transformers 4 too (SGLang 0.5.7 reads ``num_experts`` only)."""
    import transformers

    from megarl.builtin.tiny_checkpoint import MOE_FAMILIES
    from megarl.models.weights import hf_config_for_export
    from megarl.rollout.weight_stream import hf_logical_tensors

    for fam in MOE_FAMILIES:
        d = make_tiny_hf_checkpoint(str(tmp_path / fam), fam, seed=3, vocab_size=64, **SMALL)
        src = load_file(os.path.join(d, "model.safetensors"))
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # transformers' own fusing
        assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters()), fam
        held = dict(hf_logical_tensors(model))
        assert sorted(held) == sorted(src), fam
        for name, t in src.items():
            assert torch.equal(held[name], t) and held[name].is_contiguous(), (fam, name)
        with open(os.path.join(d, "config.json")) as f:
            cfg = hf_config_for_export(spec_from_hf_config(json.load(f)), torch.float32)
        key = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts", "glm4_moe": "n_routed_experts"}.get(
            fam, "num_experts")
        assert cfg[key] == 4, fam

