"""The running-sum recipe's built-in assets (the long-tail reasoning task,
megarl/data/tasks/running_sum.py): its task files and its tiny model's build, as
:mod:`megarl.commands.startup` makes the arithmetic ones.

The held-out file is the warm start's evaluation set (the same draw:
:data:`megarl.builtin.warmstart_running_sum.EVALUATION_SEED`), so the accuracy ``tiny_model.json``
records is the one the recipe's evaluation starts from."""

from __future__ import annotations

import sys


def task_splits(d) -> list:
    """``(path, split, make_rows)`` of the task files ``data.*`` asks for."""
    from megarl.builtin.warmstart_running_sum import EVALUATION_SEED
    from megarl.data.tasks.running_sum import make_problems

    terms = (d.running_sum_min_terms, d.running_sum_max_terms)
    want = [(d.train_path, "train",
             lambda: make_problems("train", 0, d.running_sum_train_n, terms, d.running_sum_alpha))]
    if d.heldout_path:
        want.append((d.heldout_path, "heldout",
                     lambda: make_problems("heldout", EVALUATION_SEED, d.running_sum_heldout_n, terms,
                                           d.running_sum_alpha, distinct=True)))
    return want


def build_command(cfg) -> list[str]:
    """The build of ``model.tiny.*`` on the task of ``data.running_sum_*``."""
    t, d = cfg.model.tiny, cfg.data
    return [sys.executable, "-m", "megarl.builtin.warmstart_running_sum", "--out", cfg.model.path,
            "--hidden-size", str(t.hidden_size), "--num-layers", str(t.num_layers), "--num-heads", str(t.num_heads),
            "--num-kv-heads", str(t.num_kv_heads), "--intermediate-size", str(t.intermediate_size),
            "--steps", str(t.warmstart_steps), "--lr", str(t.warmstart_lr), "--batch", str(t.warmstart_batch),
            "--seed", str(t.seed), "--target-accuracy", str(t.warmstart_target_accuracy or 0),
            "--heldout-n", str(d.running_sum_heldout_n), "--min-terms", str(d.running_sum_min_terms),
            "--max-terms", str(d.running_sum_max_terms), "--alpha", str(d.running_sum_alpha), "--overwrite"]


def tiny_settings(cfg) -> dict:
    """What ``tiny_model.json`` records of a build made with these settings (dotted keys)."""
    t, d = cfg.model.tiny, cfg.data
    return {"family": "llama", "hidden_size": t.hidden_size, "num_layers": t.num_layers, "num_heads": t.num_heads,
            "num_kv_heads": t.num_kv_heads, "intermediate_size": t.intermediate_size,
            "warmstart.max_steps": t.warmstart_steps, "warmstart.lr": t.warmstart_lr,
            "warmstart.batch": t.warmstart_batch, "warmstart.seed": t.seed,
            "warmstart.target_accuracy": t.warmstart_target_accuracy or None,
            "warmstart.heldout_n": d.running_sum_heldout_n, "task.name": "running_sum",
            "task.terms": [d.running_sum_min_terms, d.running_sum_max_terms], "task.alpha": d.running_sum_alpha}


#: the config keys behind :func:`tiny_settings`' entries, for the error naming the one that differs
CONFIG_KEYS = {"warmstart.heldout_n": "data.running_sum_heldout_n", "task.name": "model.tiny.task",
               "task.terms": "data.running_sum_min_terms / data.running_sum_max_terms",
               "task.alpha": "data.running_sum_alpha"}
