"""The rollout contracts against the megatron actor (docs/design.md contracts 1, 2 and 8).

torchrun workers (tests/workers/rollout_sync_worker.py) sync a megatron actor at TP=1, TP=2
and TP=2 x PP=2 into the hf rollout engine and teacher-force the generated ids back through
the actor:

* token contract: greedy rollout ids are the actor's argmax at every response position; the
  first response-mask 1 is the first sampled token; EOS and length truncation both occur;
* log-prob parity: raw-space rollout log-probs equal the actor's within 1e-4; processed-space
  log-probs at T=0.7, top-p 0.9 equal a direct computation from the actor's logits;
* the weight stream is bitwise identical at every layout (same manifest hash);
* after an optimizer step, v+1 is staged without being served until activation, then serves
  exactly what a fresh engine loaded from an HF export of v+1 serves; a corrupted bucket is
  caught by the manifest, the engine stays on v+1 and the state machine goes to FAILED.
"""

import json

import pytest
import torch

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
from megarl.data.tokenizer import TokenizerContract
from tests._dist import torchrun
from tests._tolerance import NET_FP32_LOGPROB, within

LAYOUTS = [(1, 1, False), (2, 1, True), (2, 2, False)]
PROMPTS = ("what is 3 plus 4 ?", "compute 12 times 7 .", "solve : 100 minus 58 equals ?")


