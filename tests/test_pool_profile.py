"""`moetier profile` in-process: usage shares through pipelines, the batch line, the requests a shape is
timed with, and one measurement of each shape on real tiny models (its clock and memory readings
scripted, so every number it writes is known)."""

from __future__ import annotations

import json
import platform
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ModelFactory
from moetier import ConfigError, Model
from moetier.pool import profile as prof
from moetier.pool.executor import estimate_cost, footprint, open_model, read_profile
from moetier.pool.sched import Cost
from moetier.pool.spec import ModelSpec, Pipeline, PoolSpec, Stage, load_spec


def pool(tmp: Path, models: dict[str, ModelSpec], *pipelines: Pipeline) -> PoolSpec:
    return PoolSpec(tmp / "pool.yaml", 1 << 30, models, {p.name: p for p in pipelines})


def model(tmp: Path, name: str, size: int = 4, n_ctx: int = 512) -> ModelSpec:
    path = tmp / f"{name}.gguf"
    path.write_bytes(b"G" * size)
    return ModelSpec(name, path, n_ctx=n_ctx)


def test_shape_key_is_the_models_shape_as_a_tuple(tmp_path: Path) -> None:
    """A model's shape key is (file size, has a store, cache, n_ctx) as a hashable tuple."""
    m = model(tmp_path, "a", size=7, n_ctx=256)
    assert prof.shape_key(m) == (7, False, "", 256)
    assert hash(prof.shape_key(m)) == hash((7, False, "", 256))


def test_default_usage_weighs_each_pipeline_and_each_model_outside_pipelines_once(tmp_path: Path) -> None:
    """Without weights, each pipeline and each model outside pipelines get one request; shares keep pool order."""
    ms = {n: model(tmp_path, n) for n in ("c", "a", "b")}
    one = Stage("one", "a", routes=(("^y", "two"),))
    p = Pipeline("p", "one", {"one": one, "two": Stage("two", "b")})
    probs = prof.usage_probabilities(pool(tmp_path, ms, p))
    assert list(probs) == ["c", "a", "b"]
    assert probs == {"c": 0.4, "a": 0.4, "b": 0.2}  # c 1, a 1 (the pipeline's), b half of it
    assert prof.usage_probabilities(pool(tmp_path, ms)) == pytest.approx({"c": 1 / 3, "a": 1 / 3, "b": 1 / 3})


def test_a_diamond_pipeline_merges_both_branches_into_the_last_stage(tmp_path: Path) -> None:
    """A stage two branches lead to gets both halves of the share, whatever order the stages are written in."""
    ms = {n: model(tmp_path, n) for n in ("a", "b", "c", "d")}
    stages = {
        "end": Stage("end", "d"),
        "left": Stage("left", "b", default="end"),
        "start": Stage("start", "a", routes=(("^y", "left"),), default="right"),
        "right": Stage("right", "c", default="end"),
    }
    spec = pool(tmp_path, ms, Pipeline("p", "start", stages))
    assert prof.usage_probabilities(spec) == pytest.approx({"a": 1 / 3, "b": 1 / 6, "c": 1 / 6, "d": 1 / 3})
    order = [st.name for st in prof._topological(spec.pipelines["p"])]
    assert order == ["start", "right", "left", "end"]


def test_routes_to_one_stage_add_up_and_an_ending_route_keeps_its_part(tmp_path: Path) -> None:
    """Each route takes an equal part: two routes to one stage add up, a route to null ends its part."""
    ms = {n: model(tmp_path, n) for n in ("a", "b", "c")}
    one = Stage("one", "a", routes=(("x", "two"), ("y", "two")), default="three")
    two = Stage("two", "b", routes=(("z", None),), default="three")
    spec = pool(tmp_path, ms, Pipeline("p", "one", {"one": one, "two": two, "three": Stage("three", "c")}))
    # a: 1; b: 2/3; c: 1/3 from a's default + 1/3 from half of b's
    want = {"a": 1.0, "b": 2 / 3, "c": 2 / 3}
    total = sum(want.values())
    assert prof.usage_probabilities(spec, {"p": 6.0}) == pytest.approx({m: v / total for m, v in want.items()})


def test_weights_mix_models_and_pipelines_and_zero_weights_are_allowed(tmp_path: Path) -> None:
    """A model's own weight adds to its pipelines'; zero weights are allowed, and all-zero weights give shares of 0."""
    ms = {n: model(tmp_path, n) for n in ("a", "b")}
    spec = pool(tmp_path, ms, Pipeline("p", "one", {"one": Stage("one", "a", default="two"), "two": Stage("two", "b")}))
    assert prof.usage_probabilities(spec, {"p": 1.0, "a": 2.0, "b": 0.0}) == {"a": 0.75, "b": 0.25}
    assert prof.usage_probabilities(spec, {"a": 0.0, "p": 0.0}) == {"a": 0.0, "b": 0.0}
    assert prof.usage_probabilities(spec, {}) == {"a": 0.0, "b": 0.0}


