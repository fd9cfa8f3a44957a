"""The benchmark plot: tok/s and hit rate against the expert cache size, from bench/run.py's result.

One function draws it for both `bench/run.py --out` (OUT.png) and `moetier bench-plot OUT.json`.
matplotlib is optional: without it, MoetierError says how to install it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ._files import replacing
from .errors import MoetierError

__all__ = ["bench_plot", "pyplot"]

MiB = 1 << 20


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only); MoetierError if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        msg = "matplotlib is not installed: pip install matplotlib"
        raise MoetierError(msg) from None
    return plt


def _budgets(report: dict[str, Any], source: str) -> list[tuple[int, float]]:
    """(percent, cache MiB) of every budget the run measured, ascending."""
    runs: dict[str, Any] = report["runs"]
    variants: list[str] = report.get("variants", ["moetier"])
    pcts = set()
    for name in runs:
        head, _, tail = name.rpartition("-")
        if tail.isdigit() and (head == "stock-capped" or head in variants):
            pcts.add(int(tail))
    if not pcts:
        msg = f"{source}: no budget runs (stock-capped-PCT or VARIANT-PCT) in 'runs'"
        raise MoetierError(msg)
    out = []
    for pct in sorted(pcts):
        # the harness's budget: max(min_cache_bytes, expert_bytes * pct / 100), recorded per variant run
        recorded = [runs[f"{v}-{pct}"].get("budget_bytes") for v in variants if f"{v}-{pct}" in runs]
        known = [b for b in recorded if b]
        budget = known[0] if known else max(int(report.get("min_cache_bytes", 0)), report["expert_bytes"] * pct // 100)
        out.append((pct, budget / MiB))
    return out


def _completed(run: dict[str, Any] | None) -> dict[str, Any]:
    """run, or {} if it is missing or failed (a failed run's partial numbers are not drawn)."""
    return run if run and "error" not in run else {}


def _median(run: dict[str, Any] | None, key: str) -> float | None:
    stat = _completed(run).get(key)
    return float(stat["median"]) if stat else None


def bench_plot(report: dict[str, Any], out: str | os.PathLike[str], source: str | os.PathLike[str] = "report") -> Path:
    """Writes OUT (PNG): left, decode tok/s against the cache size, one line per moetier variant, stock
    llama.cpp in RAM as a horizontal line and stock under the same memory cap as each budget (a
    horizontal line when the run has one budget); right, the expert cache hit rate per variant.
    Failed runs are left out. MoetierError if REPORT is not bench/run.py's shape or matplotlib is
    missing."""
    src = str(source)
    outp = Path(out)
    if outp.suffix == "":
        outp = outp.with_suffix(".png")  # as matplotlib would name it
    elif outp.suffix.lower() != ".png":
        msg = f"{outp}: the plot is a PNG; give an output name ending in .png"
        raise MoetierError(msg)
    if not isinstance(report, dict) or not isinstance(report.get("runs"), dict) or "expert_bytes" not in report:
        msg = f"{src}: not a bench/run.py result (it has 'runs' and 'expert_bytes')"
        raise MoetierError(msg)
    try:
        return _draw(report, outp, src)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # JSON, but not shaped as bench/run.py writes
        msg = (
            f"{src}: not a bench result ({type(e).__name__}: {e}); give the OUT.json that bench/run.py --out OUT wrote"
        )
        raise MoetierError(msg) from None


def _draw(report: dict[str, Any], outp: Path, src: str) -> Path:
    plt = pyplot()
    runs: dict[str, Any] = report["runs"]
    variants: list[str] = report.get("variants", ["moetier"])
    budgets = _budgets(report, src)
    xs_all = [mib for _, mib in budgets]

    fig, (speed, hits) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in variants:
        pts = [(mib, _median(runs.get(f"{v}-{pct}"), "decode_tok_s")) for pct, mib in budgets]
        xy = [(x, y) for x, y in pts if y is not None]
        if xy:
            speed.plot(*zip(*xy, strict=True), "o-", label=v)
        rate = [(mib, _completed(runs.get(f"{v}-{pct}")).get("hit_rate")) for pct, mib in budgets]
        xy = [(x, 100 * float(y)) for x, y in rate if y is not None]
        if xy:
            hits.plot(*zip(*xy, strict=True), "o-", label=v)
    capped = [(mib, _median(runs.get(f"stock-capped-{pct}"), "decode_tok_s")) for pct, mib in budgets]
    capped_xy = [(x, y) for x, y in capped if y is not None]
    if len(budgets) == 1 and capped_xy:
        speed.axhline(capped_xy[0][1], ls=":", c="tab:red", label="stock, same memory cap")
    elif capped_xy:
        speed.plot(*zip(*capped_xy, strict=True), "x--", c="tab:red", label="stock, same memory cap")
    ram = _median(runs.get("stock-ram"), "decode_tok_s")
    if ram is not None:
        speed.axhline(ram, ls="--", c="gray", label="stock, every expert in RAM")

    ticks = [f"{mib:.0f} MiB\n{pct}%" for pct, mib in budgets]
    for ax in (speed, hits):
        ax.set_xticks(xs_all, ticks)
        ax.set_xlabel("expert cache size (% of expert bytes)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    speed.set(ylabel="decode tok/s", title="decode speed")
    speed.set_ylim(bottom=0)
    hits.set(ylabel="hit rate %", title="expert cache hit rate", ylim=(0, 100))
    name = Path(str(report.get("model", ""))).name
    cores = report.get("machine", {}).get("cores")
    fig.suptitle(f"{name}" + (f" ({cores} cores)" if cores else ""), fontsize=10)
    fig.tight_layout()
    outp.parent.mkdir(parents=True, exist_ok=True)
    with replacing(outp) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return outp
