"""Built-in verifiable tasks: problem generators with an exact rule-based ``score``.

Each task is a module with ``make_problems(...) -> list[dict]`` (rows ``{"id", "prompt",
"answer"}``, the layout :func:`megarl.data.prompts.load_prompt_dataset` reads) and
``score(response_text, answer) -> float``.  Modules are imported lazily (by :func:`get_task`),
so ``python -m megarl.data.tasks.<name>`` runs without a double-import warning.
"""

from __future__ import annotations

import importlib

__all__ = ["TASKS", "get_task"]

TASKS = ("arithmetic", "running_sum")


def get_task(name: str):
    """The task module called ``name`` (e.g. ``get_task("arithmetic").score``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
    return importlib.import_module(f"{__name__}.{name}")
