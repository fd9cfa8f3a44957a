"""The VRAM tier on a GPU against stock llama.cpp's static placements of the same VRAM, and the
exactness oracle, in one run (a GPU machine is at hand briefly: everything it needs is here).

Model: a random-weight qwen3moe at a real MoE's shapes (n_embd 2048, 12 layers, 64 experts, top-8,
n_ff_exp 768, q8_0 experts, 3.84 GiB), written with moetier.tools.tiny. Its routing is uniform, so
a cache of a share of the experts hits about that share: what a cache gains there comes from its
mechanics, not from skew.

Speed (moetier-gpu-bench of the same build, bench/gpu-bench.cpp: -fa off, a 512-token prompt then 64
decode tokens, the medians of rounds 2-3; the first warms the caches): stock with every expert in VRAM
(-ngl 99), stock with the first N layers' experts on the CPU (-ncmoe N: 75/50/25/8/0% of expert bytes
in VRAM), and moetier with every layer on the GPU, the RAM tier holding every expert (auto budget) and
the VRAM tier at the same shares (1, 3, 6, 9, 12 layers' worth of experts); at 25% also with the RAM
tier at half the experts (SSD reads) and without prefetch; and the RAM tier alone (experts computed on
the CPU).

Oracle (llama-perplexity, 2 chunks of 512 tokens, ubatch 512/8/1): moetier with every expert in the
VRAM tier and with 25% must print stock -ngl 99's chunk perplexities exactly.

usage: python3 bench/gpu.py --bin BUILD/bin --tool BUILD/moetier-gpu-bench --work DIR --out DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPE: dict[str, Any] = {
    "n_expert": 64,
    "n_expert_used": 8,
    "n_layer": 12,
    "n_embd": 2048,
    "n_ff_exp": 768,
    "n_head": 16,
    "n_head_kv": 4,
    "n_vocab": 2048,
    "expert_type": "q8_0",
    "seed": 7,
}
# DeepSeek-V2-Lite's routing geometry (26 MoE layers, top-6 of 64) at half its expert width, so that
# it is written in the time the build takes; routed by its trace (MOETIER_ROUTING_TRACE)
TRACE_SHAPE: dict[str, Any] = {**SHAPE, "n_layer": 26, "n_expert_used": 6, "n_embd": 1024, "n_ff_exp": 704}


def expert_bytes(shape: dict[str, Any]) -> int:
    """q8_0: 34 bytes per 32 weights; gate, up and down of n_embd x n_ff_exp."""
    return 3 * int(shape["n_embd"]) * int(shape["n_ff_exp"]) * 34 // 32


EXPERT_BYTES = expert_bytes(SHAPE)
ALL_EXPERTS = EXPERT_BYTES * SHAPE["n_expert"] * SHAPE["n_layer"]


def _tiny() -> Any:
    """moetier.tools.tiny without the package (whose import needs the built module)."""
    path = Path(__file__).resolve().parents[1] / "python" / "moetier" / "tools" / "tiny.py"
    spec = importlib.util.spec_from_file_location("moetier_tiny", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_model(path: Path, shape: dict[str, Any]) -> Path:
    if not path.exists():
        t0 = time.time()
        _tiny().write_tiny_model(str(path), "qwen3moe", **shape)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.time() - t0:.0f} s", flush=True)
    return path


def write_inputs(work: Path, which: str = "uniform") -> tuple[Path, Path]:
    """The model ("uniform": SHAPE, "trace": TRACE_SHAPE) and the oracle's text."""
    work.mkdir(parents=True, exist_ok=True)
    if which == "trace":
        model = write_model(work / "qwen3moe-dsv2lite-geometry-q8.gguf", TRACE_SHAPE)
    else:
        model = write_model(work / "qwen3moe-64x-q8.gguf", SHAPE)
    text = work / "text.txt"
    if not text.exists():
        words = (
            "the cache of experts lives in memory that a graphics card reads at full speed while the rest waits".split()
        )
        lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(24)) + f" {i}." for i in range(600)]
        text.write_text("\n".join(lines))
    return model, text


DEADLINE = 0.0


def write_routing_file(npz: Path, out: Path, max_tokens: int = 0) -> tuple[int, int, int, int]:
    """A trace.npz of ../shared/traces (ids uint8 [T, L, K], n_experts) as the engine's routing file
    (csrc/moetier-routing.h: "MTRT", version, n_tokens, n_layers, n_used, n_expert, uint16 ids); the
    first max_tokens tokens (0: all). Returns its geometry (tokens, layers, top-k, experts)."""
    import numpy as np

    d = np.load(npz)
    ids = d["ids"][: max_tokens or None].astype("<u2")
    n_tokens, n_layers, k = (int(x) for x in ids.shape)
    n_expert = int(d["n_experts"])
    head = np.array([1, n_tokens, n_layers, k, n_expert], dtype="<u4")
    with open(out, "wb") as f:
        f.write(b"MTRT")
        f.write(head.tobytes())
        f.write(np.ascontiguousarray(ids).tobytes())
    return n_tokens, n_layers, k, n_expert


