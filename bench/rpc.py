"""What a split over llama.cpp's RPC backend costs: decode tok/s with 0/25/50% of the layers on a
ggml-rpc-server, stock (every expert loaded) and with moetier's expert cache serving the local
layers, in ONE run, interleaved.

Both ends run on this machine (loopback): they share its cores and there is no network delay. So
the run also counts, per decode token, the bytes and packets through the loopback interface (the
RPC traffic, on a quiet machine). On a real link add, per token, round trips x RTT + bytes /
bandwidth (a request and its answer are at least two packets).

    python bench/rpc.py --model M.gguf --store M.experts --fractions 0,25,50 --budget-pct 25 \
        --repeats 3 --out bench/results/rpc-NAME-DATE
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import moetier
from moetier import CacheConfig, Model
from moetier.server import tool_path

PROMPTS = [
    "Explain how a hash map handles collisions, with an example in Python.\n",
    "The river flowed past the old mill, and the miller's daughter",
    "def merge_sorted(a, b):\n",
]


def loopback() -> dict[str, int]:
    """Bytes and packets through the loopback interface (/proc/net/dev): on a quiet machine, the RPC
    traffic (a TCP stream's send and recv calls are not in the processes' /proc/PID/io)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            f = [int(x) for x in rest.split()]
            return {"bytes": f[0], "packets": f[1]}
    return {"bytes": 0, "packets": 0}


def worker(a: argparse.Namespace) -> None:
    """One configuration in this process: load, warm up, decode each prompt; prints JSON."""
    kw: dict[str, Any] = {"n_threads": a.threads, "n_ctx": 1024}
    if a.ngl > 0:
        kw |= {"n_gpu_layers": a.ngl, "rpc": a.endpoint}
    cache = CacheConfig.exact(budget=a.budget) if a.budget else None
    m = Model(a.model, store=a.store if cache else None, cache=cache, **kw)
    m.generate(PROMPTS[0], max_tokens=4)  # warm-up: first-touch costs are not the steady state
    steps, secs, io = 0, 0.0, {"bytes": 0, "packets": 0}
    for text in PROMPTS:
        first: dict[str, Any] = {}

        def at_first(first: dict[str, Any] = first) -> None:
            first["t"] = time.perf_counter()
            first["io"] = loopback() if a.ngl > 0 else None

        r = m.generate(text, max_tokens=a.n, on_first_token=at_first)
        t1 = time.perf_counter()
        n = len(r.tokens) - 1
        if n <= 0 or "t" not in first:
            continue
        steps += n
        secs += t1 - first["t"]
        if first["io"] is not None:
            end = loopback()
            for k in io:
                io[k] += end[k] - first["io"][k]
    print(json.dumps({"decode_tok_s": steps / secs if secs else 0.0, "steps": steps, "io": io}))


