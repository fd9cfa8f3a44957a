"""moetier.Variants: several fine-tuned variants of one MoE served from one expert cache.

Each variant is loaded with its own GGUF (its non-expert weights stay resident: attention, norms,
embeddings, routers and any shared expert) and its own expert store; the variants then share one
expert cache, the first variant's, over one budget. The cache keys an expert by (variant, layer,
expert), so a request computes with its own variant's experts, read from its store on a miss, and
the variants compete for the same slots: whichever is busy gets the room.

With a consolidation map (`moetier consolidate`, the multi-MoE paper's algorithm 1) the positions the
map shares are served by one variant's copy for every variant: one slot instead of one per variant,
at a cost in quality. Consolidation is lossy, so it is only on when a map is given; `consolidated`
says so. Without a map every variant's output equals that variant served alone.

One cache means one decode at a time: generate() serialises the variants' requests (each runs with
every thread). Prefetch and warm start are off here (their predictions and sidecar are one model's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _core
from .config import AUTO, CacheConfig
from .errors import ConfigError
from .model import GenerateResult, Model
from .tools.consolidate import _head_digest, check_rows, experts_digest


@dataclass(frozen=True)
class VariantSpec:
    """One variant: the name requests use, its GGUF and its expert store (`moetier pack`)."""

    name: str
    model: Path
    store: Path

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            msg = f"VariantSpec: name {self.name!r} must be a non-empty str"
            raise ConfigError(msg)
        for f in ("model", "store"):  # a str is taken as the path it names
            v = getattr(self, f)
            if not isinstance(v, (str, os.PathLike)):
                msg = f"VariantSpec {self.name}: {f} {v!r} must be a path"
                raise ConfigError(msg)
            object.__setattr__(self, f, Path(v))


def read_map(path: str | os.PathLike[str], variants: Sequence[VariantSpec]) -> dict[str, Any]:
    """A consolidation map, checked against the variants it is applied to (same files, same order)."""
    p = Path(path)
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        msg = f"{p}: the consolidation map does not exist"
        raise ConfigError(msg) from None
    except (OSError, ValueError) as e:
        msg = f"{p}: not a consolidation map ({e})"
        raise ConfigError(msg) from None
    if not isinstance(m, dict) or m.get("format") != "moetier-consolidation-1":
        msg = f"{p}: not a consolidation map (no format moetier-consolidation-1); write it with `moetier consolidate`"
        raise ConfigError(msg)
    mv = m.get("variants", [])
    if not isinstance(mv, list) or not all(isinstance(e, dict) for e in mv):
        msg = f"{p}: variants must be a list of the variants' entries; write the map again with `moetier consolidate`"
        raise ConfigError(msg)
    cap = m.get("capacity", 0)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        msg = f"{p}: capacity {cap!r} must be a number of shared positions (0 or more)"
        raise ConfigError(msg)
    if len(mv) != len(variants):
        msg = f"{p}: the map is of {len(mv)} variants, {len(variants)} are served"
        raise ConfigError(msg)
    for i, (entry, v) in enumerate(zip(mv, variants, strict=True)):
        # maps written before the experts' digest carry the header's only
        if entry.get("sha256_head") != _head_digest(v.model) or (
            "sha256_experts" in entry and entry["sha256_experts"] != experts_digest(v.model)
        ):
            msg = (
                f"{p}: variant {i} of the map is {entry.get('path')}, but {v.model} is served there (another file, or "
                "the variants in another order); write the map again with `moetier consolidate`"
            )
            raise ConfigError(msg)
    return m


class Closed(ConfigError):
    """The variants were closed (a server stopping): the request was not run."""

    def __init__(self) -> None:
        super().__init__("variants: closed")


class Variants:
    """Fine-tuned variants of one MoE architecture and shape served from one expert cache (see the
    module's docstring). cache: the one budget and policy (exact; prefetch, warm start and the elastic
    budget are off: asking for them is a ConfigError); consolidation: a map from `moetier consolidate`
    (lossy)."""

    def __init__(
        self,
        variants: Sequence[VariantSpec],
        cache: CacheConfig,
        *,
        consolidation: str | os.PathLike[str] | None = None,
        n_ctx: int | None = None,
        n_threads: int | None = None,
    ) -> None:
        if len(variants) < 2:
            msg = "variants: serve at least two (one variant is a plain model: moetier serve)"
            raise ConfigError(msg)
        names = [v.name for v in variants]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            msg = f"variants: the name {dup[0]!r} is given twice"
            raise ConfigError(msg)
        if cache.prefetch not in (0, CacheConfig().prefetch):
            msg = "variants: prefetch is off for variants sharing a cache (its predictions are one model's); drop it"
            raise ConfigError(msg)
        if cache.budget_bytes == AUTO:
            msg = "variants: give the shared cache a budget in bytes (an automatic one would not count the variants)"
            raise ConfigError(msg)
        if cache.grow == 1:
            msg = "variants: the shared cache keeps its budget (grow=1 is not supported with variants sharing a cache)"
            raise ConfigError(msg)
        if cache.t1 < 1.0 or cache.t2 < 1.0:
            msg = "variants: mixed precision (t1/t2 below 1) is not supported with variants sharing a cache"
            raise ConfigError(msg)
        self.specs = tuple(variants)
        self.cache = dataclasses.replace(cache, prefetch=0, warm=False)
        self.map: dict[str, Any] | None = read_map(consolidation, variants) if consolidation is not None else None
        self._lock = threading.Lock()  # one decode at a time (the variants share one cache)
        self._life = threading.Lock()  # the models' lifetime: readers of the counters need not wait for a decode
        self._models: list[Model] = []
        for v in variants:
            self._models.append(Model(v.model, store=v.store, cache=self.cache, n_ctx=n_ctx, n_threads=n_threads))
        _core.share_cache([m._m for m in self._models])
        info = self._models[0].cache_info()
        self.n_layers, self.n_expert = int(info["n_layers"]), int(info["n_expert"])
        if self.map is not None:
            self._apply(self.map, str(consolidation))
        self.requests = dict.fromkeys(names, 0)

    def _apply(self, m: dict[str, Any], where: str) -> None:
        rows = m.get("map")
        E = self.n_expert
        check_rows(rows, self.n_layers, E, len(self._models), where)
        assert isinstance(rows, list)
        for v, model in enumerate(self._models):
            keys = [(o if o >= 0 else v) * E + e for row in rows for e, o in enumerate(row)]
            model._m.set_expert_keys(keys)

    @property
    def names(self) -> list[str]:
        return [v.name for v in self.specs]

    @property
    def consolidated(self) -> bool:
        """Whether some expert positions are served by another variant's copy (lossy)."""
        # from the positions themselves: a map whose capacity says 0 but whose rows share a copy is lossy too
        return self.map is not None and any(o >= 0 for row in self.map["map"] for o in row)

    def _model(self, name: str) -> Model:
        """The variant's model; call with the lock held (the models share one cache)."""
        if not self._models:
            raise Closed
        try:
            return self._models[self.names.index(name)]
        except ValueError:
            msg = f"unknown variant {name!r}; these are served: {', '.join(self.names)}"
            raise ConfigError(msg) from None

    def generate(
        self,
        name: str,
        prompt: str | list[int],
        max_tokens: int = 64,
        temperature: float = 0.0,
        seed: int = 0,
        on_first_token: Callable[[], object] | None = None,
    ) -> GenerateResult:
        """Variant `name`'s answer (Model.generate), after the requests before it (one cache, one decode
        at a time); its stats are the shared cache's during this request."""
        with self._lock:
            m = self._model(name)
            self.requests[name] += 1
            res = m.generate(prompt, max_tokens, temperature, seed, on_first_token)
            return dataclasses.replace(res, stats=m.stats())

    def chat_prompt(self, name: str, messages: Sequence[tuple[str, str]]) -> str:
        with self._lock:
            return self._model(name).chat_prompt(messages)

    def cache_info(self) -> dict[str, int | bool]:
        """The shared cache's pools (the first variant's cache_info). It does not wait for a running
        decode (a /metrics scrape would hang behind a long answer): the counters are read safely from
        another thread."""
        with self._life:
            return self._model(self.names[0]).cache_info()

    def close(self) -> None:
        """Frees the variants, the first (whose cache the others use) last."""
        with self._lock, self._life:
            for m in reversed(self._models):
                m.close()
            self._models = []

    def __del__(self) -> None:
        # the other variants point at the first one's cache: never let the collector free it first
        models = getattr(self, "_models", [])
        while models:
            models.pop().close()
