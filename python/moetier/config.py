"""Typed configuration of moetier. Sizes are parsed here (by the C++ core's parser, so that the
shipped llama.cpp binaries accept exactly the same sizes) and validated with clear errors."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from . import _core
from .errors import ConfigError

# The option table of the C++ core (csrc/moetier-params.cpp): every CacheConfig field but budget is
# a row of it by the same name (budget is cache_bytes; the store is a Model argument), and takes its
# default from moetier_default_params() and its help from the row. tests/test_params.py checks that
# the two agree.
PARAM_TABLE: dict[str, dict[str, Any]] = {str(r["name"]): dict(r) for r in _core.param_table()}
_DEFAULTS = _core.Params()
# CacheConfig field -> option table row, where the names differ; rows that are not fields (the store
# is a Model argument; n_ctx, the context an automatic budget leaves room for, comes from ContextConfig)
FIELD_ROWS = {"budget": "cache_bytes"}
NOT_FIELDS = ("store_dir", "n_ctx")
# option table types of numbers -> what a value must be, and the type it is stored as
_NUMBERS: dict[str, tuple[type, Callable[[Any], int | float], str]] = {
    "int": (numbers.Integral, int, "an integer"),
    "float": (numbers.Real, float, "a number"),
}


def _help(row: str) -> str:
    return str(PARAM_TABLE[row]["help"])


def parse_size(value: int | str, what: str, auto: bool = False) -> int:
    """Bytes of a size given as an int or a string like '512M', '1.5G', '4096'; with auto, 'auto'
    gives AUTO (the core chooses the budget at load). The core parses both, as the tools' flags do."""
    if isinstance(value, bool):
        msg = f"{what}: {value!r} is not a size; use e.g. 512M"
        raise ConfigError(msg)
    if isinstance(value, int):
        if value < 0:
            msg = f"{what}: {value} is negative"
            raise ConfigError(msg)
        # 2^64 - 1 is the core's "auto" (a budget keeps it so, normalised); above it no 64-bit size holds it
        if value > AUTO or (value == AUTO and not auto):
            msg = f"{what}: {value} bytes is more than a 64-bit size holds"
            raise ConfigError(msg)
        return value
    if not isinstance(value, str):
        msg = f"{what}: {value!r} is not a size; give bytes (an int) or a string such as 512M"
        raise ConfigError(msg)
    parsed = _core.parse_cache_size(str(value)) if auto else _core.parse_size(str(value))
    if parsed is None:
        msg = f"{what}: {value!r} is not a size{' or auto' if auto else ''}; use e.g. 512M"
        raise ConfigError(msg)
    return int(parsed)


AUTO: int = int(_core.CACHE_AUTO)  # budget "auto": chosen at load from the memory limit (moetier.h)


def format_size(n: float) -> str:
    """n bytes in powers of 1024, e.g. '3.25 MiB' (the core's formatter, as in its log)."""
    return str(_core.format_size(int(n)))