def test_a_model_counts_each_stage_and_weight_using_it_and_weights_below_one_still_share(tmp_path: Path) -> None:
    """A model two stages use gets a job from each, its own weight adds to them in any order, and weights
    summing below 1 still give shares."""
    ms = {n: model(tmp_path, n) for n in ("a", "b")}
    stages = {
        "one": Stage("one", "a", default="two"),
        "two": Stage("two", "a", default="three"),
        "three": Stage("three", "b"),
    }
    spec = pool(tmp_path, ms, Pipeline("p", "one", stages))
    assert prof.usage_probabilities(spec) == {"a": 2 / 3, "b": 1 / 3}  # a runs twice per request
    assert prof.usage_probabilities(spec, {"a": 1.0, "p": 1.0}) == {"a": 0.75, "b": 0.25}
    assert prof.usage_probabilities(spec, {"p": 0.25}) == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    assert prof.usage_probabilities(spec, {"a": 0.5, "b": 0.25}) == pytest.approx({"a": 2 / 3, "b": 1 / 3})


def test_bad_usage_weights_say_which_name_is_wrong(tmp_path: Path) -> None:
    """A negative weight or an unknown name is refused with a message naming it."""
    spec = pool(tmp_path, {"a": model(tmp_path, "a")})
    with pytest.raises(ConfigError) as e:
        prof.usage_probabilities(spec, {"a": -0.5})
    assert str(e.value) == "usage: a: weight -0.5 is negative"
    with pytest.raises(ConfigError) as e:
        prof.usage_probabilities(spec, {"a": 1.0, "zz": 1.0})
    assert str(e.value) == "usage: unknown model or pipeline 'zz'"


def test_the_batch_line_is_the_least_squares_fit_unless_a_cost_is_negative() -> None:
    """The batch line is the least-squares fit; a negative intercept becomes 0, with k the mean time per job."""
    assert prof.fit_batch_line([1, 2, 4], [0.3, 0.4, 0.6]) == pytest.approx((0.1, 0.2))
    k, b = prof.fit_batch_line([1, 2, 4], [0.1, 0.3, 0.9])
    assert (k, b) == (pytest.approx(1.3 / 7), 0.0)
    assert prof.fit_batch_line([1], [0.25]) == (0.0, 0.25)
    # larger batches timed faster (noise): a flat line at the mean batch time, never a negative cost
    assert prof.fit_batch_line([1, 2, 4], [0.5, 0.4, 0.3]) == (0.0, pytest.approx(0.4))


def test_a_shape_is_timed_as_the_first_pipeline_stage_using_it_asks(tmp_path: Path) -> None:
    """A shape is timed as the first stage using it asks (its max_tokens, 'Yes.' as earlier answer), else plainly."""
    ms = {"a": model(tmp_path, "a", 4), "b": model(tmp_path, "b", 5), "twin": model(tmp_path, "twin", 4)}
    stages = {
        "one": Stage("one", "twin", max_tokens=3, prompt="Q: {input} / {previous}", default="two"),
        "two": Stage("two", "a", max_tokens=9, prompt="never {input}"),
    }
    spec = pool(tmp_path, ms, Pipeline("p", "one", stages))
    n, prompts = prof.timed_requests(spec, prof.shape_key(ms["a"]), 16)
    assert n == 3
    assert prompts == [f"Q: {x} / Yes." for x in prof.PROMPTS]
    assert prompts[0] == "Q: Write one sentence about the weather. / Yes."
    n, prompts = prof.timed_requests(spec, prof.shape_key(ms["b"]), 16)
    assert (n, prompts) == (16, list(prof.PROMPTS))
    assert len(prof.PROMPTS) == 8 and len(set(prof.PROMPTS)) == 8


class Clock:
    """A clock that only moves when the profiled model says its work took time."""

    def __init__(self) -> None:
        self.t = 1000.0

    def perf_counter(self) -> float:
        return self.t


class TimedModel:
    """A real model whose calls move the clock: the load by `load`, each generate by costs[i] for its
    i-th call, then batch_costs: 0.3 s for the batches' first prompt and 0.1 s for any other by default."""

    def __init__(
        self,
        m: Model,
        clock: Clock,
        load: float,
        costs: list[float],
        batch_first: str,
        batch_costs: tuple[float, float] = (0.3, 0.1),
    ) -> None:
        self.m, self.clock, self.costs, self.batch_first = m, clock, costs, batch_first
        self.batch_costs = batch_costs  # (the batches' first prompt, any other)
        self.calls: list[tuple[str, int]] = []
        self.closed = False
        clock.t += load

    def generate(self, prompt: str, max_tokens: int) -> object:
        r = self.m.generate(prompt, max_tokens=max_tokens)
        i = len(self.calls)
        self.calls.append((prompt, max_tokens))
        first, other = self.batch_costs
        self.clock.t += self.costs[i] if i < len(self.costs) else (first if prompt == self.batch_first else other)
        return r

    def close(self) -> None:
        self.closed = True
        self.m.close()


