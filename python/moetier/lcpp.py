"""moetier.Llama: llama-cpp-python's `Llama` (its whole API: completions, chat, streaming, grammars,
embeddings) running on moetier's patched libllama, with the experts served by the expert cache.

llama-cpp-python is used as it is, without its own native build (install it with
`CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36`): its ctypes
bindings load moetier's libllama (LLAMA_CPP_LIB_PATH), whose llama.h is stock llama.cpp's. The cache
is configured beside the load (moetier_model_configure), not through llama_model_params."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _core
from .config import CacheConfig
from .errors import ConfigError, ModelError
from .model import CacheStats

LLAMA_CPP_VERSION = "0.3.36"  # the sdist whose llama.cpp moetier patches and builds
INSTALL_HINT = f'CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" pip install llama-cpp-python=={LLAMA_CPP_VERSION}'
LIB_DIR = Path(__file__).resolve().parent  # libllama.so of this install

if TYPE_CHECKING:
    pass

# a pending configuration is per model path: loads of one path must not interleave
_load_lock = threading.Lock()


def point_llama_cpp_here() -> None:
    """llama-cpp-python installed without its native build (`python -m moetier.lcpp install`) has no
    libllama of its own: a plain `import llama_cpp` after `import moetier` loads moetier's. A
    llama_cpp with its own library, or a LLAMA_CPP_LIB_PATH the user set, is left alone."""
    import importlib.util

    if "LLAMA_CPP_LIB_PATH" in os.environ or "llama_cpp" in sys.modules:
        return
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return
    if not any((Path(spec.origin).parent / "lib").glob("libllama*")):
        os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)


def import_llama_cpp() -> Any:
    """llama_cpp, loaded on moetier's libllama. Raises ModelError if it is missing, of another
    version, or already loaded on another libllama."""
    wanted = os.environ.get("LLAMA_CPP_LIB_PATH")
    if wanted is not None and Path(wanted).resolve() != LIB_DIR:
        msg = f"LLAMA_CPP_LIB_PATH={wanted}: moetier.Llama needs moetier's libllama ({LIB_DIR}); unset it"
        raise ModelError(msg)
    if "llama_cpp" not in sys.modules:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    try:
        import llama_cpp
    except ImportError as e:
        msg = f"moetier.Llama needs llama-cpp-python {LLAMA_CPP_VERSION} (Python package only): {INSTALL_HINT} ({e})"
        raise ModelError(msg) from None
    if llama_cpp.__version__ != LLAMA_CPP_VERSION:
        msg = (
            f"llama-cpp-python {llama_cpp.__version__} is installed; moetier's libllama is {LLAMA_CPP_VERSION}'s: "
            f"{INSTALL_HINT}"
        )
        raise ModelError(msg)
    lib = Path(llama_cpp.llama_cpp._lib._name).resolve()
    if lib.parent != LIB_DIR:
        msg = (
            f"llama_cpp was imported before moetier.Llama and loaded {lib}; import moetier first "
            f"(or set LLAMA_CPP_LIB_PATH={LIB_DIR})"
        )
        raise ModelError(msg)
    return llama_cpp


def _llama_init(
    self: Any,
    llama_cpp: Any,
    model_path: str,
    args: tuple[Any, ...],
    cache: CacheConfig | None,
    store: str | os.PathLike[str] | None,
    kwargs: dict[str, Any],
) -> None:
    """moetier.Llama.__init__: the load configured for the cache, then llama_cpp.Llama's own.

    (A module-level function rather than the method's body: the class is built once per process, and
    a test harness that swaps function bodies at call time, as mutation testing does, reaches this.)"""
    if store is not None and cache is None:
        msg = f"{store}: an expert store needs an expert cache; pass cache=CacheConfig(...)"
        raise ConfigError(msg)
    if cache is not None and not isinstance(cache, CacheConfig):
        msg = f"moetier.Llama: cache {cache!r} must be a CacheConfig or None"
        raise ConfigError(msg)
    n_ctx = kwargs.get("n_ctx", 512)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 0:
        msg = f"moetier.Llama: n_ctx {n_ctx!r} must be a number of tokens (0: the model's training context)"
        raise ConfigError(msg)
    self._moetier_closed = False
    self.expert_cache_config = cache
    path = str(model_path)
    with _load_lock:
        # a configuration left pending for this path (by a load that never ran) must not
        # reach this one: None is stock
        params = cache.params(store, n_ctx=n_ctx) if cache is not None else None
        _core.configure_load(path, params)
        try:
            llama_cpp.Llama.__init__(self, path, *args, **kwargs)
        except ValueError as e:
            why = _core.last_error()
            raise ModelError(f"{path}: {why}" if why else str(e)) from None
        finally:
            _core.configure_load(path, None)
    self._moetier_model = ctypes.cast(self._model.model, ctypes.c_void_p).value or 0
    if cache is not None and not _core.has_cache_at(self._moetier_model):
        # the configuration never reached this libllama (another copy of it is loaded): running
        # stock here would ignore the cache silently
        loaded = sorted(
            {ln.split()[-1] for ln in Path("/proc/self/maps").read_text().splitlines() if ln.endswith("/libllama.so")}
        )
        llama_cpp.Llama.close(self)
        msg = (
            f"{path}: the expert cache was configured but libllama did not create it "
            f"(libllama loaded: {', '.join(loaded)})"
        )
        raise ModelError(msg)
    if cache is not None:
        # a failed expert read stops the graph instead of computing with an empty slot
        lib = llama_cpp.llama_cpp._lib
        self._moetier_abort = llama_cpp.ggml_abort_callback(
            ctypes.cast(lib.moetier_abort_callback, ctypes.c_void_p).value
        )
        llama_cpp.llama_set_abort_callback(self._ctx.ctx, self._moetier_abort, ctypes.c_void_p(self._moetier_model))


def _llama_decode(self: Any, run: Any, *args: Any, **kwargs: Any) -> Any:
    """run(*args, **kwargs), a llama_cpp.Llama method that decodes (eval, embed): when a failed expert
    read stopped the graph (llama_cpp says only "llama_decode returned 2"), the error names the
    file, layer and expert instead (a StoreError for a checksum mismatch)."""
    _open(self)
    try:
        return run(self, *args, **kwargs)
    except RuntimeError:
        if self._moetier_model:
            _core.raise_read_error_at(self._moetier_model, f"{self.model_path}: decode failed")
        raise


def _open(self: Any) -> int:
    """The core model's address; a ModelError once close() freed it (llama.cpp would read freed memory)."""
    if getattr(self, "_moetier_closed", False):
        msg = f"{self.model_path}: the model is closed"
        raise ModelError(msg)
    return int(self._moetier_model)


