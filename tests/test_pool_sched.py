"""CoServe's scheduler, the pool's configuration file and the simulator (no models are loaded)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from moetier import ConfigError
from moetier.pool.sched import Cost, Job, Mechanisms, Scheduler, decay_window_search
from moetier.pool.sim import SimRequest, simulate
from moetier.pool.spec import load_spec

MB = 1 << 20


def costs(**kw: Cost) -> dict[str, Cost]:
    return dict(kw)


def c(
    load: float = 1.0, nbytes: int = 100 * MB, k: float = 0.1, b: float = 0.05, max_batch: int = 4, p: float = 0.1
) -> Cost:
    return Cost(k=k, b=b, load=load, nbytes=nbytes, max_batch=max_batch, p=p)


def models_of(s: Scheduler, q: int) -> list[str]:
    return [j.model for j in s.executors[q].queue]


def test_the_named_configurations_are_the_ablation_ladder_and_the_baselines() -> None:
    """CoServe's ablation adds evict, then arrange and split, then assignment and preload; the baselines
    are round-robin over the executors with FCFS queues and LRU or FIFO replacement."""
    table = {
        "coserve": ("makespan", True, "two_stage", True, True),
        "none": ("round_robin", False, "fifo", False, False),
        "+evict": ("round_robin", False, "two_stage", False, False),
        "+arrange": ("round_robin", True, "two_stage", True, False),
        "fcfs-lru": ("round_robin", False, "lru", False, False),
        "fifo": ("round_robin", False, "fifo", False, False),
        "round-robin": ("round_robin", False, "lru", False, False),
    }
    for name, want in table.items():
        m = Mechanisms.baseline(name)
        assert (m.assign, m.arrange, m.evict, m.split, m.preload) == want, name
    assert Mechanisms() == Mechanisms.baseline("coserve")
    with pytest.raises(ConfigError) as e:
        Mechanisms.baseline("lifo")
    assert str(e.value) == "unknown scheduler 'lifo'; one of " + ", ".join(table)


def test_arranging_places_a_job_behind_its_models_group() -> None:
    for arrange, want in ((True, ["a", "a", "b"]), (False, ["a", "b", "a"])):
        s = Scheduler(costs(a=c(), b=c()), 1000 * MB, 1, Mechanisms(arrange=arrange))
        for i, m in enumerate("aba"):
            s.submit(Job(i, m, 0.0), 0.0)
        assert models_of(s, 0) == want


def test_arranging_passes_a_waiting_job_a_bounded_number_of_times() -> None:
    """A model whose requests keep coming faster than its batches drain cannot hold another model's job
    back forever: after max_overtake jobs have been placed ahead of it, later ones queue behind it."""
    s = Scheduler(costs(a=c(max_batch=2), b=c()), 1000 * MB, 1, Mechanisms(max_overtake=3))
    s.submit(Job(0, "a", 0.0), 0.0)
    s.submit(Job(1, "b", 0.0), 0.0)
    for i in range(2, 5):
        s.submit(Job(i, "a", 0.0), 0.0)
    assert models_of(s, 0) == ["a", "a", "a", "a", "b"]
    assert [j.passed for j in s.executors[0].queue] == [0, 0, 0, 0, 3]
    s.submit(Job(5, "a", 0.0), 0.0)  # b has been passed 3 times: behind it
    assert models_of(s, 0) == ["a", "a", "a", "a", "b", "a"]
    s.submit(Job(6, "a", 0.0), 0.0)  # behind the last a, passing nobody
    assert models_of(s, 0) == ["a", "a", "a", "a", "b", "a", "a"]
    assert s.executors[0].queue[4].passed == 3
    # as the scheduler runs: a's keep arriving, two per batch of two; b still runs
    s = Scheduler(costs(a=c(max_batch=2), b=c()), 1000 * MB, 1, Mechanisms(max_overtake=8))
    s.submit(Job(0, "a", 0.0), 0.0)
    s.submit(Job(1, "b", 0.0), 0.0)
    ran: list[str] = []
    for t in range(40):
        for i in range(3):
            s.submit(Job(100 + 3 * t + i, "a", 0.0), 0.0)
        batch = s.next_batch(0, 0.0)
        assert batch is not None
        ran.append(batch.model)
        s.finish(batch)
        if "b" in ran:
            break
    assert "b" in ran and len(ran) <= 6
    assert Mechanisms().max_overtake == 64


def test_makespan_assignment_prefers_the_executor_holding_the_model() -> None:
    s = Scheduler(costs(a=c(load=10, k=1, b=0), b=c(load=10, k=1, b=0)), 1000 * MB, 2, Mechanisms())
    s.executors[1].resident["a"] = 100 * MB
    assert s.submit(Job(0, "a", 0.0), 0.0) == 1  # 1 s there against 11 s on the empty one
    # b is resident nowhere: executor 0 finishes it at 11 s, executor 1 at 12 s
    assert s.submit(Job(1, "b", 0.0), 0.0) == 0
    assert s.queue_seconds(0, 0.0) == pytest.approx(11.0)
    assert s.queue_seconds(1, 0.0) == pytest.approx(1.0)
    # a third a: behind the first on executor 1 costs 1 s more (makespan 11), on executor 0 a load
    assert s.submit(Job(2, "a", 0.0), 0.0) == 1
    rr = Scheduler(costs(a=c(), b=c()), 1000 * MB, 2, Mechanisms(assign="round_robin"))
    assert [rr.submit(Job(i, "a", 0.0), 0.0) for i in range(4)] == [0, 1, 0, 1]


def test_splitting_runs_a_group_in_batches_of_the_best_size() -> None:
    for split, sizes in ((True, [2, 2, 1]), (False, [1, 1, 1, 1, 1])):
        s = Scheduler(costs(a=c(max_batch=2)), 1000 * MB, 1, Mechanisms(split=split))
        for i in range(5):
            s.submit(Job(i, "a", 0.0), 0.0)
        got = []
        while (bt := s.next_batch(0, 0.0)) is not None:
            got.append(len(bt.jobs))
            s.finish(bt)
        assert got == sizes
        assert s.stats.loads == 1


def run_loads(s: Scheduler, models: str) -> list[list[str]]:
    out = []
    for i, m in enumerate(models):
        s.submit(Job(i, m, 0.0), 0.0)
        bt = s.next_batch(0, 0.0)
        assert bt is not None
        out.append(bt.evict)
        s.finish(bt)
    return out


def test_two_stage_eviction_frees_orphaned_dependents_first_then_by_usage() -> None:
    cs = costs(
        cls1=c(nbytes=100 * MB, p=0.5),
        cls2=c(nbytes=100 * MB, p=0.2),
        det=c(nbytes=200 * MB, p=0.9),
        other=c(nbytes=100 * MB, p=0.3),
        new=c(nbytes=200 * MB, p=0.4),
    )
    deps = {"det": {"cls1"}}
    s = Scheduler(cs, 500 * MB, 1, Mechanisms(), deps)
    # det is the most used, but its predecessor cls1 is gone: stage 1 frees it before anything else
    ex = s.executors[0]
    ex.resident.update({"det": 200 * MB, "cls2": 100 * MB, "other": 100 * MB})
    assert run_loads(s, ["new"]) == [["det"]]
    # with its predecessor resident, det stays; stage 2 frees by usage, least first: cls2 (0.2), other (0.3)
    s = Scheduler(cs, 500 * MB, 1, Mechanisms(), deps)
    s.executors[0].resident.update({"det": 200 * MB, "cls1": 100 * MB, "cls2": 100 * MB, "other": 100 * MB})
    assert run_loads(s, ["new"]) == [["cls2", "other"]]


def test_the_model_being_loaded_keeps_its_next_stage() -> None:
    cs = costs(cls=c(nbytes=100 * MB, p=0.5), det=c(nbytes=200 * MB, p=0.9), other=c(nbytes=200 * MB, p=0.1))
    s = Scheduler(cs, 450 * MB, 1, Mechanisms(), {"det": {"cls"}})
    s.executors[0].resident.update({"det": 200 * MB, "other": 200 * MB})
    # cls is loading: its answers lead to det, so det is no orphan; other (least used) goes
    assert run_loads(s, ["cls"]) == [["other"]]


def test_queued_models_count_for_the_eviction() -> None:
    cs = costs(
        cls=c(nbytes=100 * MB, p=0.5),
        det=c(nbytes=200 * MB, p=0.9),
        low=c(nbytes=100 * MB, p=0.1),
        mid=c(nbytes=100 * MB, p=0.2),
        new=c(nbytes=100 * MB, p=0.3),
    )
    s = Scheduler(cs, 450 * MB, 1, Mechanisms(), {"det": {"cls"}})
    s.executors[0].resident.update({"det": 200 * MB, "low": 100 * MB, "mid": 100 * MB})
    s.submit(Job(0, "new", 0.0), 0.0)
    s.submit(Job(1, "cls", 0.0), 0.0)  # det's predecessor is queued: det is no orphan
    s.submit(Job(2, "low", 0.0), 0.0)  # low is queued: it goes after mid though it is used less
    bt = s.next_batch(0, 0.0)
    assert bt is not None and bt.model == "new" and bt.evict == ["mid"]


def test_lru_and_fifo_replacement() -> None:
    cs = costs(a=c(), b=c(), d=c(), e=c())
    lru = Scheduler(cs, 300 * MB, 1, Mechanisms(arrange=False, evict="lru"))
    fifo = Scheduler(cs, 300 * MB, 1, Mechanisms(arrange=False, evict="fifo"))
    assert run_loads(lru, "abdae") == [[], [], [], [], ["b"]]  # a was used again: b is the least recent
    assert run_loads(fifo, "abdae") == [[], [], [], [], ["a"]]  # a was loaded first


def test_budget_refuses_a_model_larger_than_an_executors_share() -> None:
    with pytest.raises(ConfigError, match=r"model big: needs .* one executor's share"):
        Scheduler(costs(big=c(nbytes=300 * MB)), 500 * MB, 2)
    with pytest.raises(ConfigError, match="unknown model 'x'"):
        Scheduler(costs(a=c()), 500 * MB).submit(Job(0, "x", 0.0), 0.0)
    with pytest.raises(ConfigError, match="unknown scheduler"):
        Mechanisms.baseline("lifo")


def test_preload_deals_models_by_usage_within_each_share() -> None:
    cs = costs(a=c(p=0.4), b=c(p=0.3), d=c(p=0.2), e=c(p=0.1), f=c(p=0.0))
    s = Scheduler(cs, 400 * MB, 2, Mechanisms())
    assert s.preload_plan() == [["a", "d"], ["b", "e"]]
    assert s.resident() == {"a": 0, "d": 0, "b": 1, "e": 1}
    assert Scheduler(cs, 400 * MB, 2, Mechanisms(preload=False)).preload_plan() == [[], []]


def test_decay_window_search_stops_where_throughput_leaves_the_line() -> None:
    probs = [1.0 / (i + 1) for i in range(60)]
    seen: list[int] = []

    def linear_then_flat(n: int) -> float:
        seen.append(n)
        return float(min(n, 20))

    lo, hi = decay_window_search(probs, linear_then_flat, w0=15, eps=0.05)
    assert lo <= 21 and 20 <= hi < 60, (lo, hi)
    assert seen == sorted(seen)  # windows slide upwards
    # a throughput that keeps growing on the line: the search runs to the top of the CDF
    _, hi2 = decay_window_search(probs, lambda n: 2.0 * n + 1, w0=15)
    assert hi2 == 60


def test_decay_window_search_by_hand() -> None:
    """100 models of equal usage: the CDF reaches i% at model i. Windows of 15% shrinking by 0.85:
    upper bounds 15, 27.75, 38.59, 47.80, ... The throughput follows n up to 40 and stays there: the
    line through (15, 15), (28, 28), (39, 39) predicts 48 at n = 48, where 40 is 17% short."""
    flat = [1.0] * 100
    assert decay_window_search(flat, lambda n: float(min(n, 40))) == (39, 48)
    # 17% short is within 17.5%; at 56 the line through the four points predicts 49.2: 19% short
    assert decay_window_search(flat, lambda n: float(min(n, 40)), eps=0.175) == (48, 56)
    assert decay_window_search(flat, lambda n: float(n)) == (100, 100)  # on the line to the top
    assert decay_window_search(flat[:10], lambda n: float(n), w0=100) == (1, 10)  # one window: all of them
    # w0 sets the first window: 20% then 36%, 48.8%: the drop at 40 shows at n = 49
    assert decay_window_search(flat, lambda n: float(min(n, 40)), w0=20) == (36, 49)
    assert decay_window_search([], float) == (0, 0) and decay_window_search([0.0, 0.0], float) == (0, 0)
    assert decay_window_search([0.0, 2.0], lambda n: float(n), w0=100) == (1, 1)  # unused models do not count


def zipf_requests(n: int, types: int, rate: float, seed: int, second: dict[str, str]) -> list[SimRequest]:
    rng = random.Random(seed)
    w = [1.0 / (i + 1) for i in range(types)]
    out = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        m = f"m{rng.choices(range(types), w)[0]}"
        out.append(SimRequest(t, (m, second[m]) if m in second else (m,)))
    return out


def test_simulator_coserve_beats_fcfs_lru_on_a_zipf_workload() -> None:
    types = 24
    second = {f"m{i}": f"d{i % 2}" for i in range(0, types, 3)}
    cs = {f"m{i}": c(load=0.3, k=0.05, b=0.02, nbytes=100 * MB, p=1.0 / (i + 1)) for i in range(types)}
    cs.update({f"d{i}": c(load=1.0, k=0.2, b=0.05, nbytes=300 * MB, p=0.5) for i in range(2)})
    deps = {f"d{i}": {m for m, d in second.items() if d == f"d{i}"} for i in range(2)}
    reqs = zipf_requests(300, types, rate=20.0, seed=1, second=second)
    budget = 1200 * MB
    co = simulate(reqs, cs, budget, 2, Mechanisms.baseline("coserve"), deps)
    fcfs = simulate(reqs, cs, budget, 1, Mechanisms.baseline("fcfs-lru"), deps)
    assert co.completed == fcfs.completed == 300
    assert co.throughput > 2 * fcfs.throughput
    assert co.loads < 0.5 * fcfs.loads


def test_simulator_times_one_group_exactly() -> None:
    cs = costs(
        a=Cost(k=0.5, b=0.25, load=2.0, nbytes=MB, max_batch=8, p=0.0),
        b=Cost(k=0.5, b=0.25, load=1.0, nbytes=MB, max_batch=8, p=0.0),
    )
    reqs = [SimRequest(0.0, ("b",)), SimRequest(0.1, ("a",)), SimRequest(0.2, ("a",))]
    r = simulate(reqs, cs, 10 * MB, 1, Mechanisms(preload=False))
    assert r.loads == 2 and r.completed == 3
    # b: 1 + 0.25 + 0.5 = 1.75; then the two a's queued meanwhile in one batch: 2 + 0.25 + 2 * 0.5
    assert r.seconds == pytest.approx(1.75 + 3.25)
    assert r.latencies == pytest.approx([1.75, 5.0 - 0.1, 5.0 - 0.2])
    assert (r.preloads, r.bytes_loaded) == (0, 2 * MB) and 0 <= r.sched_seconds < 1
    one_by_one = simulate(reqs, cs, 10 * MB, 1, Mechanisms(preload=False, split=False))
    assert one_by_one.seconds == pytest.approx(1.75 + 2.75 + 0.75)
    # a two-stage path: the second stage is submitted when the first answers; preloaded models
    cs2 = costs(
        a=Cost(k=0.5, b=0.25, load=2.0, nbytes=MB, max_batch=8, p=0.6), b=c(load=1.0, nbytes=MB, k=0.5, b=0.25, p=0.4)
    )
    r2 = simulate([SimRequest(1.0, ("a", "b"))], cs2, 10 * MB, 1, Mechanisms(), deps={"b": {"a"}})
    assert (r2.preloads, r2.loads, r2.completed, r2.bytes_loaded) == (2, 0, 1, 0)
    # the preload's loads (2 + 1 s) hold the executor from 0; then a, then b once a answered
    assert r2.latencies == pytest.approx([3.0 + 0.75 + 0.75 - 1.0]) and r2.seconds == pytest.approx(3.5)


def write(tmp: Path, text: str, name: str = "pool.yaml") -> Path:
    (tmp / "a.gguf").write_bytes(b"GGUF")
    (tmp / "b.gguf").write_bytes(b"GGUF")
    p = tmp / name
    p.write_text(text)
    return p


GOOD = """\
budget: 1G
executors: 2
models:
  a: {path: a.gguf}
  b: {path: b.gguf, max_batch: 2}
