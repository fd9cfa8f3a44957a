"""One benchmark configuration in its own process (so a memory cap applies to it alone): loads the
model with or without the expert cache, warms up once, generates on each prompt, prints JSON."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from moetier import CacheConfig, ContextConfig, Model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="GGUF model")
    p.add_argument("--cache", type=int, default=0, help="expert cache bytes; 0 = stock llama.cpp")
    p.add_argument("--store", default=None, help="expert store directory")
    p.add_argument("--policy", default="lru", help="eviction policy")
    p.add_argument("--prompts", required=True, help="JSON file: list of prompt strings")
    p.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--threads", type=int, default=2, help="threads")
    p.add_argument("--ctx", type=int, default=2048, help="context length")
    a = p.parse_args()

    t0 = time.perf_counter()
    cache = CacheConfig(budget=a.cache, policy=a.policy) if a.cache else None
    m = Model(a.model, store=a.store, cache=cache, context=ContextConfig(n_ctx=a.ctx, n_threads=a.threads))
    load_s = time.perf_counter() - t0
    prompts = json.loads(open(a.prompts).read())
    m.generate(prompts[0], max_tokens=4)  # warm-up: first-touch costs are not the steady state
    runs = []
    for text in prompts:
        r = m.generate(text, max_tokens=a.n)
        runs.append(
            {
                "prompt_tokens": r.prompt_tokens,
                "tokens": len(r.tokens),
                "ttft_s": r.prefill_seconds,
                "prefill_tok_s": r.prefill_tokens_per_second,
                "decode_tok_s": r.decode_tokens_per_second,
                "decode_s": r.decode_seconds,
                "lookups": r.stats.lookups,
                "hits": r.stats.hits,
                "bytes_read": r.stats.bytes_read,
                "read_s": r.stats.read_seconds,
                "token_ids": r.tokens,
            }
        )
    out = {
        "load_s": load_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cache_info": m.cache_info(),
        "runs": runs,
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
