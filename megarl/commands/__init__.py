"""The machinery of the commands (``python -m megarl.train`` and its flags): the command line
(:mod:`.cli`), ``--dry-run`` (:mod:`.dry_run`), the start-up checks and built-in assets
(:mod:`.startup`); what a run directory holds before a start is :mod:`megarl.checkpointing.run_dir`.  The entry
points themselves stay thin modules at the top of the package (``megarl/train.py``)."""
