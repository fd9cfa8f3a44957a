"""The pool's executors: worker threads that load, run and unload models as the scheduler says.

Models live in this process (moetier.Model, one per resident model and executor): a switch is a
llama.cpp load of the file and a free, with no process to start, and the scheduler sees every byte.
An executor runs one batch at a time, its jobs one after another on the loaded model (each job is
exactly what the model answers alone); decode releases the GIL, so executors run in parallel. A
model that leaves the pool is freed and its file dropped from the page cache, so that the next load
reads the disk, as the budget assumes."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import CacheConfig, ContextConfig, parse_size
from ..errors import ConfigError, ModelError
from ..model import Model
from .sched import Batch, Cost, Job, ModelTooBig, Scheduler
from .spec import ModelSpec, PoolSpec

DISK_BYTES_PER_SECOND = 300e6  # a cold read's rate when no profile has measured it
RETRY_LOAD_S = 30.0  # a model whose load failed fails its requests at once this long, unless its files change


class Stopping(ModelError):
    """The pool is shutting down: the request was not run (a server answers 503, try again later)."""

    def __init__(self) -> None:
        super().__init__("the pool is shutting down; the request was not run")


@dataclass
class Work:
    """What one job asks of its model: a rendered prompt, or chat messages the model's template
    renders. `done` is called once, from the executor's thread, with the answer or the error."""

    prompt: str | None
    messages: Sequence[tuple[str, str]] | None
    max_tokens: int
    done: Callable[[Answer | None, BaseException | None], None]
    temperature: float = 0.0
    seed: int = 0
    submitted: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Answer:
    model: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    executor: int
    queued_seconds: float  # submitted to started
    load_seconds: float  # the load this job's batch waited for (0 if the model was resident)
    run_seconds: float


@dataclass
class ModelCounters:
    loads: int = 0
    load_seconds: float = 0.0
    unloads: int = 0
    load_failures: int = 0
    jobs: int = 0
    failures: int = 0
    run_seconds: float = 0.0
    # executors and HTTP threads count into one model's counters: += alone could lose a count
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, v in deltas.items():
                setattr(self, name, getattr(self, name) + v)


