"""Defaults that never lose: the default configuration against LRU without prefetch, on each bench
model at each budget, with the disk at full speed and throttled (an SD card, a busy NVMe).

One `run.py` per (model, disk): the variants `lru-high` (LRU, no prefetch), `default` (the defaults:
reuse-rank, prefetch 3 with its gate) and, optionally, `always-prefetch` (the defaults with the gate
off: prefetch reads every step), all exact, interleaved, under the same caps. Stock llama.cpp under
the caps is left out (`--skip-stock-capped`: at 200 MB/s it takes hours; the headline runs have it).
Each run writes OUT-MODEL-DISK.{json,md,png}; a run whose JSON exists is not run again, so the
script picks up where an interrupted one stopped. Then OUT.md gathers the ratios of medians, default
against lru-high (and always-prefetch against lru-high), with the range of the repeats' ratios.

    python bench/defaults.py --model demo=$D.gguf:$D.experts --model b25=$B.gguf:$B.q2k.experts \\
        --disks full,200 --budgets 10,25,50,100 --repeats 3 --out bench/results/defaults-2026-11-27
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXACT = "t1=1,t2=1,repack=0"
VARIANTS = {
    "lru-high": f"lru:{EXACT},prefetch=0",
    "default": f"reuse-rank:{EXACT}",
    "always-prefetch": f"reuse-rank:{EXACT},prefetch_gate=0",
}


def parse_model(text: str) -> tuple[str, Path, Path | None]:
    """'NAME=MODEL.gguf[:STORE]' -> (name, model, store)."""
    name, eq, rest = text.partition("=")
    if not eq or not name or not rest:
        msg = f"--model {text!r}: expected NAME=MODEL.gguf[:STORE]"
        raise SystemExit(msg)
    model, _, store = rest.partition(":")
    return name, Path(model), Path(store) if store else None


def run_args(
    model: Path, store: Path | None, disk: str, variants: list[str], a: argparse.Namespace, out: Path
) -> list[str]:
    """The run.py command of one (model, disk)."""
    cmd = [sys.executable, str(HERE / "run.py"), "--model", str(model), "--budgets", a.budgets]
    cmd += ["--repeats", str(a.repeats), "-n", str(a.n), "--prompts", str(a.prompts), "--threads", str(a.threads)]
    cmd += ["--ctx", str(a.ctx), "--skip-stock-capped", "--timeout", str(a.timeout), "--out", str(out)]
    cmd += ["--variants", ";".join(f"{v}={VARIANTS[v]}" for v in variants)]
    if store is not None:
        cmd += ["--store", str(store)]
    if disk != "full":
        cmd += ["--throttle-read-mbps", disk]
    return cmd


def ratios(report: dict[str, Any], name: str, base: str, pct: int) -> dict[str, float] | None:
    """Decode speed of NAME-PCT over BASE-PCT: the ratio of the medians, and the lowest and highest
    ratio of the repeats paired in run order (each repeat ran every configuration once)."""
    runs = report["runs"]
    a, b = runs.get(f"{name}-{pct}"), runs.get(f"{base}-{pct}")
    if not a or not b or "decode_tok_s" not in a or "decode_tok_s" not in b:
        return None
    pairs = [x / y for x, y in zip(a["decode_tok_s"]["values"], b["decode_tok_s"]["values"], strict=False) if y > 0]
    return {
        "ratio": a["decode_tok_s"]["median"] / b["decode_tok_s"]["median"],
        "lo": min(pairs) if pairs else float("nan"),
        "hi": max(pairs) if pairs else float("nan"),
        "tok_s": a["decode_tok_s"]["median"],
        "base_tok_s": b["decode_tok_s"]["median"],
    }


def summary(results: dict[tuple[str, str], Path], variants: list[str], budgets: list[int]) -> str:
    """The table of ratios against lru-high, one row per (model, disk, variant)."""
    head = "| model | disk | config | " + " | ".join(f"{p}%" for p in budgets) + " |"
    rows = [head, "|" + "---|" * (3 + len(budgets))]
    for (model, disk), path in results.items():
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        for v in (x for x in variants if x != "lru-high"):
            cells = []
            for pct in budgets:
                r = ratios(report, v, "lru-high", pct)
                cells.append(
                    "-"
                    if r is None
                    else f"{r['ratio']:.2f}x ({r['lo']:.2f}-{r['hi']:.2f}; {r['tok_s']:.2f} vs {r['base_tok_s']:.2f})"
                )
            where = "full speed" if disk == "full" else f"{disk} MB/s"
            rows.append(f"| {model} | {where} | {v} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="NAME=MODEL.gguf[:STORE] (repeatable)")
    p.add_argument("--disks", default="full,200", help="'full' and/or read throttles in MB/s, comma-separated")
    p.add_argument("--budgets", default="10,25,50,100", help="expert cache budgets in %% of expert bytes")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (interleaved)")
    p.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--prompts", type=Path, default=HERE / "results" / "prompts-eval6.json", help="prompts JSON")
    p.add_argument("--threads", type=int, default=2, help="threads per run")
    p.add_argument("--ctx", type=int, default=1024, help="context length")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a run is abandoned")
    p.add_argument(
        "--always-prefetch",
        action="store_true",
        help="also run the defaults with the prefetch gate off (prefetch reads every step)",
    )
    p.add_argument("--out", type=Path, required=True, help="output prefix: OUT-MODEL-DISK.* per run, OUT.md")
    p.add_argument(
        "--summary-only",
        action="store_true",
        help="run nothing: gather the runs whose JSON exists into OUT.md (the others are left out of it)",
    )
    a = p.parse_args()
    variants = ["lru-high", "default"] + (["always-prefetch"] if a.always_prefetch else [])
    budgets = [int(x) for x in a.budgets.split(",")]
    results: dict[tuple[str, str], Path] = {}
    for spec in a.model:
        name, model, store = parse_model(spec)
        for disk in a.disks.split(","):
            out = a.out.with_name(f"{a.out.name}-{name}-{disk if disk == 'full' else disk + 'mbps'}")
            results[(name, disk)] = out.with_suffix(".json")
            if out.with_suffix(".json").exists():
                print(f"{out}.json: done before, kept", file=sys.stderr)
                continue
            if a.summary_only:
                print(f"{out}.json: not run, left out", file=sys.stderr)
                continue
            cmd = run_args(model, store, disk, variants, a, out)
            print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
    table = summary(results, variants, budgets)
    text = (
        "Decode speed against LRU without prefetch (`lru-high`), all exact: the ratio of the medians, "
        "(the lowest and highest ratio of the repeats paired in run order; tok/s of the two medians). "
        f"Made by `python bench/defaults.py {' '.join(sys.argv[1:])}`; each run's own table is in "
        "the file named by its model and disk.\n\n" + table + "\n"
    )
    a.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