pipelines:
  p:
    first: one
    stages:
      one: {model: a, max_tokens: 4, next: {"(?i)yes": two, default: null}}
      two: {model: b, prompt: "{input} / {previous}"}
"""


def test_spec_loads_models_pipelines_and_dependencies(tmp_path: Path) -> None:
    s = load_spec(write(tmp_path, GOOD.replace('"{input} / {previous}"', '"{input} as JSON: {{\\"a\\": 1}}"')))
    assert s.pipelines["p"].stages["two"].prompt.endswith('{{"a": 1}}')  # braces that are no field are text
    s = load_spec(write(tmp_path, GOOD))
    assert s.budget == 1 << 30 and s.executors == 2 and set(s.models) == {"a", "b"}
    p = s.pipelines["p"]
    assert p.stages["one"].next_stage("Yes, it is") == "two"
    assert p.stages["one"].next_stage("no") is None
    assert s.deps() == {"b": {"a"}}
    j = json.dumps({"budget": "1G", "models": {"a": {"path": "a.gguf"}}})
    assert set(load_spec(write(tmp_path, j, "pool.json")).models) == {"a"}


@pytest.mark.parametrize(
    ("old", "new", "line", "msg"),
    [
        ("model: b,", "model: zz,", 11, "unknown model 'zz'"),
        ("default: null", "default: three", 10, "no stage named 'three' .dangling"),
        ('prompt: "{input} / {previous}"', "next: one", 11, "cycle: one -> two -> one"),
        ("max_batch: 2", "max_bach: 2", 5, "unknown key 'max_bach'"),
        ('"(?i)yes"', '"(yes"', 10, "not a regular expression"),
        ("budget: 1G", "budget: lots", 1, "budget"),
        ("a.gguf", "missing.gguf", 4, "missing.gguf does not exist"),
        ("b: {path: b.gguf,", "b: {path: b.gguf, cache: 25%,", 5, "an expert cache needs a store"),
        ("first: one", "first: two", 10, "unreachable from the first stage 'two'"),
        ('"{input} / {previous}"', '"{input} {answer}"', 11, r"unknown field \{answer\}"),
    ],
)
def test_spec_errors_name_the_file_and_line(tmp_path: Path, old: str, new: str, line: int, msg: str) -> None:
    assert old in GOOD
    p = write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(ConfigError, match=msg) as e:
        load_spec(p)
    assert str(e.value).startswith(f"{p}:{line}:"), str(e.value)


def test_no_executor_ever_holds_more_than_its_share() -> None:
    rng = random.Random(3)
    cs = {f"m{i}": c(nbytes=rng.randrange(50, 300) * MB, p=rng.random()) for i in range(12)}
    deps = {"m0": {"m1", "m2"}, "m3": {"m4"}}
    for name in ("coserve", "+arrange", "+evict", "none", "fcfs-lru", "fifo", "round-robin"):
        s = Scheduler(cs, 800 * MB, 2, Mechanisms.baseline(name), deps)
        s.preload_plan()
        for i in range(200):
            s.submit(Job(i, f"m{rng.randrange(12)}", 0.0), 0.0)
            if i % 3 == 0:
                for q in range(2):
                    bt = s.next_batch(q, 0.0)
                    if bt is not None:
                        assert bt.model in s.executors[q].resident
                        s.finish(bt)
                    assert s.executors[q].used <= s.executors[q].budget, name
        assert sum(len(e.queue) for e in s.executors) + s.stats.jobs == 200  # nothing lost


def test_usage_probabilities_follow_the_pipelines_routes(tmp_path: Path) -> None:
    from moetier.pool.profile import fit_batch_line, usage_probabilities

    spec = load_spec(write(tmp_path, GOOD))
    # p: a on every request; b on half of them (the answer decides: split evenly between the outcomes)
    assert usage_probabilities(spec) == pytest.approx({"a": 1 / 1.5, "b": 0.5 / 1.5})
    assert usage_probabilities(spec, {"p": 1.0, "b": 1.0}) == pytest.approx({"a": 1 / 2.5, "b": 1.5 / 2.5})
    with pytest.raises(ConfigError, match="unknown model or pipeline 'q'"):
        usage_probabilities(spec, {"q": 1.0})
    k, b = fit_batch_line([1, 2, 4], [0.3, 0.5, 0.9])
    assert (k, b) == pytest.approx((0.2, 0.1))
    k, b = fit_batch_line([1, 2, 4], [0.5, 0.6, 0.7])  # would be b > k: fine
    assert b > 0
    k, b = fit_batch_line([1, 2], [0.5, 1.5])  # a negative intercept is clamped: the mean time per job
    assert b == 0 and k == pytest.approx(2.0 / 3)


def test_queue_time_and_one_more_job_are_the_latency_model() -> None:
    """T(q) sums each model group's load (unless resident or loaded earlier in the queue), k per job
    and b per batch; delta adds k, b when the job opens a batch, and the load of a model neither
    queued nor resident; a running batch counts until its predicted end."""
    cs = costs(a=c(load=1.0, k=0.1, b=0.05, max_batch=2), b=c(load=2.0, k=0.2, b=0.5, max_batch=4))
    s = Scheduler(cs, 1000 * MB, 1, Mechanisms(arrange=False, preload=False))
    s.executors[0].resident["a"] = cs["a"].nbytes
    for i, m in enumerate("aaabb"):
        s.submit(Job(i, m, 0.0), 0.0)
    # a: 3 jobs in 2 batches, resident; b: 2 jobs in 1 batch, loaded: (0.3 + 0.1) + (2 + 0.4 + 0.5)
    assert s.queue_seconds(0, 0.0) == pytest.approx(3.3)
    s.submit(Job(9, "a", 0.0), 0.0)  # queued behind the b's (no arranging): a's load is not paid again
    assert s.queue_seconds(0, 0.0) == pytest.approx(3.3 + 0.1 + 0.05)
    assert s.delta(0, "a") == pytest.approx(0.1 + 0.05)  # 4 a's queued in batches of 2: a 5th opens one
    bt = s.next_batch(0, 10.0)  # runs a, a: ends at 10 + 0.25
    assert bt is not None and [j.id for j in bt.jobs] == [0, 1] and not bt.load and bt.evict == []
    assert bt.predicted == pytest.approx(0.25)
    assert s.queue_seconds(0, 10.0) == pytest.approx(0.25 + (0.1 + 0.05) + (2 + 0.4 + 0.5) + (0.1 + 0.05))
    assert s.queue_seconds(0, 11.0) == pytest.approx(0.15 + 2.9 + 0.15)  # past its end: nothing left of it
    s.finish(bt)
    assert s.executors[0].running is None
    assert s.delta(0, "b") == pytest.approx(0.2)  # 2 b's queued, 4 per batch: it joins theirs


def test_delta_pays_a_load_only_for_a_model_neither_queued_nor_resident() -> None:
    cs = costs(a=c(load=1.0, k=0.1, b=0.05, max_batch=2), b=c(load=2.0, k=0.2, b=0.5, max_batch=2))
    s = Scheduler(cs, 1000 * MB, 1, Mechanisms(preload=False))
    assert s.delta(0, "b") == pytest.approx(0.2 + 0.5 + 2.0)
    s.executors[0].resident["b"] = cs["b"].nbytes
    assert s.delta(0, "b") == pytest.approx(0.2 + 0.5)
    s.submit(Job(0, "a", 0.0), 0.0)
    assert s.delta(0, "a") == pytest.approx(0.1)  # joins the queued a's batch
    s.submit(Job(1, "a", 0.0), 0.0)
    assert s.delta(0, "a") == pytest.approx(0.1 + 0.05)  # the batch of 2 is full: a new one
    nosplit = Scheduler(cs, 1000 * MB, 1, Mechanisms(split=False, preload=False))
    nosplit.submit(Job(0, "a", 0.0), 0.0)
    assert nosplit.delta(0, "a") == pytest.approx(0.1 + 0.05)  # one job per batch


def test_queue_depths_and_residency_are_reported_per_model() -> None:
    s = Scheduler(costs(a=c(), b=c(), d=c()), 1000 * MB, 2, Mechanisms(assign="round_robin", preload=False))
    for i, m in enumerate("ababa"):
        s.submit(Job(i, m, 0.0), 0.0)  # in turn: the a's on executor 0, the b's on 1
    assert s.queue_depths() == {"a": 3, "b": 2}
    assert s.resident() == {}
    s.next_batch(0, 0.0)
    s.next_batch(1, 0.0)
    assert s.resident() == {"a": 0, "b": 1}
    s.unloaded(1, "b")
    s.unloaded(1, "zz")  # not resident: nothing to do
    assert s.resident() == {"a": 0}


def test_a_model_that_cannot_be_made_resident_fails_its_batch() -> None:
    """Unreachable while every model fits one share (the constructor checks); if an executor's share
    ever holds less, the batch carries the error instead of overfilling it."""
    with pytest.raises(ConfigError, match=r"^model a: needs 209715200 bytes resident, more than one executor's"):
        Scheduler(costs(a=c(nbytes=200 * MB)), 300 * MB, 2)
    with pytest.raises(ConfigError, match=r"^executors: 0 must be at least 1$"):
        Scheduler(costs(a=c()), 300 * MB, 0)
    s = Scheduler(costs(a=c()), 300 * MB, 1, Mechanisms(preload=False))
    s.executors[0].budget = 50 * MB
    s.submit(Job(0, "a", 0.0), 0.0)
    bt = s.next_batch(0, 0.0)
    assert bt is not None and bt.error == "model a does not fit the budget"
    assert (bt.executor, bt.model, [j.id for j in bt.jobs], bt.load, bt.evict) == (0, "a", [0], False, [])
    assert s.executors[0].resident == {} and s.stats.loads == 0
    with pytest.raises(ConfigError, match=r"^unknown model 'zz'$"):
        s.submit(Job(1, "zz", 0.0), 0.0)


def test_fit_line_and_latency_percentiles() -> None:
    from moetier.pool.sched import fit_line
    from moetier.pool.sim import SimResult

    assert fit_line([1, 2, 3], [2.0, 4.0, 6.0]) == pytest.approx((2.0, 0.0))
    assert fit_line([1, 3], [1.0, 2.0]) == pytest.approx((0.5, 0.5))
    assert fit_line([2, 2], [1.0, 3.0]) == (0.0, 2.0)  # one x: the mean
    r = SimResult(completed=4, seconds=8.0, loads=0, preloads=0, bytes_loaded=0, latencies=[4.0, 1.0, 3.0, 2.0])
    assert (r.latency(0.0), r.latency(0.5), r.latency(0.74), r.latency(0.99), r.latency(1.0)) == (1, 3, 3, 4, 4)
    assert r.throughput == 0.5
    assert SimResult(0, 0.0, 0, 0, 0).latency(0.5) == 0.0 and SimResult(0, 0.0, 0, 0, 0).throughput == 0.0


def test_round_robin_deals_jobs_in_turn_and_makespan_does_not() -> None:
    cs = costs(a=c(load=5.0), b=c(load=5.0))
    rr = Scheduler(cs, 1000 * MB, 3, Mechanisms(assign="round_robin", preload=False))
    assert [rr.submit(Job(i, m, 0.0), 0.0) for i, m in enumerate("aabab")] == [0, 1, 2, 0, 1]
    ms = Scheduler(cs, 1000 * MB, 3, Mechanisms(preload=False))
    # the second a goes to an idle executor (5.15 s there ends sooner than 5.25 s behind the first),
    # b to the third; the next a and b join their model's queue, a on the lower executor of a tie
    assert [ms.submit(Job(i, m, 0.0), 0.0) for i, m in enumerate("aabab")] == [0, 1, 2, 0, 2]


def test_stage_one_frees_the_largest_orphan_first_and_lru_the_never_used_first() -> None:
    cs = costs(cls=c(nbytes=100 * MB), big=c(nbytes=200 * MB), small=c(nbytes=100 * MB), new=c(nbytes=200 * MB))
    deps = {"big": {"cls"}, "small": {"cls"}}
    s = Scheduler(cs, 450 * MB, 1, Mechanisms(), deps)
    s.executors[0].resident.update({"small": 100 * MB, "big": 200 * MB})
    assert run_loads(s, ["new"]) == [["big"]]  # 150 MB free: the larger orphan goes, and that is enough
    lru = Scheduler(cs, 450 * MB, 1, Mechanisms(evict="lru", preload=False))
    ex = lru.executors[0]
    ex.resident.update({"cls": 100 * MB, "big": 200 * MB})  # preloaded: never used yet
    assert run_loads(lru, ["small", "cls", "new"]) == [[], [], ["big"]]
    fifo = Scheduler(cs, 450 * MB, 1, Mechanisms(evict="fifo", preload=False))
    fifo.executors[0].resident.update({"big": 200 * MB, "cls": 100 * MB})
    assert run_loads(fifo, ["small", "big", "new"]) == [[], [], ["big"]]  # loaded first, out first


def test_stats_count_loads_evictions_batches_and_jobs() -> None:
    cs = costs(a=c(load=2.0, nbytes=300 * MB, k=0.5, b=0.25), b=c(load=1.0, nbytes=300 * MB))
    s = Scheduler(cs, 500 * MB, 1, Mechanisms(preload=False, arrange=False))
    for i, m in enumerate("aaba"):
        s.submit(Job(i, m, 0.0), 0.0)
    first = s.next_batch(0, 0.0)
    assert first is not None and first.load and first.predicted == pytest.approx(2.0 + 0.25 + 2 * 0.5)
    s.finish(first)
    while (bt := s.next_batch(0, 0.0)) is not None:
        s.finish(bt)
    st = s.stats
    assert (st.loads, st.evictions, st.batches, st.jobs, st.bytes_loaded) == (3, 2, 3, 4, 900 * MB)
    again = s.next_batch(0, 0.0)
    assert again is None


def test_the_budget_is_split_evenly_and_a_model_may_fill_a_share() -> None:
    s = Scheduler(costs(a=c(nbytes=150 * MB)), 301 * MB, 2)
    assert [e.budget for e in s.executors] == [301 * MB // 2] * 2
    Scheduler(costs(a=c(nbytes=150 * MB)), 300 * MB, 2)  # exactly a share: fits
    one = Scheduler(costs(a=c()), 300 * MB)
    assert len(one.executors) == 1
