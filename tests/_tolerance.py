"""The suite's numerical tolerances, each derived from the computation it bounds.

A comparison in these tests is one of three kinds, and says which.

* **Bitwise.**  The same kernels on the same inputs in the same order: a resumed or retried run
  against the uninterrupted one, an offload round trip, one engine asked twice, a forward that
  only moves rows around.  Compared with ``torch.equal`` (or ``==``), never with a tolerance: a
  tolerance there would hide the very nondeterminism the test exists to catch.

* **One formula, rounded twice** (:func:`formula_tol`).  Tensor code against a reference written
  here from the paper's formula (plain Python floats or a loop of scalar tensor ops).  Both are
  exact up to rounding, and the classical first-order bound holds whatever the order of the
  operations: a value computed through ``n`` dependent additions / multiplications of operands
  whose magnitudes sum to at most ``scale`` is within ``n * u * scale`` of the exact value, ``u``
  the unit roundoff of the dtype (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd
  ed., 2002, section 3.1: gamma_n = n u / (1 - n u)).  So a tolerance of twice that bound cannot
  be broken by a CPU's vector width, a thread count or a summation order.

* **One network, two implementations or layouts** (:data:`NET_FP32_LOGPROB` and the others
  below).  The same model's forward through transformers and through megatron, at another
  TP / PP / EP / DP layout, packed or padded, sorted or not.  Every GEMM and every reduction may
  run in another order: the kernel's blocking follows the CPU's vector width and thread count, a
  TP split re-sums partial products, packing changes the shapes a GEMM blocks.  A first-order
  bound through a network multiplies every layer's sensitivity and is far too loose to catch
  anything, so these tolerances are sized from the rounding of one pass -- about ``u * scale``
  per layer, ``scale`` the magnitude of the activations and logits -- times the depth, times a
  margin, and checked two ways: against the difference measured on two CPU kinds at 1 and 2
  threads (it must sit well inside), and against the smallest real defect each test guards (a
  wrong expert, a token shifted by one, stale weights: each moves the compared values by
  orders of magnitude more).

Each site names the tolerance it uses and why in a comment: the dtype, the depth of the
computation, and whether the reduction order may differ.

:func:`within` is the comparison; with ``MEGARL_TOLERANCE_LOG=<file>`` set it also appends every
comparison (label, error, tolerance) to that file as a JSON line, which is how the margins in
the table of the closing note were measured (``OMP_NUM_THREADS`` 1 and 2; a test's child
processes take ``MEGARL_TEST_THREADS``, default 1, see ``tests/_dist.py``).
"""

from __future__ import annotations

import json
import os

import torch

#: unit roundoff (half the machine epsilon) per dtype: |fl(x op y) - x op y| <= u |x op y|
U = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def formula_tol(dtype: torch.dtype, ops: int, scale: float) -> float:
    """Twice the first-order rounding bound ``ops * u * scale`` (module docstring): the largest
    difference between two evaluations, in ``dtype``, of one formula over ``ops`` dependent
    operations whose operands' magnitudes sum to at most ``scale``, in any order."""
    return 2.0 * ops * U[dtype] * scale


#: log-probs (and logits of magnitude <= ~30) of one fp32 network of <= 4 layers and width <= 256
#: computed two ways where every reduction may run in another order: transformers against
#: megatron, or one engine over another batch composition, with or without its KV cache (module
#: docstring, third kind).  Rounding of one pass: u * 30 ~ 1.8e-6 per layer; 4 layers, two
#: implementations: ~1.5e-5; the tolerance is ~7x that.  Measured (the whole suite with
#: MEGARL_TOLERANCE_LOG, AMD EPYC with AVX-512, at 1 and at 2 threads): at most 1.19e-5 (the
#: wide-init MoE of tests/unit/models/test_routing_replay.py at 2 threads; 1.05e-5 at 1, and an AVX-512 Xeon
#: gave 1.049e-5 for it), 1.03e-5 for top-p renormalised log-probs, otherwise <= 8e-6.  A wrong
#: expert, a token shifted by one or stale weights move a log-prob by > 1e-2 (the negative
#: controls measure it).
NET_FP32_LOGPROB = 1e-4

#: the same, but both sides are megatron's own local-spec layers on the same weights, differing
#: only in layout (TP / PP / EP partial sums, packed against padded rows, length-sorted
#: micro-batches): one implementation, half the budget.  Measured: at most 3.8e-6 (routing replay
#: on against off, 2 threads; 2.4e-7 at 1), otherwise <= 4.8e-7, often 0 (bitwise).
LAYOUT_FP32_LOGPROB = 5e-5

#: scalar values (critic / reward-model head) of the same fp32 network in two layouts: a head of
#: width <= 256 over final hidden states of magnitude <= ~10: the same budget as the log-probs.
#: Measured: at most 6e-8.
LAYOUT_FP32_VALUE = 5e-5


def adam_weights_tol(lr: float, steps: int, grad_scale: float, eps: float = 1e-8) -> float:
    """Two layouts' weights after ``steps`` Adam steps from the same start: Adam divides by
    ``sqrt(v) + eps``, so a gradient entry far above ``eps`` moves its weight by ``lr`` whatever
    its rounding, and one near or below ``eps`` by ``lr * g / eps``: there a rounding difference
    ``u * grad_scale`` (the magnitude of the terms the entry is a sum of) moves the weight by
    ``lr * u * grad_scale / eps`` per step.  Twice that, every step."""
    return 2.0 * steps * lr * U[torch.float32] * grad_scale / eps


def bf16_logprob_tol(layers: int, logit_scale: float, sides: int = 2) -> float:
    """Log-probs of one network where ``sides`` of the two passes compared round in bf16 (2: two
    bf16 implementations or layouts, e.g. TE against SGLang's kernels, CP=2 against CP=1; 1: bf16
    against an fp32 reference, tests/sglang_real/test_engine_bf16.py).  First order: a bf16 pass
    rounds every layer's output once and the weights once, so its logits carry at most
    ``(layers + 1) * u * logit_scale`` (u = 2^-8), and a log-prob twice that (the logit and the
    log-sum-exp, a convex combination of the logits' errors); twice the sum over the sides.
    ``logit_scale`` is the largest |logit| of the sequences compared, measured by the check (a
    random checkpoint's logits scale with its init std: std 0.2 at hidden 256 gives ~10)."""
    return 2.0 * 2.0 * sides * (layers + 1) * U[torch.bfloat16] * logit_scale


def bf16_near_tie(layers: int, logit_scale: float) -> float:
    """The logit gap under which two bf16 passes of one network may pick different greedy tokens:
    each moves a logit by at most ``(layers + 1) * u * logit_scale`` (:func:`bf16_logprob_tol`),
    so two candidates' order can flip only when their gap is under twice that; twice again."""
    return 2.0 * 2.0 * (layers + 1) * U[torch.bfloat16] * logit_scale


def within(err: float, tol: float, what: str) -> bool:
    """``err <= tol``; with ``MEGARL_TOLERANCE_LOG`` set, the comparison is also logged there."""
    err, tol = float(err), float(tol)
    path = os.environ.get("MEGARL_TOLERANCE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"what": what, "err": err, "tol": tol,
                                "threads": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid()}) + "\n")
    return err <= tol


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """``max |a - b|`` (over ``mask`` where given; 0.0 for an empty selection)."""
    d = (a.double() - b.double()).abs()
    if mask is not None:
        d = d[mask.bool()]
    return float(d.max()) if d.numel() else 0.0
