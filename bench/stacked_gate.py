"""Micro-benchmark of prefetch's stacked routers (HOBBIT Fig. 17a): the routers of the next p layers
in ONE matmul against p routers computed one after another, on the CPU backend. Runs the bench-only
binary bench/stacked-gate.cpp (not shipped in the package), building it in the developer build
directory if needed.

    python bench/stacked_gate.py --n-embd 1536 --n-expert 16 --p 1,2,3,4,6,8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stacked_gate_binary(build_dir: Path) -> Path:
    """The moetier-stacked-gate binary of build_dir, built (cmake target) if missing."""
    exe = build_dir / "bin" / "moetier-stacked-gate"
    if not exe.is_file():
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "moetier-stacked-gate"], check=True)
    return exe


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--n-embd", type=int, default=1536, help="router input width (model hidden size)")
    a.add_argument("--n-expert", type=int, default=16, help="experts per layer (router outputs)")
    a.add_argument("--p", default="1,2,3,4,6,8", help="numbers of layers predicted ahead")
    a.add_argument("--n-tokens", type=int, default=1, help="tokens per call (1 = decode)")
    a.add_argument("--reps", type=int, default=500, help="timed repetitions (median reported)")
    a.add_argument("--threads", type=int, default=1, help="compute threads")
    a.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a.add_argument(
        "--build-dir",
        type=Path,
        default=ROOT / "build" / "dev",
        help="configured CMake build directory (default: build/dev)",
    )
    ns = a.parse_args()
    exe = stacked_gate_binary(ns.build_dir)
    rows = []
    print("| p | one router us | p sequential us | p stacked us | stacked / one | sequential / stacked |")
    print("|---|---|---|---|---|---|")
    for p in (int(x) for x in ns.p.split(",")):
        args = [ns.n_embd, ns.n_expert, p, ns.n_tokens, ns.reps, ns.threads]
        out = subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True).stdout
        r = json.loads(out)
        rows.append({"p": p, **r})
        print(
            f"| {p} | {r['single_us']:.1f} | {r['sequential_us']:.1f} | {r['stacked_us']:.1f} "
            f"| {r['stacked_us'] / r['single_us']:.2f}x | {r['sequential_us'] / r['stacked_us']:.2f}x |"
        )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"config": {k: str(v) for k, v in vars(ns).items()}, "rows": rows}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
