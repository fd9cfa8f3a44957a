"""Probe, 2026-11-27. Question: does what budget=auto sets aside beside the expert cache match what a
capped process uses? Answer, the 0.5B under its 25% cell's 494 MiB cap: after a 538-token prompt the
process holds 118 MiB beside the cache where auto estimates 106 MiB. Result:
bench/results/reserve-0.5b-ernie-c32k-25.json.

What budget=auto sets aside beside the expert cache, against what the process uses: one process
under a cgroup v1 cap loads the model with a given cache budget, prints auto's estimate for that cap
(the load's warning or note), generates on a short and on a long prompt, and records its anonymous
memory and the group's usage after each. The model's pages are dropped first, as bench/run.py does
before every run.

    python bench/probes/reserve_probe.py --model M.gguf --cap-mib 494 --budget 26843545 \\
        --long-text ~/.cache/moetier/corpora/py-stdlib.eval.txt --out bench/results/reserve-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness's modules

import cgroup
import run

MiB = 1 << 20


def status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(a: argparse.Namespace) -> None:
    """Runs inside the cap: load, generate, measure; prints JSON."""
    from moetier import CacheConfig, ContextConfig, Model

    group = Path(a.group)

    def group_stat() -> dict[str, float]:
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        return {
            "usage_mib": int((group / "memory.usage_in_bytes").read_text()) / MiB,
            "page_cache_mib": int(stat["cache"]) / MiB,
            "mapped_file_mib": int(stat["mapped_file"]) / MiB,
            "rss_mib": int(stat["rss"]) / MiB,
        }

    out: dict[str, Any] = {"anon_before_load_mib": status_bytes("RssAnon") / MiB}
    m = Model(
        a.model,
        cache=CacheConfig(budget=a.budget, policy="reuse-rank", warm=0),
        context=ContextConfig(n_ctx=a.ctx, n_threads=2),
        repack=False,
    )
    out["budget_note"] = m.budget_note
    out["warnings"] = list(m.warnings)
    out["cache_bytes_mib"] = int(m.cache_info()["cache_bytes"]) / MiB
    out["anon_after_load_mib"] = status_bytes("RssAnon") / MiB
    long = Path(a.long_text).read_text(errors="replace")[: a.long_chars]
    prompts = {"short": "def quicksort(items):\n", "long": long}
    for name, text in prompts.items():
        r = m.generate(text, max_tokens=8)
        out[name] = {"prompt_tokens": r.prompt_tokens, "anon_mib": status_bytes("RssAnon") / MiB} | group_stat()
    out["group_max_usage_mib"] = int((group / "memory.max_usage_in_bytes").read_text()) / MiB
    json.dump(out, sys.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="MoE GGUF")
    p.add_argument("--cap-mib", type=float, required=True, help="the cgroup cap, MiB")
    p.add_argument("--budget", default="auto", help="expert cache budget in bytes, or auto")
    p.add_argument("--ctx", type=int, default=1024, help="context (bench/run.py's default)")
    p.add_argument("--long-text", required=True, help="text whose first --long-chars make the long prompt")
    p.add_argument("--long-chars", type=int, default=2400, help="characters of the long prompt (~540 tokens of code)")
    p.add_argument("--out", default=None, help="OUT.json")
    p.add_argument("--group", default=None, help=argparse.SUPPRESS)  # set in the child
    a = p.parse_args()
    if a.budget != "auto":
        a.budget = int(a.budget)
    if a.group:
        child(a)
        return 0
    # the model's pages are dropped first: pages another group read are charged to it, not to this one
    run.drop_pages([Path(a.model)])
    cap = cgroup.MemoryCap(f"moetier-reserve-{os.getpid()}", int(a.cap_mib * MiB))
    try:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--group", str(cap.path)]
        r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cap.preexec, check=False)
    finally:
        cap.close()
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-3000:])
        return r.returncode
    rep = {"model": a.model, "cap_mib": a.cap_mib, "budget": a.budget, "ctx": a.ctx} | json.loads(r.stdout)
    text = json.dumps(rep, indent=1) + "\n"
    sys.stdout.write(text)
    if a.out:
        Path(a.out + ".json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
