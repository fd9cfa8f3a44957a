"""`moetier trace` and `moetier replay`: a model's routing on any text, and every eviction policy run
over it through the engine's own cache code, beside the offline optimum.

`trace` runs the stock model over text and writes its routing in the format `moetier calibrate`
writes (calibrate.Trace: ids and gate weights per token, layer and ubatch). `replay` runs that trace
through the cache's bookkeeping (C++, simulate mode: the precision rule, the slot pools, the
per-layer partition, the policy; nothing is read) at each budget and for each policy, and reports
hits, misses and the bytes they would read per token, with

- **belady**: Belady's MIN, evicting the expert used again farthest in the future. With all experts
  in high precision it reads the fewest bytes any policy can: the bound.
- **belady-cost**: the same look-ahead weighing the bytes each next use would read (a high miss
  costs more than a low one): the reference for mixed precision.

The geometry (slots per budget, bytes per expert) comes from the engine loading the model with that
budget, so the replay sees the pools a run would have. Budgets are shares of all experts' bytes,
as bench/run.py sets them.

    moetier trace MODEL.gguf --text held-out.txt --tokens 4096 -o trace.npz
    moetier replay trace.npz -m MODEL.gguf --budgets 10,25,50 -o replay.json   # + .md, .png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .. import _core
from .._files import replacing, write_text
from ..calibrate import CalibrateConfig, Trace, concat_traces, read_texts, record_trace
from ..config import CacheConfig
from ..errors import ConfigError, ModelError
from ..model import Model

# LRU is the online baseline the gap to Belady is measured from
BASELINE = "lru"


def policies_all() -> list[str]:
    """Every policy replay can run: the online ones (a model can use them), then the offline ones."""
    return [*_core.policy_names(), *_core.offline_policy_names()]


def probe(model: str | Path, store: str | Path | None) -> dict[str, int | bool]:
    """The model's cache facts that do not depend on the budget (expert bytes, the minimum budget)."""
    # warm=False: a probe must not write a warm-start sidecar next to the user's model or store
    info = Model(model, store=store, cache=CacheConfig(budget="auto", warm=False)).cache_info()
    if int(info["n_groups"]) != 1:
        msg = f"{model}: replay simulates one pool group; this model's layers form {info['n_groups']}"
        raise ModelError(msg)
    return info


def geometry(
    model: str | Path,
    store: str | Path | None,
    probe: dict[str, int | bool],
    pct: float,
    t1: float,
    t2: float,
    low_frac: float,
) -> dict[str, int]:
    """The cache the engine builds for model at pct % of its experts' bytes: slots per pool and the
    bytes of one expert in each precision."""
    budget = max(int(probe["min_cache_bytes"]), int(int(probe["expert_bytes"]) * pct / 100))
    cache = CacheConfig(budget=budget, t1=t1, t2=t2, low_frac=low_frac, warm=False)
    info = Model(model, store=store, cache=cache).cache_info()
    n_experts = int(info["n_layers"]) * int(info["n_expert"])
    return {
        "pct": pct,  # type: ignore[dict-item]
        "budget_bytes": budget,
        "n_layers": int(info["n_layers"]),
        "n_expert": int(info["n_expert"]),
        "n_slots": int(info["n_slots"]),
        "n_slots_low": int(info.get("n_slots_low", 0)),
        "bytes_high": int(info["expert_bytes"]) // n_experts,
        "bytes_low": int(info.get("expert_bytes_low", 0)) // n_experts,
    }


def geometry_of(n_layers: int, n_expert: int, pct: float, expert_bytes: int) -> dict[str, int]:
    """A cache at pct % of n_layers x n_expert experts of expert_bytes each, with no model to load (a
    trace of real routing): the slots that share buys, one layer's experts at least, as the engine sizes
    them; no low-precision pool."""
    n_all = n_layers * n_expert
    return {
        "pct": pct,  # type: ignore[dict-item]
        "budget_bytes": int(n_all * expert_bytes * pct / 100),
        "n_layers": n_layers,
        "n_expert": n_expert,
        "n_slots": min(n_all, max(n_expert, round(n_all * pct / 100))),
        "n_slots_low": 0,
        "bytes_high": expert_bytes,
        "bytes_low": 0,
    }


