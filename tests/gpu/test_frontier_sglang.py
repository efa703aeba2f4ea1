"""The frontier families' GPU check (issue 60, item 3): tiny DeepSeek-V3 and GLM-4.5 in bf16, the
megatron actor on transformer-engine, synced into SGLang on one GPU.

    bash tests/gpu/run.sh                        # runs this after the MoE check
    python3 tests/gpu/test_frontier_sglang.py    # one GPU
    pytest -q tests/gpu/                         # the same through pytest; skipped without CUDA / sglang

What the CPU cannot run (tests/sglang_real/test_frontier_families_cpu.py says why): SGLang's
multi-latent attention (its GPU backends: FlashInfer / FlashMLA / Triton), and transformer-engine's
MLA layers (the latent norms fused into the up projections, mapped by name:
``linear_q_up_proj.layer_norm_weight``).  Rows, one per family:

1. the actor (TE spec, bf16) teacher-forced on a few sequences equals transformers' bf16 forward on
   the same checkpoint within ``bf16_logprob_tol`` (two bf16 implementations);
2. the actor synced into an SGLang engine through megarl's verified weight stream (every engine
   parameter written: for DeepSeek-V3, the fused ``fused_qkv_a_proj_with_mqa`` of each layer), and
   SGLang's teacher-forced log-probs of the same sequences equal the actor's within that tolerance.

Not run yet: no GPU has been lent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from tests.gpu._gpu_check import SKIP_REASON, TOKENIZER_HASH, Table, run_as_pytest  # noqa: E402

from tests._tolerance import bf16_logprob_tol  # noqa: E402

SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_heads=4, max_position_embeddings=512)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 8,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
#: the tiny checkpoints: DeepSeek-V3 with YaRN and the keys SGLang's model reads from DeepSeek's own
#: config.json; GLM-4.5 as tiny_checkpoint makes it
FAMILIES = {
    "deepseek_v3": dict(rope_parameters=YARN, max_position_embeddings=320, moe_layer_freq=1,
                        topk_method="noaux_tc", scoring_func="sigmoid", num_layers=3),
    "glm4_moe": dict(num_kv_heads=2),
}
EOS = 2


def sequences():
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(10, 1000, (5 + 3 * i,), generator=g).tolist() for i in range(3)]
    responses = [torch.randint(10, 1000, (6,), generator=g).tolist() for _ in range(3)]
    return prompts, responses


def actor_log_probs(model, prompts, responses):
    from megarl.models.forward import teacher_forced_log_probs

    out, scale = [], 0.0
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor([p + r], device="cuda")
        lp = teacher_forced_log_probs(model, ids)[0, len(p) - 1:].float().cpu()
        out.append(lp)
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + responses[0]], device="cuda"), None, None)
        scale = float(logits.float().abs().max())
    return out, scale


def check_actor(ctx, fam):
    import transformers

    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.models.megatron_ckpt import load_model

    d = make_tiny_hf_checkpoint(os.path.join(ctx.work, fam), fam, seed=11, dtype=torch.bfloat16, **SMALL,
                                **FAMILIES[fam])
    ctx.dirs[fam] = d
    model = load_model(d, tp=1, pp=1, dtype=torch.bfloat16)
    model.eval()
    ctx.models[fam] = model
    prompts, responses = sequences()
    mine, scale = actor_log_probs(model, prompts, responses)
    ctx.actor_lp[fam], ctx.scale[fam] = mine, scale
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    worst = 0.0
    for p, r, lp in zip(prompts, responses, mine, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([p + r], device="cuda")).logits.float()
        ref = torch.log_softmax(logits, -1)[0, len(p) - 1:-1].gather(-1, torch.tensor(r, device="cuda")[:, None])[:, 0]
        worst = max(worst, float((lp - ref.cpu()).abs().max()))
    layers = model.megarl_spec.num_layers
    tol = bf16_logprob_tol(layers, scale)
    assert worst <= tol, f"max |TE actor - transformers| log-prob {worst:.4f} > {tol:.4f}"
    attention = type(model.decoder.layers[0].self_attention).__name__
    return f"max |TE actor - transformers| {worst:.4f} (bf16 tolerance {tol:.4f}); attention {attention}"


def check_engine(ctx, fam):
    from megarl.rollout.sglang_backend import SGLangRolloutEngine
    from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine

    model = ctx.models[fam]
    engine = SGLangRolloutEngine(ctx.dirs[fam], tp_size=1, eos_token_ids=[EOS], dtype="bfloat16",
                                 mem_fraction_static=0.25)
    try:
        manifest = actor_manifest(model, dtype=torch.bfloat16)
        version = make_version(model, manifest, run_id="gpu-frontier-check", optimizer_step=0,
                               tokenizer_hash=TOKENIZER_HASH)
        report = sync_actor_to_engine(model, engine, version, manifest, bucket_bytes=8 << 20, dtype=torch.bfloat16)
        engine.activate(version)
        prompts, responses = sequences()
        _, served = engine.teacher_force(prompts, responses)
        worst = max(float((s - a[:len(s)]).abs().max()) for s, a in zip(served, ctx.actor_lp[fam], strict=True))
        tol = bf16_logprob_tol(model.megarl_spec.num_layers, ctx.scale[fam])
        assert worst <= tol, f"max |SGLang - actor| log-prob {worst:.4f} > {tol:.4f}"
        return f"{report.num_tensors} tensors verified; max |SGLang - TE actor| {worst:.4f} (tolerance {tol:.4f})"
    finally:
        engine.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if SKIP_REASON:
        print(f"frontier-family GPU check not run: {SKIP_REASON}", flush=True)
        return 1
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    table = Table()
    with tempfile.TemporaryDirectory(prefix="megarl-gpu-frontier-") as work:
        ctx = SimpleNamespace(work=work, dirs={}, models={}, actor_lp={}, scale={})
        try:
            for fam in FAMILIES:
                actor_row = f"{fam}: TE actor (bf16) = transformers"
                table.run(actor_row, lambda fam=fam: check_actor(ctx, fam))
                table.run(f"{fam}: synced into SGLang, its log-probs = the actor's",
                          lambda fam=fam: check_engine(ctx, fam), needs=(actor_row,))
        finally:
            table.print()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": table.rows}, f, indent=1)
    return 0 if table.ok else 1


def test_gpu_frontier_check():
    """pytest entry: the check in a fresh process (SGLang's schedulers are processes)."""
    run_as_pytest(__file__, "MEGARL_GPU_FRONTIER_TIMEOUT", 300)


if __name__ == "__main__":
    sys.exit(main())
