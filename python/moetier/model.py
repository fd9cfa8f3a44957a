"""moetier.Model: a GGUF model run by the patched llama.cpp, its experts served by the cache."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from . import _core
from .config import FLASH_ATTN, CacheConfig, ContextConfig
from .errors import ConfigError, ModelError, StoreError


@dataclass(frozen=True)
class LayerStats:
    """Counters of one MoE layer. A lookup is one distinct expert needed by a layer in one ubatch."""

    layer: int
    lookups: int
    hits: int
    misses: int
    bytes_read: int
    read_seconds: float
    hits_low: int = 0
    loads_high: int = 0
    loads_low: int = 0
    skipped: int = 0
    bytes_low: int = 0


@dataclass(frozen=True)
class CacheStats:
    """Expert cache counters summed over layers, with the per-layer detail. misses = loads_high +
    loads_low + skipped; hits_low counts hits served by a cached low-precision version."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    hits_low: int = 0
    loads_high: int = 0
    loads_low: int = 0
    skipped: int = 0
    bytes_low: int = 0
    layers: tuple[LayerStats, ...] = ()

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(frozen=True)
class PrefetchStats:
    """Prefetch counters. Per distance d = 1, 2, ... (index d - 1): predictions checked (decode tokens)
    and how many had the right top-1, the whole top-k set, or at least one selected expert."""

    issued: int = 0
    hits: int = 0
    waits: int = 0
    claimed: int = 0
    cancelled: int = 0
    wasted: int = 0
    bytes_read: int = 0
    bytes_wasted: int = 0
    predictions: tuple[int, ...] = ()
    top1: tuple[int, ...] = ()
    allk: tuple[int, ...] = ()
    any: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerateResult:
    """Generated text and tokens, the cache counters of this call, and its timing: prefill_seconds
    runs to the first generated token (time to first token), decode_seconds covers the rest."""

    text: str
    tokens: list[int]
    stats: CacheStats
    prompt_tokens: int
    seconds: float
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of the whole call."""
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second of decode."""
        n = len(self.tokens) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


class Model:
    """A GGUF model. With cache=None it is stock llama.cpp; with a CacheConfig the experts of its
    MoE layers are read on demand (from `store` if given, else from the GGUF) into a bounded cache.

    repack=False turns off llama.cpp's repacked CPU kernels (its CPU_REPACK copies of quantized
    weights): the weights are then used straight from the file mapping, which a memory cap can page
    out, as `--no-repack` does in the llama.cpp tools."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        store: str | os.PathLike[str] | None = None,
        cache: CacheConfig | None = None,
        context: ContextConfig | None = None,
        *,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        repack: bool = True,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            msg = f"{self.path}: model file does not exist"
            raise ModelError(msg)
        if store is not None and cache is None:
            msg = f"{store}: an expert store needs an expert cache; pass cache=CacheConfig(...)"
            raise StoreError(msg)
        ctx = context or ContextConfig()
        if n_ctx is not None or n_threads is not None:
            ctx = dataclasses.replace(
                ctx,
                n_ctx=n_ctx if n_ctx is not None else ctx.n_ctx,
                n_threads=n_threads if n_threads is not None else ctx.n_threads,
            )
        self.cache = cache
        self.context = ctx
        self.store = Path(store) if store is not None else None
        try:
            self._m = _core.Model(
                str(self.path),
                cache.budget_bytes if cache else 0,
                str(self.store) if self.store else "",
                cache.policy if cache else "lru",
                cache.direct_io if cache else True,
                ctx.n_ctx,
                ctx.n_threads,
                ctx.n_batch,
                ctx.n_ubatch,
                repack,
                cache.opts() if cache else "",
                ctx.type_k,
                ctx.type_v,
                FLASH_ATTN[ctx.flash_attn],
            )
        except ValueError as e:  # e.g. a KV cache type the core does not know
            msg = f"{self.path}: {e}"
            raise ConfigError(msg) from None
        except RuntimeError as e:
            text = str(e)
            if self.store is not None and str(self.store) in text:
                raise StoreError(text) from None
            raise ModelError(text) from None

    @property
    def n_vocab(self) -> int:
        return int(self._m.n_vocab)

    @property
    def has_cache(self) -> bool:
        return bool(self._m.has_cache)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(self._m.tokenize(text, add_special))

    def detokenize(self, tokens: list[int]) -> str:
        return bytes(self._m.detokenize(tokens)).decode("utf-8", errors="replace")

    def logits(self, tokens: list[int]) -> npt.NDArray[np.float32]:
        """Logits at the last position of tokens, evaluated from an empty context."""
        try:
            return np.asarray(self._m.logits(tokens), dtype=np.float32)
        except RuntimeError as e:
            raise ModelError(str(e)) from None

    def graph_nodes(self, tokens: list[int]) -> list[str]:
        """Names of the compute graph's nodes in the order one decode of tokens runs them."""
        try:
            return list(self._m.node_order(tokens))
        except RuntimeError as e:
            raise ModelError(str(e)) from None

    def generate(
        self, prompt: str | list[int], max_tokens: int = 64, temperature: float = 0.0, seed: int = 0
    ) -> GenerateResult:
        """Generates up to max_tokens after prompt (greedy when temperature is 0)."""
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.reset_stats()
        t0 = time.perf_counter()
        try:
            res = self._m.generate(tokens, max_tokens, temperature, seed)
        except RuntimeError as e:
            raise ModelError(str(e)) from None
        dt = time.perf_counter() - t0
        out = [int(t) for t in res["tokens"]]
        return GenerateResult(
            text=self.detokenize(out),
            tokens=out,
            stats=self.stats(),
            prompt_tokens=len(tokens),
            seconds=dt,
            prefill_seconds=float(res["prefill_s"]),
            decode_seconds=float(res["decode_s"]),
        )

    def stats(self) -> CacheStats:
        """Expert cache counters since the last reset (all zero without a cache)."""
        raw = self._m.stats()
        layers = tuple(LayerStats(**d) for d in raw.get("layers", []))
        keys: tuple[str, ...] = ("lookups", "hits", "misses", "bytes_read", "read_seconds")
        keys += ("hits_low", "loads_high", "loads_low", "skipped", "bytes_low")
        return CacheStats(**{k: sum(getattr(x, k) for x in layers) for k in keys}, layers=layers)

    def prefetch_stats(self) -> PrefetchStats:
        """Prefetch counters since the last reset (all zero without prefetch)."""
        d = self._m.prefetch_stats()
        if not d:
            return PrefetchStats()
        n = len([x for x in d["predictions"] if x]) or 0
        return PrefetchStats(
            issued=int(d["issued"]),
            hits=int(d["hits"]),
            waits=int(d["waits"]),
            claimed=int(d["claimed"]),
            cancelled=int(d["cancelled"]),
            wasted=int(d["wasted"]),
            bytes_read=int(d["bytes_read"]),
            bytes_wasted=int(d["bytes_wasted"]),
            predictions=tuple(int(x) for x in d["predictions"][:n]),
            top1=tuple(int(x) for x in d["top1"][:n]),
            allk=tuple(int(x) for x in d["allk"][:n]),
            any=tuple(int(x) for x in d["any"][:n]),
        )

    def cache_info(self) -> dict[str, int | bool]:
        """Pool sizes of the cache: n_layers, n_expert, n_slots, cache_bytes, expert_bytes, ..."""
        return dict(self._m.cache_info())

    def reset_stats(self) -> None:
        self._m.reset_stats()
