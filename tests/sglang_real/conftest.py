"""The real SGLang engine on CPU: these tests run in the SGLang test environment
(``tools/sglang_env.sh``), with ``MEGARL_SGLANG_TESTS=1``:

    PYTHONPATH=$PWD MEGARL_SGLANG_TESTS=1 $(tools/sglang_env.sh) -m pytest -q -p no:cacheprovider tests/sglang_real

``.ci/run`` runs exactly that after the main suite.  In the main environment (no SGLang) they are
not collected; with the flag set, a missing SGLang is an error, never a skip.
"""

import os

if os.environ.get("MEGARL_SGLANG_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]
else:
    from megarl.rollout import sglang_cpu

    sglang_cpu.prepare()  # before anything imports sglang: it reads SGLANG_USE_CPU_ENGINE on import
    import sglang  # noqa: F401  - no SGLang here is an error, not a skip
