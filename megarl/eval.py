"""Evaluates a model on a prompt file, scored by a reward (the program is
:mod:`megarl.commands.evaluate`).

    python -m megarl.eval --model runs/<run>/export/iter_200 --data heldout.jsonl [--config RECIPE.yaml] ...
    python -m megarl.eval --help
"""

from megarl.commands.evaluate import main

if __name__ == "__main__":
    main()
