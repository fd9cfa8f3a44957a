"""CoServe's scheduler for many models under one memory budget (Suo et al., ASPLOS '25, sections 4.1-4.3).

Pure bookkeeping, no threads and no models: the serving pool (executor.py) and the simulator (sim.py)
call the same object, so what the simulator explores is what the server does. Every mechanism can be
switched off for the ablation, and the baselines of the paper (FCFS + LRU, FIFO replacement,
round-robin executors) are settings of the same class.

Terms: an executor is a worker with its own queue and its own resident models; a job is one request
for one model (a pipeline's later stage is a new job, made when its earlier stage has answered); a
batch is the run of jobs an executor takes from the head of its queue, all for one model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError

Assign = Literal["makespan", "round_robin"]
Evict = Literal["two_stage", "lru", "fifo"]


class ModelTooBig(ConfigError):
    """A model that does not fit one executor's share of the budget (names it, for the caller to say
    where it is configured)."""

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message)
        self.model = model


@dataclass(frozen=True)
class Cost:
    """What the scheduler knows of a model, from the profiler (`moetier profile`): a batch of n of its
    jobs takes k*n + b seconds once it is resident, making it resident takes `load` seconds, and it
    occupies `nbytes` while resident. p is its prior usage probability (share of the jobs)."""

    k: float
    b: float
    load: float
    nbytes: int
    max_batch: int = 1
    p: float = 0.0

    def batch_seconds(self, n: int) -> float:
        return self.k * n + self.b


@dataclass(frozen=True)
class Mechanisms:
    """Which of CoServe's mechanisms run. The defaults are CoServe; `baseline()` names the others."""

    assign: Assign = "makespan"  # makespan-based assignment over the executors, or round-robin
    arrange: bool = True  # a job is placed right behind queued jobs of its model, not at the tail
    evict: Evict = "two_stage"  # two-stage dependency- and probability-aware eviction, or lru / fifo
    split: bool = True  # groups run in batches of up to the best batch that fits; off: one job per batch
    preload: bool = True  # models dealt to the executors by usage probability before the first job
    # arranging's bound: a queued job is passed by at most this many later jobs, so that a model whose
    # requests keep coming cannot hold the jobs of another model back forever
    max_overtake: int = 64

    @staticmethod
    def baseline(name: str) -> Mechanisms:
        """The named configuration: coserve (everything), the ablation steps none / +evict / +arrange,
        and the baselines fcfs-lru (Samba-CoE), fifo (FIFO replacement), round-robin (Samba-CoE
        Parallel: the executors in turn, FCFS and LRU on each)."""
        table = {
            "coserve": Mechanisms(),
            "none": Mechanisms("round_robin", False, "fifo", False, False),
            "+evict": Mechanisms("round_robin", False, "two_stage", False, False),
            "+arrange": Mechanisms("round_robin", True, "two_stage", True, False),
            "fcfs-lru": Mechanisms("round_robin", False, "lru", False, False),
            "fifo": Mechanisms("round_robin", False, "fifo", False, False),
            "round-robin": Mechanisms("round_robin", False, "lru", False, False),
        }
        if name not in table:
            msg = f"unknown scheduler {name!r}; one of {', '.join(table)}"
            raise ConfigError(msg)
        return table[name]


@dataclass
class Job:
    """One request for one model. payload is the caller's (the server keeps the request there)."""

    id: int
    model: str
    arrival: float
    payload: Any = None
    passed: int = 0  # later jobs placed ahead of this one by arranging


@dataclass
class Batch:
    """Jobs of one model an executor runs now: first unload `evict`, then load the model if `load`."""

    executor: int
    model: str
    jobs: list[Job]
    load: bool
    evict: list[str]
    predicted: float  # seconds the scheduler expects the batch (with its load) to take
    error: str = ""  # the model cannot be made resident: the jobs fail with this message


@dataclass
class ExecutorState:
    """One executor as the scheduler sees it: its queue, its resident models and their bytes."""

    budget: int
    queue: list[Job] = field(default_factory=list)
    resident: dict[str, int] = field(default_factory=dict)  # model -> bytes, in load order (FIFO)
    last_use: dict[str, int] = field(default_factory=dict)  # model -> tick of its last batch (LRU)
    running: Batch | None = None
    running_end: float = 0.0  # when the running batch is expected to end

    @property
    def used(self) -> int:
        return sum(self.resident.values())


@dataclass
class SchedStats:
    loads: int = 0  # models made resident (a switch each)
    bytes_loaded: int = 0
    evictions: int = 0
    batches: int = 0
    jobs: int = 0


