"""Typed configuration of moetier. Sizes are parsed here (by the C++ core's parser, so that the
shipped llama.cpp binaries accept exactly the same sizes) and validated with clear errors."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from . import _core
from .errors import ConfigError

_DEFAULTS: dict[str, Any] = _core.default_params()


def parse_size(value: int | str, what: str) -> int:
    """Bytes of a size given as an int or a string like '512M', '1.5G', '4096'."""
    if isinstance(value, bool):
        msg = f"{what}: {value!r} is not a size; use e.g. 512M"
        raise ConfigError(msg)
    if isinstance(value, int):
        if value < 0:
            msg = f"{what}: {value} is negative"
            raise ConfigError(msg)
        return value
    parsed = _core.parse_size(str(value))
    if parsed is None:
        msg = f"{what}: {value!r} is not a size; use e.g. 512M"
        raise ConfigError(msg)
    return int(parsed)


@dataclass(frozen=True)
class CacheConfig:
    """The expert cache of one model."""

    budget: int | str = field(
        default="256M",
        metadata={"help": "expert cache size in bytes, e.g. 256M or 2G; at least one layer's experts"},
    )
    policy: str = field(
        default=str(_DEFAULTS["policy"]),
        metadata={"help": "eviction policy: " + ", ".join(_core.policy_names())},
    )
    direct_io: bool = field(
        default=bool(_DEFAULTS["direct_io"]),
        metadata={"help": "read experts with O_DIRECT (bypass the page cache); falls back with a warning"},
    )
    t1: float = field(
        default=round(float(_DEFAULTS["t1"]), 6),
        metadata={
            "help": "precision threshold of a miss (HOBBIT eq. 2): an expert whose score (the normalised gate "
            "weight of the experts ranked above it) is <= t1 is read in high precision; the top-1 always is"
        },
    )
    t2: float = field(
        default=round(float(_DEFAULTS["t2"]), 6),
        metadata={
            "help": "score <= t2: read the low-precision version (needs a store); above: skip the expert. "
            "t1 = t2 = 1 keeps every expert in high precision (output equals stock llama.cpp)"
        },
    )
    low_frac: float = field(
        default=round(float(_DEFAULTS["low_frac"]), 6),
        metadata={"help": "share of the budget for low-precision slots (used with a store and t1 < t2)"},
    )
    w_lru: float = field(
        default=round(float(_DEFAULTS["w_lru"]), 6), metadata={"help": "policy multi: weight of recency"}
    )
    w_lfu: float = field(
        default=round(float(_DEFAULTS["w_lfu"]), 6),
        metadata={"help": "policy multi: weight of use frequency in the sequence"},
    )
    w_lhu: float = field(
        default=round(float(_DEFAULTS["w_lhu"]), 6),
        metadata={"help": "policy multi: weight of high-precision use frequency in the sequence"},
    )
    w_fld: float = field(
        default=round(float(_DEFAULTS["w_fld"]), 6),
        metadata={"help": "policy multi: weight of layer distance (the layer that just ran is evicted first)"},
    )

    prefetch: int = field(
        default=int(_DEFAULTS["prefetch"]),
        metadata={
            "help": "layers predicted ahead by the stacked routers of the next layers (HOBBIT sec. 3.3); their "
            "missing experts are read in the background; 0 = off"
        },
    )
    io_threads: int = field(
        default=int(_DEFAULTS["io_threads"]),
        metadata={
            "help": "prefetch lanes: with io_uring, prefetch reads in flight on the ring; without it, I/O threads "
            "(they sleep when idle) that read prefetches while the compute threads read a layer's misses. A "
            "prefetch walk starts at most this many reads, the surest predictions first. 0: no I/O "
            "pool at all: the compute threads read every miss, no io_uring, no prefetch"
        },
    )
    io_uring: int = field(
        default=int(_DEFAULTS["io_uring"]),
        metadata={
            "help": "1: read with io_uring where the kernel allows it and the experts come from a store with "
            "O_DIRECT: the kernel reads while the compute threads run, no I/O thread takes their cores; "
            "0: I/O threads"
        },
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", parse_size(self.budget, "cache.budget"))
        if self.budget == 0:
            msg = "cache.budget: 0 turns the cache off; pass cache=None instead"
            raise ConfigError(msg)
        names = _core.policy_names()
        if self.policy not in names:
            msg = f"cache.policy: unknown policy {self.policy!r}; available: {', '.join(names)}"
            raise ConfigError(msg)
        err = _core.check_opts(self.opts())
        if err is not None:
            msg = f"cache: {err}"
            raise ConfigError(msg)

    def opts(self) -> str:
        """The options as the C++ core (and --expert-opt of the shipped binaries) takes them."""
        keys = ("t1", "t2", "low_frac", "w_lru", "w_lfu", "w_lhu", "w_fld")
        out = [f"{k}={float(getattr(self, k))!r}" for k in keys]
        for k in ("prefetch", "io_threads", "io_uring"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool):
                msg = f"cache.{k}: {v!r} must be an integer"
                raise ConfigError(msg)
            out.append(f"{k}={v}")
        return ",".join(out)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> CacheConfig:
        """A config written by `moetier calibrate` (JSON of CacheConfig fields); overrides win."""
        import json
        from pathlib import Path

        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            msg = f"{path}: cannot read the cache config: {e}"
            raise ConfigError(msg) from None
        if not isinstance(data, dict):
            msg = f"{path}: the cache config must be a JSON object of CacheConfig fields"
            raise ConfigError(msg)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            msg = f"{path}: unknown cache config field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            raise ConfigError(msg)
        return cls(**{**data, **overrides})

    @classmethod
    def exact(cls, budget: int | str, **kw: Any) -> CacheConfig:
        """Every expert in high precision, none skipped: the output equals stock llama.cpp's."""
        return cls(budget=budget, t1=1.0, t2=1.0, **kw)

    @property
    def budget_bytes(self) -> int:
        return int(self.budget)  # normalised to bytes in __post_init__