@dataclass(frozen=True)
class CacheConfig:
    """The expert cache of one model."""

    budget: int | str = field(default="auto", metadata={"help": _help("cache_bytes").replace("; 0 = cache off", "")})
    reserve: int | str = field(default=0, metadata={"help": _help("reserve")})
    vram: int | str = field(default=0, metadata={"help": _help("vram")})
    policy: str = field(default=str(_DEFAULTS.policy), metadata={"help": _help("policy")})
    direct_io: bool = field(default=bool(_DEFAULTS.direct_io), metadata={"help": _help("direct_io")})
    t1: float = field(default=round(float(_DEFAULTS.t1), 6), metadata={"help": _help("t1")})
    t2: float = field(default=round(float(_DEFAULTS.t2), 6), metadata={"help": _help("t2")})
    low_frac: float = field(default=round(float(_DEFAULTS.low_frac), 6), metadata={"help": _help("low_frac")})
    w_lru: float = field(default=round(float(_DEFAULTS.w_lru), 6), metadata={"help": _help("w_lru")})
    w_lfu: float = field(default=round(float(_DEFAULTS.w_lfu), 6), metadata={"help": _help("w_lfu")})
    w_lhu: float = field(default=round(float(_DEFAULTS.w_lhu), 6), metadata={"help": _help("w_lhu")})
    w_fld: float = field(default=round(float(_DEFAULTS.w_fld), 6), metadata={"help": _help("w_fld")})
    prefetch: int = field(default=int(_DEFAULTS.prefetch), metadata={"help": _help("prefetch")})
    io_threads: int = field(default=int(_DEFAULTS.io_threads), metadata={"help": _help("io_threads")})
    prefetch_waste: float = field(
        default=round(float(_DEFAULTS.prefetch_waste), 6), metadata={"help": _help("prefetch_waste")}
    )
    io_uring: bool = field(default=bool(_DEFAULTS.io_uring), metadata={"help": _help("io_uring")})
    warm: bool = field(default=bool(_DEFAULTS.warm), metadata={"help": _help("warm")})
    fitted_prefetch: bool = field(default=bool(_DEFAULTS.fitted_prefetch), metadata={"help": _help("fitted_prefetch")})
    lock_weights: bool = field(default=bool(_DEFAULTS.lock_weights), metadata={"help": _help("lock_weights")})
    verify_all: bool = field(default=bool(_DEFAULTS.verify_all), metadata={"help": _help("verify_all")})
    prefetch_gate: bool = field(default=bool(_DEFAULTS.prefetch_gate), metadata={"help": _help("prefetch_gate")})
    grow: int = field(default=int(_DEFAULTS.grow), metadata={"help": _help("grow")})
    huge_pages: bool = field(default=bool(_DEFAULTS.huge_pages), metadata={"help": _help("huge_pages")})
    vram_cpu: bool = field(default=bool(_DEFAULTS.vram_cpu), metadata={"help": _help("vram_cpu")})
    vram_host: bool = field(default=bool(_DEFAULTS.vram_host), metadata={"help": _help("vram_host")})

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", parse_size(self.budget, "cache.budget", auto=True))
        object.__setattr__(self, "reserve", parse_size(self.reserve, "cache.reserve"))
        object.__setattr__(self, "vram", parse_size(self.vram, "cache.vram", auto=True))
        if self.budget == 0:
            msg = (
                "cache.budget: 0 turns the cache off; pass cache=None instead (moetier run: --no-cache; "
                "moetier serve: leave out --cache)"
            )
            raise ConfigError(msg)
        for f in fields(self):
            row = PARAM_TABLE[FIELD_ROWS.get(f.name, f.name)]
            v = getattr(self, f.name)
            if row["type"] == "bool":
                if isinstance(v, float) or v not in (0, 1):
                    msg = f"cache.{f.name}: {v!r} must be a bool (or 0/1)"
                    raise ConfigError(msg)
                object.__setattr__(self, f.name, bool(v))
            elif row["type"] in _NUMBERS:
                kind, cast, what = _NUMBERS[row["type"]]
                if not isinstance(v, kind) or isinstance(v, bool):
                    msg = f"cache.{f.name}: {v!r} must be {what}"
                    raise ConfigError(msg)
                try:
                    n = cast(v)
                except OverflowError:
                    n = math.inf
                if isinstance(n, float) and not math.isfinite(n):
                    msg = f"cache.{f.name}: {v!r} must be a finite number"
                    raise ConfigError(msg)
                if isinstance(n, int) and not -(2**31) <= n < 2**31:  # int32: the core's check names the range
                    msg = f"cache.{f.name}: {v} must lie in [{row['min']:g}, {row['max']:g}]"
                    raise ConfigError(msg)
                object.__setattr__(self, f.name, n)
        if not isinstance(self.policy, str):
            msg = f"cache.policy: {self.policy!r} must be a policy name (a str)"
            raise ConfigError(msg)
        why = _core.policy_error(self.policy)
        if why is not None:
            msg = f"cache.policy: {why}"
            raise ConfigError(msg)
        err = self.params().check()
        if err is not None:
            msg = f"cache: {err}"
            raise ConfigError(msg)

    def params(self, store: str | os.PathLike[str] | None = None, n_ctx: int = 0) -> _core.Params:
        """The C++ core's moetier_params: the library's defaults, each field set by name; n_ctx: the
        context an automatic budget leaves KV cache room for (0: the model's training context)."""
        p = _core.Params()
        p.cache_bytes = self.budget_bytes
        p.store_dir = str(store) if store is not None else ""
        p.n_ctx = n_ctx
        for f in fields(self):
            if f.name not in FIELD_ROWS:
                setattr(p, f.name, getattr(self, f.name))
        return p

    def opts(self) -> str:
        """The KEY=VALUE options as --expert-opt of the shipped binaries takes them."""
        out = []
        for f in fields(self):
            row = PARAM_TABLE[FIELD_ROWS.get(f.name, f.name)]
            if row["is_opt"]:
                v = getattr(self, f.name)
                if row["type"] == "size" and v == AUTO:
                    out.append(f"{f.name}=auto")
                    continue
                out.append(f"{f.name}={int(v) if row['type'] in ('bool', 'int', 'size') else float(v)!r}")
        return ",".join(out)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> CacheConfig:
        """A config written by `moetier calibrate` (JSON of CacheConfig fields); overrides win."""
        import json
        from pathlib import Path

        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            msg = f"{path}: cannot read the cache config: {e.strerror or e}"
            raise ConfigError(msg) from None
        except ValueError as e:
            msg = f"{path}: cannot read the cache config: not JSON ({e})"
            raise ConfigError(msg) from None
        if not isinstance(data, dict):
            msg = f"{path}: the cache config must be a JSON object of CacheConfig fields"
            raise ConfigError(msg)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            msg = f"{path}: unknown cache config field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            raise ConfigError(msg)
        try:
            base = cls(**data)
        except ConfigError as e:
            msg = f"{path}: {e}"  # a bad value in the file names the file; a bad override, its field only
            raise ConfigError(msg) from None
        unknown = sorted(set(overrides) - names)
        if unknown:
            msg = f"cache config overrides: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            raise ConfigError(msg)
        return replace(base, **overrides) if overrides else base

    @classmethod
    def exact(cls, budget: int | str, **kw: Any) -> CacheConfig:
        """Every expert in high precision, none skipped: the output equals stock llama.cpp's."""
        given = sorted({"t1", "t2"} & set(kw))
        if given:
            msg = f"CacheConfig.exact: {', '.join(given)} would make it lossy; use CacheConfig(...) for mixed precision"
            raise ConfigError(msg)
        return cls(budget=budget, t1=1.0, t2=1.0, **kw)

    @property
    def budget_bytes(self) -> int:
        """The budget in bytes; AUTO if the core chooses it at load."""
        return int(self.budget)  # normalised to bytes in __post_init__

    @property
    def budget_text(self) -> str:
        """The budget as the tools' --expert-cache takes it: a byte count or 'auto'."""
        return "auto" if self.budget_bytes == AUTO else str(self.budget_bytes)