class Scheduler:
    """CoServe's assignment, arranging, splitting and two-stage eviction over n executors, each with
    an equal share of the budget (as each of the paper's executors has its own memory).

    deps maps a model to the models whose answers lead to it (its predecessors in some pipeline);
    a model with predecessors is a dependent model, which stage 1 of the eviction frees first when
    none of its predecessors is resident. Not thread-safe: the caller holds one lock around it."""

    def __init__(
        self,
        costs: Mapping[str, Cost],
        budget: int,
        n_executors: int = 1,
        mechanisms: Mechanisms | None = None,
        deps: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        if n_executors < 1:
            msg = f"executors: {n_executors} must be at least 1"
            raise ConfigError(msg)
        self.costs = dict(costs)
        self.mech = mechanisms or Mechanisms()
        self.deps = {m: frozenset(d) for m, d in (deps or {}).items()}
        share = budget // n_executors
        for name, c in self.costs.items():
            if c.nbytes > share:
                msg = (
                    f"model {name}: needs {c.nbytes} bytes resident, more than one executor's share of the "
                    f"budget ({share} of {budget} bytes over {n_executors} executors); raise the budget or use "
                    "fewer executors"
                )
                raise ModelTooBig(name, msg)
        self.executors = [ExecutorState(budget=share) for _ in range(n_executors)]
        self.stats = SchedStats()
        self._rr = 0
        self._tick = 0

    # -- prediction -------------------------------------------------------------------------

    def _b_max(self, model: str) -> int:
        return max(1, self.costs[model].max_batch) if self.mech.split else 1

    def queue_seconds(self, q: int, now: float) -> float:
        """T(q): the predicted time until executor q has run everything queued on it."""
        ex = self.executors[q]
        t = max(0.0, ex.running_end - now) if ex.running else 0.0
        seen = set(ex.resident)
        i = 0
        while i < len(ex.queue):
            model = ex.queue[i].model
            j = i
            while j < len(ex.queue) and ex.queue[j].model == model:
                j += 1
            c = self.costs[model]
            n = j - i
            t += (0.0 if model in seen else c.load) + c.k * n + c.b * math.ceil(n / self._b_max(model))
            seen.add(model)
            i = j
        return t

    def delta(self, q: int, model: str) -> float:
        """Δ_q(r): what one more job of `model` adds to executor q's queue (paper section 4.2), plus
        one more b when the job starts a new batch of its group."""
        ex = self.executors[q]
        c = self.costs[model]
        same = sum(1 for j in ex.queue if j.model == model)
        exec_s = c.k if same and same % self._b_max(model) else c.k + c.b
        switch = 0.0 if same or model in ex.resident else c.load
        return exec_s + switch

    # -- submission ---------------------------------------------------------------------------

    def submit(self, job: Job, now: float) -> int:
        """Queues the job on the executor chosen by the assignment rule; returns that executor."""
        if job.model not in self.costs:
            msg = f"unknown model {job.model!r}"
            raise ConfigError(msg)
        n = len(self.executors)
        if self.mech.assign == "round_robin" or n == 1:
            q = self._rr % n
            self._rr += 1
        else:
            totals = [self.queue_seconds(i, now) for i in range(n)]
            best: tuple[float, float, int] | None = None
            for i in range(n):
                d = self.delta(i, job.model)
                others = max((totals[o] for o in range(n) if o != i), default=0.0)
                key = (max(totals[i] + d, others), d, i)
                if best is None or key < best:
                    best = key
            assert best is not None
            q = best[2]
        queue = self.executors[q].queue
        pos = len(queue)
        if self.mech.arrange:
            for i in range(len(queue) - 1, -1, -1):
                if queue[i].model == job.model:
                    pos = i + 1
                    break
            if any(j.passed >= self.mech.max_overtake for j in queue[pos:]):
                pos = len(queue)  # one behind has waited long enough: to the tail
            for j in queue[pos:]:
                j.passed += 1
        queue.insert(pos, job)
        return q

    # -- running ------------------------------------------------------------------------------

    def _victims(self, ex: ExecutorState, need: int, keep: str) -> list[str] | None:
        """Models to unload so that `need` more bytes fit; None if even all of them would not do."""
        free = ex.budget - ex.used
        if free >= need:
            return []
        others = [m for m in ex.resident if m != keep]
        if self.mech.evict == "fifo":
            order = others
        elif self.mech.evict == "lru":
            order = sorted(others, key=lambda m: ex.last_use.get(m, -1))
        else:
            # stage 1: dependent models none of whose predecessors is resident or queued here, largest
            # first (they cannot run before a predecessor is loaded again); stage 2: by prior usage,
            # least first. Two readings the paper leaves open, both measured in bench/coserve.py: a
            # predecessor queued here counts as present (else a second-stage model shared by many
            # first stages is evicted whenever none of them happens to be resident), and a model
            # queued here goes after those that are not (its load would be paid again within the queue)
            queued = {j.model for j in ex.queue}
            present = ex.resident.keys() | queued | {keep}  # the model being loaded is about to run
            stage1 = [m for m in others if self.deps.get(m) and not (self.deps[m] & present) and m not in queued]
            stage1.sort(key=lambda m: (-ex.resident[m], m))
            rest = [m for m in others if m not in stage1]
            rest.sort(key=lambda m: (m in queued, self.costs[m].p, m))
            order = stage1 + rest
        out: list[str] = []
        for m in order:
            if free >= need:
                break
            out.append(m)
            free += ex.resident[m]
        return out if free >= need else None

    def next_batch(self, q: int, now: float) -> Batch | None:
        """The batch executor q runs next (taken off its queue, residency updated), or None if its
        queue is empty. The caller unloads batch.evict, loads the model if batch.load, runs the jobs
        and calls finish()."""
        ex = self.executors[q]
        if not ex.queue:
            return None
        model = ex.queue[0].model
        n = 1
        while n < len(ex.queue) and n < self._b_max(model) and ex.queue[n].model == model:
            n += 1
        jobs, ex.queue = ex.queue[:n], ex.queue[n:]
        c = self.costs[model]
        evict: list[str] = []
        load = model not in ex.resident
        if load:
            victims = self._victims(ex, c.nbytes, model)
            if victims is None:  # unreachable while every model fits one share (checked at init)
                return Batch(q, model, jobs, False, [], 0.0, error=f"model {model} does not fit the budget")
            evict = victims
            for m in evict:
                del ex.resident[m]
            ex.resident[model] = c.nbytes
            self.stats.loads += 1
            self.stats.bytes_loaded += c.nbytes
            self.stats.evictions += len(evict)
        self._tick += 1
        ex.last_use[model] = self._tick
        predicted = (c.load if load else 0.0) + c.batch_seconds(len(jobs))
        batch = Batch(q, model, jobs, load, evict, predicted)
        ex.running, ex.running_end = batch, now + predicted
        self.stats.batches += 1
        self.stats.jobs += len(jobs)
        return batch

    def finish(self, batch: Batch) -> None:
        """The executor is done with the batch."""
        ex = self.executors[batch.executor]
        if ex.running is batch:
            ex.running = None

    def unloaded(self, q: int, model: str) -> None:
        """The executor could not keep the model (its load failed): it is no longer resident."""
        self.executors[q].resident.pop(model, None)

    def preload_plan(self) -> list[list[str]]:
        """CoServe's initialisation (section 4.1): models sorted by usage probability, dealt to the
        executors in turn, each loading while its share of the budget holds them. Residency is
        updated; the caller loads the models. Empty lists unless the preload mechanism is on."""
        plan: list[list[str]] = [[] for _ in self.executors]
        if not self.mech.preload:
            return plan
        order = sorted(self.costs, key=lambda m: (-self.costs[m].p, m))
        q = 0
        for m in order:
            if self.costs[m].p <= 0:
                break
            for _ in range(len(self.executors)):
                ex = self.executors[q]
                q = (q + 1) % len(self.executors)
                if ex.used + self.costs[m].nbytes <= ex.budget:
                    ex.resident[m] = self.costs[m].nbytes
                    plan[self.executors.index(ex)].append(m)
                    break
        return plan

    def queue_depths(self) -> dict[str, int]:
        """Queued jobs per model, over all executors."""
        out: dict[str, int] = {}
        for ex in self.executors:
            for j in ex.queue:
                out[j.model] = out.get(j.model, 0) + 1
        return out

    def resident(self) -> dict[str, int]:
        """Resident models and the executor holding each."""
        return {m: i for i, ex in enumerate(self.executors) for m in ex.resident}


def decay_window_search(
    probs: Iterable[float],
    throughput: Any,
    w0: float = 15.0,
    eps: float = 0.05,
) -> tuple[int, int]:
    """CoServe's memory split (section 4.4, eq. 1-3): the window [lo, hi] on the usage CDF (in
    percent) starts at [0, w0] and slides up, each next window (1 - w0/100) times the previous one's
    size. At each upper bound the n models whose summed usage reaches it are measured
    (throughput(n) -> requests/s); a line fitted to the points so far predicts the next one, and the
    search stops when the measured throughput falls short of the line by more than eps. Returns the
    range (n_lo, n_hi) of models of the window it stopped in; the caller picks the pool size there
    (the paper picks at random) and gives the rest of the memory to batch activations."""
    p = sorted((x for x in probs if x > 0), reverse=True)
    total = sum(p)
    if not p or total <= 0:
        return (0, 0)
    cdf: list[float] = []
    acc = 0.0
    for x in p:
        acc += x
        cdf.append(100.0 * acc / total)

    def n_at(pct: float) -> int:
        for i, v in enumerate(cdf):
            if v >= pct - 1e-9:
                return i + 1
        return len(cdf)

    decay = 1.0 - w0 / 100.0
    lo, size = 0.0, w0
    xs: list[int] = []
    ys: list[float] = []
    while True:
        hi = min(100.0, lo + size)
        n = n_at(hi)
        x = float(throughput(n))
        if len(xs) >= 2:
            k, b = fit_line(xs, ys)
            predicted = k * n + b
            if predicted > 0 and (predicted - x) / predicted > eps:
                return (n_at(lo) if lo > 0 else 1, n)
        xs.append(n)
        ys.append(x)
        if hi >= 100.0 or size < 1e-6:
            return (n_at(lo) if lo > 0 else 1, n)
        lo, size = hi, size * decay


def fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """k, b of y = k*x + b by least squares (the mean when every x is the same)."""
    n = len(xs)
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return k, my - k * mx