def run_config(a: argparse.Namespace, ngl: int, budget: int, endpoint: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--model", str(a.model), "--threads", str(a.threads)]
    cmd += ["-n", str(a.n), "--ngl", str(ngl), "--endpoint", endpoint]
    cmd += ["--budget", str(budget)] + (["--store", str(a.store)] if a.store else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def start_server(threads: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(tool_path("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    msg = "ggml-rpc-server did not start"
    raise SystemExit(msg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="MoE GGUF")
    p.add_argument("--store", type=Path, default=None, help="its expert store (default: read the GGUF)")
    p.add_argument("--fractions", default="0,25,50", help="percent of the layers on the RPC server")
    p.add_argument("--budget-pct", type=float, default=25, help="cache budget, percent of the local experts' bytes")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved")
    p.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--threads", type=int, default=2, help="threads of the local process")
    p.add_argument("--server-threads", type=int, default=2, help="threads of the RPC server")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a run is abandoned")
    p.add_argument("--out", type=Path, help="OUT.json and OUT.md")
    # worker mode (one configuration, in its own process)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ngl", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    if a.out is None:
        p.error("--out is required")

    probe = Model(a.model, store=a.store, cache=CacheConfig.exact(budget="auto"))
    info = probe.cache_info()
    n_layer = len(probe.stats().layers)
    expert_bytes, min_bytes = int(info["expert_bytes"]), int(info["min_cache_bytes"])
    del probe
    fractions = [int(f) for f in a.fractions.split(",")]
    configs: list[tuple[str, int, int]] = []
    for f in fractions:
        # -ngl counts the output layer as the last one: k layers on the server take -ngl k + 1
        k = round(n_layer * f / 100)
        ngl = k + 1 if k > 0 else 0
        local = expert_bytes * (n_layer - k) // n_layer
        budget = max(int(local * a.budget_pct / 100), min_bytes)
        configs += [(f"stock-{f}", ngl, 0), (f"moetier-{f}", ngl, budget)]

    server, endpoint = start_server(a.server_threads)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
    try:
        for rep in range(a.repeats):
            for name, ngl, budget in configs:
                r = run_config(a, ngl, budget, endpoint)
                results[name].append(r)
                print(f"  {name} #{rep + 1}: {r.get('decode_tok_s', r.get('error'))}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)

    rows = []
    summary: dict[str, Any] = {}
    for name, ngl, budget in configs:
        ok = [r for r in results[name] if "decode_tok_s" in r]
        if not ok:
            summary[name] = {"error": results[name][0].get("error")}
            continue
        tok_s = [r["decode_tok_s"] for r in ok]
        steps = sum(r["steps"] for r in ok)
        per_tok = {k: sum(r["io"][k] for r in ok) / steps for k in ("bytes", "packets")}
        summary[name] = {
            "ngl": ngl,
            "budget": budget,
            "decode_tok_s": {"median": statistics.median(tok_s), "values": tok_s},
            "per_token": per_tok,
        }
    base_s = summary.get(f"stock-{fractions[0]}", {}).get("decode_tok_s", {}).get("median")
    base_m = summary.get(f"moetier-{fractions[0]}", {}).get("decode_tok_s", {}).get("median")
    for f in fractions:
        s, m = summary.get(f"stock-{f}", {}), summary.get(f"moetier-{f}", {})
        if "decode_tok_s" not in s or "decode_tok_s" not in m:
            rows.append(f"| {f}% | {s.get('error', '')} | | {m.get('error', '')} | | | | |")
            continue
        ts, tm = s["decode_tok_s"]["median"], m["decode_tok_s"]["median"]
        k = m["ngl"] - 1 if m["ngl"] > 0 else 0
        where = f"{k} of {n_layer} and the output (-ngl {m['ngl']})" if k else "none"
        pt = m["per_token"]
        rows.append(
            f"| {where} | {ts:.2f} | {ts / base_s:.2f}x | {tm:.2f} ({m['budget'] / 2**20:.1f} MiB) | "
            f"{tm / base_m:.2f}x | {tm / ts:.2f}x | {pt['bytes'] / 1024:.1f} | {pt['packets']:.0f} |"
        )
    load = os.getloadavg()
    report: dict[str, Any] = {
        "config": {k: str(v) for k, v in vars(a).items() if k not in ("worker", "ngl", "budget", "endpoint")},
        "moetier": moetier.__file__,
        "machine": {"cores": os.cpu_count(), "loadavg": load, "platform": platform.platform()},
        "n_layer": n_layer,
        "runs": summary,
        "raw": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{a.out}.json").write_text(json.dumps(report, indent=1))
    cmd = " ".join(["python", "bench/rpc.py", *sys.argv[1:]])
    md = (
        f"Decode tok/s with part of the layers on a ggml-rpc-server on this machine (loopback), medians of "
        f"{a.repeats} interleaved repeats; stock loads every expert, moetier caches {a.budget_pct:g}% of the "
        f"local layers' experts (the server's layers compute theirs there, as stock). The RPC traffic per "
        f"decode token of moetier's runs, both ways, from the loopback interface's counters: KiB and packets "
        f"(a request and its answer are at least two). Model `{a.model.name}`; {os.cpu_count()} cores shared by both "
        f"ends, load {load[0]:.2f}; moetier from {moetier.__file__}.\n\n"
        f"Made by `{cmd}`.\n\n"
        "| layers on the server | stock tok/s | vs stock, no split | moetier tok/s (cache) | vs moetier, no split | "
        "moetier / stock | KiB / token | packets / token |\n|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    Path(f"{a.out}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