def gguf_bytes(spec: ModelSpec) -> tuple[int, int, dict[str, Any]]:
    """(non-expert tensor bytes, expert tensor bytes, a few hyperparameters) from the model's GGUF
    header (the tensor data is not read); remembered per file, size and time of change."""
    st = spec.path.stat()
    return _gguf_bytes(str(spec.path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def _gguf_bytes(path: str, size: int, mtime_ns: int) -> tuple[int, int, dict[str, Any]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ..tools.models import read_gguf_layout

    with open(path, "rb") as f:
        layout = read_gguf_layout(f)
    expert = total = 0
    n_vocab = 0
    for name, t, shape, _ in layout.tensors:
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
        n = math.prod(shape) // block * nbytes
        total += n
        if "_exps." in name:
            expert += n
        if name == "token_embd.weight" and len(shape) > 1:
            n_vocab = shape[1]
    kv = layout.kv
    arch = str(kv.get("general.architecture", ""))

    def most(key: str, default: int) -> int:
        """A hyperparameter that some architectures give per layer (an array): its largest value."""
        v = kv.get(f"{arch}.{key}")
        if isinstance(v, (list, tuple)):
            v = max((int(x) for x in v), default=0)
        return int(v) if v else default

    n_embd = most("embedding_length", 0)
    n_head = most("attention.head_count", 1)
    head_dim = n_embd // max(1, n_head)
    hp = {
        "arch": arch,
        "n_layer": most("block_count", 0),
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": most("attention.head_count_kv", n_head),
        # heads wider than n_embd / n_head (Qwen3: 128 against 2048 / 32 = 64) say so here
        "k_dim": most("attention.key_length", head_dim),
        "v_dim": most("attention.value_length", head_dim),
        "n_vocab": n_vocab,
    }
    return total - expert, expert, hp


def ctx_cells(n_ctx: int) -> int:
    """The KV cells llama.cpp makes for a context of n_ctx: a multiple of 256 (300 -> 512)."""
    return -(-n_ctx // 256) * 256


def cache_bytes(spec: ModelSpec, expert_bytes: int) -> int:
    """The expert cache the pool gives a MoE model (0 without a store: its experts load with it)."""
    if spec.store is None:
        return 0
    if spec.cache.endswith("%"):
        try:
            share = float(spec.cache[:-1]) / 100.0
        except ValueError:
            msg = f"models.{spec.name}.cache: {spec.cache!r} is not a share; use e.g. 25%"
            raise ConfigError(msg) from None
        if not 0 < share <= 1:
            msg = f"models.{spec.name}.cache: {spec.cache!r} must be above 0% and at most 100%"
            raise ConfigError(msg)
        return int(expert_bytes * share)
    return parse_size(spec.cache, f"models.{spec.name}.cache")


def footprint(spec: ModelSpec) -> tuple[int, int, int]:
    """(weights, KV cache, an allowance for llama.cpp's compute buffers) in bytes, from the GGUF: the
    weights are a dense model's tensors, or a MoE's dense tensors plus its expert cache."""
    dense, expert, hp = gguf_bytes(spec)
    weights = dense + (cache_bytes(spec, expert) if spec.store is not None else expert)
    cells = ctx_cells(spec.n_ctx)
    kv = hp["n_layer"] * cells * hp["n_head_kv"] * (hp["k_dim"] + hp["v_dim"]) * 2  # K and V in f16
    ubatch = min(512, spec.n_ctx)  # the model is opened with this ubatch
    compute = 4 * ubatch * (hp["n_vocab"] + 8 * hp["n_embd"]) + 4 * ubatch * cells * hp["n_head"]
    return weights, kv, compute


def estimate_cost(spec: ModelSpec) -> Cost:
    """What a model costs without a profile: its resident bytes (footprint(), the compute allowance
    included: an estimate, which leaves out the repacked copies llama.cpp makes of some quantized
    weights on some CPUs), a load at DISK_BYTES_PER_SECOND and a guessed 50 ms per job.
    `moetier profile` measures all of these."""
    weights, kv, compute = footprint(spec)
    return Cost(
        k=0.05, b=0.01, load=weights / DISK_BYTES_PER_SECOND, nbytes=weights + kv + compute, max_batch=spec.max_batch
    )


def read_profile(path: Path, spec: PoolSpec) -> dict[str, Cost]:
    """The costs `moetier profile` wrote; ConfigError if the file does not cover the pool's models."""
    try:
        data = json.loads(path.read_text())
        rows = data["models"]
        threads = data.get("threads", spec.threads)  # older profiles do not say
        if threads != spec.threads:
            msg = (
                f"{path}: measured with {threads} threads per executor, the pool runs {spec.threads}; its times "
                f"do not hold: run `moetier profile {spec.path}` again (or serve without the profile)"
            )
            raise ConfigError(msg)
        out = {}
        for name, r in rows.items():
            m = spec.models.get(name)
            if m is None:
                continue
            if r["path"] != str(m.path) or r["shape"] != m.shape():
                msg = f"{path}: {name} was profiled as {r['path']} {r['shape']}, it is {m.path} {m.shape()} now"
                raise ConfigError(msg + f"; run `moetier profile {spec.path}` again")
            c = Cost(
                k=float(r["k"]),
                b=float(r["b"]),
                load=float(r["load"]),
                nbytes=int(r["nbytes"]),
                max_batch=m.max_batch,  # the file's: a scheduling choice, not a measurement
                p=float(r.get("p", 0.0)),
            )
            times = (c.k, c.b, c.load)
            if c.nbytes <= 0 or not all(math.isfinite(x) and x >= 0 for x in times) or not 0 <= c.p <= 1:
                msg = f"{path}: {name}: costs out of range ({c}); run `moetier profile {spec.path}` again"
                raise ConfigError(msg)
            out[name] = c
    except ConfigError:
        raise  # our own message (a stale or out-of-range row), already naming the file
    except OSError as e:
        msg = f"{path}: cannot read the profile: {e.strerror or e}"
        raise ConfigError(msg) from None
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        # AttributeError: "models" is not an object; OverflowError: a size of Infinity
        msg = f"{path}: not a profile written by `moetier profile` ({e!r}); run it again"
        raise ConfigError(msg) from None
    missing = sorted(set(spec.models) - set(out))
    if missing:
        msg = f"{path}: no costs for {', '.join(missing)}; run `moetier profile {spec.path}` again"
        raise ConfigError(msg)
    return {m: out[m] for m in spec.models}


def open_model(spec: ModelSpec, threads: int) -> Model:
    """Loads one model of the pool as its spec says (a MoE with a store gets its expert cache)."""
    cache = None
    if spec.store is not None:
        _, expert, _ = gguf_bytes(spec)
        # the pool's budget binds: a model's cache must not grow into memory the pool gave the others
        cache = CacheConfig(budget=max(1, cache_bytes(spec, expert)), grow=0)
    ctx = ContextConfig(
        n_ctx=spec.n_ctx, n_threads=threads, n_batch=min(512, spec.n_ctx), n_ubatch=min(512, spec.n_ctx)
    )
    return Model(spec.path, store=spec.store, cache=cache, context=ctx)


def rss_bytes() -> int:
    """This process's resident memory (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def drop_page_cache(path: Path) -> None:
    """Drops a file's clean pages from the page cache, so the next read comes from the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _files_of(m: ModelSpec) -> object:
    """What a model's load reads, as (path, size, mtime) of its GGUF and of its store's files: a change
    (the file fixed or replaced) makes a failed load worth trying again."""
    paths = [m.path]
    if m.store is not None:
        try:
            paths += sorted(m.store.iterdir()) if m.store.is_dir() else [m.store]
        except OSError:
            paths.append(m.store)
    out = []
    for p in paths:
        try:
            st = p.stat()
            out.append((str(p), st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((str(p), -1, -1))
    return tuple(out)


def _deliver(work: Work, answer: Answer | None, error: BaseException | None) -> None:
    """Calls the job's callback; an error in it must not stop the executor that runs the others."""
    try:
        work.done(answer, error)
    except Exception as e:  # the callback's own bug: said, and the executor goes on
        sys.stderr.write(f"moetier pool: a request's callback failed: {type(e).__name__}: {e}\n")


class Pool:
    """The executors over one Scheduler. submit() queues a job; each executor thread takes its next
    batch, unloads what the scheduler evicted, loads the model if needed and runs the jobs."""

    def __init__(
        self,
        spec: PoolSpec,
        costs: dict[str, Cost] | None = None,
        opener: Callable[[ModelSpec, int], Model] = open_model,
    ) -> None:
        self.spec = spec
        self.warnings: list[str] = []
        if costs is None:
            costs = read_profile(spec.profile, spec) if spec.profile else self._estimates()
        self.costs = costs
        try:
            self.sched = Scheduler(costs, spec.budget, spec.executors, spec.mechanisms, spec.deps())
        except ModelTooBig as e:
            line = spec.models[e.model].line
            msg = f"{spec.path}:{line}: {e}" if line else f"{spec.path}: {e}"
            raise ConfigError(msg) from None
        self._opener = opener
        self._cv = threading.Condition()
        self._loaded: list[dict[str, Model]] = [{} for _ in range(spec.executors)]
        self.counters = {m: ModelCounters() for m in spec.models}
        self.sched_seconds = 0.0
        self.busy_seconds = [0.0] * spec.executors
        self._next_id = 0
        self._stop = False
        # model -> (its files when its load failed, when, the error): see submit
        self._failed: dict[str, tuple[object, float, BaseException]] = {}
        self._plan = self.sched.preload_plan()
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"moetier-executor-{q}", daemon=True)
            for q in range(spec.executors)
        ]
        for t in self._threads:
            t.start()

    def _estimates(self) -> dict[str, Cost]:
        out = {}
        for name, m in self.spec.models.items():
            try:
                out[name] = estimate_cost(m)
            except Exception as e:  # its load will fail and say why: only its requests fail, not the pool
                size = m.path.stat().st_size
                self.warnings.append(f"{m.path}: cannot read the GGUF's tensors to size it ({e}); sized by the file")
                out[name] = Cost(0.05, 0.01, size / DISK_BYTES_PER_SECOND, size, m.max_batch)
        return out

    def submit(self, model: str, work: Work) -> None:
        """Queues one job of `model` (ConfigError if the pool has no such model). A model whose load
        failed less than RETRY_LOAD_S ago, its files unchanged since, fails the job at once: loading it
        again would evict other models for the same failure."""
        if model not in self.costs:
            msg = f"unknown model {model!r}"
            raise ConfigError(msg)
        with self._cv:
            if self._stop:
                raise Stopping
            error = self._recent_failure(model)
            if error is None:
                t = time.perf_counter()
                self.sched.submit(Job(self._next_id, model, t, work), t)
                self.sched_seconds += time.perf_counter() - t
                self._next_id += 1
                self._cv.notify_all()
        if error is not None:
            self.counters[model].add(jobs=1, failures=1)
            _deliver(work, None, error)

    def _recent_failure(self, model: str) -> ModelError | None:
        """The error to answer a job of model with, if its last load failed recently (call with the
        lock held)."""
        failed = self._failed.get(model)
        if failed is None:
            return None
        files, when, e = failed
        age = time.monotonic() - when
        if age >= RETRY_LOAD_S or files != _files_of(self.spec.models[model]):
            return None
        return ModelError(
            f"{e} (its load failed {age:.0f} s ago; it is tried again {RETRY_LOAD_S:g} s after that, "
            "or as soon as its files change)"
        )

    def close(self) -> None:
        """Stops the executors after their running batch and frees every model."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        # what is still queued is answered, never left waiting
        with self._cv:
            queued = [j for ex in self.sched.executors for j in ex.queue]
            for ex in self.sched.executors:
                ex.queue = []
        for job in queued:
            _deliver(job.payload, None, Stopping())
        for loaded in self._loaded:
            for m in list(loaded):
                loaded.pop(m).close()

    def resident(self) -> dict[str, int]:
        with self._cv:
            return self.sched.resident()

    def resident_bytes(self) -> int:
        """Bytes of the resident models over every executor (a model on two counts twice)."""
        with self._cv:
            return sum(ex.used for ex in self.sched.executors)

    def queue_depths(self) -> dict[str, int]:
        with self._cv:
            return self.sched.queue_depths()

    def _load(self, q: int, model: str) -> float:
        t = time.perf_counter()
        try:
            self._loaded[q][model] = self._opener(self.spec.models[model], self.spec.threads)
        except Exception as e:  # not resident, and remembered (see submit); counted once that is so
            with self._cv:
                self._failed[model] = (_files_of(self.spec.models[model]), time.monotonic(), e)
                self.sched.unloaded(q, model)
            self.counters[model].add(load_failures=1)
            raise
        with self._cv:
            self._failed.pop(model, None)
        dt = time.perf_counter() - t
        self.counters[model].add(loads=1, load_seconds=dt)
        return dt

    def _unload(self, q: int, model: str) -> None:
        m = self._loaded[q].pop(model, None)
        if m is not None:
            try:
                m.close()
            except Exception as e:  # it is out of the pool either way; the batch that evicted it goes on
                sys.stderr.write(f"moetier pool: closing {model} failed ({e}); it left the pool\n")
            del m
            self.counters[model].add(unloads=1)
        try:
            drop_page_cache(self.spec.models[model].path)
        except OSError:  # the file is gone or unreadable: nothing of it to drop
            pass

    def _run(self, q: int) -> None:
        for model in self._plan[q]:
            try:
                self._load(q, model)
            except Exception:  # _load counted it and marked it not resident; its jobs will say why
                pass
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    t = time.perf_counter()
                    batch = self.sched.next_batch(q, t)
                    self.sched_seconds += time.perf_counter() - t
                    if batch is not None:
                        break
                    self._cv.wait()
            started = time.perf_counter()
            answered = 0
            try:
                for m in batch.evict:
                    self._unload(q, m)
                answered = self._run_batch(q, batch)
            except Exception as e:  # never leave a request waiting, never lose the executor
                for job in batch.jobs[answered:]:
                    _deliver(job.payload, None, e)
                if batch.model not in self._loaded[q]:  # the scheduler must not count on a model never loaded
                    with self._cv:
                        self.sched.unloaded(q, batch.model)
            self.busy_seconds[q] += time.perf_counter() - started
            with self._cv:
                self.sched.finish(batch)

    def _run_batch(self, q: int, batch: Batch) -> int:
        """Loads the batch's model if needed and runs its jobs; returns how many were answered."""
        load_s = 0.0
        error: BaseException | None = ConfigError(batch.error) if batch.error else None
        if batch.load and error is None:
            try:
                load_s = self._load(q, batch.model)
            except Exception as e:  # a failed load fails only this batch's jobs
                error = e
        for i, job in enumerate(batch.jobs):
            try:
                self._run_job(q, batch.model, job, load_s, error)
            except Exception as e:  # bookkeeping failed: this job and the rest get the error
                for rest in batch.jobs[i:]:
                    _deliver(rest.payload, None, e)
                break
        return len(batch.jobs)

    def _run_job(self, q: int, model: str, job: Job, load_s: float, error: BaseException | None) -> None:
        work: Work = job.payload
        c = self.counters[model]
        c.add(jobs=1)
        if error is not None:
            c.add(failures=1)
            _deliver(work, None, error)
            return
        t = time.perf_counter()
        try:
            m = self._loaded[q][model]
            prompt = work.prompt if work.messages is None else m.chat_prompt(work.messages)
            r = m.generate(prompt or "", max_tokens=work.max_tokens, temperature=work.temperature, seed=work.seed)
        except Exception as e:
            c.add(failures=1)
            _deliver(work, None, e)
            return
        run_s = time.perf_counter() - t
        c.add(run_seconds=run_s)
        answer = Answer(
            model=model,
            text=r.text,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=len(r.tokens),
            finish_reason="stop" if r.stop == "eog" else "length",  # OpenAI's: a full context is a length too
            executor=q,
            queued_seconds=t - work.submitted - load_s,
            load_seconds=load_s,
            run_seconds=run_s,
        )
        _deliver(work, answer, None)
