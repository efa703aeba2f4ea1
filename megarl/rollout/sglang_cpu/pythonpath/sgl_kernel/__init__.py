"""A stand-in for SGLang's CPU kernel package (``sglang-kernel-cpu``, not on the package index),
put on PYTHONPATH by :func:`megarl.rollout.sglang_cpu.prepare` on machines without CUDA.

SGLang imports these names at load time when ``is_cpu()``.  Of them, only
``assign_req_to_token_pool_cpu`` is called on the paths megarl uses (generation, weight updates,
cache flush, memory release and resume, routed experts); it is written here in torch, after the
Triton kernel ``assign_req_to_token_pool`` in ``mem_cache/allocation.py``.  The others serve
speculative decoding and raise, naming themselves, if anything calls them.  A name not listed is
missing, as in a package that lacks it (SGLang's ``try``/``except ImportError`` fallbacks work).
"""

import torch

STAND_IN = True


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """Row ``req_pool_indices[i]`` of ``req_to_token`` gets, at ``start_offset[i]:end_offset[i]``,
    request ``i``'s slice of ``out_cache_loc`` (the requests' new cache locations, concatenated)."""
    del pool_len  # the row length; torch indexes rows directly
    lengths = (end_offset - start_offset).tolist()
    at = 0
    for row, start, n in zip(req_pool_indices.tolist(), start_offset.tolist(), lengths, strict=True):
        req_to_token[row, start:start + n] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


def _not_stood_in(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not in megarl's CPU stand-in (megarl/rollout/sglang_cpu): "
                                  "it serves speculative decoding, which megarl's CPU engine does not run")

    kernel.__name__ = name
    return kernel


for _name in ("copy_all_layer_kv_cache_cpu", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
              "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
              "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "rotate_input_ids_cpu"):
    globals()[_name] = _not_stood_in(_name)
del _name