def replay_one(
    trace: Trace, geo: dict[str, int], policy: str, t1: float, t2: float, weights: Sequence[float]
) -> dict[str, Any]:
    """One policy at one geometry: the engine's counters and what they mean per token (with a VRAM tier,
    geo["n_slots_vram"], its hits and copies too)."""
    c = _core.replay(
        trace.ids,
        trace.weights,
        trace.n_expert,
        geo["bytes_high"],
        geo["bytes_low"],
        geo["n_slots"],
        geo["n_slots_low"],
        policy,
        list(weights),
        t1,
        t2,
        list(trace.seq_starts),
        geo.get("n_slots_vram", 0),
    )._asdict()
    n = max(1, int(trace.ids.shape[0]))
    return {
        "policy": policy,
        "pct": geo["pct"],
        **c,
        "hit_rate": c["n_hits"] / c["n_lookups"] if c["n_lookups"] else 0.0,
        "vram_hit_rate": c["n_vram_hits"] / c["n_lookups"] if c["n_lookups"] else 0.0,
        "vram_mb_per_token": c["n_vram_bytes"] / n / 1e6,
        "mb_per_token": c["n_bytes_read"] / n / 1e6,
        "misses_per_token": c["n_misses"] / n,
    }


def select_sequences(trace: Trace, first: int, last: int | None, path: str) -> Trace:
    """Sequences first .. last - 1 of trace (last None: to the end), each starting as it did: a part of a
    trace held out from what a policy was designed or fitted on."""
    starts = [*trace.seq_starts, int(trace.ids.shape[0])]
    n_seq = len(starts) - 1
    end = n_seq if last is None else last
    if not 0 <= first < end <= n_seq:
        upto = "" if last is None else last
        msg = f"{path}: sequences {first}:{upto} is not a range within its {n_seq} sequences"
        raise ConfigError(msg)
    t0, t1 = starts[first], starts[end]
    ub = [s - t0 for s in trace.ubatch_starts if t0 <= s < t1]
    return Trace(
        trace.ids[t0:t1],
        trace.weights[t0:t1],
        trace.layers,
        trace.n_expert,
        tuple(s - t0 for s in starts[first:end]),
        tuple(ub) if ub and ub[0] == 0 else (0, *ub),
        trace.has_weights,
    )


def check_trace(trace: Trace, geo: dict[str, int], path: str | Path) -> None:
    if trace.ids.shape[1] != geo["n_layers"] or trace.n_expert != geo["n_expert"]:
        msg = (
            f"{path}: the trace has {trace.ids.shape[1]} MoE layers of {trace.n_expert} experts; the model has "
            f"{geo['n_layers']} of {geo['n_expert']}: a trace of another model"
        )
        raise ConfigError(msg)


