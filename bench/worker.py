"""One benchmark configuration in its own process (so a memory cap applies to it alone): loads the
model with or without the expert cache, warms up once, generates on each prompt, prints JSON."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import diskstat
from moetier import CacheConfig, ContextConfig, Model

# CacheConfig fields that take whole numbers (the rest are floats)
INT_OPTS = (
    "prefetch",
    "io_threads",
    "io_uring",
    "warm",
    "lock_weights",
    "direct_io",
    "fitted_prefetch",
    "verify_all",
    "prefetch_gate",
    "grow",
    "huge_pages",
)


def parse_opts(text: str) -> tuple[dict[str, Any], bool]:
    """KEY=VALUE,... as CacheConfig fields (typed), and whether repacking stays on (repack=0 is a
    model option, not a cache one). No warm start unless asked for: repeated runs must not warm each
    other up."""
    opts: dict[str, Any] = {}  # CacheConfig fields of several types
    repack = True
    for k, v in (kv.split("=", 1) for kv in text.split(",") if kv):
        if k == "repack":
            repack = v != "0"
            continue
        opts[k] = int(v) if k in INT_OPTS else float(v)
    opts.setdefault("warm", 0)
    return opts, repack


def disk_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (/proc/self/io read_bytes)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def status_bytes(key: str) -> int:
    """A kB field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def counter_delta(now: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """now - then, field by field (lists elementwise); then empty: now."""
    out: dict[str, Any] = {}
    for k, v in now.items():
        t = then.get(k)
        if isinstance(v, list):
            out[k] = [a - b for a, b in zip(v, t, strict=True)] if t is not None else list(v)
        else:
            out[k] = v - t if t is not None else v
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="GGUF model")
    p.add_argument("--cache", default="0", help="expert cache bytes, or auto; 0 = stock llama.cpp")
    p.add_argument("--store", default=None, help="expert store directory")
    p.add_argument("--policy", default="lru", help="eviction policy")
    p.add_argument(
        "--opts",
        default="t1=1,t2=1",
        help="expert cache options KEY=VALUE,... (CacheConfig fields; default: all high precision)",
    )
    p.add_argument("--prompts", required=True, help="JSON file: list of prompt strings")
    p.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--threads", type=int, default=2, help="threads")
    p.add_argument("--ctx", type=int, default=2048, help="context length")
    p.add_argument(
        "--no-repack",
        action="store_true",
        help="turn off llama.cpp's repacked CPU weights (they are anonymous copies a memory cap cannot page out)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="no warm-up generation: the first prompt meets the cache as the load left it (cold or warm start)",
    )
    a = p.parse_args()

    t0 = time.perf_counter()
    opts, repack = parse_opts(a.opts)
    a.no_repack = a.no_repack or not repack
    budget = a.cache if a.cache == "auto" else int(a.cache)
    cache = CacheConfig(budget=budget, policy=a.policy, **opts) if budget else None
    m = Model(
        a.model,
        store=a.store,
        cache=cache,
        context=ContextConfig(n_ctx=a.ctx, n_threads=a.threads),
        repack=not a.no_repack,
    )
    load_s = time.perf_counter() - t0
    prompts = json.loads(Path(a.prompts).read_text())
    if not a.no_warmup:
        m.generate(prompts[0], max_tokens=4)  # warm-up: first-touch costs are not the steady state
    runs = []
    io0, faults0 = disk_read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    # the device the experts come from: its own counters say how busy the decode steps kept it
    device = diskstat.device_of(a.store or a.model)
    for text in prompts:
        # counters at the first token: what the decode steps alone read is the rest
        first: dict[str, int] = {}
        pf_first: dict[str, Any] = {}
        dev_first: list[diskstat.DiskCounters | None] = []

        def at_first_token(
            first: dict[str, int] = first,
            pf_first: dict[str, Any] = pf_first,
            dev_first: list[diskstat.DiskCounters | None] = dev_first,
        ) -> None:
            dev_first.append(diskstat.counters(device))
            first["disk"] = disk_read_bytes()
            first["cache"] = m.stats().n_bytes_read
            first["prefetch"] = m.prefetch_stats().bytes_read
            first["read_us"] = m.stats().read_us
            pf_first.update(m.prefetch_stats()._asdict())

        disk0 = disk_read_bytes()
        r = m.generate(text, max_tokens=a.n, on_first_token=at_first_token)
        disk1 = disk_read_bytes()
        dev1 = diskstat.counters(device)
        runs.append(
            {
                "decode_disk_read_bytes": disk1 - first.get("disk", disk1),
                # the whole device during the decode steps (other processes' reads included)
                "decode_device": diskstat.delta(dev1, dev_first[0] if dev_first else dev1),
                "decode_cache_bytes_read": r.stats.n_bytes_read - first.get("cache", r.stats.n_bytes_read),
                "decode_prefetch_bytes_read": m.prefetch_stats().bytes_read - first.get("prefetch", 0),
                # the prefetch counters of the decode steps alone (each generation resets them)
                "decode_prefetch": counter_delta(m.prefetch_stats()._asdict(), pf_first),
                "disk_read_bytes": disk1 - disk0,
                "prompt_tokens": r.prompt_tokens,
                "tokens": len(r.tokens),
                "ttft_s": r.prefill_seconds,
                "prefill_tok_s": r.prefill_tokens_per_second,
                "decode_tok_s": r.decode_tokens_per_second,
                "decode_s": r.decode_seconds,
                "n_lookups": r.stats.n_lookups,
                "n_hits": r.stats.n_hits,
                "n_skipped": r.stats.n_skipped,
                "n_loads_high": r.stats.n_loads_high,
                "n_loads_low": r.stats.n_loads_low,
                "n_bytes_read": r.stats.n_bytes_read,
                "read_s": r.stats.read_seconds,
                # what the decode steps waited for expert reads (the load ops), beside decode_s
                "decode_read_s": (r.stats.read_us - first.get("read_us", r.stats.read_us)) / 1e6,
                "token_ids": r.tokens,
                "text": r.text,
            }
        )
    out = {
        "load_s": load_s,
        # what the generations read from the disk (page faults and readahead of mmap'ed weights
        # included) and the process's anonymous memory (KV cache, compute buffers, copies of weights)
        "disk_read_bytes": disk_read_bytes() - io0,
        "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0,
        "rss_anon_bytes": status_bytes("RssAnon"),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cache_info": m.cache_info(),
        "budget_note": m.budget_note,
        "warm_progress": list(m.warm_progress()),
        "prefetch": m.prefetch_stats()._asdict(),
        "runs": runs,
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
