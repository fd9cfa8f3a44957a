"""Calibration: the routing trace, trace replay through the engine's cache code (checked against the
live engine), threshold choice, and the config file it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, ContextConfig, Model, ModelError, _core
from moetier.calibrate import CalibrateConfig, Trace, calibrate, choose_thresholds, moe_layers, record_trace, split_of


@pytest.fixture(scope="module")
def moe(tiny_model: ModelFactory) -> Path:
    return tiny_model("qwen3moe", n_expert=16, n_expert_used=4, n_layer=4, expert_type="f16")


def test_trace_is_the_models_routing(moe: Path) -> None:
    tr = record_trace(moe, LONG_PROMPT, CalibrateConfig(tokens=40, seq_len=16))
    n = min(40, len(Model(moe).tokenize(LONG_PROMPT)))
    assert tr.ids.shape == (n, 4, 4) and tr.weights.shape == (n, 4, 4)
    assert tr.layers == (0, 1, 2, 3) and tr.n_expert == 16 and tr.seq_starts == tuple(range(0, n, 16))
    assert tr.ids.min() >= 0 and tr.ids.max() < 16
    # distinct experts per selection, weights descending (top-k order), softmax probabilities
    assert all(len(set(row)) == 4 for row in tr.ids.reshape(-1, 4).tolist())
    assert np.all(np.diff(tr.weights, axis=2) <= 1e-6) and np.all((tr.weights > 0) & (tr.weights < 1))


@pytest.mark.parametrize("policy", ["lru", "multi", "lfu", "classlru", "lfru", "least-stale"])
def test_replay_matches_the_live_engine(moe: Path, policy: str) -> None:
    """One sequence decoded token by token by the engine, and the same routing replayed: the same
    hits, misses and bytes, because it is the same code."""
    probe = Model(moe, cache=CacheConfig.exact("64M")).cache_info()
    budget = int(probe["min_cache_bytes"]) * 2
    # replay models the cache's own reads: no prefetch (on by default) in the live run either
    live = Model(moe, cache=CacheConfig.exact(budget, policy=policy, prefetch=0), context=ContextConfig(n_ctx=64))
    prompt = live.tokenize("def")[:1]
    n = 48
    out = live.generate(prompt, max_tokens=n)
    s = out.stats
    info = live.cache_info()
    evaluated = prompt + out.tokens[: n - 1]  # every token run through the model (each one an output)
    tr = record_trace(moe, evaluated, CalibrateConfig(tokens=len(evaluated), seq_len=64))
    assert tr.ids.shape[0] == len(evaluated) > 8
    n_experts = int(info["n_layers"]) * int(info["n_expert"])
    r = _core.replay(
        tr.ids,
        tr.weights,
        16,
        int(info["expert_bytes"]) // n_experts,
        0,
        int(info["n_slots"]),
        0,
        policy,
        [0.25, 0.25, 0.25, 0.25],
        1.0,
        1.0,
        [0],
    )
    assert (r.n_lookups, r.n_hits, r.n_misses, r.n_bytes_read) == (s.n_lookups, s.n_hits, s.n_misses, s.n_bytes_read)
    assert r.n_hits > 0 and r.n_misses > 0


def test_replay_counts_precision_and_checks_input(moe: Path) -> None:
    tr = record_trace(moe, LONG_PROMPT, CalibrateConfig(tokens=32, seq_len=32))
    args = (tr.ids, tr.weights, 16, 1000, 250, 16, 8, "lru", [0.25] * 4)
    exact = _core.replay(*args, 1.0, 1.0)
    mixed = _core.replay(*args, 0.3, 0.95)
    assert exact.n_loads_low == 0 and exact.n_bytes_read == 1000 * exact.n_misses
    assert mixed.n_loads_low > 0 and mixed.n_skipped >= 0
    assert mixed.n_bytes_read == 1000 * mixed.n_loads_high + 250 * mixed.n_loads_low
    assert mixed.n_misses == mixed.n_loads_high + mixed.n_loads_low + mixed.n_skipped
    with pytest.raises(ValueError, match="below one layer"):
        _core.replay(tr.ids, tr.weights, 16, 1000, 0, 8, 0, "lru", [0.25] * 4, 1.0, 1.0)
    with pytest.raises(ValueError, match="out of range"):
        _core.replay(tr.ids + 16, tr.weights, 16, 1000, 0, 16, 0, "lru", [0.25] * 4, 1.0, 1.0)
    # more (layer, expert) keys than an int32 holds: refused (the product wrapped to 0 and aborted)
    wide = np.zeros((1, 65536, 1), dtype=np.int32)
    with pytest.raises(ValueError, match="more experts than a cache holds"):
        _core.replay(wide, None, 65536, 1000, 0, 65536, 0, "lru", [0.25] * 4, 1.0, 1.0)


def test_choose_thresholds() -> None:
    rng = np.random.default_rng(0)
    scores = np.concatenate([np.zeros(250), rng.uniform(0, 1, 750)]).astype(np.float32)
    t1, t2 = choose_thresholds(scores, target_low=0.3, target_skip=0.05)
    s = split_of(scores, t1, t2)
    assert abs(s["low"] - 0.3) < 0.01 and abs(s["skip"] - 0.05) < 0.01
    assert choose_thresholds(scores, 0.0, 0.0) == (1.0, 1.0)
    with pytest.raises(ConfigError):
        CalibrateConfig(target_low=0.8, target_skip=0.3)


def test_calibrate_writes_a_config_the_engine_loads(moe: Path, tmp_path: Path) -> None:
    budget = 2 * int(Model(moe, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    out = tmp_path / "m.cache.json"
    rep = calibrate(moe, LONG_PROMPT * 3, budget, out, CalibrateConfig(tokens=96, seq_len=32, grid=2))
    cfg = json.loads(out.read_text())
    assert cfg["budget"] == budget and 0 <= cfg["t1"] <= cfg["t2"] <= 1
    assert Trace.load(rep["trace_path"]).ids.shape[0] == 96
    rows = rep["policies"]
    assert {r["policy"] for r in rows} >= {"random", "lru", "lfu", "lhu", "fld", "multi"}
    assert next(r for r in rows if r["policy"] == "random")["penalty_vs_random"] == 1.0
    assert rows[0]["n_bytes_read"] == min(r["n_bytes_read"] for r in rows)
    assert (cfg["policy"], [cfg[k] for k in ("w_lru", "w_lfu", "w_lhu", "w_fld")]) == (
        rows[0]["policy"],
        rows[0]["weights"],
    )
    c = CacheConfig.from_file(out)
    Model(moe, cache=c).generate("hello", max_tokens=4)
    assert CacheConfig.from_file(out, t1=1.0, t2=1.0).t1 == 1.0

    bad = tmp_path / "bad.json"
    bad.write_text('{"budget": "1M", "colour": 3}')
    with pytest.raises(ConfigError, match="unknown cache config field"):
        CacheConfig.from_file(bad)

    # the CLI: calibrate, then run with the config
    r = subprocess.run(
        [sys.executable, "-m", "moetier.cli", "calibrate", str(moe), "--corpus", str(_text(tmp_path)),
         "--budget", str(budget), "-o", str(tmp_path / "cli.json"), "--tokens", "64", "--seq-len", "32", "-q"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "| policy |" in r.stdout and (tmp_path / "cli.json").exists()
    r = subprocess.run(
        [sys.executable, "-m", "moetier.cli", "run", "-m", str(moe), "-p", "hi", "-n", "4",
         "--cache-config", str(tmp_path / "cli.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "hit rate" in r.stderr


def _text(tmp_path: Path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text(LONG_PROMPT * 4)
    return p


def test_calibrate_searches_the_pool_split(moe: Path, tmp_path: Path) -> None:
    """With a store whose low copies the thresholds use, the share of the budget for low slots is
    searched by replay too; the config gets the split with the fewest bytes read."""
    from moetier import PackConfig, pack

    store = pack(moe, tmp_path / "s", PackConfig(low_type="q4_0"), progress=False)
    budget = 3 * int(Model(moe, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    cfg = CalibrateConfig(tokens=96, seq_len=32, grid=2, target_low=0.5)
    rep = calibrate(moe, LONG_PROMPT * 3, budget, tmp_path / "m.cache.json", cfg, store=store)
    splits = rep["low_frac_search"]
    assert [r["low_frac"] for r in splits] == [0.05, 0.1, 0.15, 0.25, 0.4]
    assert len({r["n_slots_low"] for r in splits}) > 1  # the splits differ
    best = min(splits, key=lambda r: r["n_bytes_read"])
    assert rep["config"]["low_frac"] == best["low_frac"]
    assert rep["policies"][0]["n_bytes_read"] == best["n_bytes_read"]
    # a given split is kept
    rep = calibrate(moe, LONG_PROMPT * 3, budget, tmp_path / "n.cache.json", cfg, store=store, low_frac=0.3)
    assert rep["config"]["low_frac"] == 0.3 and len(rep["low_frac_search"]) == 1


def test_bad_budget_fails_before_tracing(tmp_path: Path) -> None:
    """The budget is checked first: the model path does not even exist, so a check after the trace
    would fail on the model instead."""
    with pytest.raises(ConfigError, match=r"cache\.budget: '25%'"):
        calibrate(tmp_path / "absent.gguf", "text", "25%", tmp_path / "c.json")


def _shared(path: Path, **arrays: object) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def test_shared_trace_format_is_read_as_recorded(tmp_path: Path) -> None:
    ids = np.array([[[3, 1, 2], [0, 4, 5]]] * 4, dtype=np.uint8)  # [4 tokens, 2 layers, top-3]
    base = {"ids": ids, "seq_offsets": np.array([0, 3, 4]), "n_experts": np.int32(8), "top_k": np.int32(3)}
    tr = Trace.load(_shared(tmp_path / "a.npz", **base))
    assert tr.ids.dtype == np.int32 and tr.ids.tolist() == ids.astype(np.int32).tolist()
    # no layers: numbered from 0; no weights: each selection weighs 1/K, in float32
    assert tr.layers == (0, 1) and tr.n_expert == 8 and not tr.has_weights
    assert tr.weights.dtype == np.float32 and np.all(tr.weights == np.float32(1 / 3))
    assert tr.seq_starts == (0, 3) and tr.ubatch_starts == (0, 1, 2, 3)  # every token its own step
    w = np.full(ids.shape, 0.25, dtype=np.float64)
    tr = Trace.load(_shared(tmp_path / "b.npz", **base, layers=np.array([1, 2]), weights=w))
    assert tr.layers == (1, 2) and tr.has_weights and tr.weights.dtype == np.float32
    bad = [
        ({"ids": ids[:, :, 0]}, "ids of shape (4, 2), need [tokens, layers, top_k]"),
        ({"seq_offsets": np.array([0, 2, 2, 4])}, "seq_offsets must rise strictly from 0 to the 4 tokens"),
        ({"weights": w[:, :, :2]}, "weights (4, 2, 2) and ids (4, 2, 3) differ in shape"),
    ]
    for change, says in bad:
        p = _shared(tmp_path / "bad.npz", **{**base, **change})
        with pytest.raises(ConfigError) as e:
            Trace.load(p)
        assert str(e.value) == f"{p}: {says}"


def _trace(n: int, *, layers: tuple[int, ...] = (0, 1), n_expert: int = 8, k: int = 2, **kw: object) -> Trace:
    rng = np.random.default_rng(n)
    ids = np.stack([rng.permutation(n_expert)[:k] for _ in range(n * len(layers))]).reshape(n, len(layers), k)
    w = np.full(ids.shape, 1.0 / k, dtype=np.float32)
    return Trace(ids.astype(np.int32), w, layers, n_expert, **{"seq_starts": (0,), **kw})  # type: ignore[arg-type]


def test_concat_traces_checks_and_offsets() -> None:
    from moetier.calibrate import concat_traces

    a, b = _trace(3, ubatch_starts=(0, 2)), _trace(2, seq_starts=(0, 1), ubatch_starts=(0,), has_weights=False)
    c = concat_traces([a, b], ["a.npz", "b.npz"])
    assert c.ids.shape == (5, 2, 2) and c.ids[3:].tolist() == b.ids.tolist()
    assert (c.layers, c.n_expert, c.seq_starts, c.ubatch_starts) == ((0, 1), 8, (0, 3, 4), (0, 2, 3))
    assert not c.has_weights and concat_traces([a, a], ["a", "a2"]).has_weights
    for other in (_trace(2, layers=(0, 2)), _trace(2, n_expert=16), _trace(2, k=3)):
        with pytest.raises(ConfigError) as e:
            concat_traces([a, a, other], ["a.npz", "a2.npz", "c.npz"])
        assert str(e.value) == "c.npz: recorded on another model than a.npz (MoE layers, experts or top-k differ)"
    with pytest.raises(ValueError):
        concat_traces([a, b], ["a.npz"])  # a name for each trace


def test_policy_candidates_on_the_grid() -> None:
    from moetier.calibrate import policy_candidates

    singles = [(n, (0.25, 0.25, 0.25, 0.25)) for n in ("random", "lru", "lfu", "lhu", "fld", "reuse", "reuse-rank")]
    halves = [
        (0.0, 0.0, 0.5, 0.5),
        (0.0, 0.5, 0.0, 0.5),
        (0.0, 0.5, 0.5, 0.0),
        (0.5, 0.0, 0.0, 0.5),
        (0.5, 0.0, 0.5, 0.0),
        (0.5, 0.5, 0.0, 0.0),
    ]
    assert policy_candidates(2) == singles + [("multi", w) for w in halves]
    assert policy_candidates(1) == singles  # the grid's only points are one-hot: the single policies
    assert len(policy_candidates(4)) == 7 + 35 - 4


def test_search_policy_replays_each_candidate(moe: Path) -> None:
    from moetier.calibrate import search_policy

    tr = record_trace(moe, LONG_PROMPT, CalibrateConfig(tokens=48, seq_len=16))
    info = dict(Model(moe, cache=CacheConfig.exact("64M")).cache_info())
    info = {k: info[k] for k in ("n_groups", "n_layers", "n_expert", "expert_bytes", "n_slots")}
    info["n_slots"] = 24  # of 64 experts: a small cache, where the policies differ
    calls: list[tuple[int, int]] = []
    rows = search_policy(tr, info, 1.0, 1.0, 2, lambda done, total: calls.append((done, total)))
    assert calls == [(i, 13) for i in range(1, 14)]
    # each row is the engine's replay with the trace's weights and sequence starts
    per = int(info["expert_bytes"]) // (int(info["n_layers"]) * int(info["n_expert"]))
    for r in rows:
        want = _core.replay(
            tr.ids,
            tr.weights,
            16,
            per,
            0,
            int(info["n_slots"]),
            0,
            r["policy"],
            r["weights"],
            1.0,
            1.0,
            list(tr.seq_starts),
        )
        assert r["n_bytes_read"] == want.n_bytes_read and r["n_hits"] == want.n_hits
    random = next(r for r in rows if r["policy"] == "random")
    assert [r["penalty_vs_random"] for r in rows] == [r["n_bytes_read"] / random["n_bytes_read"] for r in rows]
    # sorted by bytes read; on a tie a weighted multi comes first
    keys = [(r["n_bytes_read"], r["policy"] != "multi") for r in rows]
    assert keys == sorted(keys)
    with pytest.raises(ModelError) as e:
        search_policy(tr, {**info, "n_groups": 2}, 1.0, 1.0, 2)
    assert str(e.value) == "calibration replays one pool group; this model's layers form several"


def test_plot_scores_draws_the_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from moetier.calibrate import plot_scores

    kept: list[object] = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, fname, *a, **k: (kept.append(fig), Path(fname).touch()))
    scores = np.array([0.0, 0.0, 0.1, 0.2, 0.3, 0.5, 0.9, 1.0], dtype=np.float32)
    assert plot_scores(scores, 0.25, 0.6, tmp_path / "s.png")
    (fig,) = kept
    ax = fig.axes[0]  # type: ignore[attr-defined]
    assert list(fig.get_size_inches()) == [7.0, 4.0]  # type: ignore[attr-defined]
    bars = ax.patches
    assert len(bars) == 60 and sum(b.get_height() for b in bars) == 6  # the 6 scores above 0
    assert bars[0].get_x() == pytest.approx(0.1) and bars[0].get_facecolor()[:3] == pytest.approx(
        (0.298, 0.447, 0.690), abs=1e-3
    )
    vlines = [ln for ln in ax.get_lines()]
    assert [(ln.get_xdata()[0], ln.get_color(), ln.get_linestyle()) for ln in vlines] == [
        (0.25, "k", "--"),
        (0.6, "k", "--"),
    ]
    texts = [(t.get_text(), t.get_position(), t.get_va()) for t in ax.texts]
    top = ax.get_ylim()[1] * 0.95
    assert [t[0] for t in texts] == [" T1=0.25", " T2=0.60"] and all(t[2] == "top" for t in texts)
    assert [t[1][1] for t in texts] == pytest.approx([top, top])
    assert ax.get_xlabel() == "unimportance score s (HOBBIT eq. 2), top-1 selections (s = 0) left out"
    assert ax.get_ylabel() == "expert selections"
    assert ax.get_title() == "high 50% / low 25% / skip 25%"
    # without matplotlib: no plot, and False
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_scores(scores, 0.25, 0.6, tmp_path / "t.png") is False


def test_calibrate_report_files_and_progress(moe: Path, tmp_path: Path) -> None:
    from moetier import PackConfig, pack
    from moetier.calibrate import LOW_FRACS, scores_of, search_policy

    store = pack(moe, tmp_path / "s", PackConfig(low_type="q4_0"), progress=False)
    budget = 3 * int(Model(moe, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    cfg = CalibrateConfig(tokens=64, seq_len=32, grid=2, target_low=0.5)
    calls: list[tuple[int, int]] = []
    out = tmp_path / "m.cache.json"
    rep = calibrate(moe, LONG_PROMPT * 3, budget, out, cfg, store=store, progress=lambda d, t: calls.append((d, t)))
    # one progress count over every split's candidates
    n = len(LOW_FRACS) * 13
    assert calls == [(i, n) for i in range(1, n + 1)]
    # the files: the config (as JSON, indented by one), the report (what was returned), trace, plot
    assert out.read_text() == json.dumps(rep["config"], indent=1) + "\n"
    report_file = tmp_path / "m.cache.report.json"
    assert report_file.read_text() == json.dumps(rep, indent=1) + "\n"
    assert rep["config_path"] == str(out) and rep["trace_path"] == str(tmp_path / "m.cache.trace.npz")
    assert rep["plot_path"] == str(tmp_path / "m.cache.scores.png") and Path(rep["plot_path"]).is_file()
    assert rep["tokens"] == 64
    tr = Trace.load(rep["trace_path"])
    t1, t2 = rep["config"]["t1"], rep["config"]["t2"]
    assert t1 < t2 and rep["split"] == split_of(scores_of(tr), t1, t2)
    # each split: the best row of a replay at that split's geometry
    for s in rep["low_frac_search"]:
        cache = CacheConfig(budget=budget, t1=t1, t2=t2, low_frac=s["low_frac"], warm=False)
        info = Model(moe, store=store, cache=cache).cache_info()
        best = search_policy(tr, dict(info), t1, t2, 2)[0]
        assert s == {
            "low_frac": s["low_frac"],
            "n_slots": int(info["n_slots"]),
            "n_slots_low": int(info["n_slots_low"]),
            "policy": best["policy"],
            "weights": best["weights"],
            "n_bytes_read": best["n_bytes_read"],
        }
    # the first split with the fewest bytes wins
    first_best = min(rep["low_frac_search"], key=lambda s: s["n_bytes_read"])
    assert rep["config"]["low_frac"] == first_best["low_frac"]
    # the probes wrote no warm-start sidecar
    assert not list(tmp_path.rglob("*cache-state*"))


def test_calibrate_without_low_copies_searches_one_split(moe: Path, tmp_path: Path) -> None:
    budget = 2 * int(Model(moe, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    cfg = CalibrateConfig(tokens=48, seq_len=16, grid=1, target_low=0.5)
    # no store: low copies are never read, whatever the thresholds; the default split is kept
    rep = calibrate(moe, LONG_PROMPT * 3, budget, tmp_path / "a.json", cfg)
    assert [s["low_frac"] for s in rep["low_frac_search"]] == [CacheConfig(budget=budget).low_frac]
    assert rep["low_frac_search"][0]["n_slots_low"] == 0
    # a store, but thresholds that use no low copy (t1 = t2 = 1): one split too
    from moetier import PackConfig, pack

    store = pack(moe, tmp_path / "s", PackConfig(low_type="q4_0"), progress=False)
    no_low = CalibrateConfig(tokens=48, seq_len=16, target_low=0.0, grid=1)
    rep = calibrate(moe, LONG_PROMPT * 3, budget, tmp_path / "b.json", no_low, store=store)
    assert (rep["config"]["t1"], rep["config"]["t2"]) == (1.0, 1.0) and len(rep["low_frac_search"]) == 1


def test_calibrate_config_bounds() -> None:
    CalibrateConfig(tokens=1, seq_len=1, grid=1, target_low=1.0)  # the smallest of each
    for kw in ({"tokens": 0}, {"seq_len": 0}, {"grid": 0}):
        with pytest.raises(ConfigError) as e:
            CalibrateConfig(**kw)  # type: ignore[arg-type]
        ((name, value),) = kw.items()
        assert str(e.value) == f"calibrate.{name}: {value} must be positive"
    for kw2, says in (
        ({"target_low": 1.1}, "calibrate.target_low: 1.1 must lie in [0, 1]"),
        ({"target_skip": -0.1}, "calibrate.target_skip: -0.1 must lie in [0, 1]"),
        (
            {"target_low": 0.6, "target_skip": 0.5},
            "calibrate.target_skip: 0.5 and target_low 0.6 must sum to at most 1",
        ),
    ):
        with pytest.raises(ConfigError) as e:
            CalibrateConfig(**kw2)  # type: ignore[arg-type]
        assert str(e.value) == says


def test_trace_load_checks_what_it_reads(tmp_path: Path) -> None:
    good = _trace(5, ubatch_starts=(0, 4))
    good_path = good.save(tmp_path / "good")
    assert Trace.load(good_path).ubatch_starts == (0, 4)
    bad = [
        ({"seq_starts": (0, 5)}, "seq_starts must rise strictly from 0 and stay below 5 tokens"),
        ({"seq_starts": (1, 3)}, "seq_starts must rise strictly from 0 and stay below 5 tokens"),
        ({"ubatch_starts": (0, 3, 3)}, "ubatch_starts must rise strictly from 0 and stay below 5 tokens"),
        ({"ids": np.full_like(good.ids, 8)}, "expert ids must lie in [0, 8)"),
        ({"weights": good.weights[:, :, :1]}, "ids (5, 2, 2) and weights (5, 2, 1) must both be [n_tokens, 2, n_used]"),
    ]
    for change, says in bad:
        fields = {f: getattr(good, f) for f in ("ids", "weights", "layers", "n_expert", "seq_starts", "ubatch_starts")}
        p = Trace(**{**fields, **change}).save(tmp_path / "bad")  # type: ignore[arg-type]
        with pytest.raises(ConfigError) as e:
            Trace.load(p)
        assert str(e.value) == f"{p}: {says}"
    # the last expert id is in range (each token's top-k distinct, ending at it)
    k = good.ids.shape[2]
    ids = np.broadcast_to(np.arange(8 - k, 8, dtype=np.int32), good.ids.shape).copy()
    top = Trace(**{**fields, "ids": ids}).save(tmp_path / "top")  # type: ignore[arg-type]
    assert int(Trace.load(top).ids.max()) == 7
    # an expert twice in one token, a weight that is not a finite number 0 or more, no tokens, float ids
    twice = Trace(**{**fields, "ids": np.full_like(good.ids, 7)}).save(tmp_path / "twice")  # type: ignore[arg-type]
    nan = good.weights.copy()
    nan[0, 0, 0] = np.nan
    for path, says in (
        (twice, "a token selects the same expert twice in one layer"),
        (Trace(**{**fields, "weights": nan}).save(tmp_path / "nan"), "gate weights must be finite and 0 or more"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigError) as e:
            Trace.load(path)
        assert str(e.value) == f"{path}: {says}"
    raw = dict(np.load(good_path))
    for change, says in (
        ({"ids": raw["ids"].astype(np.float32) + 0.7}, "ids are float32; expert ids are integers"),
        ({"ids": raw["ids"].astype(np.int64) + 2**32}, "expert ids must lie in [0, n_expert)"),
        ({"n_expert": np.array([8, 8])}, "n_expert must be one integer in [1, 65536], not [8, 8]"),
        ({"n_expert": np.float64(np.inf)}, "n_expert must be one integer in [1, 65536], not inf"),
        ({"seq_starts": np.int64(0)}, "seq_starts must be a 1-d array of integers, not int64 of shape ()"),
        (
            {
                "ids": raw["ids"][:0],
                "weights": raw["weights"][:0],
                "seq_starts": np.zeros(0, np.int64),
                "ubatch_starts": np.zeros(0, np.int64),
            },
            "0 tokens of top-",
        ),
    ):
        forged = tmp_path / "forged.npz"
        np.savez(forged, **{**raw, **change})
        with pytest.raises(ConfigError) as e:
            Trace.load(forged)
        assert str(e.value).startswith(f"{forged}: {says}"), str(e.value)
    damaged = tmp_path / "damaged.npz"
    data = bytearray(good_path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"^{damaged}: not a moetier routing trace \("):
        Trace.load(damaged)


def test_record_trace_sequences_and_ubatches(moe: Path, tiny_model: ModelFactory) -> None:
    from moetier.calibrate import moe_layers

    m = Model(moe)
    tokens = (m.tokenize(LONG_PROMPT) * 12)[:700]
    # sequences of 600 tokens run in ubatches of at most 512
    tr = record_trace(moe, tokens, CalibrateConfig(tokens=700, seq_len=600))
    assert tr.seq_starts == (0, 600) and tr.ubatch_starts == (0, 512, 600)
    assert tr.ids.dtype == np.int32 and tr.weights.dtype == np.float32 and tr.ids.shape == (700, 4, 4)
    # each sequence starts from an empty context: its routing is that of its tokens alone
    short = record_trace(moe, tokens[:40], CalibrateConfig(tokens=40, seq_len=16))
    assert short.seq_starts == (0, 16, 32) and short.ubatch_starts == (0, 16, 32)
    alone = record_trace(moe, tokens[16:32], CalibrateConfig(tokens=16, seq_len=16))
    assert np.array_equal(short.ids[16:32], alone.ids)
    assert record_trace(moe, tokens[:2], CalibrateConfig(tokens=2, seq_len=16)).ids.shape[0] == 2
    with pytest.raises(ConfigError) as e:
        record_trace(moe, tokens[:1], CalibrateConfig(tokens=2, seq_len=16))
    assert str(e.value) == "calibration text is empty (under 2 tokens); give a file of real text"
    assert moe_layers(moe) == ([0, 1, 2, 3], 16)
    dense = tiny_model("qwen2")
    with pytest.raises(ModelError) as e2:
        moe_layers(dense)
    assert str(e2.value) == f"{dense}: no MoE layers (blk.N.ffn_gate_inp.weight): calibration needs a MoE model"


def test_choose_thresholds_picks_the_quantiles_exactly() -> None:
    scores = (np.arange(1, 101) / 100 + 0.000123).astype(np.float32)  # 100 scores, 0.010123 .. 1.000123
    # 10% above t2 (index 89), 30% more between t1 and t2 (index 59), rounded to 4 places
    assert choose_thresholds(scores, 0.3, 0.1) == (round(float(scores[59]), 4), round(float(scores[89]), 4))
    assert choose_thresholds(scores, 0.3, 0.1) == (0.6001, 0.9001)
    # everything low: t1 is the smallest score; a tiny skip share: t2 is the largest
    assert choose_thresholds(scores, 1.0, 0.0)[0] == round(float(scores[0]), 4)
    assert choose_thresholds(scores, 0.0, 0.001) == (round(float(scores[99]), 4), round(float(scores[99]), 4))


def test_read_texts(tmp_path: Path) -> None:
    from moetier.calibrate import read_texts

    f = tmp_path / "t.txt"
    f.write_bytes(b"caf\xe9 ok")  # latin-1, not UTF-8: the byte is replaced
    assert read_texts([str(f)], "--corpus") == ["caf\ufffd ok"]
    with pytest.raises(ConfigError) as e:
        read_texts([str(f), str(tmp_path / "none.txt")], "--corpus")
    says = "cannot read it (No such file or directory); give text files"
    assert str(e.value) == f"--corpus {tmp_path / 'none.txt'}: {says}"


def test_split_of_boundaries_and_more_edges(moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetier.calibrate import search_policy

    # a score equal to t1 is high, one equal to t2 is low
    got_split = split_of(np.array([0.2, 0.5, 0.6, 0.8, 0.9], np.float32), 0.5, 0.8)
    assert got_split == pytest.approx({"high": 0.4, "low": 0.4, "skip": 0.2})
    assert CalibrateConfig(target_low=0.0, target_skip=1.0).target_skip == 1.0  # everything skipped is allowed
    with pytest.raises(ConfigError) as e:
        Trace.load(tmp_path / "none.npz")
    assert str(e.value) == f"{tmp_path / 'none.npz'}: cannot read the routing trace (No such file or directory)"
    # a low pool in the geometry reaches the replay
    tr = record_trace(moe, LONG_PROMPT, CalibrateConfig(tokens=48, seq_len=16))
    info = {"n_groups": 1, "n_layers": 4, "n_expert": 16, "expert_bytes": 64 * 4096, "n_slots": 20}
    low = {**info, "expert_bytes_low": 64 * 1024, "n_slots_low": 12}
    t1, t2 = 0.05, 1.0
    got = {r["policy"]: r["n_bytes_read"] for r in search_policy(tr, low, t1, t2, 1)}
    want = _core.replay(tr.ids, tr.weights, 16, 4096, 1024, 20, 12, "lru", [0.25] * 4, t1, t2, list(tr.seq_starts))
    assert got["lru"] == want.n_bytes_read
    assert got != {r["policy"]: r["n_bytes_read"] for r in search_policy(tr, info, t1, t2, 1)}
    # without matplotlib calibrate writes no plot and says so
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    budget = 2 * int(Model(moe, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    rep = calibrate(moe, LONG_PROMPT, budget, tmp_path / "c.json", CalibrateConfig(tokens=32, seq_len=16, grid=1))
    assert rep["plot_path"] is None and not (tmp_path / "c.scores.png").exists()


def test_calibrate_cli_joins_its_corpus_files_and_takes_an_auto_budget(
    moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moetier calibrate` routes the corpus files as one text, in order, with the --tokens and
    --seq-len given, and accepts --budget auto (the budget of the machine it will run on)."""
    from moetier.cli import main

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(LONG_PROMPT[:300])
    b.write_text(LONG_PROMPT[300:] * 2)
    out = tmp_path / "cli.json"
    argv = ["calibrate", str(moe), "--corpus", str(a), str(b), "--budget", "auto", "-o", str(out)]
    assert main([*argv, "--tokens", "48", "--seq-len", "16", "-q"]) == 0
    assert "| policy |" in capsys.readouterr().out
    assert json.loads(out.read_text())["budget"] == "auto"
    want = record_trace(moe, LONG_PROMPT[:300] + LONG_PROMPT[300:] * 2, CalibrateConfig(tokens=48, seq_len=16))
    got = Trace.load(tmp_path / "cli.trace.npz")
    assert np.array_equal(got.ids, want.ids)
    # the config it wrote loads as an automatic budget
    assert CacheConfig.from_file(out).budget_text == "auto"