def replay(
    trace_path: str | Path | Sequence[str | Path],
    model: str | Path | None,
    budgets: Sequence[float],
    policies: Sequence[str],
    store: str | Path | None = None,
    t1: float = 1.0,
    t2: float = 1.0,
    low_frac: float | None = None,
    weights: Sequence[float] = (0.25, 0.25, 0.25, 0.25),
    tokens: int = 0,
    progress: bool = True,
    vram: float = 0.0,
    expert_bytes: int = 1,
    sequences: tuple[int, int | None] | None = None,
) -> dict[str, Any]:
    """Every policy at every budget; the report with, per budget, the share of the gap between LRU
    and Belady in bytes each policy closes. vram: a VRAM tier over the cache of that % of the experts
    (its hits and the bytes copied into it per token are in the rows; each tier runs the policy).
    model None: the geometry is the trace's (layers, experts), each expert expert_bytes (1: the bytes
    count misses), for a trace of real routing with no model file to load. sequences (first, last): only
    those sequences of the trace (last excluded, None: to the end), before tokens is applied."""
    if model is None and (store is not None or t1 < 1.0 or t2 < 1.0):
        msg = "replay: a store and mixed precision need the model (-m) for their sizes"
        raise ConfigError(msg)
    if not 0 <= vram <= 100:
        msg = f"replay: vram={vram:g}: a share of the experts in [0, 100]"
        raise ConfigError(msg)
    offline = set(_core.offline_policy_names())
    for p in policies:
        why = None if p in offline else _core.policy_error(p)
        if why is not None:
            msg = f"replay: {why}"
            raise ConfigError(msg)
    paths = [trace_path] if isinstance(trace_path, (str, Path)) else list(trace_path)
    trace = concat_traces([Trace.load(p) for p in paths], [str(p) for p in paths])
    trace_path = ", ".join(str(p) for p in paths)
    if sequences is not None:
        trace = select_sequences(trace, sequences[0], sequences[1], trace_path)
    if tokens > 0:
        n = min(tokens, trace.ids.shape[0])
        trace = Trace(
            trace.ids[:n],
            trace.weights[:n],
            trace.layers,
            trace.n_expert,
            tuple(s for s in trace.seq_starts if s < n),
            tuple(s for s in trace.ubatch_starts if s < n),
            trace.has_weights,
        )
    lf = CacheConfig(budget="auto").low_frac if low_frac is None else low_frac
    rows: list[dict[str, Any]] = []
    geos = []
    bar = tqdm(total=len(budgets) * len(policies), desc="replaying", unit="run", disable=not progress)
    facts = probe(model, store) if model is not None else {}
    for pct in budgets:
        if model is None:
            geo = geometry_of(trace.ids.shape[1], trace.n_expert, pct, expert_bytes)
        else:
            geo = geometry(model, store, facts, pct, t1, t2, lf)
        if vram > 0:
            n_all = geo["n_layers"] * geo["n_expert"]
            geo["n_slots_vram"] = min(n_all, max(geo["n_expert"], round(n_all * vram / 100)))
        check_trace(trace, geo, trace_path)
        geos.append(geo)
        for p in policies:
            rows.append({**replay_one(trace, geo, p, t1, t2, weights), "n_slots": geo["n_slots"]})
            bar.update()
    bar.close()
    for pct in budgets:
        at = {r["policy"]: r for r in rows if r["pct"] == pct}
        if BASELINE in at and "belady" in at:
            gap = at[BASELINE]["n_bytes_read"] - at["belady"]["n_bytes_read"]
            for r in at.values():
                r["gap_closed"] = (at[BASELINE]["n_bytes_read"] - r["n_bytes_read"]) / gap if gap > 0 else None
    return {
        "trace": str(trace_path),
        "model": str(model) if model is not None else None,
        "has_weights": trace.has_weights,
        "expert_bytes": expert_bytes if model is None else None,
        "store": str(store) if store else None,
        "tokens": int(trace.ids.shape[0]),
        "sequences": list(sequences) if sequences is not None else None,
        "n_used": int(trace.ids.shape[2]),
        "t1": t1,
        "t2": t2,
        "low_frac": lf,
        "weights": list(weights),
        "vram": vram,
        "geometry": geos,
        "rows": rows,
    }


