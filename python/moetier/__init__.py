"""moetier: run Mixture-of-Experts GGUF models whose experts do not fit in memory."""

from __future__ import annotations

import os as _os

# The CPU backend's OpenMP threads spin at every barrier of a graph: libgomp's default is 300000
# spins while threads <= cores. With 2 compute threads on 2 cores they keep the cores from the
# prefetch I/O threads, whose reads then start and finish late. 3000 spins (a few microseconds)
# left in-RAM decode unchanged and made prefetch 8-29% faster in single runs
# (bench/results/cores-ernie-c32k-25-2026-11-25.md). libgomp reads it once, when it is loaded with the engine
# below; a user's own setting wins. Children (moetier serve's server, the tools) inherit it.
_os.environ.setdefault("GOMP_SPINCOUNT", "3000")


from .config import CacheConfig, ContextConfig, PackConfig, format_size, parse_size
from .errors import ConfigError, ModelError, MoetierError, StoreError
from .lcpp import point_llama_cpp_here as _point_llama_cpp_here
from .model import CacheStats, GenerateResult, LayerStats, Model, PrefetchStats
from .pack import pack
from .variants import Variants, VariantSpec

_point_llama_cpp_here()


def __getattr__(name: str) -> object:
    # moetier.Llama is llama-cpp-python's Llama on moetier's libllama: built on first use, so that
    # `import moetier` neither needs nor loads llama_cpp
    if name == "Llama":
        from .lcpp import llama_class

        return llama_class()
    raise AttributeError(name)


# the one version source: pyproject.toml reads it (scikit-build-core regex metadata provider)
__version__ = "0.1.0"

# Llama is left out: `from moetier import *` would build it, which imports llama-cpp-python (an
# optional package that also takes llama.cpp's log); `moetier.Llama` is there when asked for
__all__ = [
    "CacheConfig",
    "CacheStats",
    "ConfigError",
    "ContextConfig",
    "GenerateResult",
    "LayerStats",
    "Model",
    "ModelError",
    "MoetierError",
    "PackConfig",
    "PrefetchStats",
    "StoreError",
    "VariantSpec",
    "Variants",
    "__version__",
    "format_size",
    "pack",
    "parse_size",
]
