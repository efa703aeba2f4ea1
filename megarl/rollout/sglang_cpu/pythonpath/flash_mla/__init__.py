"""Stands in for ``flash_mla`` (``sgl-flash-mla``, a dependency of SGLang) where no CUDA exists.

The installed package loads a CUDA library at import and raises ``OSError`` (no ``libcuda.so.1``)
where ``ImportError`` is what importers catch: megatron-core's ``transformer/attention.py``
(``try: from flash_mla import ... except ImportError``) then fails to import, and with it the
megatron actor in the same process as SGLang.  Neither needs it on CPU (it is a multi-head latent
attention kernel for CUDA), so here it is simply absent.
"""

raise ImportError("flash_mla is a CUDA kernel package; megarl's CPU stand-in (megarl/rollout/sglang_cpu) makes "
                  "it absent where no CUDA device exists")