def table(rep: dict[str, Any]) -> str:
    """Markdown: per budget, the policies from fewest bytes read to most."""
    on = (
        Path(rep["model"]).name
        if rep.get("model")
        else f"the trace's geometry ({rep['geometry'][0]['n_layers']} layers x {rep['geometry'][0]['n_expert']} "
        f"experts{'' if rep.get('expert_bytes', 1) > 1 else '; MB/token counts misses, 1 byte each'})"
    )
    weights = "" if rep.get("has_weights", True) else " The trace has no gate weights: ranks follow its id order."
    seqs = rep.get("sequences")
    part = f"sequences {seqs[0]}:{'' if seqs[1] is None else seqs[1]}, " if seqs else ""
    out = [
        f"Replay of {rep['trace']} ({part}{rep['tokens']} tokens, top-{rep['n_used']}) on {on}; "
        f"t1={rep['t1']:g}, t2={rep['t2']:g}. gap closed: share of the bytes between LRU and Belady a policy saves."
        + weights,
        "",
        "| budget | slots | policy | hit rate | misses/token | MB/token | low loads | skipped | gap closed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if rep.get("vram"):
        out[0] += f" A VRAM tier of {rep['vram']:g}% of the experts over the cache: its hit rate and MB copied in."
        out[2] += " VRAM hit rate | VRAM MB/token |"
        out[3] += "---|---|"
    for geo in rep["geometry"]:
        rows = sorted((r for r in rep["rows"] if r["pct"] == geo["pct"]), key=lambda r: r["n_bytes_read"])
        for r in rows:
            g = r.get("gap_closed")
            out.append(
                f"| {geo['pct']:g}% | {geo['n_slots']}+{geo['n_slots_low']} | {r['policy']} "
                f"| {100 * r['hit_rate']:.1f}% "
                f"| {r['misses_per_token']:.2f} | {r['mb_per_token']:.2f} | {r['n_loads_low']} | {r['n_skipped']} "
                f"| {'' if g is None else f'{100 * g:.0f}%'} |"
                + (f" {100 * r['vram_hit_rate']:.1f}% | {r['vram_mb_per_token']:.2f} |" if rep.get("vram") else "")
            )
    return "\n".join(out) + "\n"


def plot(rep: dict[str, Any], out: Path) -> bool:
    """Hit rate and MB per token against the budget, a line per policy, Belady on top; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(dict.fromkeys(r["policy"] for r in rep["rows"]))
    for name in names:
        rows = sorted((r for r in rep["rows"] if r["policy"] == name), key=lambda r: r["pct"])
        x = [r["pct"] for r in rows]
        offline = name.startswith("belady")
        style: dict[str, Any] = (
            {"color": "k", "lw": 2.5, "zorder": 5, "ls": "-" if name == "belady" else ":"}
            if offline
            else {"lw": 1.2, "marker": "o", "ms": 3}
        )
        axes[0].plot(x, [100 * r["hit_rate"] for r in rows], label=name, **style)
        axes[1].plot(x, [r["mb_per_token"] for r in rows], label=name, **style)
    axes[0].set(xlabel="cache budget (% of expert bytes)", ylabel="hit rate (%)", title="hits")
    axes[1].set(xlabel="cache budget (% of expert bytes)", ylabel="MB read per token", title="bytes")
    axes[1].legend(fontsize=7, ncol=2)
    name = Path(rep["model"]).name if rep.get("model") else Path(rep["trace"].split(",")[0]).parent.name
    fig.suptitle(f"{name}: {rep['tokens']} traced tokens replayed", fontsize=9)
    fig.tight_layout()
    with replacing(out) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return True


def _floats(s: str, what: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        msg = f"{what}: {s!r} is not a comma-separated list of numbers"
        raise ConfigError(msg) from None


def trace_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="moetier trace",
        description="Record a MoE's routing on text (the stock model through llama.cpp): the experts and gate "
        "weights per token, layer and ubatch, in the .npz format moetier calibrate writes.",
    )
    p.add_argument("model", help="MoE GGUF")
    p.add_argument("--text", nargs="+", required=True, help="text file(s) to route, concatenated")
    p.add_argument("-o", "--output", required=True, help="trace to write (.npz)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens to record (default: 4096)")
    p.add_argument(
        "--seq-len", type=int, default=512, help="tokens per sequence; each starts from an empty context (default: 512)"
    )
    p.add_argument(
        "-t", "--threads", type=int, default=None, help="compute threads (default: the machine's cores, at most 8)"
    )
    a = p.parse_args(argv)
    if not Path(a.output).absolute().parent.is_dir():  # before the recording
        msg = f"-o {a.output}: {Path(a.output).absolute().parent} is not a directory; create it first"
        raise ConfigError(msg)
    text = "\n\n".join(read_texts(a.text, "--text"))
    tr = record_trace(a.model, text, CalibrateConfig(tokens=a.tokens, seq_len=a.seq_len), a.threads)
    out = tr.save(a.output)
    n, n_layers, k = tr.ids.shape
    sys.stdout.write(
        f"moetier: wrote {out}: {n} tokens x {n_layers} MoE layers x top-{k} of {tr.n_expert}, "
        f"{len(tr.seq_starts)} sequences, {len(tr.ubatch_starts)} ubatches\n"
    )
    return 0


def _expert_bytes(text: str, model: str | None) -> int:
    n = _core.parse_size(text)
    if n is None or n < 1:
        msg = f"--expert-bytes: {text!r} is not a size of at least 1 byte"
        raise ConfigError(msg)
    if n > 1 << 40:  # the replay's byte counters add every read: past a TiB per expert they would overflow
        msg = f"--expert-bytes: {text!r} is over 1 TiB per expert; give the size of one expert"
        raise ConfigError(msg)
    if model is not None and text != "1":
        msg = "--expert-bytes: the model (-m) gives the experts' sizes; give one or the other"
        raise ConfigError(msg)
    return n


def parse_sequences(text: str | None, flag: str = "--sequences") -> tuple[int, int | None] | None:
    """A range A:B of a trace's sequences given on the command line (B empty: to the end)."""
    if text is None:
        return None
    a, sep, b = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(a), int(b) if b.strip() else None
    except ValueError:
        msg = f"{flag}: {text!r} is not a range A:B of sequence numbers (B may be left out)"
        raise ConfigError(msg) from None


def replay_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="moetier replay",
        description="Replay a routing trace through the engine's cache code for every policy and budget, beside "
        "Belady's MIN (the offline optimum): hits, misses and bytes read per token; a table, a JSON report and "
        "a plot.",
    )
    p.add_argument(
        "trace",
        nargs="+",
        help="routing trace(s), replayed one after another: .npz of moetier trace or calibrate, or the shared "
        "format of real routing (ids, seq_offsets, n_experts; gate weights optional)",
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="the MoE GGUF the trace was recorded on (gives the geometry); without one, the trace's layers and "
        "experts, each of --expert-bytes",
    )
    p.add_argument(
        "--expert-bytes",
        default="1",
        help="without -m: bytes of one expert, e.g. 5M (default 1: the byte columns count misses)",
    )
    p.add_argument("--store", default=None, help="expert store (gives the low-precision sizes; default: none)")
    p.add_argument(
        "--budgets",
        default="10,25,50",
        help="cache budgets in %% of all experts' bytes, comma-separated (default: 10,25,50)",
    )
    p.add_argument(
        "--policies",
        default=",".join(policies_all()),
        help=f"policies, comma-separated (default: all: {', '.join(policies_all())})",
    )
    p.add_argument("--t1", type=float, default=1.0, help="precision threshold t1 (default 1: all high)")
    p.add_argument("--t2", type=float, default=1.0, help="precision threshold t2 (default 1: nothing skipped)")
    p.add_argument("--low-frac", type=float, default=None, help="share of the budget for low slots (default: engine's)")
    p.add_argument(
        "--weights", default="0.25,0.25,0.25,0.25", help="w_lru,w_lfu,w_lhu,w_fld of policy multi (default: equal)"
    )
    p.add_argument(
        "--sequences",
        default=None,
        help="replay only sequences A:B of the trace (from A up to B excluded, counted from 0; A: to the end), "
        "e.g. prompts held out from what a policy was tuned on (default: all)",
    )
    p.add_argument(
        "--tokens", type=int, default=0, help="replay only the first N tokens (after --sequences; default: all)"
    )
    p.add_argument(
        "--vram",
        type=float,
        default=0.0,
        help="a VRAM tier over the cache of this %% of the experts (the engine's tier code): its hits and the MB "
        "copied into it per token beside the cache's (default 0: none)",
    )
    p.add_argument("-o", "--output", default=None, help="JSON report to write; OUT.md and OUT.png beside it")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    w = _floats(a.weights, "--weights")
    if len(w) != 4 or not all(0 <= x < math.inf for x in w):
        msg = f"--weights: {a.weights!r} needs 4 finite numbers, 0 or more (w_lru,w_lfu,w_lhu,w_fld)"
        raise ConfigError(msg)
    for flag, t in (("--t1", a.t1), ("--t2", a.t2)):
        if not 0 <= t <= 1:
            msg = f"{flag}: {t} must lie in [0, 1]"
            raise ConfigError(msg)
    if a.tokens < 0:
        msg = f"--tokens: {a.tokens} must be 0 (every token) or more"
        raise ConfigError(msg)
    if a.low_frac is not None and (a.model is None or not 0 <= a.low_frac < 1):
        msg = f"--low-frac {a.low_frac}: a share in [0, 1) of a model's cache (with -m) for low-precision slots"
        raise ConfigError(msg)
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    if not policies:
        msg = f"--policies: {a.policies!r} names no policy"
        raise ConfigError(msg)
    for flag, items in (("--policies", policies), ("--budgets", _floats(a.budgets, "--budgets"))):
        twice = sorted({str(x) for x in items if items.count(x) > 1})
        if twice:
            msg = f"{flag}: {', '.join(twice)} given twice; each is one replay"
            raise ConfigError(msg)
    budgets = _floats(a.budgets, "--budgets")
    if not budgets or any(not 0 < b <= 100 for b in budgets):
        msg = f"--budgets: {a.budgets!r}: each budget is a share of the experts in (0, 100]"
        raise ConfigError(msg)
    rep = replay(
        a.trace,
        a.model,
        budgets,
        policies,
        a.store,
        a.t1,
        a.t2,
        a.low_frac,
        w,
        a.tokens,
        not a.quiet,
        a.vram,
        _expert_bytes(a.expert_bytes, a.model),
        parse_sequences(a.sequences),
    )
    md = table(rep)
    sys.stdout.write(md)
    if a.output:
        # OUT.json -> OUT.md, OUT.png (names keep their inner dots: replay-1.5b)
        base = a.output[: -len(".json")] if a.output.endswith(".json") else a.output
        write_text(base + ".json", json.dumps(rep, indent=1) + "\n")
        write_text(base + ".md", md)
        wrote = [base + ".json", base + ".md"] + ([base + ".png"] if plot(rep, Path(base + ".png")) else [])
        sys.stdout.write(f"moetier: wrote {', '.join(wrote)}\n")
    return 0
