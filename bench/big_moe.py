"""A random-weight MoE at a real model's shapes, for benchmarks at the scale users run (tens of GB).

Default: Qwen3-30B-A3B's MoE geometry (48 layers, 128 experts, top-8, n_embd 2048, expert FFN 768,
16 heads of 128 with 4 KV heads: its attention is 32 query heads wide, so ours has about half its
attention weights), Q4_K experts (random blocks), f16 attention, the tiny test vocabulary: ~16.3 GB,
of which ~16.3 GB are experts. Routing on random weights is close to uniform: hits follow the cache's
share of the experts, where a trained model's skew gives more (see the replays of real traces).

    python bench/big_moe.py                      # prints the path; writes it once (~1-3 minutes)
    moetier pack MODEL.gguf                      # the expert store beside it
    python bench/run.py --model MODEL.gguf --store MODEL.experts --budgets 36 ...
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from moetier.tools.tiny import write_tiny_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48, help="MoE layers (default: 48)")
    p.add_argument("--experts", type=int, default=128, help="experts per layer (default: 128)")
    p.add_argument("--used", type=int, default=8, help="experts per token (default: 8)")
    p.add_argument("--embd", type=int, default=2048, help="hidden size (default: 2048)")
    p.add_argument("--ff", type=int, default=768, help="expert FFN size, a multiple of 256 (default: 768)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default: 16, head size 128)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (default: 4)")
    p.add_argument("--type", default="q4_k", help="expert type: q4_k, q8_0, f16 (default: q4_k)")
    p.add_argument(
        "--dir",
        default=os.environ.get("MOETIER_CACHE", str(Path.home() / ".cache" / "moetier")) + "/models",
        help="where the model is written (default: $MOETIER_CACHE/models or ~/.cache/moetier/models)",
    )
    a = p.parse_args()
    name = f"random-qwen3moe-l{a.layers}-e{a.experts}k{a.used}-d{a.embd}-f{a.ff}-{a.type}.gguf"
    path = Path(a.dir) / name
    if not path.exists():
        t0 = time.monotonic()
        tmp = path.with_suffix(".part")
        write_tiny_model(
            tmp,
            "qwen3moe",
            n_expert=a.experts,
            n_expert_used=a.used,
            n_layer=a.layers,
            n_embd=a.embd,
            n_ff_exp=a.ff,
            n_head=a.heads,
            n_head_kv=a.kv_heads,
            expert_type=a.type,
            n_ctx_train=32768,
        )
        tmp.rename(path)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.monotonic() - t0:.0f} s")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
