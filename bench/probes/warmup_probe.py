"""Probe, 2026-11-27. Question: does upstream llama-completion's warm-up explain its shorter time to
first token under the cap? Answer, the sh60 1.5B at 25%, 22 alternating runs: no, without the
warm-up the prompt is no slower (medians 10502 ms with it, 10184 ms without). Result:
bench/results/prefill-warmup-upstream-sh60-25.txt.

Does upstream llama-completion's warm-up change its prompt time under a memory cap? Alternating
single runs with and without `--no-warmup`, each in a fresh cgroup v1 group, the model's pages
dropped first; llama.cpp's own "prompt eval time" per run, and the medians.

    python bench/probes/warmup_probe.py --bin llama-completion --model M.gguf \
        --prompts bench/results/prompts-eval3-512.json --cap-mib 1048 --pairs 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness's modules

import cgroup

PROMPT_EVAL = re.compile(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens")


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def prompt_ms(binary: Path, model: Path, prompt: Path, cap_mib: int, extra: list[str]) -> float:
    drop_pages(model)
    cap = cgroup.MemoryCap(f"moetier-warmup-{os.getpid()}", cap_mib << 20)
    try:
        args = [str(binary), "-m", str(model), "-f", str(prompt), "-n", "2", "-t", "2", "-c", "1024"]
        args += ["--no-repack", "-no-cnv", "--temp", "0", *extra]
        r = subprocess.run(args, capture_output=True, text=True, preexec_fn=cap.preexec, check=False)
    finally:
        cap.close()
    m = PROMPT_EVAL.search(r.stderr)
    if r.returncode != 0 or m is None:
        sys.exit(f"{binary}: exit {r.returncode}, no prompt eval time: {r.stderr[-400:]}")
    return float(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True, type=Path, help="upstream llama-completion")
    p.add_argument("--model", required=True, type=Path, help="GGUF")
    p.add_argument("--prompts", required=True, type=Path, help="JSON list of prompts; the first is used")
    p.add_argument("--cap-mib", required=True, type=int, help="cgroup memory cap (counts page cache)")
    p.add_argument("--pairs", type=int, default=8, help="pairs of runs, warm-up on first in each")
    a = p.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(json.loads(a.prompts.read_text())[0])
        f.flush()
        runs: dict[str, list[float]] = {"warm-up on": [], "--no-warmup": []}
        n = 0
        for _ in range(a.pairs):
            for name, extra in (("warm-up on", []), ("--no-warmup", ["--no-warmup"])):
                ms = prompt_ms(a.bin, a.model, Path(f.name), a.cap_mib, extra)
                runs[name].append(ms)
                n += 1
                print(f"{n}  {name:12s} {ms:9.2f} ms", flush=True)
    for name, v in runs.items():
        print(f"{name}: median {statistics.median(v):.0f} ms (min {min(v):.0f}, max {max(v):.0f}), {len(v)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