INT32_MAX = 2**31 - 1
MAX_THREADS = 512  # GGML_MAX_N_THREADS: ggml's thread pool holds no more

# ContextConfig.flash_attn -> llama_flash_attn_type
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


@dataclass(frozen=True)
class ContextConfig:
    """The llama.cpp context a Model runs in."""

    n_ctx: int = field(default=2048, metadata={"help": "context length in tokens"})
    n_threads: int = field(
        default=max(1, min(8, os.cpu_count() or 1)),
        metadata={
            "help": "compute threads (also the threads that read missed experts)",
            "shown_default": "the machine's cores, at most 8",
        },
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
            elif v > INT32_MAX:  # llama.cpp's fields are 32-bit
                msg = f"context.{f.name}: {v} must be at most {INT32_MAX}"
                raise ConfigError(msg)
        if self.n_threads > MAX_THREADS:
            msg = f"context.n_threads: {self.n_threads} must be at most {MAX_THREADS} (ggml's limit)"
            raise ConfigError(msg)
        if self.flash_attn not in FLASH_ATTN:
            msg = f"context.flash_attn: {self.flash_attn!r} must be one of {', '.join(FLASH_ATTN)}"
            raise ConfigError(msg)
        if self.flash_attn == "off" and self.type_v not in ("f32", "f16", "bf16"):
            msg = f"context.type_v: a quantized value cache ({self.type_v}) needs flash attention (auto or on)"
            raise ConfigError(msg)
        self.params()  # the core checks the KV cache types

    def params(self) -> _core.ContextParams:
        """llama.cpp's llama_context_params: its defaults, each field set by name."""
        p = _core.ContextParams()
        for f in fields(self):
            v = getattr(self, f.name)
            setattr(p, f.name, FLASH_ATTN[v] if f.name == "flash_attn" else v)
        return p


@dataclass(frozen=True)
class PackConfig:
    """How `moetier pack` writes an expert store."""

    low_type: str = field(
        default=str(_core.pack_defaults()["low_type"]),
        metadata={
            "help": "ggml type of the low-precision copy of each expert, e.g. q4_0, q4_k, q8_0; or a list, e.g. "
            "q2_K,q4_0: each projection takes the first type whose block size divides its rows (K-quants "
            "need rows of a multiple of 256 values); auto: q4_0, and q2_K (rows allowing) for experts of 5 "
            "bits per weight or fewer, such as Q4_K, whose q4_0 copy would be no smaller"
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.low_type, str) or not self.low_type.strip():
            msg = f"pack.low_type: {self.low_type!r} must be a ggml type name (a str) such as q4_0, or auto"
            raise ConfigError(msg)
