"""--cache auto under a memory cap, against a sweep of fixed budgets under the same cap, in ONE run.

Every configuration runs in its own process inside a cgroup v1 memory group whose limit counts page
cache (bench/cgroup.py), the model's pages dropped before each run; configurations are interleaved
per repeat so that load drifts hit all alike. Reports decode tok/s (median over prompts, then over
repeats), the budget each run used, the cgroup's peak, how often it hit the limit, and OOM kills;
`auto` should land within 10% of the best fixed budget and never be killed.

    python bench/auto_budget.py --model M --store S --cap 2.25G --budgets 256M,512M,768M,1G,1.25G --out bench/results/x
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moetier
from cgroup import MemoryCap, available
from moetier import parse_size
from run import DEFAULT_PROMPTS, drop_pages, run_worker

MiB = 1 << 20


def oom_kills(cap: MemoryCap) -> int:
    """OOM kills in the group (cgroup v1 memory.oom_control, 0 where the kernel does not say)."""
    for line in (cap.path / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def long_prompt() -> list[str]:
    gpl = Path("/usr/share/common-licenses/GPL-3")
    return [gpl.read_text()[3000:6000]] if gpl.is_file() else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF MoE model")
    p.add_argument("--store", default=None, help="expert store (default: read the GGUF)")
    p.add_argument("--cap", required=True, help="memory cap of every run, e.g. 2.25G")
    p.add_argument("--budgets", required=True, help="fixed budgets to sweep, comma-separated sizes")
    p.add_argument("--repeats", type=int, default=2, help="rounds over all configurations")
    p.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--threads", type=int, default=2, help="threads per run")
    p.add_argument("--ctx", type=int, default=1024, help="context length (auto leaves room for its KV cache)")
    p.add_argument(
        "--prompts",
        default=None,
        help="JSON list of prompts (default: the harness's four, and a long one, 3000 characters of Debian's "
        "GPL-3 text: a long prompt fills the compute buffers that short ones leave untouched)",
    )
    p.add_argument("--opts", default="t1=1,t2=1,repack=0", help="cache options of every run (default: exact)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before a run is abandoned")
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.md")
    a = p.parse_args()
    if not available():
        sys.exit("cgroup v1 memory is not writable here: the capped runs need it")

    model = Path(a.model).expanduser()
    cap_bytes = parse_size(a.cap, "--cap")
    configs = [str(parse_size(b, "--budgets")) for b in a.budgets.split(",")] + ["auto"]
    texts = json.loads(Path(a.prompts).read_text()) if a.prompts else [*DEFAULT_PROMPTS, *long_prompt()]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
        prompts = f.name
    common = ["--model", str(model), "--prompts", prompts, "-n", str(a.n), "--threads", str(a.threads)]
    common += ["--ctx", str(a.ctx), "--opts", a.opts] + (["--store", a.store] if a.store else [])
    files = [model] + ([Path(a.store)] if a.store else [])

    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for rep in range(a.repeats):
        for c in configs:
            drop_pages(files)
            cap = MemoryCap(f"moetier-auto-{os.getpid()}", cap_bytes)
            try:
                r = run_worker([*common, "--cache", c], cap, a.timeout)
                r["failcnt"] = cap.failcnt()
                r["oom_kills"] = oom_kills(cap)
            finally:
                cap.close()
            runs[c].append(r)
            tok = statistics.median(x["decode_tok_s"] for x in r["runs"]) if "runs" in r else 0.0
            print(f"[{rep + 1}/{a.repeats}] {c}: {tok:.2f} tok/s {r.get('error', '')}", file=sys.stderr)

    rows = []
    for c in configs:
        ok = [r for r in runs[c] if "runs" in r]
        tok = statistics.median(statistics.median(x["decode_tok_s"] for x in r["runs"]) for r in ok) if ok else 0.0
        rows.append(
            {
                "config": c,
                "decode_tok_s": tok,
                "per_repeat": [statistics.median(x["decode_tok_s"] for x in r["runs"]) for r in ok],
                "budget_bytes": int(ok[0]["cache_info"]["cache_bytes"]) if ok else 0,
                "peak_bytes": max((r.get("cgroup_peak_bytes", 0) for r in runs[c]), default=0),
                "rss_anon_bytes": max((r.get("rss_anon_bytes", 0) for r in runs[c]), default=0),
                "failcnt": max((r["failcnt"] for r in runs[c]), default=0),
                "oom_kills": sum(r["oom_kills"] for r in runs[c]),
                "errors": [r["error"] for r in runs[c] if "error" in r],
                "note": ok[0].get("budget_note", "") if ok else "",
            }
        )
    fixed = [r for r in rows if r["config"] != "auto" and not r["errors"]]
    best = max(fixed, key=lambda r: r["decode_tok_s"]) if fixed else None
    auto = rows[-1]
    report = {
        "model": str(model),
        "store": a.store,
        "cap_bytes": cap_bytes,
        "moetier": str(Path(moetier.__file__).parent),
        "loadavg": os.getloadavg(),
        "config": vars(a),
        "rows": rows,
        "best_fixed": best["config"] if best else None,
        "auto_vs_best": auto["decode_tok_s"] / best["decode_tok_s"] if best and best["decode_tok_s"] else None,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps(report, indent=1))
    lines = [
        f"# auto budget under a {cap_bytes / MiB:.0f} MiB cap: {model.name}",
        "",
        f"moetier: {report['moetier']}; load average {report['loadavg'][0]:.2f}; {a.repeats} repeats, interleaved",
        "",
        "| budget | cache MiB | decode tok/s (per repeat) | vs best fixed | cgroup peak MiB | anon MiB | limit hits "
        "| OOM kills |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = f"{r['decode_tok_s'] / best['decode_tok_s']:.2f}x" if best and best["decode_tok_s"] else "-"
        name = r["config"] if r["config"] == "auto" else f"{int(r['config']) / MiB:.0f} MiB"
        reps = ", ".join(f"{x:.2f}" for x in r["per_repeat"])
        err = f" ({'; '.join(r['errors'])})" if r["errors"] else ""
        lines.append(
            f"| {name} | {r['budget_bytes'] / MiB:.0f} | {r['decode_tok_s']:.2f} ({reps}){err} | {vs} "
            f"| {r['peak_bytes'] / MiB:.0f} | {r['rss_anon_bytes'] / MiB:.0f} | {r['failcnt']} | {r['oom_kills']} |"
        )
    lines += ["", f"auto chose: {auto['note']}", ""]
    out.with_name(out.name + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
