"""Upstream llama.cpp (unpatched, the pinned commit; bench/external/build-upstream.sh) as one benchmark
configuration, with worker.py's interface and output: its llama-completion, greedy, on each prompt in
turn (one process per prompt, all inside the same cap, so the page cache one left is what the next
finds, as in one process), after a 4-token warm-up on the first prompt. Timings are llama.cpp's own
(`common_perf_print`: prompt eval = time to first token's pass; eval = the decode steps, plus the
sampling of the tokens they decode, which llama.cpp times apart and worker.py's decode time holds);
disk bytes and faults from the children's rusage and /proc/self/io. No token ids: run.py compares
texts."""

from __future__ import annotations

import argparse
import json
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_RE = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
EVAL_RE = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")
SAMPLING_RE = re.compile(r"\bsampling time =\s*([\d.]+) ms")


def children_io() -> tuple[int, int, int]:
    """read bytes (storage), major faults and peak RSS bytes of the waited-for children so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    # ru_inblock counts 512-byte blocks read from storage by the children
    return ru.ru_inblock * 512, ru.ru_majflt, ru.ru_maxrss * 1024


def complete(binary: str, model: str, prompt: str, n: int, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [binary, "-m", model, "-p", prompt, "-n", str(n), "--temp", "0", "-t", str(a.threads), "-c", str(a.ctx)]
    cmd += ["-no-cnv", "--no-display-prompt", "--simple-io", "--no-warmup", *shlex.split(a.args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        tail = " | ".join(r.stderr.strip().splitlines()[-3:])
        msg = f"llama-completion exited with {r.returncode}: {tail}"
        raise SystemExit(msg)
    return {"text": r.stdout, **timings(r.stderr)}


def timings(stderr: str) -> dict[str, Any]:
    """llama-completion's perf lines -> prompt_ms, prompt_tokens, eval_ms, eval_runs. eval_ms holds
    the sampling of the eval_runs tokens after the first: worker.py's decode time samples each token
    too (greedy over the whole vocabulary, 0.28-0.45 ms a token on the 0.5B), and llama.cpp's eval time
    does not."""
    pm, em, sm = PROMPT_RE.search(stderr), EVAL_RE.search(stderr), SAMPLING_RE.search(stderr)
    if not pm or not em or not sm:
        msg = "llama-completion printed no timings"
        raise SystemExit(msg)
    runs = int(em.group(2))
    # one sample per generated token: runs + 1, the first of them before decode starts
    sampling_ms = float(sm.group(1)) * runs / (runs + 1)
    return {
        "prompt_ms": float(pm.group(1)),
        "prompt_tokens": int(pm.group(2)),
        "eval_ms": float(em.group(1)) + sampling_ms,
        "eval_runs": runs,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--upstream-bin", required=True, help="path of upstream llama.cpp's llama-completion")
    p.add_argument("--upstream-args", dest="args", default="", help="more llama-completion flags (e.g. --no-repack)")
    p.add_argument("--model", required=True, help="GGUF model")
    p.add_argument("--prompts", required=True, help="JSON file: list of prompt strings")
    p.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--threads", type=int, default=2, help="threads")
    p.add_argument("--ctx", type=int, default=2048, help="context length")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up generation")
    p.add_argument("--timeout", type=float, default=900, help="seconds before one prompt is abandoned")
    return p


def main() -> None:
    a = parser().parse_args()

    prompts = json.loads(Path(a.prompts).read_text())
    t0 = time.perf_counter()
    if not a.no_warmup:
        complete(a.upstream_bin, a.model, prompts[0], 4, a)
    load_s = time.perf_counter() - t0
    io0, f0, _ = children_io()
    runs = []
    for text in prompts:
        d = complete(a.upstream_bin, a.model, text, a.n, a)
        n = d["eval_runs"] + 1  # the first token comes out of the prompt's pass
        runs.append(
            {
                "prompt_tokens": d["prompt_tokens"],
                "tokens": n,
                "ttft_s": d["prompt_ms"] / 1e3,
                "prefill_tok_s": d["prompt_tokens"] / (d["prompt_ms"] / 1e3) if d["prompt_ms"] > 0 else 0.0,
                "decode_tok_s": d["eval_runs"] / (d["eval_ms"] / 1e3) if d["eval_ms"] > 0 else 0.0,
                "decode_s": d["eval_ms"] / 1e3,
                "n_lookups": 0,
                "n_hits": 0,
                "n_bytes_read": 0,
                "read_s": 0.0,
                "token_ids": [],
                "text": d["text"],
            }
        )
    io1, f1, peak = children_io()
    out = {
        "load_s": load_s,
        "disk_read_bytes": io1 - io0,
        "major_faults": f1 - f0,
        "rss_anon_bytes": 0,
        "peak_rss_bytes": peak,
        "upstream": {"bin": a.upstream_bin, "args": a.args},
        "runs": runs,
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
