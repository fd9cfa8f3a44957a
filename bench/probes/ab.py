"""Probe, 2026-11-23. Question: did that day's engine refactor (1d848dc -> 1e5613d) change the
cache's decisions or its decode speed on the 1.5B (e16k8) at 25%? Answer: without prefetch both
engines gave the same counters and text in every run; exact decoded at 0.987x over 10 pairs.
Results: bench/results/qwen2.5-coder-1.5b-moe-arch10-ab.{json,md} and
bench/results/qwen2.5-coder-1.5b-moe-arch10-ab-exact.{json,md}.

Interleaved A/B of two moetier installs (say, before and after a change) on one model: the same
`moetier run` alternates between them, so machine drift hits both alike. Prints and writes each
run's decode speed and cache counters, and the medians.

    python bench/probes/ab.py --a /tmp/base --b python --model M.gguf --store S -n 48 --repeats 5 \\
        --config "exact=--cache 92M --cache-t1 1 --cache-t2 1" --out bench/results/NAME
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

PROMPT = 'def quicksort(items):\n    """Sort a list of numbers."""\n'
# the stats line of `moetier run` (either engine): speed, then the counters
LINE = re.compile(
    r"\(([0-9.]+) tok/s\).*cache hit rate [0-9.]+% \((\d+)/(\d+) lookups, (\d+) misses: "
    r"(\d+) read high, (\d+) low, (\d+) skipped\)"
)
COUNTERS = ("n_hits", "n_lookups", "n_misses", "n_loads_high", "n_loads_low", "n_skipped")


def run(pythonpath: str, model: str, store: str | None, flags: list[str], n: int) -> dict[str, Any]:
    """One `moetier run`: tok_s, the cache counters and the generated text."""
    cmd = [sys.executable, "-m", "moetier.cli", "run", "-m", model, "-p", PROMPT, "-n", str(n), *flags]
    if store:
        cmd += ["--store", store]
    env = {**os.environ, "PYTHONPATH": str(Path(pythonpath).resolve())}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    m = LINE.search(r.stderr)
    if not m:
        msg = f"no stats line in: {r.stderr[-500:]}"
        raise RuntimeError(msg)
    counters = {k: int(v) for k, v in zip(COUNTERS, m.groups()[1:], strict=True)}
    return {"tok_s": float(m.group(1)), **counters, "text": r.stdout}


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--a", required=True, help="PYTHONPATH of install A (the baseline)")
    a.add_argument("--b", required=True, help="PYTHONPATH of install B")
    a.add_argument("--model", required=True, help="GGUF MoE model")
    a.add_argument("--store", default=None, help="expert store")
    a.add_argument("-n", type=int, default=48, help="tokens per run")
    a.add_argument("--repeats", type=int, default=5, help="runs of each install per configuration")
    a.add_argument("--config", action="append", required=True, help="NAME=FLAGS of `moetier run` (repeatable)")
    a.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.md")
    ns = a.parse_args()
    report: dict[str, object] = {"config": vars(ns), "runs": {}}
    md = [
        f"model `{Path(ns.model).name}`, {ns.n} tokens, A = `{ns.a}`, B = `{ns.b}`, load {os.getloadavg()[0]:.2f}",
        "",
    ]
    md += [
        "| config | A tok/s (runs) | B tok/s (runs) | B / A medians | same counters and text |",
        "|---|---|---|---|---|",
    ]
    for spec in ns.config:
        name, flags = spec.split("=", 1)
        runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        for _ in range(ns.repeats):
            for side in ("a", "b"):
                runs[side].append(run(getattr(ns, side), ns.model, ns.store, shlex.split(flags), ns.n))
        report["runs"][name] = runs  # type: ignore[index]
        med = {s: statistics.median(r["tok_s"] for r in runs[s]) for s in runs}
        same = all(
            {k: v for k, v in x.items() if k != "tok_s"} == {k: v for k, v in runs["a"][0].items() if k != "tok_s"}
            for s in runs
            for x in runs[s]
        )
        speeds = {s: ", ".join(f"{r['tok_s']:.2f}" for r in runs[s]) for s in runs}
        ratio = med["b"] / med["a"]
        md.append(
            f"| {name} | {med['a']:.2f} ({speeds['a']}) | {med['b']:.2f} ({speeds['b']}) | {ratio:.3f} | {same} |"
        )
    Path(ns.out + ".json").write_text(json.dumps(report, indent=1))
    Path(ns.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
