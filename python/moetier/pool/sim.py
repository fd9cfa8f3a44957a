"""A discrete-event simulator of the pool: the same Scheduler as the server, fed measured costs.

It runs CoServe's ablation and baselines in seconds where real runs take many minutes; the bench
(bench/coserve.py) runs the real server for the headline comparison. Each simulated request follows
a known path of models (a pipeline's stages, as its routing rules decided them)."""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .sched import Batch, Cost, Job, Mechanisms, Scheduler


@dataclass(frozen=True)
class SimRequest:
    arrival: float
    path: tuple[str, ...]  # the models its stages run, in order


@dataclass
class SimResult:
    completed: int
    seconds: float  # first arrival to last answer
    loads: int  # model switches after the preload
    preloads: int
    bytes_loaded: int
    latencies: list[float] = field(default_factory=list)
    sched_seconds: float = 0.0  # wall time spent inside the scheduler

    @property
    def throughput(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0

    def latency(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


def simulate(
    requests: Sequence[SimRequest],
    costs: Mapping[str, Cost],
    budget: int,
    n_executors: int,
    mechanisms: Mechanisms,
    deps: Mapping[str, set[str]] | None = None,
    actual: Mapping[str, Cost] | None = None,
) -> SimResult:
    """Runs the requests through a Scheduler; `actual` (default: costs) gives the true durations, so
    a scheduler fed wrong estimates can be tried."""
    true = actual or costs
    sched = Scheduler(costs, budget, n_executors, mechanisms, deps)
    spent = 0.0
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, data: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    t0 = time.perf_counter()
    plan = sched.preload_plan()
    spent += time.perf_counter() - t0
    busy = [False] * n_executors
    preloads = 0
    for q, models in enumerate(plan):
        if models:
            busy[q] = True
            preloads += len(models)
            push(sum(true[m].load for m in models), "ready", q)
    for i, r in enumerate(requests):
        push(r.arrival, "arrive", (i, 0))
    stage_of: dict[int, tuple[int, int]] = {}
    latencies: list[float] = []
    next_job = 0
    last = 0.0

    def start(q: int, now: float) -> None:
        nonlocal spent
        t = time.perf_counter()
        batch = sched.next_batch(q, now)
        spent += time.perf_counter() - t
        if batch is None:
            busy[q] = False
            return
        busy[q] = True
        c = true[batch.model]
        dur = (c.load if batch.load else 0.0) + c.batch_seconds(len(batch.jobs))
        push(now + dur, "done", batch)

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            assert isinstance(data, tuple)
            ri, si = data
            stage_of[next_job] = (ri, si)
            t = time.perf_counter()
            q = sched.submit(Job(next_job, requests[ri].path[si], now), now)
            spent += time.perf_counter() - t
            next_job += 1
            if not busy[q]:
                start(q, now)
        elif kind == "ready":
            assert isinstance(data, int)
            start(data, now)
        else:
            assert isinstance(data, Batch)
            sched.finish(data)
            for job in data.jobs:
                ri, si = stage_of.pop(job.id)
                if si + 1 < len(requests[ri].path):
                    push(now, "arrive", (ri, si + 1))
                else:
                    latencies.append(now - requests[ri].arrival)
                    last = max(last, now)
            start(data.executor, now)
    first = min((r.arrival for r in requests), default=0.0)
    return SimResult(
        completed=len(latencies),
        seconds=last - first,
        loads=sched.stats.loads,
        preloads=preloads,
        bytes_loaded=sched.stats.bytes_loaded,
        latencies=latencies,
        sched_seconds=spent,
    )
