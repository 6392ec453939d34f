"""Put this folder first on ``PYTHONPATH`` to make bitsandbytes believe the CPU has AVX512-BF16: its import then tries
to fetch an optional kernel from the Hugging Face hub (``kernels-community``) and logs a warning when that fails, as
it does on such CPUs (e.g. recent Xeons). The machines the tests run on may lack the instruction set."""

import importlib.abc
import importlib.machinery
import sys


class _FakeAVX512BF16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.has_avx512bf16 = lambda: True

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _FakeAVX512BF16())
