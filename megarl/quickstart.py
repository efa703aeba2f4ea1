"""The model layer end to end on CPU, as a newcomer's first command (the program is
:mod:`megarl.commands.quickstart`).

    python -m megarl.quickstart [--config configs/quickstart_tiny.yaml] [key=value ...]
"""

from megarl.commands.quickstart import main

if __name__ == "__main__":
    main()
