# megarl's SGLang-on-CPU mends for the interpreters SGLang spawns (its schedulers): put first on
# PYTHONPATH by megarl.rollout.sglang_cpu.prepare(), active only with MEGARL_SGLANG_CPU=1.  The
# mends are loaded from their file, so a child needs nothing else of megarl on its path.
import os

if os.environ.get("MEGARL_SGLANG_CPU") == "1":
    import importlib.util
    import sys

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mends.py")
    _spec = importlib.util.spec_from_file_location("megarl_sglang_cpu_mends", _path)
    _mends = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mends
    _spec.loader.exec_module(_mends)
    _mends.install()
