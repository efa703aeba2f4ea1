"""What a run shows while it runs: ``metrics.jsonl`` and the progress line (:mod:`.metrics`), the
trackers behind it -- TensorBoard, wandb, mlflow (:mod:`.trackers`) -- the sample tables
(:mod:`.sample_log`) and the per-rank timeline (:mod:`.profiling`)."""
