"""The lossy speed/quality frontier: each lossy configuration of a bench/run.py result at
its measured perplexity cost on held-out text, beside its decode speed from the same run.

Perplexity comes from the shipped llama-perplexity on each --text (ctx x chunks tokens):
- a moetier configuration (POINT=moetier) runs with the expert cache of its run (budget, store,
  policy and options, read back from the result file) and decodes the text token by token (-ub 1),
  so its precision rule and its cache meet the text as they meet a generation; its cost is taken
  against exact stock decoded the same way (the 'exact' row: moetier's exact mode equals it);
- a stock configuration (POINT=stock:FLAGS) runs the llama-perplexity FLAGS given, in batches: the
  peer's `--n-expert-used K` is llama.cpp's own expert_used_count override (the peer sets exactly
  that KV), so its perplexity is stock's with `--override-kv ARCH.expert_used_count=int:K`; a smaller
  quantization is `-m FILE`. Their cost is taken against exact stock in batches.
The peer's `--drop-cold-experts` decides from its live cache and the peer has no teacher-forced
scoring, so those points carry the run's agreement with stock's greedy text and its dropped share,
and no perplexity.

    python bench/frontier.py --run R.json --text prose.txt --text code.txt \\
        --points 'mixed-25=moetier;peer-k6-25=stock:--override-kv ernie4_5-moe.expert_used_count=int:6' \\
        --out bench/results/frontier-R
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from moefy_eval import perplexity
from moetier.config import CacheConfig
from moetier.plot import pyplot
from worker import parse_opts


def moetier_flags(report: dict[str, Any], name: str) -> list[str]:
    """llama-perplexity flags that give the cache of run NAME: its budget, store, policy, options."""
    run = report["runs"].get(name)
    if not run or "budget_bytes" not in run:
        msg = f"{name}: not a moetier configuration of the run (no budget)"
        raise SystemExit(msg)
    args = run["args"]
    policy = args[args.index("--policy") + 1]
    opts, repack = parse_opts(args[args.index("--opts") + 1])
    cfg = CacheConfig(budget=int(run["budget_bytes"]), policy=policy, **opts)
    flags = ["-ub", "1", "--expert-cache", str(run["budget_bytes"]), "--expert-opt", cfg.opts()]
    flags += ["--expert-policy", policy]
    if report["config"].get("store"):
        flags += ["--expert-store", report["config"]["store"]]
    if not repack:
        flags.append("--no-repack")
    return flags


def parse_points(text: str) -> list[tuple[str, str, list[str]]]:
    """'NAME=moetier;NAME=stock:FLAGS;...' -> [(name, kind, flags)]."""
    out = []
    for item in (x.strip() for x in text.split(";") if x.strip()):
        name, _, spec = item.partition("=")
        kind, _, flags = spec.partition(":")
        if not name or kind not in ("moetier", "stock"):
            msg = f"--points: {item!r} is not NAME=moetier or NAME=stock:FLAGS"
            raise SystemExit(msg)
        out.append((name, kind, shlex.split(flags)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="bench/run.py result (.json) with the lossy configurations")
    p.add_argument("--text", action="append", help="held-out text (repeat for several)")
    p.add_argument("--points", help="NAME=moetier;NAME=stock:FLAGS;... (NAME: a config of the run)")
    p.add_argument(
        "--render",
        action="store_true",
        help="no perplexity runs: the table and plot again from OUT.json of an earlier run (its texts and points)",
    )
    p.add_argument(
        "--lossless",
        default=None,
        help="our exact configuration of the run (default: the fastest of ours that left nothing out, "
        "at the points' budget)",
    )
    p.add_argument(
        "--peer-lossless",
        default=None,
        help="the peer's lossless configuration to compare with (default: its fastest that dropped nothing, "
        "at the points' budget)",
    )
    p.add_argument("--ctx", type=int, default=512, help="perplexity context (default: 512)")
    p.add_argument("--chunks", type=int, default=2, help="chunks of ctx tokens per text (default: 2)")
    p.add_argument("--threads", type=int, default=2, help="threads (default: 2)")
    p.add_argument("--out", required=True, help="output prefix: OUT.json, OUT.md, OUT.png")
    a = p.parse_args()

    report = json.loads(Path(a.run).read_text())
    out = Path(a.out)
    if a.render:
        doc = json.loads(out.with_name(out.name + ".json").read_text())
        names = list(doc["points"])
        render(
            report,
            doc,
            out,
            pick_lossless(report, a.run, a.lossless, names, peer=False),
            pick_lossless(report, a.run, a.peer_lossless, names, peer=True),
        )
        return
    if not a.text or not a.points:
        p.error("--text and --points are required (unless --render)")
    model = Path(report["model"])
    texts = [Path(t) for t in a.text]
    names = [n for n, _, _ in parse_points(a.points)]
    lossless = pick_lossless(report, a.run, a.lossless, names, peer=False)
    peer_lossless = pick_lossless(report, a.run, a.peer_lossless, names, peer=True)

    def ppl(flags: list[str]) -> dict[str, float]:
        return {t.stem: perplexity(model, t, a.ctx, a.chunks, a.threads, flags) for t in texts}

    base = {"decode": ppl(["-ub", "1", "--no-repack"]), "batch": ppl(["--no-repack"])}
    sys.stderr.write(f"exact: {base}\n")
    points: dict[str, Any] = {}
    for name, kind, flags in parse_points(a.points):
        mode = "decode" if kind == "moetier" else "batch"
        p_ = ppl(moetier_flags(report, name) if kind == "moetier" else [*flags, "--no-repack"])
        points[name] = {
            "kind": kind,
            "flags": flags,
            "ppl": p_,
            "vs_exact": {k: v / base[mode][k] for k, v in p_.items()},
        }
        sys.stderr.write(f"{name}: {p_}\n")
    doc = {"run": a.run, "model": str(model), "texts": [str(t) for t in texts], "ctx": a.ctx, "chunks": a.chunks}
    doc |= {"exact": base, "points": points}
    out.with_name(out.name + ".json").write_text(json.dumps(doc, indent=1))
    render(report, doc, out, lossless, peer_lossless)


def render(
    report: dict[str, Any], doc: dict[str, Any], out: Path, lossless: str | None, peer_lossless: str | None
) -> None:
    md = table(report, doc, lossless, peer_lossless)
    out.with_name(out.name + ".md").write_text(md)
    print(md)
    plot(report, doc, out.with_name(out.name + ".png"), lossless, peer_lossless)


def pick_lossless(report: dict[str, Any], run_path: str, name: str | None, points: list[str], peer: bool) -> str | None:
    """The configuration the lossy points are set against: the one named (it must be in the run), or
    the fastest lossless one of ours (peer=False: nothing skipped, no low loads) or of the peer's
    (nothing dropped) at the budget the points share; None where the run has none (the peer not run)."""
    runs = report["runs"]
    if name is not None:
        if name not in runs or "error" in runs[name]:
            msg = f"{run_path}: no configuration {name!r} ran (configurations: {', '.join(runs)})"
            raise SystemExit(msg)
        return name
    budgets = {n.rsplit("-", 1)[-1] for n in points}
    if len(budgets) != 1:
        msg = f"{run_path}: the points are at several budgets ({', '.join(sorted(budgets))}): name --lossless"
        raise SystemExit(msg)
    budget = budgets.pop()

    def lossless(n: str) -> bool:
        lossy = runs[n].get("lossy") or {}
        # the peer's reduced top-k drops nothing it routes: it routes fewer
        fewer = any("--n-expert-used" in a for a in runs[n].get("args") or [])
        return not fewer and not any(lossy.get(k) for k in ("skipped", "loads_low", "dropped"))

    cands = [
        n
        for n, r in runs.items()
        if "error" not in r
        and "decode_tok_s" in r
        and n.endswith("-" + budget)
        and n.startswith("peer") == peer
        and not n.startswith(("stock", "upstream"))
        and lossless(n)
    ]
    return max(cands, key=lambda n: float(runs[n]["decode_tok_s"]["median"]), default=None)


def speed(report: dict[str, Any], name: str | None) -> float | None:
    run = report["runs"].get(name)
    return float(run["decode_tok_s"]["median"]) if run and "decode_tok_s" in run else None


def rows_of(
    report: dict[str, Any], doc: dict[str, Any], lossless: str | None, peer: str | None
) -> list[dict[str, Any]]:
    """One row per configuration of the run that is ours or the peer's (lossless and lossy) or a
    point with a perplexity."""
    names = [n for n in (lossless, *doc["points"]) if n is not None]
    budget = "-" + next(iter(doc["points"])).rsplit("-", 1)[-1] if doc["points"] else ""
    names += [n for n in report["runs"] if n.startswith("peer") and n.endswith(budget) and n not in names]
    out = []
    for n in names:
        run = report["runs"].get(n, {})
        pt = doc["points"].get(n)
        out.append(
            {
                "name": n,
                "tok_s": speed(report, n),
                "vs_peer": (speed(report, n) or 0) / p if (p := speed(report, peer)) else None,
                "vs_exact": pt["vs_exact"]
                if pt
                else (dict.fromkeys(doc["exact"]["decode"], 1.0) if n in (lossless, peer) else None),
                "agreement": (run.get("agreement") or {}).get("median"),
                "lossy": run.get("lossy") or {},
            }
        )
    return out


def table(report: dict[str, Any], doc: dict[str, Any], lossless: str | None, peer: str | None) -> str:
    stems = list(doc["exact"]["decode"])
    head = f"| config | decode tok/s | vs {peer or 'the peer (not run)'} | " + " | ".join(
        f"ppl {s} vs exact" for s in stems
    )
    head += " | agreement with stock | left out |"
    lines = [
        f"model `{Path(doc['model']).name}`, run `{Path(doc['run']).name}`; perplexity on {doc['chunks']} x "
        f"{doc['ctx']} tokens of each text; exact: decode "
        + ", ".join(f"{k} {v:.4f}" for k, v in doc["exact"]["decode"].items())
        + ", batch "
        + ", ".join(f"{k} {v:.4f}" for k, v in doc["exact"]["batch"].items()),
        "",
        head,
        "|" + "---|" * (5 + len(stems)),
    ]
    for r in rows_of(report, doc, lossless, peer):
        ppl = [f"{100 * (r['vs_exact'][s] - 1):+.2f}%" if r["vs_exact"] else "n/a" for s in stems]
        lossy = r["lossy"]
        left = (
            f"{100 * lossy['dropped']:.1f}% dropped"
            if "dropped" in lossy
            else f"{100 * lossy['skipped']:.1f}% skipped, {100 * lossy['loads_low']:.0f}% of loads low"
            if "skipped" in lossy
            else "-"
        )
        agree = "-" if r["agreement"] is None else f"{r['agreement']:.2f}"
        tok = "-" if r["tok_s"] is None else f"{r['tok_s']:.2f}"
        vs = "-" if r["vs_peer"] is None else f"{r['vs_peer']:.2f}x"
        lines.append(f"| {r['name']} | {tok} | {vs} | " + " | ".join(ppl) + f" | {agree} | {left} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], doc: dict[str, Any], out: Path, lossless: str | None, peer: str | None) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows_of(report, doc, lossless, peer):
        if r["tok_s"] is None:
            continue
        style = "o" if not r["name"].startswith(("peer", "upstream")) else "s" if r["name"].startswith("peer") else "^"
        if r["vs_exact"]:
            cost = 100 * (sum(r["vs_exact"].values()) / len(r["vs_exact"]) - 1)
            left.plot(cost, r["tok_s"], style)
            left.annotate(r["name"], (cost, r["tok_s"]), fontsize=7)
        if r["agreement"] is not None:
            right.plot(r["agreement"], r["tok_s"], style)
            right.annotate(r["name"], (r["agreement"], r["tok_s"]), fontsize=7)
    left.set_xlabel("perplexity over exact, mean of texts (%)")
    left.set_ylabel("decode tok/s")
    right.set_xlabel("agreement with stock's greedy text")
    right.invert_xaxis()
    fig.suptitle(f"{Path(doc['model']).name}: speed and quality (o moetier, s peer, ^ stock)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
