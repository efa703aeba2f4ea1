"""A tiny generative judge for the tests (the e2e run on the hf engine, the SGLang tier's)."""

import os

import torch


def yes_no_judge(path, tokenizer_dir, seed):
    """A random causal LM whose head leans on the words yes and no, so that its greedy text holds a
    verdict that depends on what it read (a judge's output, without training one)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint

    make_tiny_hf_checkpoint(path, "llama", seed=seed, vocab_size=112, hidden_size=32, num_layers=2, num_heads=2,
                            num_kv_heads=1, intermediate_size=64, tokenizer_dir=tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(path)
    sd = load_file(os.path.join(path, "model.safetensors"))
    w, g = sd["lm_head.weight"], torch.Generator().manual_seed(seed)
    w.mul_(0.1)
    lean = torch.randn(w.shape[1], generator=g)  # yes along it, no against it: the hidden state decides
    w[tok.convert_tokens_to_ids("yes")], w[tok.convert_tokens_to_ids("no")] = lean, -lean
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path