def test_a_trace_is_written_whole_or_not_at_all(moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails (a full disk, a size limit) leaves the trace that was there, and no temporary
    file; a good write replaces it."""
    good = _trace(5)
    path = good.save(tmp_path / "t.npz")
    before = path.read_bytes()

    def full(self: Trace, p: Path) -> None:
        p.write_bytes(b"PK\x03\x04 half")  # a partial archive
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Trace, "_write", full)
    with pytest.raises(OSError, match="No space left"):
        _trace(7).save(path)
    assert path.read_bytes() == before and sorted(q.name for q in tmp_path.iterdir()) == ["t.npz"]
    monkeypatch.undo()
    assert _trace(7).save(path) == path and Trace.load(path).ids.shape[0] == 7


def test_moe_layers_refuses_a_file_that_is_no_gguf_and_counts_the_router_weight_only(moe: Path, tmp_path: Path) -> None:
    """Not a GGUF, or one gguf cannot read: a ModelError naming the file (not gguf's ValueError); a router
    bias beside its weight (gpt-oss has one) is no second layer."""
    junk = tmp_path / "junk.gguf"
    junk.write_text("hello\n")
    with pytest.raises(ModelError, match=rf"^{junk}: not a GGUF file"):
        moe_layers(junk)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(moe.read_bytes()[:200])
    with pytest.raises(ModelError, match=rf"^{cut}: gguf cannot read its header \("):
        moe_layers(cut)
    import gguf

    biased = tmp_path / "biased.gguf"
    w = gguf.GGUFWriter(biased, "qwen2moe")
    for il in (0, 2):
        w.add_tensor(f"blk.{il}.ffn_gate_inp.weight", np.zeros((8, 16), dtype=np.float32))
        w.add_tensor(f"blk.{il}.ffn_gate_inp.bias", np.zeros(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert moe_layers(biased) == ([0, 2], 8)


def test_calibrate_and_train_policy_refuse_settings_that_cannot_finish_or_be_right() -> None:
    """A grid whose weightings no replay could finish; a learning rate or weight decay that is not finite;
    a negative seed: ConfigErrors."""
    from moetier.tools.train_policy import TrainPolicyConfig as TrainConfig

    with pytest.raises(ConfigError, match=r"^calibrate.grid: 33 must be at most 32"):
        CalibrateConfig(grid=33)
    CalibrateConfig(grid=32)
    for kw in ({"lr": float("nan")}, {"lr": float("inf")}, {"weight_decay": float("nan")}):
        with pytest.raises(ConfigError, match=r"^train-policy: lr must be positive"):
            TrainConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^train-policy: seed -1 must be in \[0, 2\^63 - 1\]$"):
        TrainConfig(seed=-1)