@pytest.fixture
def profiled(tmp_path: Path, tiny_model: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """A pool of three tiny models of two shapes (a and c alike; b larger), a in a pipeline, profiled with
    a scripted clock and resident-memory readings."""
    a, c, b = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=2), tiny_model("qwen2", n_layer=3, seed=1)
    assert a.stat().st_size == c.stat().st_size != b.stat().st_size
    cfg = {
        "budget": "1G",
        "threads": 2,
        "models": {
            "a": {"path": str(a), "n_ctx": 256},
            "c": {"path": str(c), "n_ctx": 256, "max_batch": 1},
            "b": {"path": str(b), "n_ctx": 256, "max_batch": 2},
        },
        "pipelines": {"p": {"stages": {"s": {"model": "a", "max_tokens": 3, "prompt": "Q: {input} / {previous}"}}}},
    }
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(cfg))
    spec = load_spec(path)
    clock = Clock()
    monkeypatch.setattr(prof, "time", SimpleNamespace(perf_counter=clock.perf_counter, strftime=time.strftime))
    opened: list[TimedModel] = []
    a_prompts = [f"Q: {x} / Yes." for x in prof.PROMPTS]
    plan = {
        "a": (0.25, [0.6, 0.1], a_prompts[1]),  # the first request is 0.5 s slower: counted in the load
        "b": (0.5, [0.1, 0.2], prof.PROMPTS[1]),  # the first is faster than the second: nothing added
    }
    threads: list[int] = []

    def opener(m: ModelSpec, n_threads: int) -> TimedModel:
        threads.append(n_threads)
        load, costs, first = plan[m.name]
        opened.append(TimedModel(open_model(m, n_threads), clock, load, costs, first))
        return opened[-1]

    monkeypatch.setattr(prof, "open_model", opener)
    rss = iter([100 << 20, 103 << 20, 200 << 20, 150 << 20])  # a grows by 3 MiB; b's reading drops
    monkeypatch.setattr(prof, "rss_bytes", lambda: next(rss))
    dropped: list[Path] = []
    real_drop = prof.drop_page_cache

    def drop(p: Path) -> None:
        dropped.append(p)
        real_drop(p)

    monkeypatch.setattr(prof, "drop_page_cache", drop)
    notes: list[str] = []
    data = prof.profile(spec, weights={"p": 2.0, "b": 1.0, "c": 1.0}, note=notes.append)  # 16 tokens by default
    yield SimpleNamespace(spec=spec, data=data, opened=opened, notes=notes, dropped=dropped, threads=threads)


def test_profile_measures_one_model_per_shape_with_its_timed_requests(profiled: SimpleNamespace) -> None:
    """Each shape is opened once, run cold, warm, then in batches of 1, 2, 4 up to max_batch, closed and dropped."""
    spec, opened = profiled.spec, profiled.opened
    assert profiled.threads == [2, 2]
    a, b = opened
    ap = [f"Q: {x} / Yes." for x in prof.PROMPTS]
    assert a.calls == [(ap[0], 3), (ap[0], 3), (ap[1], 3), (ap[1], 3), (ap[2], 3), *[(p, 3) for p in ap[1:5]]]
    bp = list(prof.PROMPTS)
    assert b.calls == [(bp[0], 16), (bp[0], 16), (bp[1], 16), (bp[1], 16), (bp[2], 16)]  # max_batch 2: no batch of 4
    assert a.closed and b.closed
    am, bm = spec.models["a"].path, spec.models["b"].path
    assert profiled.dropped == [am, am, bm, bm]


