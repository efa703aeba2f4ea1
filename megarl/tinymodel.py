"""Builds the built-in tiny model (the program is :mod:`megarl.builtin.warmstart`).

    python -m megarl.tinymodel --out DIR [--target-accuracy 0.3 --steps 2000 ...]
    python -m megarl.tinymodel --help
"""

from megarl.builtin.warmstart import main

if __name__ == "__main__":
    main()
