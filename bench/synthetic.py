"""Engine overhead and read path on a generated (random-weight) MoE, stock llama.cpp in the same run.

No memory cap here (the cgroup harness comes with the real-model benchmarks): this measures what the
cache costs when experts hit, and how fast misses stream, against stock llama.cpp with every expert
in RAM. Prints a markdown table with ratios to stock.

    python bench/synthetic.py --layers 16 --experts 32 --used 4 --embd 384 --ff 384 --budgets 25,50,100
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from moetier import CacheConfig, CacheStats, ContextConfig, Model
from moetier.tools.tiny import write_tiny_model

PROMPT = "The expert cache reads the experts of each MoE layer on demand from the disk. " * 3


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(model: Model, n: int, repeats: int) -> tuple[float, float, CacheStats | None]:
    """Median decode tok/s over repeats (first run is the warm-up), hit rate and stats of the last."""
    rates, hit = [], 0.0
    stats = None
    for i in range(repeats + 1):
        r = model.generate(PROMPT, max_tokens=n)
        if i == 0:
            continue
        rates.append(r.tokens_per_second)
        hit = r.stats.hit_rate
        stats = r.stats
    return statistics.median(rates), hit, stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="MoE layers (default: 16)")
    p.add_argument("--experts", type=int, default=32, help="experts per layer (default: 32)")
    p.add_argument("--used", type=int, default=4, help="experts per token (default: 4)")
    p.add_argument("--embd", type=int, default=384, help="hidden size (default: 384)")
    p.add_argument("--ff", type=int, default=384, help="expert FFN size (default: 384)")
    p.add_argument("--budgets", default="25,50,100", help="cache budgets in %% of expert bytes (default: 25,50,100)")
    p.add_argument("-n", type=int, default=32, help="tokens generated per run (default: 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (default: 3)")
    p.add_argument("--threads", type=int, default=2, help="threads (default: 2)")
    p.add_argument(
        "--dir",
        default=os.environ.get("MOETIER_CACHE", str(Path.home() / ".cache" / "moetier")),
        help="where the generated model is kept (default: $MOETIER_CACHE or ~/.cache/moetier)",
    )
    a = p.parse_args()

    path = Path(a.dir) / f"synthetic-L{a.layers}-E{a.experts}-k{a.used}-d{a.embd}-f{a.ff}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_model(
            path,
            "qwen3moe",
            n_layer=a.layers,
            n_expert=a.experts,
            n_expert_used=a.used,
            n_embd=a.embd,
            n_ff_exp=a.ff,
            n_head=8,
            n_head_kv=4,
            seed=3,
        )
    ctx = ContextConfig(n_ctx=1024, n_threads=a.threads)
    stock = Model(path, context=ctx)
    base, _, _ = run(stock, a.n, a.repeats)
    del stock
    info = Model(path, cache=CacheConfig(budget="16G"), context=ctx).cache_info()
    expert_bytes = int(info["expert_bytes"])
    print(
        f"model: {path.name}, {path.stat().st_size / 2**20:.0f} MiB, experts {expert_bytes / 2**20:.0f} MiB, "
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
    )
    print("| config | decode tok/s | vs stock | hit rate | MB read/token | read MB/s |")
    print("|---|---|---|---|---|---|")
    print(f"| stock llama.cpp (all in RAM) | {base:.2f} | 1.00 | - | - | - |")
    for pct in [int(x) for x in a.budgets.split(",")]:
        budget = max(int(info["min_cache_bytes"]), expert_bytes * pct // 100)
        if pct >= 100:
            budget = int(info["min_cache_bytes"]) * int(info["n_layers"])
        drop_page_cache(path)
        m = Model(path, cache=CacheConfig(budget=budget), context=ctx)
        rate, hit, s = run(m, a.n, a.repeats)
        assert s is not None
        mb_tok = s.total.n_bytes_read / 1e6 / a.n
        bw = s.total.n_bytes_read / 1e6 / s.read_seconds if s.read_seconds else 0.0
        print(
            f"| moetier {pct}% ({budget / 2**20:.0f} MiB) | {rate:.2f} | {rate / base:.2f} | {100 * hit:.1f}% "
            f"| {mb_tok:.2f} | {bw:.0f} |"
        )


if __name__ == "__main__":
    main()
