"""Several fine-tuned variants of one MoE on one machine: quality under consolidation, and QoS of
serving them from one expert cache against time and space sharing (the multi-MoE paper's evaluation).

Variants (made once, cached under $MOETIER_CACHE/variants/):
  1. the dense Qwen2.5-Coder-0.5B fine-tuned on each domain's calibration split (bench/finetune.py:
     torch on the CPU, the FFN weights of every layer trained);
  2. the base converted by moefy with the demo's recipe, its neuron partition saved; every variant
     converted with that partition (the same neurons in expert (layer, e) of every variant; routers and
     down projections fitted on the variant), then packed.

Quality (own domain's held-out split, llama-perplexity, 512-token windows): the base and the variant
dense, the variant's MoE alone, consolidated at C = 25/50/100% (the map's GGUF of that variant, what
serving with the map computes) and the weight average of the variants' MoEs (the paper's baseline).

QoS (2, then 4 variants): one Poisson stream per variant, short prompts from its domain, 25-token
answers, the summed rate at 70% of one variant's measured capacity, the expert cache budget equal to one
variant's expert bytes, every server under one cgroup v1 cap, prefetch and warm start off everywhere:
  single     one variant (llama-server with the cache) at the summed rate: the paper's bound;
  shared     serve-variants: the variants' experts in one cache (exact);
  shared-c50 serve-variants with the 50% consolidation map (lossy);
  time       llama-server's router, --models-max 1: each variant's server (with the cache) started
             and stopped as requests switch;
  space      one llama-server per variant, each with 1/V of the cache and of the threads.
TTFT = turnaround - the server's decode time after the first token; turnaround is the client's.

    python bench/multimoe.py --out bench/results/multimoe-qwen0.5b-DATE
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cgroup
import moetier
from coserve import drop_page_cache, free_port, post, wait_up
from moefy_eval import perplexity
from moetier import CacheConfig, Model, pack
from moetier.server import cache_flags, tool_path
from moetier.tools import models
from moetier.tools.consolidate import consolidate, write_average, write_consolidated
from moetier.tools.moefy import MoefyConfig, builtin_calibration_text, generated_prose, moefy

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MOETIER_CACHE", Path.home() / ".cache" / "moetier"))
WORK = CACHE / "variants"
CORPORA = CACHE / "corpora"
# the demo's recipe (cli.cmd_demo): 16 experts, top-8, 16384 calibration tokens, ridge 0.1
MOEFY = MoefyConfig(calib_tokens=16384, router_ridge=0.1, refit_ridge=0.1)
CAPACITIES = (0.25, 0.5, 1.0)
ANSWER_TOKENS = 25
THREADS = 2


def log(s: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {s}\n")
    sys.stderr.flush()


def dense_variant(d: str) -> Path:
    return WORK / f"qwen2.5-coder-0.5b-ft-{d}.gguf"


def moe_variant(d: str) -> Path:
    return WORK / f"qwen2.5-coder-0.5b-ft-{d}-moe.gguf"


def convert_base(domains: list[str]) -> tuple[str, dict[str, float]]:
    """The calibration text every conversion uses, and the base converted with its partition saved."""
    base = models.fetch("qwen2.5-coder-0.5b", quiet=True, log=log)
    WORK.mkdir(parents=True, exist_ok=True)
    calib = WORK / "calib.txt"
    if not calib.exists():
        log("calibration text: the base's own prose, the built-in text and a slice of each domain")
        prose = generated_prose(base, 4096)
        slices = [(CORPORA / f"{d}.calib.txt").read_text(errors="replace")[:60_000] for d in domains]
        calib.write_text(builtin_calibration_text(400_000, extra="\n\n".join(prose + slices)))
    text = calib.read_text()
    part = WORK / "partition.npz"
    times_path = WORK / "conversion-times.json"
    times: dict[str, float] = json.loads(times_path.read_text()) if times_path.exists() else {}
    base_moe = WORK / "qwen2.5-coder-0.5b-base-moe.gguf"
    if not part.exists() or not base_moe.exists():
        log("moefy: the base, its partition saved")
        t0 = time.monotonic()
        moefy(base, base_moe, text, MOEFY, save_partition=part, progress=False)
        times["base"] = time.monotonic() - t0
        times_path.write_text(json.dumps(times, indent=1))
    return text, times


def make(domains: list[str], steps: int) -> dict[str, Any]:
    """Fine-tunes, converts and packs what is missing; returns the times and the fine-tunes' records."""
    base = models.fetch("qwen2.5-coder-0.5b", quiet=True, log=log)
    WORK.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {"base": str(base), "finetune": {}, "moefy_seconds": {}, "pack_seconds": {}}
    for d in domains:
        out = dense_variant(d)
        if not out.exists():
            log(f"fine-tuning on {d} ({steps} steps)")
            cmd = [sys.executable, str(ROOT / "bench" / "finetune.py"), "--base", str(base)]
            cmd += ["--train", str(CORPORA / f"{d}.calib.txt"), "--eval", str(CORPORA / f"{d}.eval.txt")]
            cmd += ["-o", str(out), "--steps", str(steps)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rec["finetune"][d] = json.loads(out.with_suffix(".json").read_text())
    text, times = convert_base(domains)
    part = WORK / "partition.npz"
    times_path = WORK / "conversion-times.json"
    for d in domains:
        moe = moe_variant(d)
        if not moe.exists():
            log(f"moefy: {d} with the base's partition")
            t0 = time.monotonic()
            moefy(dense_variant(d), moe, text, MOEFY, partition=part, progress=False)
            times[d] = time.monotonic() - t0
        store = moe.with_suffix(".store")
        if not (store / "manifest.json").exists():
            t0 = time.monotonic()
            pack(moe, store, progress=False)
            rec["pack_seconds"][d] = time.monotonic() - t0
        times_path.write_text(json.dumps(times, indent=1))
    rec["moefy_seconds"] = times
    return rec


def quality(domains: list[str], chunks: int) -> dict[str, Any]:
    """Each variant's perplexity on its own held-out domain text, alone and consolidated."""
    moes = [moe_variant(d) for d in domains]
    out: dict[str, Any] = {"maps": {}, "ppl": {}}
    avg = WORK / f"avg-{len(domains)}-moe.gguf"
    if not avg.exists():
        log("weight average of the variants' MoEs")
        write_average(moes, avg)
    maps = {}
    for c in CAPACITIES:
        mp = WORK / f"map-{len(domains)}-c{int(c * 100)}.json"
        if not mp.exists():
            mp.write_text(json.dumps(consolidate(moes, c)))
        maps[c] = json.loads(mp.read_text())
        out["maps"][c] = {
            "path": str(mp),
            "same_position_mean": maps[c]["same_position_mean"],
            "cross_position_mean": maps[c]["cross_position_mean"],
        }
    base = models.fetch("qwen2.5-coder-0.5b", quiet=True, log=log)
    base_moe = WORK / "qwen2.5-coder-0.5b-base-moe.gguf"
    for i, d in enumerate(domains):
        text = CORPORA / f"{d}.eval.txt"
        row: dict[str, float] = {}

        def ppl(name: str, model: Path, row: dict[str, float] = row, text: Path = text, d: str = d) -> None:
            row[name] = perplexity(model, text, 512, chunks, THREADS, [])
            log(f"  {d} {name}: {row[name]:.3f}")

        ppl("base dense", base)
        ppl("base MoE", base_moe)
        ppl("variant dense", dense_variant(d))
        ppl("variant MoE", moes[i])
        for c in CAPACITIES:
            g = WORK / f"cons-{len(domains)}-c{int(c * 100)}-{d}.gguf"
            if not g.exists():
                write_consolidated(maps[c], i, g)
            ppl(f"consolidated {int(c * 100)}%", g)
            g.unlink()
        ppl("weight average", avg)
        out["ppl"][d] = row
    return out


def prompts_of(d: str, n: int, seed: int) -> list[str]:
    """n short prompts (about 20 tokens: 80 characters at a line start) from the domain's held-out text."""
    text = (CORPORA / f"{d}.eval.txt").read_text(errors="replace")
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        at = text.find("\n", rng.randrange(len(text) - 2000)) + 1
        p = " ".join(text[at : at + 200].split())[:80]
        if len(p) >= 60:
            out.append(p)
    return out


def workload(domains: list[str], rate: float, n: int, seed: int) -> list[tuple[float, int, str]]:
    """n requests: one Poisson stream per variant at rate / V (arrival time, variant, prompt)."""
    rng = random.Random(seed)
    per = rate / len(domains)
    reqs: list[tuple[float, int, str]] = []
    for v, d in enumerate(domains):
        t = 0.0
        ps = prompts_of(d, n, seed + v)
        for p in ps:
            t += rng.expovariate(per)
            reqs.append((t, v, p))
    reqs.sort()
    return reqs[:n]


def server_cmd(model: Path, store: Path, budget: int, port: int, threads: int) -> list[str]:
    cache = CacheConfig.exact(budget=budget, prefetch=0, warm=False)
    cmd = [str(tool_path("llama-server")), "-m", str(model), *cache_flags(cache, str(store))]
    return [*cmd, "-c", "512", "-t", str(threads), "-np", "1", "--host", "127.0.0.1", "--port", str(port)]


def drive(ports: list[int], names: list[str], reqs: list[tuple[float, int, str]]) -> list[dict[str, Any]]:
    """Sends each request at its arrival time to its variant's port (names: the `model` to ask for)."""
    out: list[dict[str, Any]] = [{} for _ in reqs]
    t0 = time.perf_counter()

    def one(i: int) -> None:
        at, v, prompt = reqs[i]
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        start = time.perf_counter()
        try:
            body = {"model": names[v], "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0}
            r = post(ports[v], {**body, "cache_prompt": False})
            lat = time.perf_counter() - start
            if "timings" in r:
                decode = float(r["timings"]["predicted_ms"]) / 1000
            else:
                decode = float(r["moetier"]["decode_seconds"])
            n = int(r["usage"]["completion_tokens"])
            out[i] = {
                "ok": True,
                "variant": v,
                "latency": lat,
                "ttft": lat - decode,
                "tokens": n,
                "text": r["choices"][0]["text"],
                "end": time.perf_counter() - t0,
                "arrival": at,
            }
        except Exception as e:  # a lost request is recorded and fails the run's check
            out[i] = {"ok": False, "variant": v, "error": repr(e), "arrival": at}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run_system(
    system: str, domains: list[str], reqs: list[tuple[float, int, str]], budget: int, cap: int, out_dir: Path
) -> dict[str, Any]:
    V = len(domains)
    moes = [moe_variant(d) for d in domains]
    stores = [m.with_suffix(".store") for m in moes]
    for m in moes:
        drop_page_cache(m)
    group = cgroup.MemoryCap(f"moetier-multimoe-{system}-{V}", cap)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    ports: list[int] = []
    names = [f"v{i}" for i in range(V)]
    tag = f"{system}-{V}"

    def start(cmd: list[str], port: int, health: str = "/health") -> None:
        lf = open(out_dir / f"{tag}-{len(procs)}.log", "wb")
        logs.append(lf)
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, preexec_fn=group.preexec)
        procs.append(p)
        wait_up(port, p, health, timeout=300)

    try:
        if system == "single":
            port = free_port()
            start(server_cmd(moes[0], stores[0], budget, port, THREADS), port)
            ports = [port] * V
            names = ["v0"] * V
            reqs = [(at, 0, p) for at, _, p in reqs]
        elif system.startswith("shared"):
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "moetier.cli",
                "serve-variants",
                *map(str, moes),
                "--stores",
                *map(str, stores),
            ]
            cmd += ["--names", ",".join(names), "--cache", str(budget), "-c", "512", "-t", str(THREADS)]
            cmd += ["--port", str(port)]
            if system == "shared-c50":
                cmd += ["--consolidate", str(WORK / f"map-{V}-c50.json")]
            start(cmd, port)
            ports = [port] * V
        elif system == "space":
            for i in range(V):
                port = free_port()
                start(server_cmd(moes[i], stores[i], budget // V, port, max(1, THREADS // V)), port)
                ports.append(port)
        elif system == "time":
            port = free_port()
            cache = CacheConfig.exact(budget=budget, prefetch=0, warm=False)
            ini = out_dir / f"{tag}-preset.ini"
            lines = ["version = 1", "", "[*]", "c = 512", f"threads = {THREADS}", "parallel = 1", ""]
            for n, m, s in zip(names, moes, stores, strict=True):
                lines += [f"[{n}]", f"model = {m}", f"expert-store = {s}", f"expert-cache = {budget}"]
                lines += [f"expert-policy = {cache.policy}", f"expert-opt = {cache.opts()}", ""]
            ini.write_text("\n".join(lines))
            cmd = [str(tool_path("llama-server")), "--models-preset", str(ini), "--models-max", "1"]
            start([*cmd, "--host", "127.0.0.1", "--port", str(port)], port, "/models")
            ports = [port] * V
        else:
            msg = f"unknown system {system}"
            raise ValueError(msg)
        t = time.perf_counter()
        recs = drive(ports, names, reqs)
        wall = time.perf_counter() - t
        peak = int((group.path / "memory.max_usage_in_bytes").read_text())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for lf in logs:
            lf.close()
        group.close()
    ok = [r for r in recs if r.get("ok")]
    first = min(r[0] for r in reqs)
    last = max(r["end"] for r in ok) if ok else float("nan")
    res = {
        "system": system,
        "variants": V,
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "turnaround": sum(r["latency"] for r in ok) / len(ok) if ok else float("nan"),
        "ttft": sum(r["ttft"] for r in ok) / len(ok) if ok else float("nan"),
        "per_minute": 60 * len(ok) / (last - first) if ok else 0.0,
        "wall": wall,
        "peak_bytes": peak,
        "records": recs,
    }
    log(
        f"  {tag}: {len(ok)} done, {res['failed']} failed, turnaround {res['turnaround']:.2f} s, "
        f"TTFT {res['ttft']:.2f} s, {res['per_minute']:.1f}/min, peak {peak / 2**20:.0f} MiB"
    )
    return res


def capacity(domain: str, budget: int, cap: int, out_dir: Path, n: int = 6) -> float:
    """Requests per second one variant's server completes when n arrive at once (it answers them in turn)."""
    reqs = [(i * 1e-3, 0, p) for i, p in enumerate(prompts_of(domain, n, 99))]
    return float(run_system("single", [domain], reqs, budget, cap, out_dir)["per_minute"]) / 60


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--domains", default="fortunes,linux-doc,py-stdlib,py-library", help="the variants' domains")
    p.add_argument("--steps", type=int, default=100, help="fine-tune steps per variant (default: 100)")
    p.add_argument("--chunks", type=int, default=8, help="perplexity windows per text (default: 8)")
    p.add_argument("--requests", type=int, default=24, help="requests per QoS run (default: 24)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: quality, qos")
    p.add_argument("--out", required=True, help="result path without extension (.json, .md)")
    args = p.parse_args()
    domains = args.domains.split(",")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_dir = WORK / "runs" / out.name
    run_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"command": " ".join(sys.argv), "package": moetier.__file__, "domains": domains}
    res["make"] = make(domains, args.steps)
    skip = set(args.skip.split(",")) if args.skip else set()
    if "quality" not in skip:
        res["quality"] = quality(domains, args.chunks)
        Path(str(out) + ".json").write_text(json.dumps(res, indent=1))
    if "qos" not in skip:
        info = Model(
            moe_variant(domains[0]),
            store=moe_variant(domains[0]).with_suffix(".store"),
            cache=CacheConfig.exact(budget="64G", prefetch=0, warm=False),
        ).cache_info()
        budget = int(info["expert_bytes"])
        size = moe_variant(domains[0]).stat().st_size
        res["qos"] = {"budget": budget, "runs": []}
        for V in (2, 4):
            if V > len(domains):
                continue
            vs = domains[:V]
            # room for every variant's non-expert weights, one budget of experts, and the processes
            cap = budget + V * (size - budget) + (768 << 20)
            cap1 = capacity(vs[0], budget, cap, run_dir)
            rate = 0.7 * cap1
            reqs = workload(vs, rate, args.requests, seed=V)
            log(f"{V} variants: one variant serves {cap1:.2f} req/s; summed rate {rate:.2f} req/s, cap {cap >> 20} MiB")
            by: dict[str, dict[str, Any]] = {}
            for system in ("single", "shared", "shared-c50", "time", "space"):
                r = run_system(system, vs, reqs, budget, cap, run_dir)
                r.update(capacity=cap1, rate=rate, cap=cap)
                by[system] = r
                res["qos"]["runs"].append(r)
                Path(str(out) + ".json").write_text(json.dumps(res, indent=1))
            # the exact systems answer each request alike (each variant's own experts, greedy)
            space = by["space"]["records"]
            for system in ("shared", "time"):
                diff = sum(
                    1
                    for a, b in zip(by[system]["records"], space, strict=True)
                    if a.get("ok") and b.get("ok") and a["text"] != b["text"]
                )
                by[system]["differ_from_space"] = diff
    res["load"] = os.getloadavg()
    Path(str(out) + ".json").write_text(json.dumps(res, indent=1))
    Path(str(out) + ".md").write_text(report(res))
    log(f"wrote {out}.md")


def report(res: dict[str, Any]) -> str:
    lines = [
        f"# Variants of one MoE: Qwen2.5-Coder-0.5B fine-tuned on {len(res['domains'])} domains, "
        f"{time.strftime('%Y-%m-%d')}",
        "",
        f"Made by `{res['command']}` (installed package: `{res['package']}`; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in res.get('load', ()))}).",
        "",
        "## Variants",
        "",
        "| domain | fine-tune tokens | fine-tune s | moefy s | perplexity before (torch) | after |",
        "|---|---|---|---|---|---|",
    ]
    mk = res["make"]
    for d in res["domains"]:
        f = mk["finetune"][d]
        lines.append(
            f"| {d} | {f['train_tokens']} | {f['train_s']:.0f} | {mk['moefy_seconds'].get(d, float('nan')):.0f} | "
            f"{f['ppl_before']:.2f} | {f['ppl_after']:.2f} |"
        )
    if "quality" in res:
        q = res["quality"]
        cols = list(next(iter(q["ppl"].values())))
        lines += ["", "## Quality: perplexity on each variant's own held-out domain text", ""]
        lines += ["| domain | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for d, row in q["ppl"].items():
            lines.append(f"| {d} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
        m = q["maps"][str(0.5)] if str(0.5) in q["maps"] else q["maps"][0.5]
        lines += ["", "Expert distance between variants 0 and 1, mean per layer: same position / other positions:", ""]
        lines.append(
            ", ".join(
                f"{s:.2f}/{c:.2f}" for s, c in zip(m["same_position_mean"], m["cross_position_mean"], strict=True)
            )
        )
    if "qos" in res:
        lines += [
            "",
            "## QoS",
            "",
            "| variants | system | done | failed | answers unlike space sharing's | turnaround s | TTFT s | "
            "per minute | peak MiB |",
        ]
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in res["qos"]["runs"]:
            lines.append(
                f"| {r['variants']} | {r['system']} | {r['completed']} | {r['failed']} | "
                f"{r.get('differ_from_space', '-')} | {r['turnaround']:.2f} | {r['ttft']:.2f} | "
                f"{r['per_minute']:.1f} | {r['peak_bytes'] / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
