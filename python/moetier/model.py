"""moetier.Model: a GGUF model run by the patched llama.cpp, its experts served by the cache."""

from __future__ import annotations

import dataclasses
import numbers
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from . import _core
from .config import CacheConfig, ContextConfig
from .errors import ConfigError, ModelError, StoreError

# The counters cross the boundary as the C structs themselves (csrc/moetier.h moetier_layer_stats,
# moetier_prefetch_stats): their fields are named once, in C.
LayerStats = _core.LayerStats
PrefetchStats = _core.PrefetchStats


@dataclass(frozen=True)
class CacheStats:
    """Expert cache counters summed over layers (`total`, also reachable as attributes: stats.n_hits)
    with the per-layer detail. A lookup is one distinct expert needed by a layer in one ubatch;
    n_misses = n_loads_high + n_loads_low + n_skipped; n_hits_low counts hits served by a cached
    low-precision version. With a VRAM tier (CacheConfig.vram), n_vram_hits lookups were found in VRAM
    and n_vram_copies copied there from the RAM tier (n_vram_bytes, in vram_copy_us)."""

    total: LayerStats = dataclasses.field(default_factory=LayerStats)
    layers: tuple[LayerStats, ...] = ()

    @property
    def hit_rate(self) -> float:
        return self.total.n_hits / self.total.n_lookups if self.total.n_lookups else 0.0

    @property
    def vram_hit_rate(self) -> float:
        """Share of lookups found in the VRAM tier (0 without one)."""
        return self.total.n_vram_hits / self.total.n_lookups if self.total.n_lookups else 0.0

    @property
    def read_seconds(self) -> float:
        """Time the layers' compute waited for their expert reads."""
        return self.total.read_us / 1e6

    def __getattr__(self, name: str) -> int:
        if name.startswith("__"):
            raise AttributeError(name)
        value: int = getattr(self.total, name)
        return value


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
    # why generation stopped: "eog" (the model ended its answer), "length" (max_tokens were generated)
    # or "context" (the context is full)
    stop: str = ""

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


def check_sampling(max_tokens: int, temperature: float, seed: int) -> None:
    """ConfigError naming the argument for a token count, temperature or seed the sampler cannot take."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 0 <= max_tokens <= 2**31 - 1:
        msg = f"generate: max_tokens {max_tokens!r} must be an integer in [0, {2**31 - 1}]"
        raise ConfigError(msg)
    try:
        finite = not isinstance(temperature, bool) and 0 <= float(temperature) < float("inf")
    except (TypeError, ValueError, OverflowError):
        finite = False
    if not finite:
        msg = f"generate: temperature {temperature!r} must be a finite number, 0 (greedy) or more"
        raise ConfigError(msg)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= 2**32 - 1:
        msg = f"generate: seed {seed!r} must be an integer in [0, {2**32 - 1}]"
        raise ConfigError(msg)


def check_text(text: object, what: str) -> str:
    """text, if it is a str that UTF-8 can encode (no lone surrogate) and holds no NUL (which would end
    it in the core); else a ConfigError naming what."""
    if not isinstance(text, str):
        msg = f"{what}: {type(text).__name__} is not text (a str)"
        raise ConfigError(msg)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        msg = f"{what}: character {e.start} is a lone surrogate ({text[e.start]!r}), not text UTF-8 can encode"
        raise ConfigError(msg) from None
    if "\x00" in text:
        msg = f"{what}: a NUL character at {text.index(chr(0))}; the text would end there"
        raise ConfigError(msg)
    return text


def _token_ids(tokens: object, what: str, n_vocab: int) -> list[int]:
    """tokens (a list, tuple, array or other iterable of ints) as a list of the vocabulary's ids; a
    ConfigError naming what otherwise."""
    try:
        if isinstance(tokens, (str, bytes, bytearray)):
            raise TypeError
        ids = list(tokens)  # type: ignore[call-overload]
    except TypeError:
        msg = f"{what}: the tokens must be a list of token ids (int), not {type(tokens).__name__}"
        raise ConfigError(msg) from None
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral) or not 0 <= int(t) < n_vocab:
            msg = f"{what}: token {i} is {t!r}, not an id of the vocabulary (0 to {n_vocab - 1})"
            raise ConfigError(msg)
    return [int(t) for t in ids]


class _Closed:
    """What a closed Model holds instead of its core: every use says so."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __getattr__(self, name: str) -> object:
        msg = f"{self.path}: the model is closed"
        raise ModelError(msg)


def check_gguf(path: str | os.PathLike[str]) -> Path:
    """path as a Path if it names a GGUF file; ModelError saying what it names instead (nothing, a
    directory, a file of another format), before llama.cpp's loader would say only that it failed."""
    p = Path(path)
    if p.is_dir():
        msg = f"{p}: is a directory, not a model file; give the .gguf file"
        raise ModelError(msg)
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        msg = f"{p}: model file does not exist"
        raise ModelError(msg) from None
    except OSError as e:
        msg = f"{p}: cannot read the model file: {e.strerror or e}"
        raise ModelError(msg) from None
    if magic != b"GGUF":
        msg = f"{p}: not a GGUF file; convert the model with llama.cpp's convert_hf_to_gguf.py"
        raise ModelError(msg)
    return p


