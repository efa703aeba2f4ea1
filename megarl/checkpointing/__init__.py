"""Training-position checkpoints and run directories: what a run leaves on disk and resumes from.

``checkpoint.py`` writes and reads the checkpoints (atomic publish, MANIFEST, verified load);
``run_dir.py`` decides what a run directory's contents mean before a start.  This package sits
above ``megarl.models`` (it saves and loads models and optimizers through it) and
``megarl.runtime``, and below ``megarl.control``, which decides when to checkpoint.
"""
