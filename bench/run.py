"""The benchmark harness: stock llama.cpp and moetier on the same model and prompts, in ONE run.

For each budget (percent of expert bytes) it measures, each configuration in its own process:
  - stock llama.cpp fully in RAM (once: the in-RAM reference, with its repacked CPU kernels),
  - stock llama.cpp in RAM without repacking (once, in a cgroup without a limit: its peak minus the
    model file, i.e. KV cache, compute buffers, the interpreter and the libraries' code pages, is the
    headroom of the caps),
  - stock llama.cpp under a memory cap that counts page cache (cgroup v1): non-expert bytes
    (without the token embedding: it is read by rows, and both systems keep it in the file mapping,
    touching only the rows of the tokens seen) + budget + headroom. Stock runs without repacking:
    repacked weights are anonymous copies a cap cannot page out (with them, stock either OOMs or
    gets every expert in RAM for free),
  - moetier under the same cap with the budget as its expert cache.
Pages of the model and store are dropped before every run; every process warms up once. It reports
prefill and decode tok/s, time to first token, bytes read per token, hit rate and peak memory, with
ratios to the capped stock run and to in-RAM, as JSON + markdown + PNG, plus the disk's O_DIRECT
bandwidth at the expert size and the I/O bound it implies. The PNG is moetier.plot.bench_plot's, the
same as `moetier bench-plot OUT.json` draws.

    python bench/run.py --model ~/.cache/moetier/models/x.gguf --budgets 10,25,50,100 --out bench/results/x
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moetier
from cgroup import MemoryCap, available
from moetier import CacheConfig, Model, MoetierError
from moetier.plot import bench_plot

MiB = 1 << 20
DEFAULT_PROMPTS = [
    'def quicksort(items):\n    """Sort a list of numbers."""\n',
    "The Python tutorial explains that lists are mutable sequences, and that",
    "In the Linux kernel, a memory cgroup limits the page cache and anonymous memory of",
    "Write a function that parses an ISO 8601 date string and returns a datetime object.\n",
]


def drop_pages(paths: list[Path]) -> None:
    """Evicts the files' pages so no run reads another run's page cache."""
    for p in paths:
        files = [p] if p.is_file() else sorted(x for x in p.iterdir() if x.is_file())
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def embedding_bytes(path: Path) -> int:
    """Bytes of the token embedding matrix (token_embd.weight) of a GGUF, 0 if it has none."""
    from gguf import GGUFReader

    for t in GGUFReader(str(path)).tensors:
        if t.name == "token_embd.weight":
            return int(t.n_bytes)
    return 0


def disk_bandwidth(path: Path, chunk: int, seconds: float = 3.0) -> float:
    """O_DIRECT random reads of `chunk` bytes (rounded to 4096) from path: bytes per second."""
    import mmap
    import random

    chunk = max(4096, (chunk + 4095) // 4096 * 4096)
    size = path.stat().st_size
    buf = mmap.mmap(-1, chunk)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    rng = random.Random(0)
    done, t0 = 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            off = rng.randrange(0, max(1, size - chunk)) // 4096 * 4096
            done += os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
        buf.close()
    return done / (time.perf_counter() - t0)


def run_worker(args: list[str], cap: MemoryCap | None, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).with_name("worker.py")), *args]
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=cap.preexec if cap else None
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    out: dict[str, Any] = json.loads(r.stdout)
    if cap:
        out["cgroup_peak_bytes"] = cap.max_usage()
    return out


def prefetch_summary(pf: dict[str, Any] | None, tokens: int) -> dict[str, float] | None:
    """Prefetch counters of one generation per token, and the accuracy of the distance-1 predictions."""
    if not pf or not pf.get("n_issued"):
        return None
    n = max(1, pf["n_pred"][0])
    return {
        "reads_per_token": pf["n_issued"] / tokens,
        "hits_per_token": pf["n_hits"] / tokens,
        "cancelled_per_token": pf["n_cancelled"] / tokens,
        "wasted_per_token": pf["n_wasted"] / tokens,
        "bytes_per_token": pf["bytes_read"] / tokens,
        "bytes_wasted_per_token": pf["bytes_wasted"] / tokens,
        "top1": pf["n_top1"][0] / n,
        "allk": pf["n_allk"][0] / n,
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread over repeats of the per-repeat means over prompts."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return {"error": results[0].get("error", "failed") if results else "no runs"}

    def per_repeat(key: str) -> list[float]:
        return [statistics.mean(run[key] for run in r["runs"]) for r in ok]

    def stat(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    tokens = sum(run["tokens"] + run["prompt_tokens"] for run in ok[-1]["runs"])
    lookups = sum(run["n_lookups"] for run in ok[-1]["runs"])
    hits = sum(run["n_hits"] for run in ok[-1]["runs"])
    return {
        "repeats": len(ok),
        "decode_tok_s": stat(per_repeat("decode_tok_s")),
        "prefill_tok_s": stat(per_repeat("prefill_tok_s")),
        "ttft_s": stat(per_repeat("ttft_s")),
        "hit_rate": hits / lookups if lookups else None,
        "bytes_read_per_token": sum(run["n_bytes_read"] for run in ok[-1]["runs"]) / tokens,
        "disk_read_per_token": statistics.median(r["disk_read_bytes"] / tokens for r in ok),
        "major_faults_per_token": statistics.median(r["major_faults"] / tokens for r in ok),
        "rss_anon_bytes": max(r["rss_anon_bytes"] for r in ok),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
        "cgroup_peak_bytes": max((r.get("cgroup_peak_bytes", 0) for r in ok), default=0),
        "token_ids": [run["token_ids"] for run in ok[-1]["runs"]],
        # the counters cover the last generation (each resets them)
        "prefetch": prefetch_summary(
            ok[-1].get("prefetch"), ok[-1]["runs"][-1]["tokens"] + ok[-1]["runs"][-1]["prompt_tokens"]
        ),
        "errors": [r["error"] for r in results if "error" in r],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF MoE model")
    p.add_argument("--store", default=None, help="expert store for moetier (default: read the GGUF)")
    p.add_argument("--budgets", default="10,25,50,100", help="expert cache budgets in %% of expert bytes")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (median and spread reported)")
    p.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--prompts", default=None, help="JSON file with a list of prompts (default: a small built-in set)")
    p.add_argument("--threads", type=int, default=2, help="threads per run")
    p.add_argument("--ctx", type=int, default=1024, help="context length")
    p.add_argument("--policy", default="lru", help="moetier eviction policy")
    p.add_argument("--opts", default="t1=1,t2=1", help="moetier cache options KEY=VALUE,... (default: high only)")
    p.add_argument(
        "--variants",
        default=None,
        help="several moetier configurations in the same run (an ablation): NAME=POLICY:OPTS;NAME=POLICY:OPTS... "
        "e.g. 'lru-high=lru:t1=1,t2=1;precision=lru:t1=0.6,t2=0.9' (default: one, 'moetier', from --policy/--opts)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds before a run is abandoned (thrashing)")
    p.add_argument(
        "--headroom-mib",
        type=float,
        default=None,
        help="headroom in the cap (default: cgroup peak of the in-RAM no-repack run minus the model, +64 MiB)",
    )
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json, OUT.md, OUT.png")
    a = p.parse_args()

    variants = parse_variants(a.variants) if a.variants else [("moetier", a.policy, a.opts)]
    model = Path(a.model).expanduser()
    info = Model(model, cache=CacheConfig(budget="64G", warm=False)).cache_info()
    expert_bytes = int(info["expert_bytes"])
    embedding = embedding_bytes(model)
    non_expert = model.stat().st_size - expert_bytes - embedding
    n_experts = int(info["n_layers"]) * int(info["n_expert"])
    files = [model] + ([Path(a.store)] if a.store else [])

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(json.loads(Path(a.prompts).read_text()) if a.prompts else DEFAULT_PROMPTS, f)
        prompts_file = f.name
    common = [
        "--model",
        str(model),
        "--prompts",
        prompts_file,
        "-n",
        str(a.n),
        "--threads",
        str(a.threads),
        "--ctx",
        str(a.ctx),
    ]

    bw = disk_bandwidth(model, expert_bytes // n_experts)
    report: dict[str, Any] = {
        "model": str(model),
        "model_bytes": model.stat().st_size,
        "expert_bytes": expert_bytes,
        "non_expert_bytes": non_expert,
        "embedding_bytes": embedding,
        "min_cache_bytes": int(info["min_cache_bytes"]),
        # which build ran (the workers inherit this interpreter's environment): a stale installed
        # package and a fresh build tree give different numbers
        "moetier": str(Path(moetier.__file__).parent),
        "machine": {"cores": os.cpu_count(), "loadavg": os.getloadavg(), "platform": platform.platform()},
        "disk_odirect_bytes_per_s": bw,
        "config": vars(a),
        "variants": [v[0] for v in variants],
        "runs": {},
    }
    print(f"moetier from {report['moetier']}", file=sys.stderr)
    print(f"disk O_DIRECT at {expert_bytes // n_experts / 1024:.0f} KiB: {bw / 1e6:.0f} MB/s", file=sys.stderr)

    def measure(name: str, extra: list[str], cap_bytes: int | None) -> dict[str, Any]:
        results = []
        for i in range(a.repeats):
            drop_pages(files)
            cap = MemoryCap(f"moetier-bench-{os.getpid()}", cap_bytes) if cap_bytes else None
            try:
                results.append(run_worker(common + extra, cap, a.timeout))
            finally:
                if cap:
                    cap.close()
            print(f"  {name} #{i + 1}: " + (results[-1].get("error") or "ok"), file=sys.stderr)
        s = summarize(results)
        s["cap_bytes"] = cap_bytes
        report["runs"][name] = s
        return s

    if not available():
        msg = "cgroup v1 memory is not available: the capped runs need it"
        raise SystemExit(msg)
    ram = measure("stock-ram", [], None)
    if "error" in ram:
        msg = f"stock in-RAM run failed: {ram['error']}"
        raise SystemExit(msg)
    # in a cgroup without a real limit: its peak counts everything the process touches (anonymous
    # memory, the model's pages, and the code pages of the libraries), so peak - model is the rest
    plain = measure("stock-ram-norepack", ["--no-repack"], 1 << 40)
    if "error" in plain:
        msg = f"stock in-RAM run without repacking failed: {plain['error']}"
        raise SystemExit(msg)
    headroom = (
        int(a.headroom_mib * MiB)
        if a.headroom_mib is not None
        else max(plain["rss_anon_bytes"], plain["cgroup_peak_bytes"] - model.stat().st_size) + 64 * MiB
    )
    report["headroom_bytes"] = headroom

    for pct in [int(x) for x in a.budgets.split(",")]:
        budget = max(int(info["min_cache_bytes"]), expert_bytes * pct // 100)
        cap = non_expert + budget + headroom
        measure(f"stock-capped-{pct}", ["--no-repack"], cap)
        for name, policy, opts in variants:
            measure(
                f"{name}-{pct}",
                ["--cache", str(budget), "--policy", policy, "--opts", opts]
                + (["--store", a.store] if a.store else []),
                cap,
            )
            report["runs"][f"{name}-{pct}"]["budget_bytes"] = budget

    write_outputs(report, Path(a.out))


def parse_variants(text: str) -> list[tuple[str, str, str]]:
    """'NAME=POLICY:OPTS;...' -> [(name, policy, opts)]."""
    out = []
    for item in (x.strip() for x in text.split(";") if x.strip()):
        name, _, rest = item.partition("=")
        policy, _, opts = rest.partition(":")
        if not name or not policy or name.startswith("stock"):
            msg = f"--variants: {item!r} is not NAME=POLICY:OPTS (NAME must not start with 'stock')"
            raise SystemExit(msg)
        out.append((name, policy, opts))
    return out


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    ram = runs["stock-ram"]
    rows = [
        "| config | cap MiB | decode tok/s (min-max) | vs capped stock | vs in-RAM | prefill tok/s | TTFT s "
        "| hit rate | disk MB/token | peak MiB | same tokens as stock in RAM |",
        "|" + "---|" * 11,
    ]
    variants = report.get("variants", ["moetier"])
    pcts = sorted({int(k.rsplit("-", 1)[1]) for k in runs if k.startswith("stock-capped-")})
    bound_bytes = report["disk_odirect_bytes_per_s"]
    names = ["stock-ram", "stock-ram-norepack"] + [f"{k}-{p}" for p in pcts for k in ("stock-capped", *variants)]
    for name in [n for n in names if n in runs]:
        s = runs[name]
        if "error" in s:
            rows.append(f"| {name} | | failed: {s['error']} | | | | | | | | |")
            continue
        base = runs.get("stock-capped-" + name.rsplit("-", 1)[-1], {}) if not name.startswith("stock") else {}
        d = s["decode_tok_s"]
        vs_cap = f"{d['median'] / base['decode_tok_s']['median']:.2f}x" if base.get("decode_tok_s") else "-"
        # repacked kernels round differently: a run without them is compared with in-RAM stock without them
        plain = runs.get("stock-ram-norepack", {})
        same = (
            "yes"
            if s["token_ids"] == ram["token_ids"]
            else "yes (= no-repack)"
            if plain and s["token_ids"] == plain.get("token_ids")
            else "no"
        )
        hit = "" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
        rows.append(
            f"| {name} | {(s['cap_bytes'] or 0) / MiB:.0f} "
            f"| {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | {vs_cap} "
            f"| {d['median'] / ram['decode_tok_s']['median']:.2f}x | {s['prefill_tok_s']['median']:.1f} "
            f"| {s['ttft_s']['median']:.2f} | {hit} "
            f"| {s['disk_read_per_token'] / 1e6:.2f} | {max(s['peak_rss_bytes'], s['cgroup_peak_bytes']) / MiB:.0f} "
            f"| {same} |"
        )
        if s["disk_read_per_token"] > 0:
            s["io_bound_tok_s"] = bound_bytes / s["disk_read_per_token"]
    pf_rows = [
        f"| {name} | {p['reads_per_token']:.1f} | {p['hits_per_token']:.1f} | {p['cancelled_per_token']:.1f} "
        f"| {p['wasted_per_token']:.1f} | {p['bytes_per_token'] / 1e6:.2f} | {p['bytes_wasted_per_token'] / 1e6:.2f} "
        f"| {p['top1']:.2f} | {p['allk']:.2f} |"
        for name in names
        if name in runs and (p := runs[name].get("prefetch"))
    ]
    if pf_rows:
        rows += [
            "",
            "prefetch (per token; accuracy of the predictions one layer ahead):",
            "",
            "| config | reads | used | cancelled (queued) | wasted (read, unused) | MB read | MB wasted "
            "| top-1 | all-k |",
            "|" + "---|" * 9,
            *pf_rows,
        ]
    text = (
        f"model `{Path(report['model']).name}`: {report['model_bytes'] / MiB:.0f} MiB, experts "
        f"{report['expert_bytes'] / MiB:.0f} MiB, token embedding {report.get('embedding_bytes', 0) / MiB:.0f} MiB; "
        f"cap = other non-expert {report['non_expert_bytes'] / MiB:.0f} MiB + budget + headroom "
        f"{report['headroom_bytes'] / MiB:.0f} MiB; disk O_DIRECT {bound_bytes / 1e6:.0f} MB/s; "
        f"{report['machine']['cores']} cores, load {report['machine']['loadavg'][0]:.2f}\n\n" + "\n".join(rows) + "\n"
    )
    for r in runs.values():
        r.pop("token_ids", None)
    out.with_name(out.name + ".json").write_text(json.dumps(report, indent=1))
    out.with_name(out.name + ".md").write_text(text)
    print(text)
    try:
        bench_plot(report, out.with_name(out.name + ".png"), source=out.with_name(out.name + ".json"))
    except MoetierError as e:
        print(f"no plot: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