class Model:
    """A GGUF model. With cache=None it is stock llama.cpp; with a CacheConfig the experts of its
    MoE layers are read on demand (from `store` if given, else from the GGUF) into a bounded cache.

    repack=False turns off llama.cpp's repacked CPU kernels (its CPU_REPACK copies of quantized
    weights): the weights are then used straight from the file mapping, which a memory cap can page
    out, as `--no-repack` does in the llama.cpp tools. n_gpu_layers offloads that many layers to a
    GPU (a CUDA build), as `-ngl`; with CacheConfig.vram their experts are cached in its memory.

    rpc names llama.cpp RPC servers ("HOST:PORT,...", as `--rpc`; each runs `moetier tool
    ggml-rpc-server`): n_gpu_layers then places layers on them too. tensor_overrides places tensors
    by name, "PATTERN=BUFFER_TYPE" each, as `-ot` (e.g. "blk\\.1[0-5]\\.=RPC0[10.0.0.2:50052]"). A
    layer whose experts an RPC server holds computes them there, as stock llama.cpp; the expert cache
    serves the layers whose experts stay on this machine."""

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
        n_gpu_layers: int = 0,
        rpc: str = "",
        tensor_overrides: Sequence[str] = (),
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            msg = f"Model: path {path!r} must be a file name (str or os.PathLike)"
            raise ConfigError(msg)
        for name, value, cls in (("cache", cache, CacheConfig), ("context", context, ContextConfig)):
            if value is not None and not isinstance(value, cls):
                msg = f"Model: {name} {value!r} must be a {cls.__name__} or None"
                raise ConfigError(msg)
        if store is not None and not isinstance(store, (str, os.PathLike)):
            msg = f"Model: store {store!r} must be a directory name (str or os.PathLike) or None"
            raise ConfigError(msg)
        if not isinstance(repack, bool):
            msg = f"Model: repack {repack!r} must be True or False"
            raise ConfigError(msg)
        self.path = check_gguf(path)
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
        params = cache.params(self.store, n_ctx=ctx.n_ctx) if cache else _core.Params()
        # errors come typed from the core: ConfigError, StoreError (at load and at decode alike), ModelError
        if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int) or not 0 <= n_gpu_layers <= 2**31 - 1:
            msg = f"n_gpu_layers: {n_gpu_layers!r} must be a non-negative integer (layers offloaded to a GPU)"
            raise ConfigError(msg)
        if not isinstance(rpc, str):
            msg = f"rpc: {rpc!r} must be a string of HOST:PORT, comma-separated"
            raise ConfigError(msg)
        if (
            not isinstance(tensor_overrides, Sequence)
            or isinstance(tensor_overrides, str)
            or not all(isinstance(o, str) for o in tensor_overrides)
        ):
            msg = f"tensor_overrides: {tensor_overrides!r} must be a sequence of PATTERN=BUFFER_TYPE strings"
            raise ConfigError(msg)
        self._lock = threading.RLock()  # generate resets and reads the counters under it
        self._m = _core.Model(str(self.path), params, ctx.params(), repack, n_gpu_layers, rpc, list(tensor_overrides))

    @property
    def n_vocab(self) -> int:
        return int(self._m.n_vocab)

    @property
    def n_ctx(self) -> int:
        """The context's length as llama.cpp made it: context.n_ctx, or more where llama.cpp pads it (to a
        multiple of 256); prompts up to it fit."""
        return int(self._m.n_ctx)

    @property
    def has_cache(self) -> bool:
        return bool(self._m.has_cache)

    @property
    def exact(self) -> bool:
        """True if every selected expert is computed in high precision (no low-precision reads, no
        skipped experts): the output equals stock llama.cpp's. Mixed precision is asked for with t1/t2
        (or a config from `moetier calibrate`); without a cache the model is stock, hence exact."""
        return bool(self._m.cache_info().get("exact", True))

    @property
    def warnings(self) -> tuple[str, ...]:
        """Parameters that could not take effect as given (t1 < t2 without low copies, policy weights
        on a policy without weights, prefetch with nothing to predict, io_uring or O_DIRECT refused).
        Also logged at WARN level."""
        padded = (
            ()
            if self.n_ctx == self.context.n_ctx
            else (f"n_ctx={self.context.n_ctx} is {self.n_ctx} here: llama.cpp pads the context to a multiple of 256",)
        )
        return (*self._m.warnings, *padded)

    @property
    def prefetch_source(self) -> str:
        """What predicts the prefetches: 'stacked routers', 'fitted predictor PATH (N of M maps)'
        (moetier fit-predictor), or '' (no prefetch or no cache)."""
        return str(self._m.prefetch_source)

    @property
    def budget_note(self) -> str:
        """How the cache's budget was chosen: for budget='auto' the memory limit and what was
        subtracted from it ('' without a cache)."""
        return str(self._m.budget_note)

    @property
    def state_path(self) -> str:
        """The warm-start sidecar ('' if warm is off or there is no cache)."""
        return str(self._m.state_path)

    def save_state(self) -> bool:
        """Writes the warm-start sidecar now (it is also written when the model is freed and every
        minute of decoding); False if warm is off."""
        return bool(self._m.save_state())

    def warm_progress(self) -> tuple[int, int]:
        """(experts the warm start reads in the background, of which read so far); (0, 0) without
        a usable sidecar."""
        n, done = self._m.warm_progress()
        return int(n), int(done)

    def read_latency(self) -> dict[str, object] | None:
        """Latencies of expert reads: counts per bucket (upper bounds le_us), n and sum_us; None
        without a cache."""
        h = self._m.read_hist()
        return dict(h) if h is not None else None

    def close(self) -> None:
        """Frees the model now (the sidecar is written then) instead of at garbage collection; a later
        use is a ModelError."""
        with self._lock:
            self._m = _Closed(self.path)  # type: ignore[assignment]

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(self._m.tokenize(check_text(text, "tokenize"), bool(add_special)))

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str:
        """(role, content) messages as the model's chat template renders them, the assistant's turn
        opened (llama.cpp's built-in renderers, as llama-server without --jinja); ModelError if the
        model has no template or llama.cpp cannot render it."""
        if isinstance(messages, (str, bytes)):
            msg = "chat_prompt: messages must be a sequence of (role, content) pairs, not one string"
            raise ConfigError(msg)
        pairs = []
        for i, m in enumerate(messages):
            if not isinstance(m, (tuple, list)) or len(m) != 2:
                msg = f"chat_prompt: message {i} is {m!r}, not a (role, content) pair"
                raise ConfigError(msg)
            pairs.append(
                (
                    check_text(m[0], f"chat_prompt: message {i}'s role"),
                    check_text(m[1], f"chat_prompt: message {i}'s content"),
                )
            )
        return str(self._m.chat_prompt(pairs))

    def detokenize(self, tokens: list[int]) -> str:
        return bytes(self._m.detokenize(_token_ids(tokens, "detokenize", self.n_vocab))).decode(
            "utf-8", errors="replace"
        )

    def logits(self, tokens: list[int]) -> npt.NDArray[np.float32]:
        """Logits at the last position of tokens, evaluated from an empty context."""
        ids = _token_ids(tokens, "logits", self.n_vocab)
        if not ids:
            msg = "logits: no tokens to evaluate"
            raise ConfigError(msg)
        with self._lock:
            return np.asarray(self._m.logits(ids), dtype=np.float32)

    def graph_nodes(self, tokens: list[int]) -> list[str]:
        """Names of the compute graph's nodes in the order one decode of tokens runs them."""
        try:
            with self._lock:
                return list(_core.trace.node_order(self._m, tokens))
        except RuntimeError as e:
            raise ModelError(str(e)) from None

    def generate(
        self,
        prompt: str | list[int],
        max_tokens: int = 64,
        temperature: float = 0.0,
        seed: int = 0,
        on_first_token: Callable[[], object] | None = None,
    ) -> GenerateResult:
        """Generates up to max_tokens after prompt (greedy when temperature is 0), fewer where the
        context fills up (as llama.cpp's tools stop); a prompt longer than the context is a ConfigError.
        on_first_token is called once the first token is sampled, before decode starts and outside
        both timings (so a benchmark can split its counters into prefill and decode there)."""
        check_sampling(max_tokens, temperature, seed)
        if isinstance(prompt, (bytes, bytearray)):
            msg = "generate: the prompt is bytes; give text (a str) or token ids (a list of int)"
            raise ConfigError(msg)
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else _token_ids(prompt, "generate", self.n_vocab)
        if on_first_token is not None and not callable(on_first_token):
            msg = f"generate: on_first_token {on_first_token!r} must be callable or None"
            raise ConfigError(msg)
        with self._lock:  # one context: two threads decoding in it at once would corrupt it
            self.reset_stats()
            t0 = time.perf_counter()
            res = self._m.generate(tokens, max_tokens, temperature, seed, on_first_token)
            dt = time.perf_counter() - t0
            stats = self.stats()
        out = [int(t) for t in res["tokens"]]
        return GenerateResult(
            text=self.detokenize(out),
            tokens=out,
            stats=stats,
            prompt_tokens=len(tokens),
            seconds=dt,
            prefill_seconds=float(res["prefill_s"]),
            decode_seconds=float(res["decode_s"]),
            stop=str(res["stop"]),
        )

    def stats(self) -> CacheStats:
        """Expert cache counters since the last reset (all zero without a cache)."""
        return CacheStats(total=self._m.stats_total(), layers=tuple(self._m.layer_stats()))

    def prefetch_stats(self) -> PrefetchStats:
        """Prefetch counters since the last reset (all zero without prefetch)."""
        return self._m.prefetch_stats()

    def cache_info(self) -> dict[str, int | bool]:
        """Pool sizes of the cache: n_layers, n_expert, n_slots, cache_bytes, expert_bytes, ..."""
        return dict(self._m.cache_info())

    def reset_stats(self) -> None:
        """Zeroes the counters; from another thread, after the decode running there (zeroing them under
        a decode would tear its counts)."""
        with self._lock:
            self._m.reset_stats()
