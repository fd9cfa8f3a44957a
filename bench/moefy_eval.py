"""Perplexity of a moefied model against its dense source, and the perplexity-vs-top-k curve.

Runs the shipped llama-perplexity on held-out text: the dense model, then the MoE with its trained
top-k and with other k (llama.cpp's --override-kv on expert_used_count; the router and the down
refit were fitted for the trained k). Prints a markdown table, writes JSON.

    python bench/moefy_eval.py --dense D.gguf --moe M.gguf --text eval.txt --ks 1,2,3,4,6,8 --out R.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import gguf

from moetier.server import tool_path


def perplexity(model: Path, text: Path, ctx: int, chunks: int, threads: int, extra: list[str]) -> float:
    cmd = [
        str(tool_path("llama-perplexity")),
        "-m",
        str(model),
        "-f",
        str(text),
        "-c",
        str(ctx),
        "--chunks",
        str(chunks),
        "-t",
        str(threads),
        *extra,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    if not m:
        msg = f"llama-perplexity failed on {model}: {(r.stderr or r.stdout)[-500:]}"
        raise RuntimeError(msg)
    return float(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", required=True, help="dense source GGUF")
    p.add_argument("--moe", required=True, help="moefied GGUF")
    p.add_argument("--text", required=True, help="held-out evaluation text (not the calibration text)")
    p.add_argument("--ks", default="", help="top-k values to evaluate besides the trained one, e.g. 1,2,3,6,8")
    p.add_argument("--ctx", type=int, default=512, help="perplexity context (default: 512)")
    p.add_argument("--chunks", type=int, default=20, help="max chunks (default: 20)")
    p.add_argument("--threads", type=int, default=2, help="threads (default: 2)")
    p.add_argument("--out", default=None, help="JSON output path")
    a = p.parse_args()

    moe = Path(a.moe)
    r = gguf.GGUFReader(moe)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()  # ernie4_5-moe or qwen2moe
    e = int(r.fields[f"{arch}.expert_count"].parts[-1][0])
    k0 = int(r.fields[f"{arch}.expert_used_count"].parts[-1][0])
    ks = sorted({k0, *[int(x) for x in a.ks.split(",") if x]})
    dense = perplexity(Path(a.dense), Path(a.text), a.ctx, a.chunks, a.threads, [])
    rows = {"dense": dense}
    for k in ks:
        extra = [] if k == k0 else ["--override-kv", f"{arch}.expert_used_count=int:{k}"]
        rows[f"k={k}"] = perplexity(moe, Path(a.text), a.ctx, a.chunks, a.threads, extra)
        sys.stderr.write(f"k={k}: {rows[f'k={k}']:.3f}\n")
    lines = [
        f"{moe.name}: {e} experts, trained top-{k0}; eval {Path(a.text).name}, c={a.ctx}",
        "",
        "| model | perplexity | vs dense |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {v:.3f} | {100 * (v / dense - 1):+.1f}% |" for name, v in rows.items()]
    sys.stdout.write("\n".join(lines) + "\n")
    if a.out:
        Path(a.out).write_text(json.dumps({"moe": str(moe), "n_expert": e, "trained_k": k0, "ppl": rows}, indent=1))


if __name__ == "__main__":
    main()
