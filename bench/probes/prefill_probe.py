"""Probe, 2026-11-27. Question: does a prompt's prefill wait for expert reads? Answer, the sh60 1.5B at
25%, three 512-token prompts: no, 0.01-0.03 s of waiting against 37-41 s of compute. Results:
bench/results/prefill-probe-1.5b-ernie-sh60-25-p512.{json,md} and
bench/results/prefill-probe-1.5b-ernie-sh60-25-p512-quiet.{json,md}.

Where a prompt's prefill time goes with the expert cache: per configuration, the time to first
token, the time the layers' compute waited for expert reads (the load ops), the bytes read, and
stock llama.cpp in RAM (every expert loaded, no cache) on the same prompts as the compute reference.

No memory cap: the cache's own cost, not the page cache's. Each configuration loads the model in
this process once, warms up on a short prompt, then prefills each prompt (one generated token),
interleaved over repeats; medians are reported.

    python bench/probes/prefill_probe.py --model M.gguf --store M.experts --budget 80M \\
        --prompts bench/results/prompts-eval3-512.json \\
        --config exact=t1=1,t2=1 --config no-prefetch=t1=1,t2=1,prefetch=0 --out bench/results/x
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import probe
from moetier import Model


def one(model: Model, prompts: list[str]) -> list[dict[str, float]]:
    rows = []
    for p in prompts:
        r = model.generate(p, max_tokens=1)
        rows.append(
            {
                "ttft_s": r.prefill_seconds,
                "tokens": r.prompt_tokens,
                "wait_s": r.stats.read_seconds,
                "mb_read": r.stats.n_bytes_read / 1e6,
                "misses": r.stats.n_misses,
            }
        )
    return rows


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    probe.add_model_args(a, repeats=3)
    ns = a.parse_args()
    prompts = probe.prompts(ns)
    configs: dict[str, tuple[dict[str, Any], bool] | None] = {"stock-ram": None, **probe.configs(ns)}
    load0 = os.getloadavg()[0]
    runs: dict[str, list[list[dict[str, float]]]] = {k: [] for k in configs}
    for rep in range(ns.repeats):
        for name, opts in configs.items():
            m = probe.open_model(ns, opts)
            try:
                rows = one(m, prompts)
            finally:
                m.close()
            runs[name].append(rows)
            print(
                f"rep {rep} {name}: " + ", ".join(f"{r['ttft_s']:.2f}s/{r['wait_s']:.2f}s" for r in rows),
                file=sys.stderr,
                flush=True,
            )
    summary = {}
    for name, reps in runs.items():
        per = {k: statistics.median(sum(r[k] for r in rows) for rows in reps) for k in reps[0][0]}
        spread = [sum(r["ttft_s"] for r in rows) for rows in reps]
        summary[name] = {**per, "ttft_min": min(spread), "ttft_max": max(spread)}
    ref = summary["stock-ram"]["ttft_s"]
    md = [
        f"model `{Path(ns.model).name}`, budget {ns.budget}, {len(prompts)} prompts "
        f"({int(summary['stock-ram']['tokens'])} tokens), {ns.repeats} repeats, {ns.threads} threads, "
        f"no cap, load {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end",
        "",
        "| config | TTFT s, all prompts (min-max) | vs stock in RAM | waiting for reads s | MB read | misses |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        md.append(
            f"| {name} | {s['ttft_s']:.2f} ({s['ttft_min']:.2f}-{s['ttft_max']:.2f}) | {s['ttft_s'] / ref:.3f}x | "
            f"{s['wait_s']:.2f} | {s['mb_read']:.1f} | {int(s['misses'])} |"
        )
    Path(ns.out + ".json").write_text(json.dumps({"config": vars(ns), "summary": summary, "runs": runs}, indent=1))
    Path(ns.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
