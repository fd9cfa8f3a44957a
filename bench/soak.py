"""Load under a memory cap: many streaming clients against `moetier serve --parallel N` in a cgroup v1
memory group, every answer checked against stock llama-server's answers under the same load.

    python bench/soak.py --model M.gguf --budget-pct 25 --clients 8 --parallel 4 --duration 600 \\
        --out bench/results/soak-...

Two phases, same prompts, clients, slots and schedule:
  1. reference: the same patched llama-server with the expert cache off (stock llama.cpp's code path),
     no cap;
  2. moetier: the expert cache at budget-pct of the expert bytes, the server in a cgroup whose limit
     counts page cache: other non-expert bytes + budget + headroom (run.py's formula).

llama.cpp is not batch-invariant (a request's logits depend a little on what shares its batch), so
one reference answer per prompt is not the truth: each prompt's reference is the set of answers stock
gave it under load. An answer is `exact` if it is in that set, `diverged` if it is not but shares a
longer prefix with its own prompt's answers than with any other prompt's (numerical drift), `mixed`
if it is closer to another prompt's answers (delivered to the wrong request), `lost` if the stream
failed or ended without a finish reason. The same check of stock against itself (each answer
against the other answers of its prompt) gives the drift a batch alone causes.

Reported: requests served, exact/diverged/mixed/lost counts, request latency and time to first token
p50/p99, generated tokens per second over the run, the cgroup's peak, failcnt and OOM kills, and
whether the server is still healthy at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import moetier
from cgroup import ROOT, MemoryCap
from moetier import CacheConfig, Model

MiB = 1 << 20


@dataclass
class Reply:
    """One streamed request as a client saw it."""

    client: int
    prompt: int
    text: str = ""
    finish: str | None = None
    error: str | None = None
    chunks: int = 0  # content chunks: llama-server streams one token per chunk
    t_start: float = 0.0
    ttft: float | None = None
    latency: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish is not None


def prompts_from(texts: Sequence[str], n: int, chars: int = 300) -> list[str]:
    """n prompts of about `chars` characters, cut at spaces from evenly spaced places in the texts in
    turn (held-out text the models were not calibrated on)."""
    out: list[str] = []
    per = -(-n // len(texts))
    for t in texts:
        for k in range(per):
            start = t.find(" ", len(t) * (2 * k + 1) // (2 * per)) + 1
            piece = t[start : start + chars]
            piece = piece[: piece.rfind(" ")] if " " in piece else piece
            out.append(piece.strip())
    return [p for p in out if p][:n]


def _stream_one(
    base_url: str, client: int, prompt_id: int, prompt: str, n_predict: int, timeout: float, cache_prompt: bool = True
) -> Reply:
    from openai import OpenAI

    r = Reply(client, prompt_id, t_start=time.monotonic())
    try:
        with OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=timeout) as oc:
            stream = oc.completions.create(
                model="m",
                prompt=prompt,
                max_tokens=n_predict,
                temperature=0,
                seed=42,
                stream=True,
                extra_body=None if cache_prompt else {"cache_prompt": False},
            )
            parts: list[str] = []
            for ch in stream:
                if not ch.choices:
                    continue
                c = ch.choices[0]
                if c.text:
                    if r.ttft is None:
                        r.ttft = time.monotonic() - r.t_start
                    parts.append(c.text)
                    r.chunks += 1
                if c.finish_reason:
                    r.finish = c.finish_reason
            r.text = "".join(parts)
    except Exception as e:  # every failure is counted as lost, with its message
        r.error = f"{type(e).__name__}: {e}"[:300]
    r.latency = time.monotonic() - r.t_start
    return r


def run_load(
    base_url: str,
    prompts: Sequence[str],
    clients: int,
    duration: float,
    n_predict: int,
    timeout: float = 600.0,
) -> tuple[list[Reply], float]:
    """`clients` threads, each streaming one request after another until duration has passed (requests
    in flight finish); client c asks prompts c, c + clients, c + 2 * clients, ... (mod len(prompts)),
    so every prompt meets changing neighbours. Returns the replies and the wall time of the load."""
    replies: list[Reply] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    deadline = t0 + duration

    def worker(c: int) -> None:
        k = 0
        while time.monotonic() < deadline:
            pid = (c + k * clients) % len(prompts)
            rep = _stream_one(base_url, c, pid, prompts[pid], n_predict, timeout)
            with lock:
                replies.append(rep)
            k += 1

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies, time.monotonic() - t0


def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def classify(
    replies: Sequence[Reply], reference: dict[int, list[str]], *, leave_one_out: bool = False
) -> dict[str, Any]:
    """Each reply against the reference answers of every prompt (see the module doc). leave_one_out:
    the reference is the replies themselves, and a reply is not compared with itself (one copy of its
    text is removed from its own prompt's set)."""
    counts = {"exact": 0, "diverged": 0, "mixed": 0, "lost": 0}
    diverged_at: list[int] = []
    examples: list[dict[str, Any]] = []
    for r in replies:
        if not r.ok:
            counts["lost"] += 1
            if len(examples) < 5:
                examples.append({"kind": "lost", "prompt": r.prompt, "error": r.error, "finish": r.finish})
            continue
        own = list(reference.get(r.prompt, []))
        if leave_one_out and r.text in own:
            own.remove(r.text)
        if not own:
            continue  # nothing to compare with (a prompt asked once in a leave-one-out check)
        if r.text in own:
            counts["exact"] += 1
            continue
        best_own = max(_lcp(r.text, o) for o in own)
        best_other = max((_lcp(r.text, o) for q, os_ in reference.items() if q != r.prompt for o in os_), default=0)
        if best_other > best_own:
            counts["mixed"] += 1
            kind = "mixed"
        else:
            counts["diverged"] += 1
            diverged_at.append(best_own)
            kind = "diverged"
        if len(examples) < 5:
            examples.append({"kind": kind, "prompt": r.prompt, "text": r.text[:200], "common_prefix": best_own})
    checked = sum(counts.values())
    return {
        **counts,
        "checked": checked,
        "diverged_at_chars_median": statistics.median(diverged_at) if diverged_at else None,
        "examples": examples,
    }


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summarize(replies: Sequence[Reply], wall: float) -> dict[str, Any]:
    ok = [r for r in replies if r.ok]
    lat = [r.latency for r in ok if r.latency is not None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tokens = sum(r.chunks for r in ok)
    return {
        "requests": len(replies),
        "served": len(ok),
        "generated_tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "latency_p50_s": _pct(lat, 0.5),
        "latency_p99_s": _pct(lat, 0.99),
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "finish_reasons": {k: sum(1 for r in ok if r.finish == k) for k in sorted({str(r.finish) for r in ok})},
    }


def by_prompt(replies: Sequence[Reply]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for r in replies:
        if r.ok:
            out.setdefault(r.prompt, []).append(r.text)
    return out


def with_alone(under_load: dict[int, list[str]], alone: Sequence[str]) -> dict[int, list[str]]:
    """The reference answers of each prompt: stock's under load and its answer alone (one request at a
    time). Which requests share a ubatch changes a request's logits (in stock llama.cpp as in moetier),
    and the batches a load makes depend on the server's speed, so a slower server meets compositions
    the stock phase never did; alone is the one composition both can reproduce."""
    out = {k: list(v) for k, v in under_load.items()}
    for i, t in enumerate(alone):
        out.setdefault(i, []).append(t)
    return out


@dataclass
class ServerRun:
    """`moetier serve ARGS` on a port, optionally inside a memory cap; stopped by stop()."""

    args: list[str]
    log: Path
    cap: MemoryCap | None = None
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        cmd = [sys.executable, "-m", "moetier.cli", "serve", *self.args, "--port", str(self.port)]
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=self.cap.preexec if self.cap else None
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                msg = f"server exited with {self.proc.returncode}: {self.log.read_text(errors='replace')[-2000:]}"
                raise RuntimeError(msg)
            if self.healthy():
                return
            time.sleep(0.3)
        self.stop()
        msg = f"server did not become healthy in {timeout:.0f} s: {self.log.read_text(errors='replace')[-2000:]}"
        raise RuntimeError(msg)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return bool(r.status == 200 and json.loads(r.read()).get("status") == "ok")
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("llamacpp:"):
                    name, _, value = line.partition(" ")
                    out[name.removeprefix("llamacpp:")] = float(value)
        return out

    def stop(self) -> int | None:
        """Stops the server; returns its exit code if it had exited on its own before."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return code


def oom_kills(cap: MemoryCap) -> int:
    """OOM kills in the group (memory.oom_control's oom_kill, kernels >= 4.13)."""
    for line in (cap.path / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def phase(
    name: str,
    args: list[str],
    prompts: Sequence[str],
    a: argparse.Namespace,
    log_dir: Path,
    cap: MemoryCap | None,
    duration: float,
    on_done: Callable[[ServerRun], dict[str, Any]] | None = None,
) -> tuple[list[Reply], dict[str, Any]]:
    srv = ServerRun(args, log_dir / f"{name}.log", cap)
    t0 = time.monotonic()
    srv.start()
    startup = time.monotonic() - t0
    print(f"{name}: serving after {startup:.1f} s; {a.clients} clients for {duration:.0f} s", file=sys.stderr)
    load0 = os.getloadavg()
    try:
        replies, wall = run_load(srv.url, prompts, a.clients, duration, a.n_predict)
        healthy = srv.healthy()
        metrics = srv.metrics() if healthy else {}
        extra = on_done(srv) if on_done else {}
    finally:
        exited = srv.stop()
    out = {
        **summarize(replies, wall),
        "startup_s": startup,
        "healthy_after": healthy,
        "exited_during_run": exited,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "metrics": {k: v for k, v in metrics.items() if k.startswith(("expert_cache", "n_decode", "requests"))},
        **extra,
    }
    print(f"{name}: {json.dumps({k: v for k, v in out.items() if k != 'metrics'})}", file=sys.stderr)
    return replies, out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF MoE model")
    p.add_argument("--store", default=None, help="expert store for moetier (default: read the GGUF)")
    p.add_argument("--budget-pct", type=float, default=25.0, help="expert cache budget in %% of the expert bytes")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    p.add_argument("--parallel", type=int, default=4, help="llama-server slots (--parallel)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load on moetier")
    p.add_argument("--ref-duration", type=float, default=None, help="seconds of load on stock (default: --duration)")
    p.add_argument("-n", "--n-predict", type=int, default=48, help="tokens generated per request")
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts, from held-out corpus text")
    p.add_argument(
        "--corpora", default="fortunes,linux-doc,py-stdlib", help="corpora whose eval splits give the prompts"
    )
    p.add_argument("--ctx", type=int, default=4096, help="server context, shared by the slots")
    p.add_argument("--threads", type=int, default=2, help="server threads")
    p.add_argument("--headroom-mib", type=float, default=384.0, help="cap = other non-expert + budget + this")
    p.add_argument("--cache-args", default="", help="more `moetier serve` cache flags for the moetier phase")
    p.add_argument(
        "--control-duration",
        type=float,
        default=180.0,
        help="seconds of a control phase: stock under the same load slowed by --control-hogs busy processes (0: off)",
    )
    p.add_argument("--control-hogs", type=int, default=2, help="busy processes competing with the control phase")
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.md")
    a = p.parse_args(argv)

    from corpora import corpus
    from run import embedding_bytes

    model = Path(a.model).expanduser()
    prompts = prompts_from([corpus(c, "eval") for c in a.corpora.split(",")], a.prompts)
    info = Model(model, cache=CacheConfig(budget="64G", warm=False)).cache_info()
    expert_bytes = int(info["expert_bytes"])
    non_expert = model.stat().st_size - expert_bytes - embedding_bytes(model)
    budget = max(int(info["min_cache_bytes"]), int(expert_bytes * a.budget_pct / 100))
    cap_bytes = non_expert + budget + int(a.headroom_mib * MiB)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.with_name(out.name + "-logs")
    log_dir.mkdir(exist_ok=True)
    common = ["-m", str(model), "--parallel", str(a.parallel), "-c", str(a.ctx), "-t", str(a.threads), "--metrics"]

    def alone(srv: ServerRun) -> dict[str, Any]:
        # without the slot's previous KV (cache_prompt), so the prompt is prefilled in one batch of its own
        return {"alone": [_stream_one(srv.url, 0, i, p, a.n_predict, 600.0, False).text for i, p in enumerate(prompts)]}

    ref_replies, ref = phase("stock", common, prompts, a, log_dir, None, a.ref_duration or a.duration, alone)
    under_load = by_prompt(ref_replies)
    reference = with_alone(under_load, ref["alone"])

    control: dict[str, Any] | None = None
    if a.control_duration > 0:
        # stock again under the same load, slowed by busy processes: the divergence a slower server
        # gets from the batch compositions its speed makes, with no cache involved
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.control_hogs)]
        try:
            c_replies, control = phase("stock-slowed", common, prompts, a, log_dir, None, a.control_duration)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        control["check"] = classify(c_replies, reference)

    cache_args = ["--cache", str(budget), *([] if not a.store else ["--store", a.store]), *a.cache_args.split()]
    cap = MemoryCap(f"moetier-soak-{os.getpid()}", cap_bytes)
    try:

        def memory(_: ServerRun) -> dict[str, Any]:
            return {"cgroup_peak_bytes": cap.max_usage(), "cgroup_failcnt": cap.failcnt(), "oom_kills": oom_kills(cap)}

        replies, run = phase("moetier", common + cache_args, prompts, a, log_dir, cap, a.duration, memory)
    finally:
        cap.close()

    report = {
        "model": str(model),
        "moetier_package": str(Path(moetier.__file__).parent),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "cgroup": str(ROOT)},
        "config": vars(a),
        "expert_bytes": expert_bytes,
        "non_expert_bytes": non_expert,
        "budget_bytes": budget,
        "cap_bytes": cap_bytes,
        "prompts": prompts,
        "stock": {**ref, "check_self": classify(ref_replies, reference, leave_one_out=True)},
        "stock_slowed": control,
        "moetier": {
            **run,
            "check": classify(replies, reference),
            "check_load_only": classify(replies, under_load),
        },
        "replies": {"stock": [asdict(r) for r in ref_replies], "moetier": [asdict(r) for r in replies]},
    }
    out.with_name(out.name + ".json").write_text(json.dumps(report, indent=1))
    out.with_name(out.name + ".md").write_text(render(report))
    print(render(report))
    c = report["moetier"]["check"]
    bad = c["mixed"] + c["lost"] + run["oom_kills"] + (0 if run["healthy_after"] else 1)
    return 1 if bad else 0


def render(r: dict[str, Any]) -> str:
    m, s = r["moetier"], r["stock"]
    c, cs, cl = m["check"], s["check_self"], m["check_load_only"]

    def f(x: float | None, d: int = 2) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    cfg = r["config"]
    lines = [
        f"# Soak: {cfg['clients']} streaming clients, --parallel {cfg['parallel']}, {Path(r['model']).name}",
        "",
        f"moetier from `{r['moetier_package']}`; cache {r['budget_bytes'] / MiB:.0f} MiB ({cfg['budget_pct']:.0f}% of "
        f"{r['expert_bytes'] / MiB:.0f} MiB of experts); cgroup v1 cap {r['cap_bytes'] / MiB:.0f} MiB (other "
        f"non-expert {r['non_expert_bytes'] / MiB:.0f} MiB + cache + {cfg['headroom_mib']:.0f} MiB); "
        f"{len(r['prompts'])} prompts from the eval splits of {cfg['corpora']}, {cfg['n_predict']} tokens each, "
        "greedy, streamed; stock = the same llama-server with the cache off, no cap.",
        "",
        "| server | load s | requests | served | lost | tok/s | latency p50 / p99 s | TTFT p50 / p99 s "
        "| healthy after | cgroup peak MiB | OOM kills |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x, chk in (("stock", s, cs), ("moetier", m, c)):
        peak = f"{x['cgroup_peak_bytes'] / MiB:.0f}" if "cgroup_peak_bytes" in x else "no cap"
        lines.append(
            f"| {name} | {x['wall_s']:.0f} | {x['requests']} | {x['served']} | {chk['lost']} | {x['tok_s']:.2f} "
            f"| {f(x['latency_p50_s'])} / {f(x['latency_p99_s'])} | {f(x['ttft_p50_s'])} / {f(x['ttft_p99_s'])} "
            f"| {x['healthy_after']} | {peak} | {x.get('oom_kills', '-')} |"
        )
    lines += [
        "",
        "| answers, each against stock's answers for its prompt | exact | diverged | mixed up | lost |",
        "|---|---|---|---|---|",
        f"| moetier vs stock under load or alone | {c['exact']} | {c['diverged']} | {c['mixed']} | {c['lost']} |",
        f"| moetier vs stock under load only | {cl['exact']} | {cl['diverged']} | {cl['mixed']} | {cl['lost']} |",
        f"| stock vs its other answers (batch drift alone) | {cs['exact']} | {cs['diverged']} | {cs['mixed']} "
        f"| {cs['lost']} |",
        *(
            [
                f"| stock slowed by {cfg['control_hogs']} busy processes ({r['stock_slowed']['tok_s']:.1f} tok/s) "
                f"vs stock under load or alone | {k['exact']} | {k['diverged']} | {k['mixed']} | {k['lost']} |"
            ]
            if (k := (r.get("stock_slowed") or {}).get("check"))
            else []
        ),
        "",
        f"Diverged answers share a median {f(c['diverged_at_chars_median'], 0)} characters with stock's "
        f"(stock with itself: {f(cs['diverged_at_chars_median'], 0)}). Load average at the moetier phase's "
        f"start {m['loadavg_start'][0]:.2f}, end {m['loadavg_end'][0]:.2f}; cgroup failcnt "
        f"{m.get('cgroup_failcnt', '-')} (reclaim at the limit, not a failure).",
        "",
        "A request's answer depends on which requests share its ubatches and on what its slot held before "
        "(prompt cache), in stock llama.cpp as in moetier, and the batches a load makes depend on the server's "
        "speed: a diverged answer met a batch composition the stock phase did not (the slowed stock row is the "
        "same effect with no cache involved). With the same batches moetier's logits equal stock's bit for bit "
        "(tests/test_llama_cpp.py::test_multi_sequence_batches_bit_equal_stock). 'Alone' answers are "
        "requested one at a time without the prompt cache.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
