#!/usr/bin/env python
"""Build the built-in tiny model: tokenizer, a small Llama, a warm start through the megatron actor.

    python tools/make_tiny_model.py --out DIR [--task arithmetic --steps 470 --lr 2e-3 --task-arg max_digits=2 ...]

The same program as ``python -m megarl.tinymodel`` (the recipes call that one when the model
they name is missing); see its docstring for what it does.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.tinymodel import main  # noqa: E402

if __name__ == "__main__":
    main()
