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
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import diskstat
import moetier
from cgroup import MemoryCap, ReadThrottle, available, block_device
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


def disk_bandwidth(path: Path, chunk: int, seconds: float = 2.0, depth: int = 1) -> float:
    """O_DIRECT random reads of `chunk` bytes (rounded to 4096) from path, `depth` of them in flight at
    once (diskstat.direct_reads): bytes per second."""
    # no larger than the file allows (a tiny test model)
    block = min(max(4096, (chunk + 4095) // 4096 * 4096), max(4096, (path.stat().st_size - 4096) // 4096 * 4096))
    t0 = time.perf_counter()
    done = diskstat.direct_reads(path, block, depth, lambda: time.perf_counter() - t0 < seconds)
    return done / (time.perf_counter() - t0)


DISK_DEPTHS = (1, 2, 4, 8)  # the engine reads with io_uring / io threads at depths up to the top-k


def run_worker(
    args: list[str],
    cap: MemoryCap | None,
    timeout: float,
    script: str = "worker.py",
    throttle: ReadThrottle | None = None,
) -> dict[str, Any]:
    """One configuration in a child process (worker.py, or peer_worker.py for the peer), inside cap
    and, with a throttle, on a disk slowed to its rate."""
    cmd = [sys.executable, str(Path(__file__).with_name(script)), *args]
    groups = [g for g in (cap, throttle) if g is not None]

    def join() -> None:
        for g in groups:
            g.preexec()

    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=join if groups else None)
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
        # predicted misses left unread: the byte cap spent, the disk behind (older engines: absent)
        "capped_per_token": pf.get("n_capped", 0) / tokens,
        "busy_per_token": pf.get("n_busy", 0) / tokens,
        # decode steps with prefetch reading (prefetch_gate; older engines: absent)
        "reading_share": pf["n_steps_on"] / (pf["n_steps_on"] + pf["n_steps_off"])
        if pf.get("n_steps_on", 0) + pf.get("n_steps_off", 0) > 0
        else None,
    }


def decode_prefetch(r: dict[str, Any], steps: int | None) -> tuple[dict[str, Any] | None, int]:
    """The prefetch counters of a repeat's decode steps, summed over its generations, and the steps;
    a worker without them: the last generation's whole counters and its prompt + generated tokens."""
    runs = r["runs"]
    if steps and all("decode_prefetch" in run for run in runs):
        total: dict[str, Any] = {}
        for run in runs:
            for k, v in run["decode_prefetch"].items():
                if isinstance(v, list):
                    total[k] = [a + b for a, b in zip(total.get(k, [0] * len(v)), v, strict=True)]
                else:
                    total[k] = total.get(k, 0) + v
        return total, steps
    return r.get("prefetch"), runs[-1]["tokens"] + runs[-1]["prompt_tokens"]


