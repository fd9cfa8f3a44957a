"""Transparent huge pages for the expert cache's slot pools (`huge_pages=1`) against the default 4 KiB
pages, and stock llama.cpp in RAM: one process per run generates on the same prompt several times, so
its first generation fills the cache (every miss a read into fresh slots) and the later ones find the
text's experts cached (the compute alone, where the TLB matters). Interleaved repeats, medians and
ranges, ratios to the default. Each run's pages of the model and store are dropped first.

    python bench/huge_pages.py --model M.gguf --store M.experts --cache 7323000000 --cap-gib 8 \
        --repeats 3 -n 48 --out bench/results/huge-pages-30b-...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from cgroup import MemoryCap
from run import drop_pages, run_worker


def rates(out: dict[str, Any]) -> tuple[float, float]:
    """Decode tok/s of the first generation (the cache filling) and of the later ones together."""
    runs = out["runs"]
    first = runs[0]["decode_tok_s"]
    later = runs[1:]
    toks = sum(r["tokens"] - 1 for r in later)
    secs = sum(r["decode_s"] for r in later)
    return first, toks / secs if secs > 0 else 0.0


def stat(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def fmt(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})" if s else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF MoE model")
    p.add_argument("--store", default=None, help="expert store (default: read the GGUF)")
    p.add_argument("--cache", required=True, help="expert cache bytes (both moetier configurations)")
    p.add_argument("--cap-gib", type=float, default=0.0, help="memory cap (cgroup v1) for the moetier runs; 0: none")
    p.add_argument("--prompt", default="Hello", help="the prompt, generated on --times times per process")
    p.add_argument("--times", type=int, default=3, help="generations per process (the first fills the cache)")
    p.add_argument("-n", type=int, default=48, help="tokens per generation")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every configuration")
    p.add_argument("--threads", type=int, default=2, help="threads")
    p.add_argument("--policy", default="reuse-rank", help="eviction policy")
    p.add_argument("--no-stock", action="store_true", help="leave out stock llama.cpp in RAM (needs the model's size)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is abandoned")
    p.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    a = p.parse_args()

    model = Path(a.model).expanduser()
    store = Path(a.store).expanduser() if a.store else None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([a.prompt] * a.times, f)
        prompts = f.name
    base = ["--model", str(model), "--prompts", prompts, "-n", str(a.n), "--threads", str(a.threads)]
    cache = ["--cache", a.cache, "--policy", a.policy, *(["--store", str(store)] if store else [])]
    configs: list[tuple[str, list[str], bool]] = [
        ("moetier (4 KiB pages, the default)", [*cache, "--opts", "t1=1,t2=1"], True),
        ("moetier huge_pages=1", [*cache, "--opts", "t1=1,t2=1,huge_pages=1"], True),
    ]
    if not a.no_stock:
        configs.append(("stock llama.cpp in RAM", ["--cache", "0"], False))
    cap = MemoryCap("moetier-huge-pages", int(a.cap_gib * 2**30)) if a.cap_gib > 0 else None
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
    try:
        for rep in range(a.repeats):
            for name, args, capped in configs:
                drop_pages([x for x in (model, store) if x is not None])
                out = run_worker([*base, *args], cap if capped else None, a.timeout)
                if "error" in out:
                    results[name].append({"error": out["error"]})
                    print(f"[{rep + 1}/{a.repeats}] {name}: {out['error']}", flush=True)
                    continue
                first, later = rates(out)
                tokens = [r["token_ids"] for r in out["runs"]]
                results[name].append(
                    {
                        "first_tok_s": first,
                        "cached_tok_s": later,
                        "hit_rate_later": sum(r["n_hits"] for r in out["runs"][1:])
                        / max(1, sum(r["n_lookups"] for r in out["runs"][1:])),
                        "tokens": tokens,
                        "peak_bytes": out.get("cgroup_peak_bytes", out["peak_rss_bytes"]),
                        "n_huge": out["cache_info"].get("n_huge") if out.get("cache_info") else None,
                    }
                )
                print(f"[{rep + 1}/{a.repeats}] {name}: first {first:.2f} tok/s, cached {later:.2f}", flush=True)
    finally:
        if cap:
            cap.close()
        os.unlink(prompts)

    summary: dict[str, dict[str, Any]] = {}
    for name, rs in results.items():
        ok = [r for r in rs if "error" not in r]
        summary[name] = {
            "first": stat([r["first_tok_s"] for r in ok]),
            "cached": stat([r["cached_tok_s"] for r in ok]),
            "peak_mib": max((r["peak_bytes"] for r in ok), default=0) / 2**20,
            "errors": [r["error"] for r in rs if "error" in r],
        }
    ref_name = configs[0][0]
    ref = summary[ref_name]
    stock_tokens = next((r["tokens"] for r in results.get("stock llama.cpp in RAM", []) if "tokens" in r), None)
    rows = []
    for name, s in summary.items():
        ratio_first = s["first"]["median"] / ref["first"]["median"] if s["first"] and ref["first"] else 0.0
        ratio_cached = s["cached"]["median"] / ref["cached"]["median"] if s["cached"] and ref["cached"] else 0.0
        same = (
            "-"
            if stock_tokens is None or name.startswith("stock")
            else ("yes" if all(r.get("tokens") == stock_tokens for r in results[name] if "tokens" in r) else "no")
        )
        rows.append(
            f"| {name} | {fmt(s['first'])} | {ratio_first:.2f}x | {fmt(s['cached'])} | {ratio_cached:.2f}x "
            f"| {s['peak_mib']:.0f} | {same} |"
        )
    cap_note = f"a cap of {a.cap_gib:g} GiB (cgroup v1) on the moetier runs" if cap else "no memory cap"
    lines = [
        f"Model `{model.name}`, expert cache {int(a.cache) / 2**30:.2f} GiB, {cap_note}, {a.threads} threads, "
        f'the prompt "{a.prompt}" generated {a.times} times per process ({a.n} tokens each), {a.repeats} '
        f"interleaved repeats, decode tok/s median (min-max); load {os.getloadavg()[0]:.2f} at the end",
        "",
        "| configuration | first generation (cache filling) | vs default | later generations (cached) "
        "| vs default | peak MiB | same tokens as stock |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "hit rate of the later generations: "
        + ", ".join(
            f"{name} {statistics.median(r['hit_rate_later'] for r in results[name] if 'error' not in r):.1%}"
            for name, s in summary.items()
            if not name.startswith("stock") and s["cached"]
        ),
        "",
        *(f"- {n}: {len(s['errors'])} run(s) failed: {s['errors'][0]}" for n, s in summary.items() if s["errors"]),
        "",
        "Made by `python bench/huge_pages.py "
        + " ".join(
            (f"-{k} {v}" if k == "n" else f"--{k.replace('_', '-')} {v}")
            for k, v in vars(a).items()
            if v not in (None, False) and k not in ("out", "no_stock")
        )
        + (" --no-stock" if a.no_stock else "")
        + f" --out {a.out}`",
    ]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    Path(a.out + ".json").write_text(json.dumps({"config": vars(a), "summary": summary, "runs": results}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
