"""The peer BigMoeOnEdge as one benchmark configuration, with worker.py's interface and output: its
`bmoe-cli --session` (model loaded once, one JSON request per prompt, KV cleared between them, as
worker.py runs every prompt in one loaded model) warms up on 4 tokens of the first prompt, then
generates on each prompt; the JSON on stdout has worker.py's fields, from the peer's own telemetry
(BMOE_PROGRESS per token, BMOE_DONE per request) and the child's /proc counters.

Differences to worker.py, all reported as such: the peer gives text, not token ids (run.py compares
texts); its hit rate is its own (cache_hit_pct); its decode rate is its own tok/s (decode steps
after the first token over their time); the split of disk bytes at the first token is read when the
first BMOE_PROGRESS line arrives, so a read of the second token already under way may count as
decode."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import diskstat

MiB = 1 << 20


def proc_field(pid: int, name: str, key: str) -> int:
    """A field of /proc/PID/NAME ("io": bytes; "status": kB fields, returned in bytes)."""
    try:
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            if line.startswith(key + ":"):
                v = int(line.split()[1])
                return v * 1024 if name == "status" else v
    except OSError:
        pass
    return 0


def major_faults(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[9])
    except (OSError, IndexError, ValueError):
        return 0


class Session:
    """bmoe-cli --session as a child process: requests on stdin, BMOE_* lines on stdout."""

    def __init__(self, cmd: list[str], timeout: float) -> None:
        # its log goes to a file: a pipe nobody reads fills up and stops the peer
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1
        )
        self.timeout = timeout
        ready = self._until("BMOE_READY", "BMOE_ERROR")
        if ready[0] != "BMOE_READY":
            self.fail(f"peer did not start: {ready[1]}")
        self.ready: dict[str, Any] = ready[1]

    @property
    def stdout(self) -> IO[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    def fail(self, msg: str) -> None:
        self.proc.kill()
        self.log.seek(0)
        err = self.log.read()
        tail = " | ".join(err.strip().splitlines()[-3:])
        text = f"{msg}; stderr: {tail}"
        raise SystemExit(text)

    def _until(self, *tags: str) -> tuple[str, dict[str, Any]]:
        while True:
            line = self.stdout.readline()
            if not line:
                self.fail(f"peer exited with {self.proc.wait()}")
            tag, _, body = line.strip().partition(" ")
            if tag in tags:
                return tag, json.loads(body) if body else {}

    def generate(self, rid: int, prompt: str, n: int, device: str | None = None) -> dict[str, Any]:
        """One request; the peer's BMOE_DONE fields plus the disk bytes and faults of the child
        during it, the decode-only share of them (after the first token), and what the device
        (diskstat) read and how busy it was in the decode steps."""
        assert self.proc.stdin is not None
        pid = self.proc.pid
        io0, f0 = proc_field(pid, "io", "read_bytes"), major_faults(pid)
        req = {"cmd": "generate", "id": rid, "prompt": prompt, "n_predict": n, "clear_kv": True}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        first_io: int | None = None
        first_dev: diskstat.DiskCounters | None = None
        steps: list[dict[str, Any]] = []
        while True:
            tag, body = self._until("BMOE_PROGRESS", "BMOE_DONE", "BMOE_ERROR")
            if tag == "BMOE_ERROR":
                self.fail(f"request {rid}: {body.get('msg')}")
            if tag == "BMOE_PROGRESS":
                if first_io is None:
                    first_io = proc_field(pid, "io", "read_bytes")
                    first_dev = diskstat.counters(device)
                steps.append(body)
                continue
            io1 = proc_field(pid, "io", "read_bytes")
            body["disk_read_bytes"] = io1 - io0
            body["decode_disk_read_bytes"] = io1 - (first_io if first_io is not None else io1)
            body["decode_device"] = diskstat.delta(diskstat.counters(device), first_dev)
            body["major_faults"] = major_faults(pid) - f0
            # the peer's per-step expert reads: step 1 carries the prompt's pass, the rest decode
            body["decode_read_bytes"] = int(sum(s.get("read_mb", 0.0) for s in steps[1:]) * MiB)
            return body

    def close(self) -> dict[str, int]:
        """Peak and anonymous memory of the child, then closes it."""
        pid = self.proc.pid
        mem = {
            "peak_rss_bytes": proc_field(pid, "status", "VmHWM"),
            "rss_anon_bytes": proc_field(pid, "status", "RssAnon"),
        }
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write('{"cmd":"close"}\n')
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        return mem


def summary_counts(csv_text: str) -> list[dict[str, int]]:
    """experts_routed / experts_dropped of each request from the '# summary' lines the peer's --csv
    sink writes (one per request, in order; key=value tokens)."""
    out = []
    for line in csv_text.splitlines():
        if not line.startswith("# summary "):
            continue
        kv = dict(tok.split("=", 1) for tok in line[len("# summary ") :].split() if "=" in tok)
        out.append({k: int(kv.get(k, 0)) for k in ("experts_routed", "experts_dropped")})
    return out


def attach_counts(runs: list[dict[str, Any]], counts: list[dict[str, int]]) -> None:
    """Each measured request gets its summary's counts: the last len(runs) summaries (the warm-up's
    comes first)."""
    for run, c in zip(runs, counts[len(counts) - len(runs) :], strict=True):
        run.update(c)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-bin", required=True, help="path of the peer's bmoe-cli")
    p.add_argument("--peer-args", default="", help="the peer's flags (e.g. '--moe-stream --cache-mb 26')")
    p.add_argument("--model", required=True, help="GGUF model")
    p.add_argument("--prompts", required=True, help="JSON file: list of prompt strings")
    p.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--threads", type=int, default=2, help="threads")
    p.add_argument("--ctx", type=int, default=2048, help="context length")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up generation")
    p.add_argument("--timeout", type=float, default=900, help="seconds before the peer is abandoned")
    return p


def main() -> None:
    a = parser().parse_args()

    # its per-request summary (what --drop-cold-experts dropped) comes from its CSV sink
    csv_file = tempfile.NamedTemporaryFile("r", suffix=".csv")
    cmd = [a.peer_bin, "-m", a.model, "-t", str(a.threads), "-c", str(a.ctx), "--temp", "0", "--session"]
    cmd += ["--csv", csv_file.name, *shlex.split(a.peer_args)]
    t0 = time.perf_counter()
    s = Session(cmd, a.timeout)
    load_s = time.perf_counter() - t0
    prompts = json.loads(Path(a.prompts).read_text())
    if not a.no_warmup:
        s.generate(0, prompts[0], 4)
    runs = []
    disk = faults = 0
    device = diskstat.device_of(a.model)
    for i, text in enumerate(prompts, start=1):
        d = s.generate(i, text, a.n, device)
        disk += d["disk_read_bytes"]
        faults += d["major_faults"]
        n = int(d["tokens"])
        decode_s = (n - 1) / d["tok_s"] if n > 1 and d["tok_s"] > 0 else 0.0
        runs.append(
            {
                "prompt_tokens": int(d["n_prompt"]),
                "tokens": n,
                "ttft_s": float(d["prefill_s"]),
                "prefill_tok_s": float(d["prefill_tps"]),
                "decode_tok_s": float(d["tok_s"]),
                "decode_s": decode_s,
                # the peer counts hits per expert read; no lookup count: its rate is carried as is
                "n_lookups": 0,
                "n_hits": 0,
                "peer_cache_hit_pct": float(d["cache_hit_pct"]),
                "n_bytes_read": int(float(d["read_mib"]) * MiB),
                "decode_cache_bytes_read": d["decode_read_bytes"],
                "decode_prefetch_bytes_read": 0,
                "decode_disk_read_bytes": d["decode_disk_read_bytes"],
                "decode_device": d["decode_device"],
                "disk_read_bytes": d["disk_read_bytes"],
                "read_s": float(d["io_s_tok"]) * n,
                "stall_s_per_token": float(d["stall_s_tok"]),
                "token_ids": [],
                "text": str(d["text"]),
            }
        )
    mem = s.close()
    attach_counts(runs, summary_counts(Path(csv_file.name).read_text()))
    out = {
        "load_s": load_s,
        "disk_read_bytes": disk,
        "major_faults": faults,
        **mem,
        "peer": {"cmd": cmd, "ready": s.ready},
        "runs": runs,
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
