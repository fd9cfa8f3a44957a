"""Probe, 2026-11-28. Question: what does one model switch cost in moetier serve-pool (models
loaded into its own process) against llama-server's router mode (one child process per model)?

Both servers get room for one model only and alternate requests between two distinct copies of
SmolLM2-135M-Instruct (made by bench/coserve.py), each file dropped from the page cache before its
request, so every request loads its model from disk. A request's time minus the same request's time
on a model already loaded is the switch. Prints and writes the medians of the repeats.

    python bench/probes/switch_cost.py --out bench/results/switch-cost-smollm2-2026-11-28 --repeats 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moetier
from coserve import WORK, free_port, post, wait_up
from moetier.pool.executor import drop_page_cache

PROMPT = "Component 7: a bridged pin pair near the connector. Is it defective? Answer yes or no."


def timed(port: int, model: str) -> float:
    t = time.perf_counter()
    post(port, {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "cache_prompt": False})
    return time.perf_counter() - t


def measure(cmd: list[str], port: int, health: str, models: dict[str, Path], repeats: int) -> dict[str, float]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(port, proc, health)
        names = list(models)
        timed(port, names[0])  # whatever starts once per server
        switch, resident = [], []
        for i in range(repeats):
            m = names[(i + 1) % 2]
            drop_page_cache(models[m])
            switch.append(timed(port, m))  # the other model is resident: unload it, load this one
            resident.append(timed(port, m))  # loaded now
        return {
            "switch_request_s": statistics.median(switch),
            "resident_request_s": statistics.median(resident),
            "switch_s": statistics.median(s - r for s, r in zip(switch, resident, strict=True)),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    models = {"a": WORK / "cls-00.gguf", "b": WORK / "cls-01.gguf"}
    run_dir = WORK / "runs" / "switch-cost"
    run_dir.mkdir(parents=True, exist_ok=True)
    size = models["a"].stat().st_size
    cfg = run_dir / "pool.json"
    cfg.write_text(
        json.dumps(
            {
                "budget": int(size * 1.8),
                "executors": 1,
                "threads": 2,
                "scheduler": "fcfs-lru",
                "models": {k: {"path": str(v), "n_ctx": 256} for k, v in models.items()},
            }
        )
    )
    ini = run_dir / "router.ini"
    ini.write_text(
        "version = 1\n\n[*]\nc = 256\nthreads = 2\nparallel = 1\n\n"
        + "".join(f"[{k}]\nmodel = {v}\n\n" for k, v in models.items())
    )
    res = {}
    port = free_port()
    res["serve-pool"] = measure(
        [sys.executable, "-m", "moetier.cli", "serve-pool", str(cfg), "--port", str(port), "--no-profile"],
        port,
        "/health",
        models,
        args.repeats,
    )
    port = free_port()
    server = str(Path(moetier.__file__).parent / "bin" / "llama-server")
    res["llama-server router"] = measure(
        [server, "--models-preset", str(ini), "--models-max", "1", "--host", "127.0.0.1", "--port", str(port)],
        port,
        "/models",
        models,
        args.repeats,
    )
    lines = [
        f"# One model switch: moetier serve-pool against llama-server's router mode, {time.strftime('%Y-%m-%d')}",
        "",
        f"Made by `python {' '.join(sys.argv)}`: two distinct SmolLM2-135M-Instruct Q4_1 copies "
        f"({size / 2**20:.0f} MiB each), room for one, requests alternating between them, each file cold; medians of "
        f"{args.repeats}. A request of 4 tokens.",
        "",
        "| server | request with a switch, s | request on the resident model, s | the switch, s |",
        "|---|---|---|---|",
    ]
    for k, v in res.items():
        lines.append(f"| {k} | {v['switch_request_s']:.3f} | {v['resident_request_s']:.3f} | {v['switch_s']:.3f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
