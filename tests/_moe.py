"""MoE fixtures shared by the MoE tests and the SGLang tier: a real model's config.json, the MoE
recipe shrunk for a test, and the check that a sealed batch's routing is its export's."""

from __future__ import annotations

import torch

from tests._tolerance import NET_FP32_LOGPROB

#: Qwen3-30B-A3B's config.json (the published model: 30.5 B parameters)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "vocab_size": 151936, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
    "router_aux_loss_coef": 0.001, "output_router_logits": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645, "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
    "transformers_version": "4.51.0",
}

#: the MoE recipe shrunk for a test: a 2-layer, 4-expert tiny Qwen3-MoE built in 20 warm-start steps
SHRUNK = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
          "model.tiny.num_kv_heads=1", "model.tiny.num_experts=4", "model.tiny.top_k=2",
          "model.tiny.moe_intermediate_size=32", "model.tiny.warmstart_steps=20",
          "model.tiny.warmstart_target_accuracy=null",
          "data.task.train_n=200", "data.task.heldout_n=16", "eval.n=16", "eval.every=0"]


def assert_routing_is_the_exports(hf_model, facts, k):
    """The sealed batch's recorded routing is what the export's routers choose, token by token,
    layer by layer -- wherever the choice is not a tie within the parity tolerance: the engine's
    cached decode and this teacher-forced forward may round a near-tie either way (at most 1% are)."""
    re = facts.routed_experts
    decided = ties = 0
    for row, (cols, chosen, margin) in enumerate(_export_routing(hf_model, facts)):
        same = (re.experts[row, cols].long().sort(dim=-1).values == chosen.sort(dim=-1).values).all(-1)
        clear = margin > NET_FP32_LOGPROB
        assert bool(same[clear].all()), (k, row)
        decided, ties = decided + int(clear.sum()), ties + int((~clear).sum())
    assert decided > 0 and ties <= 0.01 * decided, (decided, ties)


def _export_routing(model, facts):
    """Per row: the top-k expert sets transformers' routers choose at every recorded position
    (``routing_token_mask``), teacher-forced on the row's real tokens, ``(positions, layers, k)``,
    and the margin between each position's k-th and (k+1)-th router logit ``(positions, layers)``."""
    from megarl.experience.schema import routing_token_mask

    P, k = facts.prompt_len, facts.routed_experts.experts.shape[-1]
    rec = routing_token_mask(facts.attention_mask)
    out = []
    for b in range(facts.batch_size):
        am = facts.attention_mask[b]
        n = int(facts.response_mask[b].sum())
        tokens = torch.cat([facts.prompt_ids[b][am[:P] != 0], facts.response_ids[b][:n]])[None]
        with torch.no_grad():
            logits = model(tokens, output_router_logits=True).router_logits  # a tuple: (tokens, E) per layer
        top = [lg.topk(k + 1, dim=-1) for lg in logits]
        chosen = torch.stack([t.indices[:, :k] for t in top], dim=1)  # (tokens, layers, k)
        margin = torch.stack([t.values[:, k - 1] - t.values[:, k] for t in top], dim=1)
        cols = rec[b].nonzero()[:, 0]
        out.append((cols, chosen[: len(cols)], margin[: len(cols)]))
    return out