def run(cmd: list[str], log: Path, timeout: float = 120, env: dict[str, str] | None = None) -> tuple[int, str]:
    t0 = time.time()
    if DEADLINE and t0 > DEADLINE:
        print(f"  [skipped: past the deadline] {log.name}", flush=True)
        return 125, ""
    try:
        full = {**os.environ, **env} if env else None
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full)
        out, rc = p.stdout + "\n" + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        parts = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        out, rc = "\n".join([*parts, "TIMEOUT"]), 124
    log.write_text(" ".join(cmd) + "\n\n" + out)
    print(f"  [{time.time() - t0:5.1f} s rc {rc}] {log.name}", flush=True)
    return rc, out


ROUND = re.compile(r"round (\d+): pp \d+ tok ([\d.]+) tok/s, tg \d+ tok ([\d.]+) tok/s")
STATS = re.compile(
    r"moetier: (\d+) lookups, RAM tier (\d+) hits (\d+) misses (\d+) bytes read; VRAM tier (\d+) slots, (\d+) hits, "
    r"(\d+) copies, (\d+) bytes copied in ([\d.]+) ms, (\d+) on the CPU"
)


def bench(
    tool: Path, model: Path, name: str, extra: list[str], logs: Path, threads: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Rounds of moetier-gpu-bench; the medians of the rounds after the first (which warms the caches)."""
    cmd = [str(tool), "-m", str(model), "-c", "1024", "-b", "512", "-ub", "512", "-npp", "512", "-ntg", "64",
           "-ngl", "99", "-fa", "off", "-t", str(threads), *extra]  # fmt: skip
    rc, out = run(cmd, logs / f"bench-{name}.log", env=env)
    rounds = [(float(m.group(2)), float(m.group(3))) for m in ROUND.finditer(out) if m.group(1) != "0"]
    r: dict[str, Any] = {"name": name, "args": " ".join(extra), "rc": rc}
    if rounds:
        r["pp_tps"] = statistics.median(x[0] for x in rounds)
        r["tg_tps"] = statistics.median(x[1] for x in rounds)
    m = STATS.search(out)
    if m:
        v = [float(x) for x in m.groups()]
        r.update(lookups=v[0], ram_hit_pct=round(100 * v[1] / max(1, v[0]), 1), bytes_read=v[3], vram_slots=v[4])
        r.update(vram_hit_pct=round(100 * v[5] / max(1, v[0]), 1), vram_copies=v[6], vram_bytes=v[7], copy_ms=v[8])
        r.update(vram_cpu_pct=round(100 * v[9] / max(1, v[0]), 1))
    return r


def perplexity(
    bin_dir: Path, model: Path, text: Path, name: str, extra: list[str], logs: Path, threads: int
) -> dict[str, Any]:
    cmd = [
        str(bin_dir / "llama-perplexity"),
        "-m",
        str(model),
        "-f",
        str(text),
        "-c",
        "512",
        "-b",
        "512",
        "--chunks",
        "2",
        "-ngl",
        "99",
        "-fa",
        "off",
        "-t",
        str(threads),
        "--seed",
        "1",
        *extra,
    ]
    rc, out = run(cmd, logs / f"ppl-{name}.log")
    chunks = re.findall(r"\[(\d+)\]([\d.]+|nan|inf)", out)
    final = re.search(r"Final estimate: PPL = ([\d.]+|nan|inf)", out)
    return {"name": name, "rc": rc, "chunks": [c[1] for c in chunks], "final": final.group(1) if final else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, required=True, help="folder of llama-perplexity")
    ap.add_argument("--tool", type=Path, required=True, help="moetier-gpu-bench (bench/gpu-bench.cpp)")
    ap.add_argument("--work", type=Path, required=True, help="folder for the model and text (written if missing)")
    ap.add_argument("--out", type=Path, required=True, help="folder for results and logs")
    ap.add_argument("--threads", type=int, default=16, help="CPU threads (stock's CPU experts, our reads)")
    ap.add_argument("--skip-oracle", action="store_true", help="speed only")
    ap.add_argument(
        "--inputs-only", choices=("uniform", "trace"), default=None, help="write that model and the text, run nothing"
    )
    ap.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="routing file (write_routing_file of DeepSeek-V2-Lite's trace.npz): also runs the trace-geometry model "
        "with that routing",
    )
    ap.add_argument(
        "--quick", action="store_true", help="the short follow-up plan (cooperative compute, the all-in-VRAM gap)"
    )
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds after which no new run starts")
    args = ap.parse_args()
    if args.inputs_only:
        write_inputs(args.work, args.inputs_only)
        return 0
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model, text = write_inputs(args.work)
    global DEADLINE
    DEADLINE = args.deadline
    res: dict[str, Any] = {"expert_bytes": ALL_EXPERTS, "shape": SHAPE, "speed": [], "oracle": []}

    def save() -> None:
        (args.out / "gpu-results.json").write_text(json.dumps(res, indent=1))

    t = args.threads
    gib = 2**30
    speed = res["speed"]

    def layers_vram(shape: dict[str, Any], k: int) -> int:
        """k layers' worth of experts in the VRAM tier, and its zero slots (one per expert a token selects)."""
        return expert_bytes(shape) * (int(shape["n_expert"]) * k + int(shape["n_expert_used"]))

    def share(shape: dict[str, Any], k: int) -> int:
        return round(100 * k / int(shape["n_layer"]))

    def stock(m: Path, shape: dict[str, Any], k: int, tag: str = "", env: dict[str, str] | None = None) -> None:
        n = int(shape["n_layer"])
        extra = ["-ncmoe", str(n - k)] if k < n else []
        name = f"stock{tag}-" + (f"ncmoe{n - k}-vram{share(shape, k)}" if k < n else "all-vram")
        speed.append(bench(args.tool, m, name, extra, logs, t, env))
        save()

    def ours(m: Path, shape: dict[str, Any], k: int, name: str = "", opts: str = "", cache: str = "auto",
             env: dict[str, str] | None = None) -> None:  # fmt: skip
        extra = ["--expert-cache", cache, "--expert-opt", f"vram={layers_vram(shape, k)}{opts}"]
        speed.append(bench(args.tool, m, f"moetier{name}-vram{share(shape, k)}", extra, logs, t, env))
        save()

    def oracle(
        ubs: tuple[int, ...], configs: tuple[tuple[int, str], ...] = ((12, ""), (3, ""), (3, ",vram_cpu=1"))
    ) -> None:
        for ub in ubs:
            ref = perplexity(args.bin, model, text, f"stock-ub{ub}", ["-ub", str(ub)], logs, t)
            res["oracle"].append(ref)
            if any(opts for _, opts in configs) and ub <= 8:
                # the tolerance for cooperative compute: stock's own experts-on-the-CPU against -ngl 99
                tol = perplexity(args.bin, model, text, f"stock-cpu-moe-ub{ub}", ["-ub", str(ub), "--cpu-moe"], logs, t)
                if tol["final"] and ref["final"]:
                    tol["rel_diff"] = abs(float(tol["final"]) / float(ref["final"]) - 1)
                res["oracle"].append(tol)
            for k, opts in configs:
                if opts and ub > 8:
                    continue  # cooperative compute works on decode-sized ubatches only
                extra = [
                    "-ub",
                    str(ub),
                    "--expert-cache",
                    "auto",
                    "--expert-opt",
                    f"vram={layers_vram(SHAPE, k)}{opts}",
                ]
                name = f"moetier-vram{share(SHAPE, k)}{'-cpu' if opts else ''}-ub{ub}"
                r = perplexity(args.bin, model, text, name, extra, logs, t)
                r["exact"] = bool(r["chunks"]) and r["chunks"] == ref["chunks"]
                if r["final"] and ref["final"]:
                    r["rel_diff"] = abs(float(r["final"]) / float(ref["final"]) - 1)
                res["oracle"].append(r)
                save()

    print("speed", flush=True)
    tenv = {"MOETIER_ROUTING_TRACE": str(args.trace.resolve())} if args.trace is not None else {}
    if args.quick:
        # a short follow-up: the all-in-VRAM gap with and without CUDA graphs, cooperative compute
        # beside copies only and stock at 25% and 8% (uniform) and 23% and 50% (trace), its oracle
        nographs = {"GGML_CUDA_DISABLE_GRAPHS": "1"}
        stock(model, SHAPE, 12)
        ours(model, SHAPE, 12)
        stock(model, SHAPE, 3)
        ours(model, SHAPE, 3, "-cpu", ",vram_cpu=1")
        ours(model, SHAPE, 3, "-noprefetch", ",prefetch=0")
        if args.trace is not None:
            tmodel, _ = write_inputs(args.work, "trace")
            stock(tmodel, TRACE_SHAPE, 6, "-trace-geometry")
            ours(tmodel, TRACE_SHAPE, 6, "-trace-cpu", ",prefetch=0,vram_cpu=1", env=tenv)
            ours(tmodel, TRACE_SHAPE, 6, "-trace", ",prefetch=0", env=tenv)
        stock(model, SHAPE, 12, "-nographs", env=nographs)
        ours(model, SHAPE, 12, "-nographs", env=nographs)
        if not args.skip_oracle:
            oracle((1, 8), ((3, ",vram_cpu=1"),))
        stock(model, SHAPE, 1)
        ours(model, SHAPE, 1, "-cpu", ",vram_cpu=1")
        if args.trace is not None:
            stock(tmodel, TRACE_SHAPE, 13, "-trace-geometry")
            ours(tmodel, TRACE_SHAPE, 13, "-trace-cpu", ",prefetch=0,vram_cpu=1", env=tenv)
        ours(model, SHAPE, 6, "-cpu", ",vram_cpu=1")
        stock(model, SHAPE, 6)
    # the most telling runs first (a run past the deadline is skipped)
    if not args.quick:
        stock(model, SHAPE, 12)
        ours(model, SHAPE, 12)
        stock(model, SHAPE, 3)
        ours(model, SHAPE, 3, "-noprefetch", ",prefetch=0")
        ours(model, SHAPE, 3, "-cpu", ",vram_cpu=1")
        tmodel = None
        if args.trace is not None:
            # real routing: prefetch off (the stacked routers predict the model's own random routing)
            tmodel, _ = write_inputs(args.work, "trace")
            stock(tmodel, TRACE_SHAPE, 6, "-trace-geometry")
            ours(tmodel, TRACE_SHAPE, 6, "-trace", ",prefetch=0", env=tenv)
            ours(tmodel, TRACE_SHAPE, 6, "-trace-cpu", ",prefetch=0,vram_cpu=1", env=tenv)
        if not args.skip_oracle:
            print("oracle", flush=True)
            oracle((1, 512, 8))
        for k in (3, 6, 1, 9):
            ours(model, SHAPE, k)
        for k in (6, 1, 9):
            ours(model, SHAPE, k, "-cpu", ",vram_cpu=1")
        for k in (6, 9, 1, 0):
            stock(model, SHAPE, k)
        if tmodel is not None:
            stock(tmodel, TRACE_SHAPE, 26, "-trace-geometry")
            stock(tmodel, TRACE_SHAPE, 13, "-trace-geometry")
            ours(tmodel, TRACE_SHAPE, 13, "-trace", ",prefetch=0", env=tenv)
            ours(tmodel, TRACE_SHAPE, 13, "-trace-cpu", ",prefetch=0,vram_cpu=1", env=tenv)
        ours(model, SHAPE, 3, "-ram50", cache=str(ALL_EXPERTS // 2 + gib // 8))
        speed.append(bench(args.tool, model, "moetier-ram-only-cpu-experts", ["--expert-cache", "auto"], logs, t))
        save()
        if not args.skip_oracle:
            oracle((32,))

    lines = [
        "| run | VRAM share | pp512 tok/s | tg tok/s | tg vs stock same VRAM | VRAM hits | on the CPU | RAM hits |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def stock_for(r: dict[str, Any]) -> dict[str, Any]:
        """Stock's run with the same model, share of experts in VRAM and CUDA graphs setting."""
        trace = "trace" in r["name"]
        graphs = "nographs" in r["name"]
        m = re.search(r"vram(\d+)$", r["name"])
        for x in speed:
            if (
                x["name"].startswith("stock")
                and ("trace" in x["name"]) == trace
                and ("nographs" in x["name"]) == graphs
            ):
                if (m and x["name"].endswith(f"vram{m.group(1)}")) or (
                    "all-vram" in x["name"] and m and m.group(1) == "100"
                ):
                    return x
        return {}

    for r in speed:
        m = re.search(r"vram(\d+)$", r["name"])
        base = stock_for(r) if r["name"].startswith("moetier") else {}
        ratio = f"{r['tg_tps'] / base['tg_tps']:.2f}x" if "tg_tps" in r and "tg_tps" in base else ""
        pct = m.group(1) if m else 100 if "all-vram" in r["name"] else 0
        lines.append(
            f"| {r['name']} | {pct}% | {r.get('pp_tps', 'fail')} | {r.get('tg_tps', 'fail')} | "
            f"{ratio} | {r.get('vram_hit_pct', '')} | {r.get('vram_cpu_pct', '')} | {r.get('ram_hit_pct', '')} |"
        )
    for r in res["oracle"]:
        lines.append(
            f"oracle {r['name']}: rc {r['rc']} final {r['final']} exact {r.get('exact', 'ref')} "
            f"rel diff {r.get('rel_diff', 0):.2e} chunks {','.join(r['chunks'][:2])}"
        )
    summary = "\n".join(lines)
    (args.out / "gpu-summary.md").write_text(summary + "\n")
    save()
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
