"""Warm start vs cold start, in ONE run: time to first token and the first tokens' decode speed of
a fresh process, with and without the warm-start sidecar of an earlier session.

The earlier session runs other prompts than the measured ones (its sidecar ranks the experts that
session used; the measured prompts are new to it), and its sidecar is restored before every warm
run, so repeats do not warm each other up. Cold and warm runs alternate; the model's and the store's
pages are dropped before each. The first prompt is sent as soon as the model is loaded: the
background reads of a warm start compete with it (the least favourable case for them).

    python bench/warm_start.py --model M --store S --budget 25% --out bench/results/warm-x
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moetier
from moetier import CacheConfig, Model, parse_size
from run import drop_pages, run_worker

EARLIER = [
    "The history of the printing press begins in the fifteenth century, when",
    'def read_config(path):\n    """Load a YAML configuration file and return a dict."""\n',
    "A binary search tree keeps its keys in sorted order, so that lookup",
]
MEASURED = [
    "Explain how a hash map handles collisions, with an example in Python.\n",
    "The river flowed past the old mill, and the miller's daughter",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF MoE model")
    p.add_argument("--store", required=True, help="expert store (the sidecar lives next to it)")
    p.add_argument("--budget", default="25%", help="cache budget: a size, or a share of the expert bytes (25%%)")
    p.add_argument("--repeats", type=int, default=3, help="cold/warm pairs")
    p.add_argument("-n", type=int, default=32, help="tokens generated for the first prompt")
    p.add_argument("--threads", type=int, default=2, help="threads")
    p.add_argument("--opts", default="t1=1,t2=1,repack=0", help="cache options (default: exact)")
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.md")
    a = p.parse_args()

    model, store = Path(a.model).expanduser(), Path(a.store).expanduser()
    info = Model(model, store=store, cache=CacheConfig(budget="64G", warm=False)).cache_info()
    if a.budget.endswith("%"):
        budget = int(int(info["expert_bytes"]) * float(a.budget[:-1]) / 100)
    else:
        budget = parse_size(a.budget, "--budget")
    sidecar = store / "cache-state.bin"
    tmp = Path(tempfile.mkdtemp())
    (tmp / "earlier.json").write_text(json.dumps(EARLIER))
    (tmp / "measured.json").write_text(json.dumps(MEASURED[:1]))
    common = ["--model", str(model), "--store", str(store), "--cache", str(budget), "--threads", str(a.threads)]

    # the earlier session: writes the sidecar at exit
    sidecar.unlink(missing_ok=True)
    drop_pages([model, store])
    earlier = ["--prompts", str(tmp / "earlier.json"), "-n", "64", "--opts", a.opts + ",warm=1"]
    r = run_worker([*common, *earlier], None, 900)
    if "error" in r or not sidecar.is_file():
        sys.exit(f"the earlier session failed or wrote no sidecar: {r.get('error')}")
    shutil.copy(sidecar, tmp / "sidecar")

    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for rep in range(a.repeats):
        for kind in ("cold", "warm"):
            shutil.copy(tmp / "sidecar", sidecar)
            drop_pages([model, store])
            opts = a.opts + (",warm=1" if kind == "warm" else ",warm=0")
            args = [*common, "--prompts", str(tmp / "measured.json"), "-n", str(a.n), "--opts", opts, "--no-warmup"]
            r = run_worker(args, None, 900)
            if "error" in r:
                sys.exit(f"{kind} run failed: {r['error']}")
            first = r["runs"][0]
            row = {
                "load_s": r["load_s"],
                "ttft_s": first["ttft_s"],
                "decode_tok_s": first["decode_tok_s"],
                "first_token_after_start_s": r["load_s"] + first["ttft_s"],
                "tokens_s": first["decode_s"] + first["ttft_s"],
                "n_hits": first["n_hits"],
                "n_lookups": first["n_lookups"],
                "warm_progress": r["warm_progress"],
                "token_ids": first["token_ids"],
            }
            runs[kind].append(row)
            print(
                f"[{rep + 1}/{a.repeats}] {kind}: TTFT {row['ttft_s']:.2f} s, {row['decode_tok_s']:.2f} tok/s, "
                f"hits {row['n_hits']}/{row['n_lookups']}, warm {row['warm_progress']}",
                file=sys.stderr,
            )
    same = all(r["token_ids"] == runs["cold"][0]["token_ids"] for k in runs for r in runs[k])

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    report = {
        "model": str(model),
        "store": str(store),
        "budget_bytes": budget,
        "expert_bytes": int(info["expert_bytes"]),
        "moetier": str(Path(moetier.__file__).parent),
        "loadavg": os.getloadavg(),
        "config": vars(a),
        "runs": runs,
        "same_tokens": same,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps(report, indent=1))
    lines = [
        f"# warm vs cold start: {model.name}, cache {budget / 2**20:.0f} MiB of "
        f"{int(info['expert_bytes']) / 2**20:.0f} MiB experts",
        "",
        f"moetier: {report['moetier']}; load average {report['loadavg'][0]:.2f}; {a.repeats} cold/warm pairs, "
        f"medians; first prompt sent right after load; same tokens cold and warm: {same}",
        "",
        f"| start | load s | TTFT s | first {a.n} tokens tok/s | hits/lookups (first prompt) |",
        "|---|---|---|---|---|",
    ]
    for kind in ("cold", "warm"):
        lines.append(
            f"| {kind} | {med(kind, 'load_s'):.2f} | {med(kind, 'ttft_s'):.2f} | {med(kind, 'decode_tok_s'):.2f} "
            f"| {med(kind, 'n_hits'):.0f}/{med(kind, 'n_lookups'):.0f} |"
        )
    lines += [
        "",
        f"warm/cold: TTFT {med('warm', 'ttft_s') / med('cold', 'ttft_s'):.2f}x, decode "
        f"{med('warm', 'decode_tok_s') / med('cold', 'decode_tok_s'):.2f}x",
        "",
    ]
    out.with_name(out.name + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
