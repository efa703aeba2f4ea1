"""Evaluation shared by the held-out evaluation during training
(:class:`megarl.control.heldout.Evaluator`) and the evaluation command (``python -m megarl.eval``).

* :mod:`megarl.control.candidates` -- generate (with regeneration of lost candidates), score with the
  run's scorer, and keep every candidate's outcome per prompt;
* :mod:`megarl.evaluation.estimators` -- accuracy over *scored* samples, pass@k (Chen et al. 2021)
  and maj@k, per source, and the per-row results written to JSONL.

A sample whose generation was lost or whose scorer failed is *unscored*: it is counted
(``eval/generation_failures``, ``eval/scorer_failures``) and never reported as a wrong answer;
an evaluation in which nothing was scored has no accuracy (NaN in the metrics, ``null`` in
``metrics.jsonl``).
"""