# ContextConfig.flash_attn -> llama_flash_attn_type
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


@dataclass(frozen=True)
class ContextConfig:
    """The llama.cpp context a Model runs in."""

    n_ctx: int = field(default=2048, metadata={"help": "context length in tokens"})
    n_threads: int = field(
        default=max(1, min(8, os.cpu_count() or 1)),
        metadata={"help": "compute threads (also the threads that read missed experts)"},
    )
    n_batch: int = field(default=512, metadata={"help": "logical batch size for prompt processing"})
    n_ubatch: int = field(default=512, metadata={"help": "physical batch size (tokens per graph run)"})
    type_k: str = field(
        default="f16", metadata={"help": "KV cache type of the keys (a ggml type: f16, f32, q8_0, ...)"}
    )
    type_v: str = field(
        default="f16",
        metadata={"help": "KV cache type of the values (a ggml type; a quantized one needs flash attention)"},
    )
    flash_attn: str = field(default="auto", metadata={"help": "flash attention: auto (llama.cpp decides), on or off"})

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("str", str):
                if not isinstance(v, str) or not v:
                    msg = f"context.{f.name}: {v!r} must be a non-empty string"
                    raise ConfigError(msg)
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                msg = f"context.{f.name}: {v!r} must be a positive integer"
                raise ConfigError(msg)
        if self.flash_attn not in FLASH_ATTN:
            msg = f"context.flash_attn: {self.flash_attn!r} must be one of {', '.join(FLASH_ATTN)}"
            raise ConfigError(msg)
        if self.flash_attn == "off" and self.type_v not in ("f32", "f16", "bf16"):
            msg = f"context.type_v: a quantized value cache ({self.type_v}) needs flash attention (auto or on)"
            raise ConfigError(msg)


@dataclass(frozen=True)
class PackConfig:
    """How `moetier pack` writes an expert store."""

    low_type: str = field(
        default=str(_DEFAULTS["low_type"]),
        metadata={"help": "ggml type of the low-precision copy of each expert, e.g. q4_0, q4_k, q8_0"},
    )
