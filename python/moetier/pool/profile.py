"""`moetier profile`: measures what the pool's scheduler needs (CoServe section 4.5).

Per model: the cold load time (its file dropped from the page cache first; with its first request's
extra time, when the weights' pages come from the disk), the bytes it adds to
this process once loaded and run, and the latency line k*n + b of a batch of n jobs, fitted to timed
batches. Models of one shape (same file size, store, cache and context) cost the same,
so one of them is measured for all, as the paper profiles once per architecture. Usage
probabilities come from the request mix (weights per model or pipeline), carried through each
pipeline's routes: a fixed route passes its whole share on, a route chosen by the answer splits it
evenly between its outcomes (the answer is not known before the router runs)."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._files import write_text
from ..errors import ConfigError
from .executor import drop_page_cache, estimate_cost, footprint, open_model, rss_bytes
from .sched import fit_line
from .spec import ModelSpec, PoolSpec

PROMPTS = (
    "Write one sentence about the weather.",
    "Name a colour and a fruit.",
    "What is two plus three?",
    "Describe a cat in five words.",
    "Say hello in French.",
    "List three prime numbers.",
    "What does a compiler do?",
    "Give a synonym for quick.",
)


def shape_key(spec: ModelSpec) -> tuple[Any, ...]:
    return tuple(spec.shape())


def usage_probabilities(spec: PoolSpec, weights: Mapping[str, float] | None = None) -> dict[str, float]:
    """Each model's share of the jobs. weights: request weight per model or pipeline (default: 1 for
    every pipeline and every model that is in no pipeline)."""
    in_pipelines = {s.model for p in spec.pipelines.values() for s in p.stages.values()}
    if weights is None:
        weights = {name: 1.0 for name in spec.pipelines}
        weights.update({m: 1.0 for m in spec.models if m not in in_pipelines})
    jobs = dict.fromkeys(spec.models, 0.0)
    for name, w in weights.items():
        if w < 0:
            msg = f"usage: {name}: weight {w} is negative"
            raise ConfigError(msg)
        if name in spec.models:
            jobs[name] += w
            continue
        if name not in spec.pipelines:
            msg = f"usage: unknown model or pipeline {name!r}"
            raise ConfigError(msg)
        p = spec.pipelines[name]
        flow = {p.first: w}
        for st in _topological(p):
            f = flow.pop(st.name, 0.0)
            jobs[st.model] += f
            outcomes = [t for _, t in st.routes] + [st.default]
            for t in outcomes:
                if t is not None:
                    flow[t] = flow.get(t, 0.0) + f / len(outcomes)
    total = sum(jobs.values())
    return {m: (v / total if total > 0 else 0.0) for m, v in jobs.items()}


def _topological(p: Any) -> list[Any]:
    order: list[str] = []
    seen: set[str] = set()

    def visit(s: str) -> None:
        if s in seen:
            return
        seen.add(s)
        st = p.stages[s]
        for t in [t for _, t in st.routes] + [st.default]:
            if t is not None:
                visit(t)
        order.append(s)

    visit(p.first)
    return [p.stages[s] for s in reversed(order)]


def fit_batch_line(ns: list[int], ts: list[float]) -> tuple[float, float]:
    """k, b of t = k*n + b (sched.fit_line); a negative b is clamped to 0 with k the mean time per job
    (a batch never runs faster than its jobs), a negative k to a flat line at the mean time per batch
    (timing noise can make a larger batch look faster; a pool refuses a negative cost)."""
    k, b = fit_line(ns, ts)
    if b < 0:
        k, b = sum(ts) / sum(ns), 0.0
    elif k < 0:
        k, b = 0.0, sum(ts) / len(ts)
    return k, b


def timed_requests(spec: PoolSpec, key: tuple[Any, ...], max_tokens: int) -> tuple[int, list[str]]:
    """The requests a shape of model is timed with: as a pipeline stage that uses it asks (its
    max_tokens, its prompt with PROMPTS as the input and a short earlier answer), else max_tokens
    tokens after PROMPTS."""
    for p in spec.pipelines.values():
        for st in p.stages.values():
            if shape_key(spec.models[st.model]) == key:
                fill = [st.prompt.replace("{input}", x).replace("{previous}", "Yes.") for x in PROMPTS]
                return st.max_tokens, fill
    return max_tokens, list(PROMPTS)


def profile(
    spec: PoolSpec,
    max_tokens: int = 16,
    weights: Mapping[str, float] | None = None,
    batches: tuple[int, ...] = (1, 2, 4),
    note: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Measures every shape of model in the pool; returns the profile (see write_profile). A model in
    a pipeline is timed as its first stage there asks; max_tokens times the others."""
    probs = usage_probabilities(spec, weights)
    reps: dict[tuple[Any, ...], str] = {}
    for name, m in spec.models.items():
        reps.setdefault(shape_key(m), name)
    measured: dict[str, dict[str, Any]] = {}
    for i, (key, name) in enumerate(reps.items()):
        m = spec.models[name]
        same = sum(1 for s in spec.models.values() if shape_key(s) == key)
        note(f"[{i + 1}/{len(reps)}] {name} ({m.path.name}; {same} of this shape)")
        n_tok, prompts = timed_requests(spec, key, max_tokens)
        drop_page_cache(m.path)
        before = rss_bytes()
        t = time.perf_counter()
        model = open_model(m, spec.threads)
        load = time.perf_counter() - t
        # the first request also pays for the weights' first touch (their pages come from the disk) and
        # the compute buffers: part of a switch, so counted in the load (beyond the same request warm)
        t = time.perf_counter()
        model.generate(prompts[0], max_tokens=n_tok)
        first = time.perf_counter() - t
        nbytes = max(0, rss_bytes() - before)
        t = time.perf_counter()
        model.generate(prompts[0], max_tokens=n_tok)
        load += max(0.0, first - (time.perf_counter() - t))
        ns: list[int] = []
        ts: list[float] = []
        for n in batches:
            if n > m.max_batch:
                continue
            t = time.perf_counter()
            for j in range(n):
                model.generate(prompts[(j + 1) % len(prompts)], max_tokens=n_tok)
            ns.append(n)
            ts.append(time.perf_counter() - t)
        k, b = fit_batch_line(ns, ts)
        model.close()
        del model
        drop_page_cache(m.path)
        # what the process grew by holds the compute buffers; the weights and KV it has not touched yet
        # still count in full
        w_bytes, kv, _ = footprint(m)
        estimate = estimate_cost(m).nbytes
        measured[name] = {"load": load, "nbytes": max(nbytes, w_bytes + kv), "k": k, "b": b, "rss_delta": nbytes}
        note(
            f"    load {load:.2f} s, {nbytes / 2**20:.0f} MiB measured ({estimate / 2**20:.0f} estimated), "
            f"k {k * 1000:.0f} ms, b {b * 1000:.0f} ms"
        )
    rows = {}
    for name, m in spec.models.items():
        rep = reps[shape_key(m)]
        rows[name] = {
            **measured[rep],
            "max_batch": m.max_batch,
            "p": probs[name],
            "profiled_as": rep,
            "path": str(m.path),
            "shape": m.shape(),
        }
    return {
        "config": str(spec.path),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "threads": spec.threads,
        "max_tokens": max_tokens,
        "models": rows,
    }


def write_profile(data: Mapping[str, Any], path: Path) -> None:
    write_text(path, json.dumps(data, indent=1) + "\n")
