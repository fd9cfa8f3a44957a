"""What the in-process probes (prefill_probe.py, contention_probe.py) share: their model arguments
and how a configuration's model is opened and warmed up. It answers no question itself."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness's modules

from moetier import CacheConfig, Model
from worker import parse_opts


def add_model_args(a: argparse.ArgumentParser, repeats: int) -> None:
    """The arguments every probe takes: model, store, budget, prompts, configurations, repeats,
    threads, context and output prefix."""
    a.add_argument("--model", required=True, help="GGUF MoE model")
    a.add_argument("--store", default=None, help="expert store")
    a.add_argument("--budget", required=True, help="expert cache budget (bytes or e.g. 80M)")
    a.add_argument("--prompts", required=True, help="JSON list of prompts")
    a.add_argument("--config", action="append", required=True, help="NAME=OPTS (CacheConfig k=v,...); repeatable")
    a.add_argument("--repeats", type=int, default=repeats, help="rounds over the configurations")
    a.add_argument("--threads", type=int, default=2, help="compute threads")
    a.add_argument("--ctx", type=int, default=1024, help="context length")
    a.add_argument("--out", required=True, help="output prefix: OUT.json and OUT.md")


def configs(ns: argparse.Namespace) -> dict[str, tuple[dict[str, Any], bool]]:
    """--config NAME=OPTS, ... -> {name: (CacheConfig fields, repack)} (worker.parse_opts: no warm start)."""
    return {name: parse_opts(opts) for name, _, opts in (c.partition("=") for c in ns.config)}


def prompts(ns: argparse.Namespace) -> list[str]:
    out: list[str] = json.loads(Path(ns.prompts).read_text())
    return out


def open_model(ns: argparse.Namespace, opts: tuple[dict[str, Any], bool] | None) -> Model:
    """The model with the cache of opts, or stock without repacking (opts None: the cache's slots
    are not repacked, so that is the same compute), warmed up on a short prompt (first touch of
    buffers, threads)."""
    if opts is None:
        m = Model(ns.model, n_ctx=ns.ctx, n_threads=ns.threads, repack=False)
    else:
        cache = CacheConfig(budget=ns.budget, **opts[0])
        m = Model(ns.model, store=ns.store, cache=cache, n_ctx=ns.ctx, n_threads=ns.threads, repack=opts[1])
    try:
        m.generate("def f(x):", max_tokens=2)
    except BaseException:
        m.close()
        raise
    return m