def median_or_none(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def lossy_counts(ok: list[dict[str, Any]]) -> dict[str, float] | None:
    """What a lossy configuration left out, summed over its repeats: moetier's skipped share of
    lookups and low-precision share of loads, or the peer's dropped share of routed experts
    (generation only: it drops nothing in the prompt's pass). None for a configuration that reports
    neither."""
    runs = [run for r in ok for run in r["runs"]]
    if any("experts_routed" in run for run in runs):
        routed = sum(run.get("experts_routed", 0) for run in runs)
        return {"dropped": sum(run.get("experts_dropped", 0) for run in runs) / max(1, routed)}
    if any(run.get("n_lookups") for run in runs):  # stock (no cache) looks nothing up
        lookups = sum(run["n_lookups"] for run in runs)
        loads = sum(run.get("n_loads_high", 0) + run.get("n_loads_low", 0) for run in runs)
        return {
            "skipped": sum(run.get("n_skipped", 0) for run in runs) / max(1, lookups),
            "loads_low": sum(run.get("n_loads_low", 0) for run in runs) / max(1, loads),
        }
    return None


def prefix_agreement(texts: list[str | None], refs: list[list[str]]) -> float:
    """Mean over prompts of the share of the reference's characters a generation reproduces before
    it first differs, against the closest of the references (greedy outputs of exact stock): 1.0
    is the same text, a lossy mode lands below."""
    shares = []
    for i, t in enumerate(norm_texts(texts) or []):
        best = 0.0
        for ref in refs:
            r = ref[i] if i < len(ref) else ""
            same = next((k for k, (x, y) in enumerate(zip(t, r, strict=False)) if x != y), min(len(t), len(r)))
            best = max(best, same / len(r) if r else float(t == r))
        shares.append(best)
    return statistics.mean(shares) if shares else 0.0


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread over repeats of the per-repeat means over prompts."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return {"error": results[0].get("error", "failed") if results else "no runs"}

    def per_repeat(key: str) -> list[float]:
        return [statistics.mean(run[key] for run in r["runs"]) for r in ok]

    def stat(xs: list[float]) -> dict[str, Any]:
        # values: per repeat, in run order (repeat i of every configuration ran in the same round)
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}

    def decode_steps(r: dict[str, Any]) -> int:
        # the first token comes out of the prompt's pass: decode is the steps after it
        return sum(max(0, run["tokens"] - 1) for run in r["runs"])

    def decode_per_token(r: dict[str, Any], *keys: str) -> float | None:
        n = decode_steps(r)
        if not n or not any(k in run for run in r["runs"] for k in keys):
            return None  # not split at the first token (upstream's llama-completion)
        return sum(run.get(k, 0) for run in r["runs"] for k in keys) / n

    def decode_rate(r: dict[str, Any], get: Callable[[dict[str, Any]], float | None]) -> float | None:
        # a quantity of the decode steps over their seconds (not per token times the median rate)
        vals = [get(run) for run in r["runs"]]
        secs = sum(run.get("decode_s", 0.0) for run in r["runs"])
        return sum(v for v in vals if v is not None) / secs if secs and all(v is not None for v in vals) else None

    def own_reads(run: dict[str, Any]) -> float | None:
        v = run.get("decode_disk_read_bytes")
        return None if v is None else float(v)

    def device(key: str) -> Callable[[dict[str, Any]], float | None]:
        return lambda run: run.get("decode_device", {}).get(key)

    tokens = sum(run["tokens"] + run["prompt_tokens"] for run in ok[-1]["runs"])
    lookups = sum(run["n_lookups"] for run in ok[-1]["runs"])
    hits = sum(run["n_hits"] for run in ok[-1]["runs"])
    return {
        "repeats": len(ok),
        "decode_tok_s": stat(per_repeat("decode_tok_s")),
        "prefill_tok_s": stat(per_repeat("prefill_tok_s")),
        "ttft_s": stat(per_repeat("ttft_s")),
        "hit_rate": hits / lookups
        if lookups
        else statistics.mean(run["peer_cache_hit_pct"] / 100 for run in ok[-1]["runs"])
        if "peer_cache_hit_pct" in ok[-1]["runs"][0]
        else None,
        # per token of prompt + generation (diluted by the prompt): kept for older result files
        "bytes_read_per_token": sum(run["n_bytes_read"] for run in ok[-1]["runs"]) / tokens,
        # what one decode step moves: the cache's demand reads plus prefetch reads, and the disk
        "decode_steps": decode_steps(ok[-1]),
        "decode_bytes_per_token": decode_per_token(ok[-1], "decode_cache_bytes_read", "decode_prefetch_bytes_read"),
        # the decode steps' wait for expert reads; the rest of a step (1 / decode_tok_s) is compute
        "decode_stall_s_per_token": median_or_none([decode_per_token(r, "decode_read_s") for r in ok]),
        "decode_disk_read_per_token": median_or_none([decode_per_token(r, "decode_disk_read_bytes") for r in ok]),
        # bytes per second of decode the process read, and the whole device's rate and busy share
        # (diskstat: time with a request in flight) over the same steps
        "decode_disk_read_bps": median_or_none([decode_rate(r, own_reads) for r in ok]),
        "decode_device_read_bps": median_or_none([decode_rate(r, device("read_bytes")) for r in ok]),
        "decode_device_busy": median_or_none([decode_rate(r, device("busy_s")) for r in ok]),
        "disk_read_per_token": statistics.median(r["disk_read_bytes"] / tokens for r in ok),
        "major_faults_per_token": statistics.median(r["major_faults"] / tokens for r in ok),
        "rss_anon_bytes": max(r["rss_anon_bytes"] for r in ok),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
        "cgroup_peak_bytes": max((r.get("cgroup_peak_bytes", 0) for r in ok), default=0),
        "token_ids": [run["token_ids"] for run in ok[-1]["runs"]],
        # lossy configurations differ from run to run (the peer's dropping follows its cache)
        "texts_by_repeat": [[run.get("text") for run in r["runs"]] for r in ok],
        "lossy": lossy_counts(ok),
        # per decode step, over the last repeat's generations (older workers: the last generation's
        # counters, prompt included, per token of prompt and generation)
        "prefetch": prefetch_summary(*decode_prefetch(ok[-1], decode_steps(ok[-1]))),
        "errors": [r["error"] for r in results if "error" in r],
        # what the cache got: with budget=auto, the size it chose and why (moetier's workers only)
        "cache_bytes": (ok[-1].get("cache_info") or {}).get("cache_bytes"),
        "budget_note": ok[-1].get("budget_note") or None,
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
        "e.g. 'lru-high=lru:t1=1,t2=1;precision=lru:t1=0.6,t2=0.9' (default: one, 'moetier', from --policy/--opts); "
        "budget=auto in OPTS sizes that variant's cache from the cap instead of the budget; store=0 makes "
        "that variant read the GGUF where --store is given",
    )
    p.add_argument(
        "--peer",
        default=None,
        help="path of the peer BigMoeOnEdge's bmoe-cli (bench/external/build-bigmoeonedge.sh builds it); "
        "runs the --peer-variants under the same caps, budgets, prompts and threads",
    )
    p.add_argument(
        "--peer-variants",
        default="peer=--moe-stream --cache-mb {budget_mib} --force-cache",
        help="peer configurations NAME=FLAGS;... ({budget_mib}: our budget in whole MiB)",
    )
    p.add_argument(
        "--upstream",
        default=None,
        help="path of upstream (unpatched) llama.cpp's llama-completion (bench/external/build-upstream.sh "
        "builds it): runs the --upstream-variants in RAM and under each cap",
    )
    p.add_argument(
        "--upstream-variants",
        default="upstream=;upstream-norepack=--no-repack;upstream-dio=--load-mode dio",
        help="upstream configurations NAME=FLAGS;... (llama-completion flags)",
    )
    p.add_argument(
        "--skip-stock-capped",
        action="store_true",
        help="leave out stock llama.cpp under each cap (it reads nearly every expert for each token: hours with a "
        "throttled disk); the runs then compare the moetier variants with each other",
    )
    p.add_argument(
        "--cap-gib",
        type=float,
        default=None,
        help="one memory cap in GiB instead of --budgets (a device's RAM): the cache's budget is what the "
        "non-expert weights and the headroom leave of it; runs are named by that budget's %% of the experts",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds before a run is abandoned (thrashing)")
    p.add_argument(
        "--throttle-read-mbps",
        type=float,
        default=None,
        help="every run reads the disk that holds the model at most this many MB/s (cgroup v1 blkio "
        "throttle; e.g. 200 for an SD card or a busy NVMe) (default: the disk's own speed)",
    )
    p.add_argument(
        "--headroom-mib",
        type=float,
        default=None,
        help="headroom in the cap (default: cgroup peak of the in-RAM no-repack run minus the model, +64 MiB)",
    )
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json, OUT.md, OUT.png")
    a = p.parse_args()

    variants = parse_variants(a.variants) if a.variants else [("moetier", a.policy, a.opts)]
    peers = parse_peer_variants(a.peer_variants, "--peer-variants") if a.peer else []
    upstreams = parse_peer_variants(a.upstream_variants, "--upstream-variants") if a.upstream else []
    model = Path(a.model).expanduser()
    info = Model(model, cache=CacheConfig(budget="64G", warm=False)).cache_info()
    expert_bytes = int(info["expert_bytes"])
    embedding = embedding_bytes(model)
    non_expert = model.stat().st_size - expert_bytes - embedding
    n_experts = int(info["n_layers"]) * int(info["n_expert"])
    # the other model files a variant names (a smaller quantization): their pages are dropped too
    files = [model] + ([Path(a.store)] if a.store else []) + model_flags([f for _, f in peers + upstreams])

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

    by_depth = {d: disk_bandwidth(model, expert_bytes // n_experts, depth=d) for d in DISK_DEPTHS}
    bw = max(by_depth.values())
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
        # the best of the queue depths: what the disk can deliver to a reader that keeps it busy
        "disk_odirect_bytes_per_s": bw,
        "disk_odirect_by_depth": {str(d): v for d, v in by_depth.items()},
        "config": vars(a),
        "variants": [v[0] for v in variants] + [v[0] for v in peers] + [v[0] for v in upstreams],
        "runs": {},
    }
    print(f"moetier from {report['moetier']}", file=sys.stderr)
    probe = ", ".join(f"QD{d} {v / 1e6:.0f}" for d, v in by_depth.items())
    print(f"disk O_DIRECT at {expert_bytes // n_experts / 1024:.0f} KiB: {probe} MB/s", file=sys.stderr)

    def run_one(name: str, extra: list[str], cap_bytes: int | None, script: str = "worker.py") -> dict[str, Any]:
        # no run reads another run's page cache, and each capped run gets a fresh group
        drop_pages(files)
        cap = MemoryCap(f"moetier-bench-{os.getpid()}", cap_bytes) if cap_bytes else None
        throttle = (
            ReadThrottle(f"moetier-bench-{os.getpid()}", block_device(model), int(a.throttle_read_mbps * 1e6))
            if a.throttle_read_mbps
            else None
        )
        try:
            r = run_worker(common + extra, cap, a.timeout, script, throttle)
        finally:
            for g in (cap, throttle):
                if g:
                    g.close()
        print(f"  {name}: " + (r.get("error") or "ok"), file=sys.stderr)
        return r

    if not available():
        msg = "cgroup v1 memory is not available: the capped runs need it"
        raise SystemExit(msg)
    # the headroom of the cap, from one uncounted in-RAM run without repacking in a group without a
    # real limit: its peak counts everything the process touches (anonymous memory, the model's pages,
    # the code pages of the libraries), so peak - model is the rest
    probe_run = run_one("headroom probe (stock in RAM, no repack)", ["--no-repack"], 1 << 40)
    if "error" in probe_run:
        msg = f"stock in-RAM run without repacking failed: {probe_run['error']}"
        raise SystemExit(msg)
    headroom = (
        int(a.headroom_mib * MiB)
        if a.headroom_mib is not None
        else max(probe_run["rss_anon_bytes"], probe_run["cgroup_peak_bytes"] - model.stat().st_size) + 64 * MiB
    )
    report["headroom_bytes"] = headroom

    # (name, worker flags, cap, budget); stock under a cap runs without repacking: repacked weights
    # are anonymous copies a cap cannot page out
    configs: list[tuple[str, list[str], int | None, int | None, str]] = [
        ("stock-ram", [], None, None, "worker.py"),
        ("stock-ram-norepack", ["--no-repack"], 1 << 40, None, "worker.py"),
    ]
    for name, flags in upstreams:
        up = ["--upstream-bin", a.upstream, f"--upstream-args={flags}"]
        configs.append((f"{name}-ram", up, 1 << 40, None, "upstream_worker.py"))
    caps: list[tuple[int, int, int]] = []  # (pct for the names, budget, cap)
    if a.cap_gib is not None:
        # the cap is given: the cache gets what the non-experts and the headroom leave
        cap = int(a.cap_gib * (1 << 30))
        budget = cap - non_expert - headroom
        if budget < int(info["min_cache_bytes"]):
            msg = f"--cap-gib {a.cap_gib}: leaves {budget / MiB:.0f} MiB for experts, below the minimum cache"
            raise SystemExit(msg)
        caps.append((round(100 * budget / expert_bytes), budget, cap))
    for pct in [int(x) for x in a.budgets.split(",")] if a.cap_gib is None else []:
        budget = max(int(info["min_cache_bytes"]), expert_bytes * pct // 100)
        caps.append((pct, budget, non_expert + budget + headroom))
    for pct, budget, cap in caps:
        if not a.skip_stock_capped:
            configs.append((f"stock-capped-{pct}", ["--no-repack"], cap, None, "worker.py"))
        for name, policy, opts in variants:
            size, opts = cache_flag(opts, budget)
            store, opts = store_flag(opts, a.store)
            flags = ["--cache", size, "--policy", policy, "--opts", opts]
            configs.append((f"{name}-{pct}", flags + (["--store", store] if store else []), cap, budget, "worker.py"))
        for name, peer_args in peers:
            # the peer's cache in whole MiB, as its --cache-mb takes it: never more than ours
            flags = ["--peer-bin", a.peer, f"--peer-args={peer_args.format(budget_mib=budget // MiB)}"]
            configs.append((f"{name}-{pct}", flags, cap, budget, "peer_worker.py"))
        for name, flags in upstreams:
            up = ["--upstream-bin", a.upstream, f"--upstream-args={flags}"]
            configs.append((f"{name}-{pct}", up, cap, None, "upstream_worker.py"))

    # interleaved: every repeat runs each configuration once, starting one further along, so drift
    # in the disk or the machine's load lands on all of them, not on whole blocks
    results: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
    for rep in range(a.repeats):
        k = rep % len(configs)
        for name, extra, cap_bytes, _, script in configs[k:] + configs[:k]:
            results[name].append(run_one(f"{name} #{rep + 1}", extra, cap_bytes, script))
    for name, extra, cap_bytes, budget, _ in configs:
        s = summarize(results[name])
        s["cap_bytes"] = cap_bytes
        s["args"] = common[common.index("--threads") :] + extra
        if budget is not None:
            s["budget_bytes"] = budget
        report["runs"][name] = s
    if "error" in report["runs"]["stock-ram"]:
        msg = f"stock in-RAM run failed: {report['runs']['stock-ram']['error']}"
        raise SystemExit(msg)

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


def cache_flag(opts: str, budget: int) -> tuple[str, str]:
    """A variant's --cache value and its other options: the budget, or 'auto' where OPTS holds
    budget=auto (the cache sized at load from the cgroup limit, under the same cap)."""
    items = [x for x in opts.split(",") if x]
    auto = "budget=auto" in items
    return ("auto" if auto else str(budget)), ",".join(x for x in items if x != "budget=auto")


def store_flag(opts: str, store: str | None) -> tuple[str | None, str]:
    """A variant's store and its other options: --store, or none where OPTS holds store=0 (that
    variant reads the GGUF, beside variants that read the store, in one run)."""
    items = [x for x in opts.split(",") if x]
    return (None if "store=0" in items else store), ",".join(x for x in items if x != "store=0")


def parse_peer_variants(text: str, option: str) -> list[tuple[str, str]]:
    """'NAME=FLAGS;...' -> [(name, flags)] (FLAGS may be empty)."""
    out = []
    for item in (x.strip() for x in text.split(";") if x.strip()):
        name, eq, flags = item.partition("=")
        if not name or name.startswith("stock") or not eq:
            msg = f"{option}: {item!r} is not NAME=FLAGS (NAME must not start with 'stock')"
            raise SystemExit(msg)
        out.append((name, flags))
    return out


def model_flags(flag_sets: list[str]) -> list[Path]:
    """The files that -m / --model name in FLAGS (a variant that runs another model file)."""
    out = []
    for flags in flag_sets:
        words = shlex.split(flags)
        out += [Path(words[i + 1]) for i, w in enumerate(words[:-1]) if w in ("-m", "--model")]
    return out


def norm_texts(texts: list[str | None] | None) -> list[str] | None:
    """Texts compared across systems: llama-completion ends its output with a blank line, so
    trailing whitespace is left out."""
    return [(t or "").rstrip() for t in texts] if texts else None


def last_texts(s: dict[str, Any]) -> list[str | None] | None:
    """The texts of a configuration's last repeat (what the same-text column compares)."""
    by_repeat = s.get("texts_by_repeat")
    return by_repeat[-1] if by_repeat else None


def busy_fmt(busy: float | None) -> str:
    return "-" if busy is None else f"{100 * busy:.0f}%"


def agree_fmt(a: dict[str, float]) -> str:
    return f"{a['median']:.2f} ({a['min']:.2f}-{a['max']:.2f})"


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    ram = runs["stock-ram"]
    rows = [
        "| config | cap MiB | decode tok/s (min-max) | vs capped stock | vs in-RAM | prefill tok/s | TTFT s "
        "| hit rate | decode disk MB/token | decode disk MB/s | disk busy (device MB/s) | peak MiB "
        "| same tokens as stock in RAM |",
        "|" + "---|" * 13,
    ]
    variants = report.get("variants", ["moetier"])
    pcts = sorted(
        {
            int(tail)
            for head, _, tail in (k.rpartition("-") for k in runs)
            if tail.isdigit() and (head == "stock-capped" or head in variants)
        }
    )
    bound_bytes = report["disk_odirect_bytes_per_s"]
    in_ram = ["stock-ram", "stock-ram-norepack"] + [n for n in runs if n.endswith("-ram") and n != "stock-ram"]
    names = in_ram + [f"{k}-{p}" for p in pcts for k in ("stock-capped", *variants)]
    for name in [n for n in names if n in runs]:
        s = runs[name]
        if "error" in s:
            rows.append(f"| {name} | | failed: {s['error']} | | | | | | | | | | |")
            continue
        base = runs.get("stock-capped-" + name.rsplit("-", 1)[-1], {}) if not name.startswith("stock") else {}
        d = s["decode_tok_s"]
        vs_cap = f"{d['median'] / base['decode_tok_s']['median']:.2f}x" if base.get("decode_tok_s") else "-"
        # repacked kernels round differently: a run without them is compared with in-RAM stock without them
        plain = runs.get("stock-ram-norepack", {})
        if s["token_ids"] and any(s["token_ids"]):
            same = (
                "yes"
                if s["token_ids"] == ram["token_ids"]
                else "yes (= no-repack)"
                if plain and s["token_ids"] == plain.get("token_ids")
                else "no"
            )
        else:  # the peer and upstream report text, not token ids
            texts = norm_texts(last_texts(s))
            refs = (norm_texts(last_texts(ram)), norm_texts(last_texts(plain)))
            same = "same text" if texts and texts in refs else "no (text)"
        hit = "" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
        dec_disk = s.get("decode_disk_read_per_token") or 0.0
        dec_mb = f"{dec_disk / 1e6:.2f}" if dec_disk else "-"
        rate = s.get("decode_disk_read_bps") or (dec_disk * d["median"] if dec_disk else 0.0)  # older files
        dec_rate = f"{rate / 1e6:.0f}" if rate else "-"
        busy, dev_rate = s.get("decode_device_busy"), s.get("decode_device_read_bps")
        dev = f"{busy_fmt(busy)} ({dev_rate / 1e6:.0f})" if busy is not None and dev_rate is not None else "-"
        rows.append(
            f"| {name} | {(s['cap_bytes'] or 0) / MiB:.0f} "
            f"| {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | {vs_cap} "
            f"| {d['median'] / ram['decode_tok_s']['median']:.2f}x | {s['prefill_tok_s']['median']:.1f} "
            f"| {s['ttft_s']['median']:.2f} | {hit} "
            f"| {dec_mb} | {dec_rate} | {dev} "
            f"| {max(s['peak_rss_bytes'], s['cgroup_peak_bytes']) / MiB:.0f} | {same} |"
        )
        if dec_disk > 0:
            # decode speed if the disk at its best probed depth were the only limit
            s["io_bound_tok_s"] = bound_bytes / dec_disk
    pf_rows = [
        f"| {name} | {p['reads_per_token']:.1f} | {p['hits_per_token']:.1f} | {p['cancelled_per_token']:.1f} "
        f"| {p['wasted_per_token']:.1f} | {p['bytes_per_token'] / 1e6:.2f} | {p['bytes_wasted_per_token'] / 1e6:.2f} "
        f"| {p['top1']:.2f} | {p['allk']:.2f} | {p.get('capped_per_token', 0):.1f} | {p.get('busy_per_token', 0):.1f} "
        f"| {busy_fmt(p.get('reading_share'))} |"
        for name in names
        if name in runs and (p := runs[name].get("prefetch"))
    ]
    if pf_rows:
        rows += [
            "",
            "prefetch (per decode step, over the last repeat; results of older workers: per token of the last "
            "prompt and its generation; accuracy of the predictions one layer ahead; misses left unread by the "
            "byte cap and because the disk was behind; the decode steps in which prefetch read, where it "
            "measures whether it pays):",
            "",
            "| config | reads | used | cancelled (queued) | wasted (read, unused) | MB read | MB wasted "
            "| top-1 | all-k | capped | busy | steps reading |",
            "|" + "---|" * 12,
            *pf_rows,
        ]
    t_rows = [
        f"| {name} | {1e3 / d:.1f} | {1e3 * st:.1f} | {1e3 / d - 1e3 * st:.1f} "
        f"| {busy_fmt(runs[name].get('decode_device_busy'))} |"
        for name in names
        if name in runs
        and (st := runs[name].get("decode_stall_s_per_token")) is not None
        and (d := runs[name].get("decode_tok_s", {}).get("median"))
    ]
    if t_rows:
        rows += [
            "",
            "where a decode step's time goes (medians over repeats): the load ops (expert reads the compute "
            "threads do, or wait for on the io_uring and the prefetch lanes), and the rest (compute); the share "
            "of the decode time the disk had a read in flight (near 100%: the disk is the limit):",
            "",
            "| config | ms / token | waiting for reads | the rest | disk busy |",
            "|" + "---|" * 5,
            *t_rows,
        ]
    exact = ("stock-ram", "stock-ram-norepack")
    exact_refs = [t for t in (norm_texts(last_texts(runs[k])) for k in exact if k in runs) if t]
    q_rows = []
    for name in [n for n in names if n in runs and n not in exact]:
        s = runs[name]
        if "error" in s or not s.get("texts_by_repeat"):
            continue
        agree = [prefix_agreement(texts, exact_refs) for texts in s["texts_by_repeat"]]
        s["agreement"] = {"median": statistics.median(agree), "min": min(agree), "max": max(agree)}
        lossy = s.get("lossy") or {}
        left = (
            f"{100 * lossy['dropped']:.1f}% dropped"
            if "dropped" in lossy
            else f"{100 * lossy['skipped']:.1f}% skipped"
            if "skipped" in lossy
            else "-"
        )
        low = f"{100 * lossy['loads_low']:.0f}%" if "loads_low" in lossy else "-"
        q_rows.append(f"| {name} | {s['decode_tok_s']['median']:.2f} | {agree_fmt(s['agreement'])} | {left} | {low} |")
    if q_rows:
        rows += [
            "",
            "quality: the share of stock's greedy text (in RAM) each configuration reproduces before it first "
            "differs, mean over prompts, median (min-max) over repeats; what a lossy mode left out:",
            "",
            "| config | decode tok/s | agreement with stock | skipped / dropped | loads in low precision |",
            "|" + "---|" * 5,
            *q_rows,
        ]
    notes = [f"- {name}: {s['budget_note']}" for name, s in runs.items() if s.get("budget_note")]
    if notes:
        rows += [
            "",
            "how each cache budget was set (the load's note, last repeat; `budget=auto` says what it subtracted):",
            "",
            *notes,
        ]
    by_depth = report.get("disk_odirect_by_depth") or {"1": bound_bytes}
    depths = ", ".join(f"QD{d} {v / 1e6:.0f}" for d, v in by_depth.items())
    throttle = (report.get("config") or {}).get("throttle_read_mbps")
    if throttle:
        depths += f" (unthrottled; every run's reads throttled to {throttle:g} MB/s)"
    text = (
        f"model `{Path(report['model']).name}`: {report['model_bytes'] / MiB:.0f} MiB, experts "
        f"{report['expert_bytes'] / MiB:.0f} MiB, token embedding {report.get('embedding_bytes', 0) / MiB:.0f} MiB; "
        f"cap = other non-expert {report['non_expert_bytes'] / MiB:.0f} MiB + budget + headroom "
        f"{report['headroom_bytes'] / MiB:.0f} MiB; disk O_DIRECT {depths} MB/s; "
        f"{report['machine']['cores']} cores, load {report['machine']['loadavg'][0]:.2f}\n\n" + "\n".join(rows) + "\n"
    )
    for r in runs.values():
        r.pop("token_ids", None)
        r.pop("texts_by_repeat", None)
    out.with_name(out.name + ".json").write_text(json.dumps(report, indent=1))
    out.with_name(out.name + ".md").write_text(text)
    print(text)
    try:
        bench_plot(report, out.with_name(out.name + ".png"), source=out.with_name(out.name + ".json"))
    except MoetierError as e:
        print(f"no plot: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