def _llama_close(self: Any, llama_cpp: Any) -> None:
    self._moetier_closed = True
    self._moetier_model = 0  # the model is freed: its address must not be used again
    if hasattr(self, "_stack"):  # not when __init__ refused the arguments before llama_cpp's own ran
        llama_cpp.Llama.close(self)


def _llama_class() -> type:
    llama_cpp = import_llama_cpp()

    class Llama(llama_cpp.Llama):  # type: ignore[misc, name-defined]
        """llama_cpp.Llama with the experts served by moetier's expert cache.

        cache: the cache (None: stock llama.cpp, every expert loaded); store: an expert store written
        by `moetier pack`; every other argument is llama_cpp.Llama's."""

        def __init__(
            self,
            model_path: str,
            *args: Any,
            cache: CacheConfig | None = None,
            store: str | os.PathLike[str] | None = None,
            **kwargs: Any,
        ) -> None:
            _llama_init(self, llama_cpp, model_path, args, cache, store, kwargs)

        def close(self) -> None:
            _llama_close(self, llama_cpp)

        def eval(self, tokens: Any) -> None:
            _llama_decode(self, llama_cpp.Llama.eval, tokens)

        def embed(self, *args: Any, **kwargs: Any) -> Any:
            return _llama_decode(self, llama_cpp.Llama.embed, *args, **kwargs)

        def tokenize(self, *args: Any, **kwargs: Any) -> Any:
            _open(self)
            return llama_cpp.Llama.tokenize(self, *args, **kwargs)

        def detokenize(self, *args: Any, **kwargs: Any) -> Any:
            _open(self)
            return llama_cpp.Llama.detokenize(self, *args, **kwargs)

        @property
        def has_expert_cache(self) -> bool:
            return bool(_core.has_cache_at(_open(self)))

        def cache_stats(self) -> CacheStats:
            """The expert cache's counters (all zero without a cache)."""
            total, layers = _core.stats_at(_open(self))
            return CacheStats(total=total, layers=tuple(layers))

        def cache_info(self) -> dict[str, int | bool]:
            return dict(_core.cache_info_at(_open(self)))

        @property
        def budget_note(self) -> str:
            """How the cache's size was chosen (with cache=CacheConfig() or budget "auto": from the
            memory limit, less what the model and the context need)."""
            return _core.budget_note_at(_open(self))

    Llama.__module__ = "moetier"
    Llama.__qualname__ = "Llama"
    return Llama


_cls: type | None = None


def llama_class() -> type:
    """moetier.Llama (built on first use: importing moetier does not import llama_cpp)."""
    global _cls
    if _cls is None:
        _cls = _llama_class()
    return _cls


def install(argv: list[str] | None = None) -> int:
    """Installs llama-cpp-python's Python package without its native build (moetier's libllama
    serves it): from the sdist the moetier build fetched into $MOETIER_CACHE (sha256 checked there),
    else from the package index."""
    import argparse
    import subprocess

    from .tools.models import default_cache

    p = argparse.ArgumentParser(prog="python -m moetier.lcpp", description=install.__doc__)
    p.add_argument("command", choices=["install"], help="install llama-cpp-python (Python package only)")
    p.parse_args(argv)
    sdist = default_cache() / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    target = str(sdist) if sdist.is_file() else f"llama-cpp-python=={LLAMA_CPP_VERSION}"
    env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}
    sys.stderr.write(f"moetier: pip install {target} (CMAKE_ARGS={env['CMAKE_ARGS']})\n")
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", target], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(install())
