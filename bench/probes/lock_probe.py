"""Probe, 2026-11-25. Question: under the cap of the 1.5B's 50% cell, does locking the non-expert
weights keep them from being paged out? Answer: 13 major faults per run locked against 349
unlocked, at about the same decode speed (6.7-7.3 tok/s); neither collapsed. Result:
bench/results/lock-probe-1.5b-50.json.

The non-expert weights locked or not, under one memory cap (cgroup v1): worker.py's run of each,
with the locked bytes, major faults and disk reads. Writes JSON.

    python bench/probes/lock_probe.py --model M.gguf --cap-bytes N --budget B --prompts P.json --out R.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness's modules

from cgroup import MemoryCap
from run import drop_pages, run_worker


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="MoE GGUF")
    p.add_argument("--cap-bytes", type=int, required=True, help="cgroup v1 memory limit")
    p.add_argument("--budget", type=int, required=True, help="expert cache bytes")
    p.add_argument("--prompts", required=True, help="JSON list of prompts")
    p.add_argument("--opts", default="t1=1,t2=1,prefetch=1,io_threads=2,repack=0", help="cache options")
    p.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating")
    p.add_argument("--out", required=True, help="JSON output")
    a = p.parse_args()
    out: dict[str, Any] = {"model": a.model, "cap_bytes": a.cap_bytes, "budget": a.budget, "opts": a.opts, "runs": []}
    for rep in range(a.repeats):
        for lock in (1, 0):
            drop_pages([Path(a.model)])
            cap = MemoryCap(f"moetier-lock-probe-{rep}-{lock}", a.cap_bytes)
            try:
                args = ["--model", a.model, "--cache", str(a.budget), "--opts", f"{a.opts},lock_weights={lock}"]
                r = run_worker([*args, "--prompts", a.prompts, "--ctx", "1024", "--no-repack"], cap, 900)
            finally:
                cap.close()
            if "error" in r:
                out["runs"].append({"lock_weights": lock, "error": r["error"]})
                continue
            tokens = sum(x["tokens"] for x in r["runs"])
            row = {
                "lock_weights": lock,
                "weights_locked": r["cache_info"]["weights_locked"],
                "major_faults": r["major_faults"],
                "disk_read_bytes": r["disk_read_bytes"],
                "tokens": tokens,
                "decode_tok_s": sorted(x["decode_tok_s"] for x in r["runs"])[len(r["runs"]) // 2],
                "cgroup_peak_bytes": r.get("cgroup_peak_bytes", 0),
            }
            out["runs"].append(row)
            sys.stderr.write(f"{row}\n")
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