def test_profile_reports_the_load_bytes_and_batch_line_it_measured(profiled: SimpleNamespace) -> None:
    """The profile's load, bytes, k and b follow the timings and memory readings; a same-shape model reuses them."""
    spec, data = profiled.spec, profiled.data
    wa, kva, _ = footprint(spec.models["a"])
    wb, kvb, _ = footprint(spec.models["b"])
    assert wa + kva < 3 << 20  # the measured growth of a is larger than its weights and KV
    rows = data["models"]
    assert list(rows) == ["a", "c", "b"]
    ra = rows["a"]
    assert set(ra) == {"load", "nbytes", "k", "b", "rss_delta", "max_batch", "p", "profiled_as", "path", "shape"}
    assert (ra["load"], ra["k"], ra["b"]) == pytest.approx((0.75, 0.1, 0.2))
    assert (ra["nbytes"], ra["rss_delta"], ra["max_batch"], ra["p"]) == (3 << 20, 3 << 20, 4, 0.5)
    assert (ra["profiled_as"], ra["path"], ra["shape"]) == ("a", str(spec.models["a"].path), spec.models["a"].shape())
    rc = rows["c"]
    assert {k: rc[k] for k in ("load", "nbytes", "k", "b", "rss_delta")} == {
        k: ra[k] for k in ("load", "nbytes", "k", "b", "rss_delta")
    }
    assert (rc["max_batch"], rc["p"], rc["profiled_as"]) == (1, 0.25, "a")
    assert (rc["path"], rc["shape"]) == (str(spec.models["c"].path), spec.models["c"].shape())
    rb = rows["b"]
    assert (rb["load"], rb["k"], rb["b"]) == pytest.approx((0.5, 0.1, 0.2))  # batches of 1 and 2 only
    assert (rb["nbytes"], rb["rss_delta"], rb["max_batch"], rb["p"], rb["profiled_as"]) == (wb + kvb, 0, 2, 0.25, "b")
    assert (data["config"], data["threads"], data["max_tokens"], data["host"]) == (
        str(spec.path),
        2,
        16,
        platform.node(),
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", data["date"])
    assert set(data) == {"config", "date", "host", "threads", "max_tokens", "models"}


def test_profile_notes_each_shape_and_its_numbers(profiled: SimpleNamespace) -> None:
    """The progress notes name each measured model, its file, its shape's count and its measured numbers."""
    spec = profiled.spec
    ea = estimate_cost(spec.models["a"]).nbytes / 2**20
    eb = estimate_cost(spec.models["b"]).nbytes / 2**20
    assert profiled.notes == [
        f"[1/2] a ({spec.models['a'].path.name}; 2 of this shape)",
        f"    load 0.75 s, 3 MiB measured ({ea:.0f} estimated), k 100 ms, b 200 ms",
        f"[2/2] b ({spec.models['b'].path.name}; 1 of this shape)",
        f"    load 0.50 s, 0 MiB measured ({eb:.0f} estimated), k 100 ms, b 200 ms",
    ]


def test_a_written_profile_is_json_the_pool_reads_back(profiled: SimpleNamespace, tmp_path: Path) -> None:
    """write_profile replaces the file with one-space-indented JSON and a newline, which read_profile reads back."""
    out = tmp_path / "pool.profile.json"
    out.write_text("old")
    prof.write_profile(profiled.data, out)
    assert out.read_text() == json.dumps(profiled.data, indent=1) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir() if "profile" in p.name) == ["pool.profile.json"]
    costs = read_profile(out, profiled.spec)
    assert list(costs) == ["a", "c", "b"]
    ra = profiled.data["models"]["a"]
    assert costs["c"] == Cost(k=ra["k"], b=ra["b"], load=ra["load"], nbytes=3 << 20, max_batch=1, p=0.25)
    assert costs["b"].nbytes == profiled.data["models"]["b"]["nbytes"] and costs["b"].max_batch == 2


def test_profile_skips_batches_above_max_batch_in_any_order_and_notes_k_and_b_in_ms(
    tmp_path: Path, tiny_model: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch sizes above the model's max_batch are skipped wherever they stand in the list; the note gives
    the load in seconds and k and b in milliseconds."""
    m = ModelSpec("m", tiny_model("qwen2", seed=1), n_ctx=256, max_batch=2)
    spec = pool(tmp_path, {"m": m})
    clock = Clock()
    monkeypatch.setattr(prof, "time", SimpleNamespace(perf_counter=clock.perf_counter, strftime=time.strftime))
    opened: list[TimedModel] = []

    def opener(ms: ModelSpec, n_threads: int) -> TimedModel:
        # a batch of n takes 2n + 3 seconds: 5 s for its first job, 2 s for each other
        opened.append(TimedModel(open_model(ms, n_threads), clock, 1.0, [1.0, 1.0], prof.PROMPTS[1], (5.0, 2.0)))
        return opened[-1]

    monkeypatch.setattr(prof, "open_model", opener)
    monkeypatch.setattr(prof, "rss_bytes", lambda: 0)
    notes: list[str] = []
    data = prof.profile(spec, max_tokens=2, batches=(4, 2, 1), note=notes.append)
    (timed,) = opened
    assert [p for p, _ in timed.calls[2:]] == [prof.PROMPTS[1], prof.PROMPTS[2], prof.PROMPTS[1]]  # 2, then 1
    row = data["models"]["m"]
    assert (row["load"], row["k"], row["b"]) == pytest.approx((1.0, 2.0, 3.0))
    estimate = estimate_cost(m).nbytes / 2**20
    assert notes[1] == f"    load 1.00 s, 0 MiB measured ({estimate:.0f} estimated), k 2000 ms, b 3000 ms"
