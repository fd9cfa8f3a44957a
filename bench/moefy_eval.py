"""Perplexity of moefied models against their dense source on held-out texts, their routing realism,
and the perplexity-vs-top-k curve.

Runs the shipped llama-perplexity on each text: the dense model, then each MoE with its trained top-k
(and, with --ks, other k through llama.cpp's --override-kv on expert_used_count; the router and the
experts were fitted for the trained k). With --routing, each MoE's routing report
(moetier.tools.routing: selection frequency, top-1 share of the gate weight, stacked-gate accuracy)
on the first text. Prints a markdown table, writes JSON.

    python bench/moefy_eval.py --dense D.gguf --moe M1.gguf M2.gguf --text prose.txt code.txt \\
        [--ks 1,2,4] [--routing] --out R.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import gguf

from moetier.server import tool_path


def perplexity(model: Path, text: Path, ctx: int, chunks: int, threads: int, extra: list[str]) -> float:
    """llama-perplexity's final estimate; a NaN chunk or a failed run is an error."""
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
    out = r.stdout + r.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    if not m or "nan" in out.split("Final estimate")[0].split("perplexity:")[-1]:
        msg = f"llama-perplexity failed or gave nan on {model} / {text}: {out[-500:]}"
        raise RuntimeError(msg)
    return float(m.group(1))


def moe_meta(path: Path) -> tuple[str, int, int]:
    r = gguf.GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()  # ernie4_5-moe or qwen2moe
    return (
        arch,
        int(r.fields[f"{arch}.expert_count"].parts[-1][0]),
        int(r.fields[f"{arch}.expert_used_count"].parts[-1][0]),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", required=True, help="dense source GGUF")
    p.add_argument("--moe", required=True, nargs="+", help="moefied GGUF(s)")
    p.add_argument("--text", required=True, nargs="+", help="held-out evaluation text(s), not calibration text")
    p.add_argument("--ks", default="", help="top-k values to evaluate besides the trained one, e.g. 1,2,3,6,8")
    p.add_argument("--routing", action="store_true", help="also each MoE's routing report on the first text")
    p.add_argument("--ctx", type=int, default=512, help="perplexity context (default: 512)")
    p.add_argument("--chunks", type=int, default=12, help="max chunks per text (default: 12)")
    p.add_argument("--threads", type=int, default=2, help="threads (default: 2)")
    p.add_argument(
        "--dense-from",
        default=None,
        help="take the dense model's perplexities from an earlier --out JSON of the same texts, ctx and chunks "
        "(llama-perplexity on CPU is deterministic here) instead of measuring them again",
    )
    p.add_argument("--out", default=None, help="JSON output path")
    a = p.parse_args()

    texts = [Path(t) for t in a.text]
    if len({t.stem for t in texts}) < len(texts):
        # results are keyed by the file's stem: two texts of one stem would share one cell
        p.error(f"two texts have the same name (stem): {' '.join(a.text)}")
    dense = Path(a.dense)
    ppl: dict[str, dict[str, float]] = {"dense": {}}
    if a.dense_from:
        prev = json.loads(Path(a.dense_from).read_text())
        if prev["dense"] != str(dense):
            p.error(f"{a.dense_from}: measured {prev['dense']}, not {dense}")
        if sorted(prev["texts"]) != sorted(str(t) for t in texts):
            p.error(f"{a.dense_from}: measured the texts {prev['texts']}, not {[str(t) for t in texts]}")
        # files before --dense-from recorded no ctx/chunks: their commands (in the results' notes) said
        if prev.get("ctx", a.ctx) != a.ctx or prev.get("chunks", a.chunks) != a.chunks:
            p.error(f"{a.dense_from}: measured with ctx {prev.get('ctx')} and {prev.get('chunks')} chunks")
        ppl["dense"] = {t.stem: float(prev["ppl"]["dense"][t.stem]) for t in texts}
    else:
        for t in texts:
            ppl["dense"][t.stem] = perplexity(dense, t, a.ctx, a.chunks, a.threads, [])
    routing: dict[str, Any] = {}
    for mp in (Path(m) for m in a.moe):
        arch, _, k0 = moe_meta(mp)
        for k in sorted({k0, *[int(x) for x in a.ks.split(",") if x]}):
            extra = [] if k == k0 else ["--override-kv", f"{arch}.expert_used_count=int:{k}"]
            row = f"{mp.stem}" + ("" if k == k0 else f" k={k}")
            ppl[row] = {t.stem: perplexity(mp, t, a.ctx, a.chunks, a.threads, extra) for t in texts}
            sys.stderr.write(f"{row}: {ppl[row]}\n")
        if a.routing:
            from moetier.tools.routing import routing_report

            rep = routing_report(mp, texts[0].read_text(errors="replace"), n_threads=a.threads)
            routing[mp.stem] = asdict(rep) | {"summary": rep.summary()}

    head = "| model | " + " | ".join(t.stem for t in texts) + " |"
    lines = [f"llama-perplexity -c {a.ctx} --chunks {a.chunks}; ratio to dense in brackets", "", head]
    lines.append("|---" * (len(texts) + 1) + "|")
    for name, row in ppl.items():
        cells = [
            f"{row[t.stem]:.3f}" + ("" if name == "dense" else f" ({row[t.stem] / ppl['dense'][t.stem]:.2f}x)")
            for t in texts
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, r in routing.items():
        lines += ["", f"{name}: {r['summary']}"]
    sys.stdout.write("\n".join(lines) + "\n")
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "dense": str(dense),
                    "dense_from": a.dense_from,
                    "ctx": a.ctx,
                    "chunks": a.chunks,
                    "texts": [str(t) for t in texts],
                    "ppl": ppl,
                    "routing": routing,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