def _pick_eos(hf_dir, tok):
    """A token that greedy decoding emits early for prompt 0 but never for prompt 1, so one
    response ends with EOS and another is truncated by max_new_tokens."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    outs = []
    for q in PROMPTS[:2]:
        ids = torch.tensor([tok.encode_prompt([{"role": "user", "content": q}])])
        with torch.no_grad():
            g = m.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(g[0, ids.shape[1]:].tolist())
    for t in outs[0][1:5]:
        if t not in outs[1] and t not in outs[0][: outs[0].index(t)]:
            return t
    raise AssertionError(f"no usable EOS candidate in {outs}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    build_tiny_tokenizer(root / "tok")
    hf = make_tiny_hf_checkpoint(str(root / "hf"), "llama", seed=21, vocab_size=128,
                                 tokenizer_dir=str(root / "tok"))
    eos = _pick_eos(hf, TokenizerContract.from_pretrained(hf))
    out = {}
    for tp, pp, step in LAYOUTS:
        args = ["--tp", str(tp), "--pp", str(pp), "--hf", hf, "--out", str(root), "--eos", str(eos)]
        torchrun("rollout_sync_worker.py", tp * pp, *(args + (["--step"] if step else [])))
        with open(root / f"rollout_tp{tp}_pp{pp}.json") as f:
            out[(tp, pp)] = json.load(f)
    return out


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)], ids=["tp1", "tp2", "tp2pp2"])
def test_token_and_log_prob_contracts(runs, tp, pp):
    r = runs[(tp, pp)]
    g, s = r["greedy"], r["sampled"]
    assert g["argmax_mismatch"] == 0, "rollout ids are not the actor's greedy tokens"
    assert g["first_action_ok"] and s["first_action_ok"]
    assert "eos" in g["finish_reasons"] and "length" in g["finish_reasons"], g["finish_reasons"]
    # fp32, the hf engine vs the megatron actor at this layout: two implementations
    assert within(g["raw_err"], NET_FP32_LOGPROB, f"actor_sync/tp{tp}pp{pp}/greedy_raw") and \
        within(s["raw_err"], NET_FP32_LOGPROB, f"actor_sync/tp{tp}pp{pp}/sampled_raw"), (g["raw_err"], s["raw_err"])
    assert s["processed_err"] is not None and within(s["processed_err"], NET_FP32_LOGPROB,
                                                     f"actor_sync/tp{tp}pp{pp}/processed"), s["processed_err"]
    assert len(g["versions"]) == 1 and len(s["versions"]) == 1


def test_weight_stream_bitwise_equal_across_layouts(runs):
    ref = runs[(1, 1)]
    for key in [(2, 1), (2, 2)]:
        assert runs[key]["manifest"] == ref["manifest"], f"tp{key[0]}pp{key[1]} stream differs"
        assert runs[key]["manifest_hash"] == ref["manifest_hash"]
    assert len(ref["manifest"]) == 2 + 9 * 2 + 1  # embed, norm, lm_head + 9 per layer


def test_version_switch_after_optimizer_step(runs):
    r = runs[(2, 1)]
    assert r["v0"] != r["v1"]
    assert r["after_activation_ids"] != r["greedy0_ids"], "the step did not change greedy output: vacuous"
    # staged but not activated: still v
    assert r["before_activation_ids"] == r["greedy0_ids"]
    assert r["before_activation_version"] == r["v0"]
    # activated: exactly what a fresh engine from an HF export of v+1 serves
    assert r["export_manifest_equal"]
    assert r["after_activation_ids"] == r["fresh_ids"]
    assert r["after_activation_version"] == r["v1"]
    assert r["greedy1"]["argmax_mismatch"] == 0 and within(r["greedy1"]["raw_err"], NET_FP32_LOGPROB, "actor_sync/v1_raw")


def test_corrupted_bucket_is_caught(runs):
    r = runs[(2, 1)]
    err = r["corrupt_error"]
    assert err is not None, "the corrupted bucket was not detected"
    assert "do not match the expected manifest" in err and "checksum" in err, err
    assert f"engine stays on {r['v1']}" in err, err
    assert r["phase_is_failed"], r["corrupt_phase"]
    assert r["after_corrupt_version"] == r["v1"]
    assert r["after_corrupt_ids"] == r["after_activation_ids"]


def test_qkv_read_in_place_and_built_in_the_engine(tmp_path, megatron_world):
    """The commit-time manifest reads Q, K and V inside megatron's fused QKV (no copy) and equals
    the manifest of the assembled tensors, in the actor's dtype and cast; the stream builds them
    straight in the engine's staging tensors (one copy, not two), and the engine loads, verifies
    and serves them: after a weight change the engine matches a fresh export."""
    from safetensors.torch import load_file

    from megarl.models.megatron_ckpt import load_model
    from megarl.models.weights import iter_hf_tensors
    from megarl.rollout.hf_backend import HFRolloutEngine
    from megarl.rollout.weight_stream import TensorManifest
    from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine

    # 4 heads in 2 groups of head_dim 32: each group's K is 32 x 128 fp32 = 16 KiB, whole
    # checksum rows, so the manifest reads Q, K and V in place
    hf = make_tiny_hf_checkpoint(str(tmp_path / "m"), "llama", seed=3, hidden_size=128)
    model = load_model(hf)
    src = load_file(f"{hf}/model.safetensors")
    qkv = [n for n in src if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]
    assert len(qkv) == 6
    engine = HFRolloutEngine(hf, dtype=torch.float32)
    staging = engine.staging_target
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        plain = dict(iter_hf_tensors(model))
        for dtype in (torch.bfloat16, None):
            assembled = TensorManifest.from_named_tensors((n, t.to(dtype or t.dtype)) for n, t in plain.items())
            manifest = actor_manifest(model, dtype=dtype)
            assert manifest.to_dict() == assembled.to_dict()
        built = {}

        def recording(name):
            t = staging(name)
            built[name] = None if t is None else t.data_ptr()
            return t

        engine.staging_target = recording
        version = make_version(model, manifest, "test", step, "sha256:" + "0" * 64)
        report = sync_actor_to_engine(model, engine, version, manifest, bucket_bytes=1 << 16)
        engine.activate(version)
        assert sorted(built) == sorted(qkv) and all(built.values()), built
        assert report.manifest_hash == manifest.global_hash
        served = dict(engine._active.targets())
        for n in qkv:
            assert served[n].data_ptr() == built[n], f"{n} was copied again after it was built"
        for n, t in plain.items():
            assert torch.equal(served[n], t), n
