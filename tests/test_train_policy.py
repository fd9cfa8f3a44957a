"""`moetier train-policy` piece by piece: the network file, Belady's labels, the decisions it learns from,
the training rounds and the held-out report, each checked against the engine's own replay."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from conftest import ModelFactory
from moetier import ConfigError, _core
from moetier.calibrate import Trace, concat_traces
from moetier.tools import replay as rp
from moetier.tools import train_policy as tp
from moetier.tools.mlp import MLP, FitConfig, fit


def routing(seed: int, n_tokens: int = 120, n_layers: int = 4, n_expert: int = 8, k: int = 2) -> Trace:
    """Skewed routing of a MoE in two sequences, each expert of a token weighing 1/k."""
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(n_expert, 0.5), size=n_layers)
    ids = np.zeros((n_tokens, n_layers, k), dtype=np.int32)
    for t in range(n_tokens):
        for il in range(n_layers):
            ids[t, il] = rng.choice(n_expert, size=k, replace=False, p=pop[il])
    weights = np.full(ids.shape, 1 / k, np.float32)
    return Trace(ids, weights, tuple(range(n_layers)), n_expert, (0, n_tokens // 2), (0, n_tokens // 2))


def saved(tmp_path: Path, name: str, trace: Trace) -> Path:
    return trace.save(tmp_path / name)


def decisions(trace: Trace, geo: dict[str, int], policy: str) -> dict[str, Any]:
    """The engine's log of every eviction decision of policy over trace (the recorder's rows)."""
    _, rows = _core.replay_decisions(
        trace.ids, trace.weights, trace.n_expert, geo["bytes_high"], 0, geo["n_slots"], 0, policy,
        [0.25] * 4, 1.0, 1.0, list(trace.seq_starts),
    )  # fmt: skip
    return rows


def monotone_net() -> MLP:
    """A network whose score rises with the first input alone (x0 >= 0): SiLU(SiLU(x0))."""
    one = np.ones((1, 1), np.float32)
    return MLP([np.array([[1.0, 0.0]], np.float32), one, one.copy()], [np.zeros(1, np.float32) for _ in range(3)])


# FlashMoE's Table 1 (hidden units, epochs, AdamW's step and decay, batch) and the sampling knobs
DEFAULTS: dict[str, Any] = {"hidden": 128, "epochs": 8, "lr": 1e-3, "weight_decay": 1e-2, "batch": 512, "rounds": 2}
DEFAULTS |= {"max_rows": 400_000, "seed": 0, "layer_distance": False}


class FakeClock:
    """perf_counter for decision_cost_us: each timed replay (a start and an end reading) lasts the next
    of the given seconds."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = list(durations)
        self.now = 0.0
        self.calls = 0

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.durations.pop(0)
        return self.now


def test_config_defaults_and_limits() -> None:
    """The defaults are FlashMoE's Table 1 plus the round and sampling knobs; every bound is checked at its
    edge, with the message that names the knobs."""
    assert asdict(tp.TrainPolicyConfig()) == DEFAULTS
    for ok in ({"hidden": 1}, {"hidden": 1024}, {"epochs": 1}, {"batch": 1}, {"rounds": 1}, {"max_rows": 1}):
        tp.TrainPolicyConfig(**ok)  # type: ignore[arg-type]
    tp.TrainPolicyConfig(lr=1e-9, weight_decay=0.0)
    for bad in ({"hidden": 0}, {"hidden": 1025}, {"epochs": 0}, {"batch": 0}, {"rounds": 0}, {"max_rows": 0}):
        with pytest.raises(ConfigError) as e:
            tp.TrainPolicyConfig(**bad)  # type: ignore[arg-type]
        assert str(e.value) == "train-policy: hidden (1-1024), epochs, batch, rounds and max_rows must be positive"
    for bad_f in ({"lr": 0.0}, {"lr": -1e-3}, {"weight_decay": -1e-9}, {"lr": math.inf}, {"weight_decay": math.inf}):
        with pytest.raises(ConfigError) as e:
            tp.TrainPolicyConfig(**bad_f)
        assert str(e.value) == "train-policy: lr must be positive and weight_decay not negative (finite numbers both)"
    tp.TrainPolicyConfig(seed=0)
    tp.TrainPolicyConfig(seed=2**63 - 1)
    for seed in (-1, 2**63):
        with pytest.raises(ConfigError) as e:
            tp.TrainPolicyConfig(seed=seed)
        assert str(e.value) == f"train-policy: seed {seed} must be in [0, 2^63 - 1]"


def test_network_file_layout(tmp_path: Path) -> None:
    """new_net is [1/r, f/max f] -> hidden -> hidden -> score by default; save_net writes the magic, the
    input and hidden counts as little-endian uint32, then w1, b1, w2, b2, w3, b3 as little-endian float32."""
    net = tp.new_net(5, np.random.default_rng(9))
    assert [w.shape for w in net.weights] == [(5, 2), (5, 5), (1, 5)]
    ref = MLP.init([2, 5, 5, 1], np.random.default_rng(9))
    assert all(np.array_equal(a, b) for a, b in zip(net.params(), ref.params(), strict=True))
    for b in net.biases:  # zero biases would hide a swapped weight and bias
        b += np.arange(1, len(b) + 1, dtype=np.float32) / 8
    path = tmp_path / "n.bin"
    tp.save_net(net, path)
    w1, w2, w3 = net.weights
    b1, b2, b3 = net.biases
    floats = np.concatenate([w1.ravel(), b1, w2.ravel(), b2, w3.ravel(), b3]).astype(np.float64)
    want = b"MOETFMN1" + struct.pack("<II", 2, 5) + struct.pack(f"<{len(floats)}f", *floats)
    assert path.read_bytes() == want
    tp.save_net(tp.new_net(4, np.random.default_rng(0), 3), path)
    assert path.read_bytes()[8:16] == struct.pack("<II", 3, 4)
    x = np.array([[0.5, 0.25], [1.0, 0.0]], np.float32)
    assert np.array_equal(tp.scores(net, x), net(x)[:, 0]) and tp.scores(net, x).shape == (2,)


def test_labels_mark_the_farthest_next_use_of_each_decision() -> None:
    """A candidate is labelled 1 where its next use is the farthest of its decision's (every candidate that
    never comes back, where several do not), else 0; decision ids need not start at 0 or be contiguous."""
    d = np.array([3, 3, 3, 5, 5, 7, 7, 7, 7], np.int64)
    n = np.array([4.0, np.inf, 9.0, 0.0, 2.0, np.inf, 1.0, np.inf, 6.0])
    y = tp.labels(d, n)
    assert y.dtype == np.float32
    assert y.tolist() == [0, 1, 0, 0, 1, 1, 0, 1, 0]
    assert tp.labels(np.array([0], np.int64), np.array([0.0])).tolist() == [1.0]
    empty = tp.labels(np.zeros(0, np.int64), np.zeros(0))
    assert empty.shape == (0,) and empty.dtype == np.float32


def _decisions() -> tp.Decisions:
    """Three decisions over seven candidates (rows of one decision apart), as the recorder could log them."""
    x = np.array(
        [[0.5, 0.1, 0], [0.2, 0.9, 0], [0.9, 0.3, 0], [0.3, 0.2, 0], [0.1, 0.8, 0], [0.7, 0.6, 0], [0.7, 0.5, 0]],
        np.float32,
    )
    d = np.array([1, 0, 1, 0, 1, 2, 2], np.int64)
    n = np.array([5.0, 2.0, 1.0, 8.0, 3.0, 4.0, 4.0])
    chosen = np.array([False, False, True, True, False, True, False])
    return tp.Decisions(x, d, n, chosen)


def test_decisions_rows_and_count() -> None:
    """rows() keeps the same rows of every field (by index or mask); n_decisions counts distinct ids."""
    dec = _decisions()
    assert dec.n_decisions == 3
    part = dec.rows(np.array([0, 2, 4], np.int64))
    assert part.d.tolist() == [1, 1, 1] and part.n.tolist() == [5.0, 1.0, 3.0] and part.n_decisions == 1
    assert part.chosen.tolist() == [False, True, False] and np.array_equal(part.x, dec.x[[0, 2, 4]])
    masked = dec.rows(dec.d == 2)
    assert masked.d.tolist() == [2, 2] and masked.chosen.tolist() == [True, False]


def test_agreement_of_the_network_top_score() -> None:
    """agreement: the share of decisions whose highest-scored candidate (ties: the first row) has the
    farthest next use; the rows of a decision may lie apart; no decisions: 0."""
    dec = _decisions()
    y = tp.labels(dec.d, dec.n)
    assert y.tolist() == [1, 0, 0, 1, 0, 1, 1]
    # decision 0: top score row 3 (y 1); decision 1: row 2 (y 0); decision 2: a tie, row 5 (y 1)
    net = monotone_net()
    assert tp.agreement(net, dec.x[:, :2], y, dec.d) == pytest.approx(2 / 3, rel=1e-6)
    y2 = np.array([0, 0, 1, 1, 0, 1, 0], np.float32)
    assert tp.agreement(net, dec.x[:, :2], y2, dec.d) == 1.0
    y3 = np.array([0, 0, 0, 1, 0, 0, 1], np.float32)  # decision 0 right; the tie counts its first row, not the second
    assert tp.agreement(net, dec.x[:, :2], y3, dec.d) == pytest.approx(1 / 3, rel=1e-6)
    assert tp.agreement(net, np.zeros((0, 2), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64)) == 0.0


def test_chosen_agreement_of_the_policy_choices() -> None:
    """chosen_agreement: the share of decisions where the candidate the policy evicted has the farthest next
    use; no decisions: 0."""
    dec = _decisions()
    # decision 0 evicted row 3 (farthest, 8), decision 1 row 2 (1, not 5), decision 2 row 5 (a tie at 4)
    assert tp.chosen_agreement(dec) == pytest.approx(2 / 3, rel=1e-6)
    assert tp.chosen_agreement(dec.rows(dec.d == 1)) == 0.0
    assert tp.chosen_agreement(dec.rows(dec.d == 5)) == 0.0


def test_oldest_per_layer_keeps_each_layers_least_recently_used() -> None:
    """Per decision and layer (the third input), the candidate of smallest 1/r, the first row of a tie,
    whatever the frequencies; the kept row indices come back in ascending order."""
    x = np.array(
        [
            [0.5, 0.1, 0.0],  # 0: decision 0, layer 0
            [0.2, 0.9, 0.0],  # 1: decision 0, layer 0, older: kept
            [0.4, 0.2, 0.5],  # 2: decision 0, layer 0.5, tie: kept
            [0.4, 0.1, 0.5],  # 3: decision 0, layer 0.5, tie
            [0.3, 0.8, 0.0],  # 4: decision 1, layer 0: kept
            [0.6, 0.0, 0.0],  # 5: decision 1, layer 0
            [0.9, 0.5, 0.25],  # 6: decision 1, layer 0.25: kept
            [0.1, 0.7, 0.0],  # 7: decision 2 (same layer distance as decision 1's): kept
        ],
        np.float32,
    )
    d = np.array([0, 0, 0, 0, 1, 1, 1, 2], np.int64)
    k = tp.oldest_per_layer(x, d)
    assert k.tolist() == [1, 2, 4, 6, 7]
    order = np.array([7, 2, 5, 0, 4, 1, 6, 3])  # the same rows shuffled: the same rows kept
    assert sorted(order[tp.oldest_per_layer(x[order], d[order])].tolist()) == [1, 2, 4, 6, 7]
    empty = tp.oldest_per_layer(np.zeros((0, 3), np.float32), np.zeros(0, np.int64))
    assert empty.shape == (0,) and empty.dtype == np.int64


def _many(n_dec: int = 10, per: int = 3) -> tp.Decisions:
    d = np.repeat(np.arange(n_dec, dtype=np.int64), per)
    x = np.arange(n_dec * per * 3, dtype=np.float32).reshape(-1, 3)
    return tp.Decisions(x, d, np.arange(n_dec * per, dtype=np.float64), np.tile([True] + [False] * (per - 1), n_dec))


def test_subsample_keeps_whole_decisions() -> None:
    """Up to max_rows candidates nothing is dropped (the same object back); above, int(decisions x max_rows /
    candidates) whole decisions, at least one, distinct, drawn at random, the rows in their order."""
    dec = _many()
    assert tp.subsample(dec, 30, np.random.default_rng(0)) is dec
    assert tp.subsample(dec, 31, np.random.default_rng(0)) is dec
    for max_rows, n_keep in ((29, 9), (20, 6), (3, 1), (2, 1), (1, 1)):
        got = tp.subsample(dec, max_rows, np.random.default_rng(1))
        assert got.n_decisions == n_keep, max_rows
        assert len(got.d) == 3 * n_keep and np.all(np.bincount(got.d) % 3 == 0)
        assert np.all(np.diff(got.n) > 0), "the kept rows keep their order"
        kept = np.isin(dec.d, got.d)
        assert np.array_equal(got.x, dec.x[kept]) and np.array_equal(got.chosen, dec.chosen[kept])
    a = tp.subsample(dec, 20, np.random.default_rng(1))
    b = tp.subsample(dec, 20, np.random.default_rng(2))
    assert np.array_equal(a.d, tp.subsample(dec, 20, np.random.default_rng(1)).d) and not np.array_equal(a.d, b.d)


GEOS = [rp.geometry_of(4, 8, 25, 1), rp.geometry_of(4, 8, 100, 1), rp.geometry_of(4, 8, 50, 1)]


def test_collect_joins_every_run_with_unique_decision_ids() -> None:
    """collect replays each trace at each geometry (trace by trace) and keeps every decision the recorder
    logged, its ids moved past the previous runs'; a budget with no eviction adds nothing; per_layer keeps
    the rows oldest_per_layer picks; without it (the default) every candidate."""
    trs = [routing(1), routing(2, n_tokens=90)]
    for per_layer in (False, True):
        want_x, want_d, want_n, want_c = [], [], [], []
        base = 0
        for tr in trs:
            for g in GEOS:
                rows = decisions(tr, g, "multi")
                if not len(rows["decision"]):
                    assert g["pct"] == 100
                    continue
                keep = tp.oldest_per_layer(rows["x"], rows["decision"]) if per_layer else np.arange(len(rows["x"]))
                want_x.append(rows["x"][keep])
                want_d.append(rows["decision"][keep] + base)
                want_n.append(rows["next_use"][keep])
                want_c.append(rows["chosen"][keep])
                base += int(rows["decision"].max()) + 1
        if per_layer:
            got = tp.collect(trs, GEOS, "multi", 10**9, np.random.default_rng(0), per_layer=True)
        else:
            got = tp.collect(trs, GEOS, "multi", 10**9, np.random.default_rng(0))
        assert np.array_equal(got.x, np.concatenate(want_x)) and np.array_equal(got.d, np.concatenate(want_d))
        assert np.array_equal(got.n, np.concatenate(want_n)) and np.array_equal(got.chosen, np.concatenate(want_c))
        assert got.n_decisions == base == 495 + 170 + 339 + 136
        assert (len(got.d) == 3558 + 2560 + 2441 + 2046) != per_layer


def test_collect_samples_each_run_to_its_share_of_max_rows() -> None:
    """max_rows is shared out over the runs (traces x geometries, floor division): each run keeps
    int(its decisions x share / its candidates) whole decisions; one run keeps the whole max_rows."""
    trs = [routing(1), routing(2, n_tokens=90)]
    runs = [decisions(tr, g, "lru") for tr in trs for g in GEOS]
    runs = [r for r in runs if len(r["decision"])]
    assert [(len(np.unique(r["decision"])), len(r["decision"])) for r in runs] == [
        (535, 1313), (206, 892), (406, 956), (173, 778)
    ]  # fmt: skip
    got = tp.collect(trs, GEOS, "lru", 605, np.random.default_rng(3))  # 100 candidates a run, 6 runs
    lo = 0
    for r in runs:
        hi = lo + int(r["decision"].max()) + 1
        ids = np.unique(got.d[(got.d >= lo) & (got.d < hi)])
        assert len(ids) == int(len(np.unique(r["decision"])) * 100 / len(r["decision"])), (lo, hi)
        kept = np.isin(r["decision"], ids - lo)
        assert np.array_equal(np.sort(got.n[np.isin(got.d, ids)]), np.sort(r["next_use"][kept]))
        lo = hi
    one = tp.collect(trs[:1], GEOS[:1], "lru", 300, np.random.default_rng(3))
    assert one.n_decisions == int(535 * 300 / 1313)


def test_collect_of_no_decisions_is_empty() -> None:
    """No eviction at any run (or no trace at all): empty arrays of the recorder's shapes and types."""
    for got in (
        tp.collect([routing(1)], GEOS[1:2], "lru", 100, np.random.default_rng(0)),
        tp.collect([], GEOS, "lru", 100, np.random.default_rng(0)),
    ):
        assert got.x.shape == (0, 3) and got.x.dtype == np.float32
        assert got.d.shape == (0,) and got.d.dtype == np.int64
        assert got.n.shape == (0,) and got.n.dtype == np.float64
        assert got.chosen.shape == (0,) and got.chosen.dtype == np.bool_
        assert got.n_decisions == 0


def test_decision_cost_is_the_best_replay_time_over_lru_per_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """decision_cost_us: (best of 3 replays of the policy - best of 3 of LRU) / its decisions, in
    microseconds; never negative; a replay with no decisions divides by 1."""
    tr = routing(1)
    n_multi = len(np.unique(decisions(tr, GEOS[0], "multi")["decision"]))
    assert n_multi == 495
    clock = FakeClock([3.0, 2.0, 2.5, 1.5, 1.0, 1.25])
    monkeypatch.setattr(tp, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    assert tp.decision_cost_us(tr, GEOS[0], "multi") == 1e6 * 1.0 / 495
    assert clock.calls == 12 and not clock.durations
    clock = FakeClock([1.0, 0.5, 4.0, 0.25])
    monkeypatch.setattr(tp, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    assert tp.decision_cost_us(tr, GEOS[2], "lru", repeats=2) == 1e6 * 0.25 / 206
    clock = FakeClock([0.5, 0.5, 0.5, 1.0, 1.0, 1.0])
    monkeypatch.setattr(tp, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    assert tp.decision_cost_us(tr, GEOS[0], "multi") == 0.0
    clock = FakeClock([2.0, 2.0, 2.0, 0.5, 0.5, 0.5])
    monkeypatch.setattr(tp, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    assert tp.decision_cost_us(tr, GEOS[1], "multi") == 1.5e6


def read_net(path: Path) -> MLP:
    """The network of a file save_net wrote (the layout test_network_file_layout pins)."""
    data = path.read_bytes()
    n_in, hidden = struct.unpack("<II", data[8:16])
    f = np.frombuffer(data[16:], "<f4").astype(np.float32)
    sizes = [(hidden, n_in), (hidden,), (hidden, hidden), (hidden,), (1, hidden), (1,)]
    arrays, at = [], 0
    for shape in sizes:
        n = int(np.prod(shape))
        arrays.append(f[at : at + n].reshape(shape))
        at += n
    assert at == len(f)
    return MLP(arrays[0::2], arrays[1::2])


@pytest.fixture
def traces(tmp_path: Path) -> tuple[list[Path], list[Path]]:
    """Two training traces and two held-out ones of the same 4-layer, 8-expert routing model."""
    train = [saved(tmp_path, "a.npz", routing(1)), saved(tmp_path, "b.npz", routing(2, n_tokens=90))]
    held = [saved(tmp_path, "c.npz", routing(3, n_tokens=60)), saved(tmp_path, "d.npz", routing(4, n_tokens=50))]
    return train, held


def test_train_policy_rounds_are_the_documented_training(
    traces: tuple[list[Path], list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Round 1 fits a fresh network (seeded) with MSE and the configured AdamW to Belady's labels of LRU's
    decisions; round 2 adds the decisions of the round-1 network and fits on both; each round's figures are
    those of its decisions, the file holds the final network."""
    train, _ = traces
    cfg = tp.TrainPolicyConfig(hidden=6, epochs=3, lr=3e-3, weight_decay=0.05, batch=200, max_rows=2000, seed=4)
    trs = [Trace.load(p) for p in train]
    geos = [rp.geometry_of(4, 8, b, 1) for b in (25, 50)]
    fit_cfg = FitConfig(epochs=3, lr=3e-3, weight_decay=0.05, batch=200)
    rng = np.random.default_rng(4)
    net = MLP.init([2, 6, 6, 1], rng)
    dec1 = tp.collect(trs, geos, "lru", 2000, rng)
    x1, y1 = dec1.x[:, :2], tp.labels(dec1.d, dec1.n)
    loss1 = fit(net, x1, y1[:, None], "mse", fit_cfg, rng)
    net1 = tmp_path / "net1.bin"
    tp.save_net(net, net1)
    dec2 = tp.collect(trs, geos, f"flashmoe:{net1}", 2000, rng)
    x2, y2 = dec2.x[:, :2], tp.labels(dec2.d, dec2.n)
    before = tp.agreement(net, x2, y2, dec2.d)
    loss2 = fit(net, np.concatenate([x1, x2]), np.concatenate([y1, y2])[:, None], "mse", fit_cfg, rng)
    capsys.readouterr()

    out = tmp_path / "p.flashmoe.bin"
    rep = tp.train_policy(None, train, [], out, [25, 50], cfg)
    err = capsys.readouterr().err
    assert "round 1" in err and "round 2" in err  # the training progress bars name their round
    final = read_net(out)
    assert all(np.array_equal(a, b) for a, b in zip(final.params(), net.params(), strict=True))
    assert rep["rounds"] == [
        {
            "driver": "lru",
            "decisions": dec1.n_decisions,
            "candidates": len(dec1.d),
            "driver_agreement": tp.chosen_agreement(dec1),
            "positive_share": float(y1.mean()),
            "loss": loss1,
            "agreement_before": None,
            "agreement": tp.agreement(read_net(net1), x1, y1, dec1.d),
        },
        {
            "driver": "flashmoe",
            "decisions": dec2.n_decisions,
            "candidates": len(dec2.d),
            "driver_agreement": tp.chosen_agreement(dec2),
            "positive_share": float(y2.mean()),
            "loss": loss2,
            "agreement_before": before,
            "agreement": tp.agreement(net, x2, y2, dec2.d),
        },
    ]
    assert len(loss1) == 3 and len(dec1.d) < 1313 + 892 + 956 + 778  # sampled to about 2000 candidates
    assert 0 < before < 1


def test_train_policy_held_out_report(
    traces: tuple[list[Path], list[Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held-out traces, one after the other, replayed at each budget with LRU, multi, the network and
    Belady: the engine's counters, the share of LRU's extra bytes over Belady the policy saves (none where
    LRU reads no more than Belady), Belady's agreement of the network's and LRU's own evictions, the decision
    cost at the middle budget, and the run's settings."""
    train, held = traces
    out = tmp_path / "p.flashmoe.bin"
    cfg = tp.TrainPolicyConfig(hidden=4, epochs=1, rounds=1, seed=1)
    clock = FakeClock([3.0, 3.0, 3.0, 1.0, 1.0, 1.0])
    monkeypatch.setattr(tp, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    rep = tp.train_policy(None, train, held, out, [25, 100], cfg)
    ev = concat_traces([Trace.load(p) for p in held], [str(p) for p in held])
    name = f"{held[0]}, {held[1]}"
    rows = []
    for pct in (25, 100):
        g = rp.geometry_of(4, 8, pct, 1)
        at = {p: rp.replay_one(ev, g, p, 1.0, 1.0, [0.25] * 4) for p in ("lru", "multi", f"flashmoe:{out}", "belady")}
        gap = at["lru"]["n_bytes_read"] - at["belady"]["n_bytes_read"]
        assert (gap > 0) == (pct == 25)
        for p, row in at.items():
            closed = (at["lru"]["n_bytes_read"] - row["n_bytes_read"]) / gap if gap > 0 else None
            rows.append({**row, "trace": name, "trace_label": "held-out (2 traces)", "policy": p.split(":")[0]})
            rows[-1]["gap_closed"] = closed
    assert rep["rows"] == rows
    assert [(r["policy"], r["gap_closed"]) for r in rows if r["policy"] in ("lru", "belady")] == [
        ("lru", 0.0), ("belady", 1.0), ("lru", None), ("belady", None)
    ]  # fmt: skip
    geos = [rp.geometry_of(4, 8, b, 1) for b in (25, 100)]
    flash = tp.collect([ev], geos, f"flashmoe:{out}", 10**9, np.random.default_rng(0))
    lru = tp.collect([ev], geos, "lru", 10**9, np.random.default_rng(0))
    assert rep["eval_agreement"] == tp.chosen_agreement(flash) and rep["eval_agreement_lru"] == tp.chosen_agreement(lru)
    assert rep["eval_agreement"] != rep["eval_agreement_lru"]
    assert rep["decision_us"] == 2e6  # the middle budget, 100%, has no decisions: divided by 1
    assert {k: v for k, v in rep.items() if k not in ("rounds", "rows", "eval_agreement", "eval_agreement_lru")} == {
        "model": None,
        "network": str(out),
        "train_sequences": None,
        "eval_sequences": None,
        "config": {**DEFAULTS, "hidden": 4, "epochs": 1, "rounds": 1, "seed": 1},
        "budgets": [25, 100],
        "train": [str(p) for p in train],
        "eval": [name],
        "decision_us": 2e6,
    }


def test_a_gap_of_one_byte_is_closed_in_shares(traces: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    """Where LRU reads a single expert more than Belady, the gap closed is still LRU's 0 and Belady's 1."""
    train, _ = traces
    ids = [[[2, 0], [1, 2], [2, 0], [0, 1]], [[1, 2], [2, 0], [0, 1], [0, 2]], [[2, 1], [0, 2], [1, 0], [2, 0]]]
    short = np.array(ids, np.int32)
    held = Trace(short, np.full(short.shape, 0.5, np.float32), (0, 1, 2, 3), 8, (0,), (0,)).save(tmp_path / "s.npz")
    rep = tp.train_policy(None, train[:1], [held], tmp_path / "g.bin", [25], tp.TrainPolicyConfig(hidden=2, rounds=1))
    at = {r["policy"]: r for r in rep["rows"]}
    assert at["lru"]["n_bytes_read"] - at["belady"]["n_bytes_read"] == 1
    assert (at["lru"]["gap_closed"], at["belady"]["gap_closed"]) == (0.0, 1.0)


def test_train_policy_with_the_layer_distance(traces: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    """layer_distance: a three-input network, trained on multi's decisions (it offers every layer's slots)
    cut to each layer's least recently used, the candidates such a network scores; held out the same. Every
    sample (max_rows) is drawn from the run's one seeded random stream, after the training."""
    train, held = traces
    cfg = tp.TrainPolicyConfig(hidden=5, epochs=2, batch=128, rounds=1, max_rows=100, seed=2, layer_distance=True)
    trs = [Trace.load(p) for p in train]
    geos = [rp.geometry_of(4, 8, 50, 1)]
    rng = np.random.default_rng(2)
    net = MLP.init([3, 5, 5, 1], rng)
    dec = tp.collect(trs, geos, "multi", 100, rng, per_layer=True)
    y = tp.labels(dec.d, dec.n)
    loss = fit(net, dec.x, y[:, None], "mse", FitConfig(epochs=2, batch=128), rng)
    out = tmp_path / "l.bin"
    rep = tp.train_policy(None, train, held[:1], out, [50], cfg)
    ev = [Trace.load(held[0])]
    flash = tp.collect(ev, geos, f"flashmoe:{out}", 100, rng, per_layer=True)
    lru = tp.collect(ev, geos, "lru", 100, rng)
    assert len(flash.d) < 300 and len(lru.d) < 522  # both sampled
    assert out.read_bytes()[8:16] == struct.pack("<II", 3, 5)
    assert all(np.array_equal(a, b) for a, b in zip(read_net(out).params(), net.params(), strict=True))
    r = rep["rounds"][0]
    assert (r["driver"], r["decisions"], r["candidates"], r["loss"]) == ("multi", dec.n_decisions, len(dec.d), loss)
    assert rep["eval_agreement"] == tp.chosen_agreement(flash)
    assert rep["eval_agreement_lru"] == tp.chosen_agreement(lru)
    assert rep["eval"] == [str(held[0])] and rep["rows"][0]["trace_label"] == "held-out (1 trace)"


def test_train_policy_without_held_out_traces(traces: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    """No held-out traces: no rows, no decision cost, no held-out agreements, and the table's first line
    gives the training agreement and says so; held-out sequences without held-out traces are refused; the
    budgets are 10, 25 and 50% unless given."""
    train, _ = traces
    rep = tp.train_policy(None, train[:1], [], tmp_path / "n.bin", cfg=tp.TrainPolicyConfig(hidden=2, epochs=1))
    assert rep["budgets"] == [10, 25, 50]
    assert (rep["rows"], rep["eval"], rep["decision_us"]) == ([], [], None)
    assert (rep["eval_agreement"], rep["eval_agreement_lru"]) == (None, None)
    assert [r["driver"] for r in rep["rounds"]] == ["lru", "flashmoe"]  # two rounds by default
    head = "| trace | budget | policy | hit rate | MB/token | gap closed |\n|---|---|---|---|---|---|\n"
    train_pct = 100 * rep["rounds"][-1]["agreement"]
    first = (
        f"FlashMoE policy {tmp_path / 'n.bin'}: decisions where it evicts the candidate used again last (Belady's "
        f"choice among those offered): train {train_pct:.1f}%; no held-out traces (--eval)"
    )
    assert tp.table(rep) == first + "\n\n" + head
    with pytest.raises(ConfigError, match=r"^train-policy: eval sequences name part of the held-out traces"):
        tp.train_policy(None, train[:1], [], tmp_path / "m.bin", eval_sequences=(0, 1))


def test_train_policy_on_parts_of_the_traces(traces: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    """train_sequences cuts each training trace, eval_sequences the joined held-out traces, to sequences
    A:B (B None: to the end); a range a trace does not have names the trace (the held-out ones joined)."""
    train, held = traces
    cfg = tp.TrainPolicyConfig(hidden=2, epochs=1, rounds=1)
    out = tmp_path / "s.bin"
    rep = tp.train_policy(None, train, held, out, [50], cfg, (1, 2), (2, None))
    assert (rep["train_sequences"], rep["eval_sequences"]) == ([1, 2], [2, None])
    g = rp.geometry_of(4, 8, 50, 1)
    parts = [rp.select_sequences(Trace.load(p), 1, 2, str(p)) for p in train]
    assert rep["rounds"][0]["decisions"] == tp.collect(parts, [g], "lru", 10**9, np.random.default_rng(0)).n_decisions
    ev = concat_traces([Trace.load(p) for p in held], [str(p) for p in held])  # sequences: 2 + 2
    tail = rp.select_sequences(ev, 2, None, "x")
    assert tail.ids.shape[0] == 50
    assert rep["rows"][0]["n_misses"] == rp.replay_one(tail, g, "lru", 1.0, 1.0, [0.25] * 4)["n_misses"]
    assert rep["rows"][0]["n_misses"] != rp.replay_one(ev, g, "lru", 1.0, 1.0, [0.25] * 4)["n_misses"]
    with pytest.raises(ConfigError) as e:
        tp.train_policy(None, train, held, out, [50], cfg, (2, None))
    assert str(e.value) == f"{train[0]}: sequences 2: is not a range within its 2 sequences"
    with pytest.raises(ConfigError) as e:
        tp.train_policy(None, train, held, out, [50], cfg, None, (1, 5))
    assert str(e.value) == f"{held[0]}, {held[1]}: sequences 1:5 is not a range within its 4 sequences"


def test_train_policy_refuses_traces_of_another_model(traces: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    """Without a model the first training trace sets the layers and experts; a trace with other layers or
    other experts, for training or held out, is named; a budget with no evictions at all is refused."""
    train, held = traces
    cfg = tp.TrainPolicyConfig(hidden=2, epochs=1, rounds=1)
    out = tmp_path / "x.bin"
    layers = saved(tmp_path, "layers.npz", routing(5, n_layers=3))
    experts = saved(tmp_path, "experts.npz", routing(5, n_expert=16))
    for bad, says in ((layers, "3 MoE layers of 8 experts"), (experts, "4 MoE layers of 16 experts")):
        with pytest.raises(ConfigError) as e:
            tp.train_policy(None, [train[0], bad], [], out, [50], cfg)
        assert str(e.value) == f"{bad}: a trace of another model ({says})"
        with pytest.raises(ConfigError) as e:
            tp.train_policy(None, train, [bad], out, [50], cfg)
        assert str(e.value) == f"{bad}: a trace of another model ({says})"
    both = [experts, saved(tmp_path, "experts2.npz", routing(6, n_expert=16))]
    with pytest.raises(ConfigError) as e:
        tp.train_policy(None, train, both, out, [50], cfg)
    assert str(e.value) == f"{both[0]}, {both[1]}: a trace of another model (4 MoE layers of 16 experts)"
    with pytest.raises(ConfigError) as e:
        tp.train_policy(None, train, [held[0], held[1], experts], out, [50], cfg)
    assert str(e.value).startswith(f"{experts}: recorded on another model than {held[0]}")
    with pytest.raises(ConfigError) as e:
        tp.train_policy(None, train, held, out, [100], cfg)
    assert str(e.value) == "train-policy: no eviction decisions at budgets [100]: a budget that holds every expert?"


def test_train_policy_takes_the_geometry_from_the_model(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """With a model, each budget's cache is the one the engine builds for it (replay's geometry), and the
    traces must match the model's MoE layers and experts."""
    model = tiny_model("qwen3moe", n_expert=16, n_expert_used=4, n_layer=4, expert_type="f16")
    train = saved(tmp_path, "t.npz", routing(1, n_expert=16, k=4))
    held = saved(tmp_path, "h.npz", routing(2, n_tokens=60, n_expert=16, k=4))
    out = tmp_path / "m.bin"
    rep = tp.train_policy(model, [train], [held], out, [25, 50], tp.TrainPolicyConfig(hidden=2, epochs=1, rounds=1))
    assert rep["model"] == str(model)
    info = rp.probe(model, None)
    ev = Trace.load(held)
    for pct in (25, 50):
        g = rp.geometry(model, None, info, pct, 1.0, 1.0, 0.25)
        got = [r for r in rep["rows"] if r["pct"] == pct]
        assert [r["n_bytes_read"] for r in got] == [
            rp.replay_one(ev, g, p, 1.0, 1.0, [0.25] * 4)["n_bytes_read"]
            for p in ("lru", "multi", f"flashmoe:{out}", "belady")
        ]
        assert got[0]["n_bytes_read"] == got[0]["n_misses"] * g["bytes_high"] > 0
    other = saved(tmp_path, "o.npz", routing(1, n_expert=8, k=4))
    with pytest.raises(ConfigError) as e:
        tp.train_policy(model, [other], [], out, [50], tp.TrainPolicyConfig(hidden=2, epochs=1, rounds=1))
    assert str(e.value) == f"{other}: a trace of another model (4 MoE layers of 8 experts)"
    args = ["-m", str(model), "--train", str(train), "-o", str(tmp_path / "c.bin"), "--budgets", "50"]
    assert tp.main([*args, "--hidden", "2", "--epochs", "1", "--rounds", "1"]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["model"] == str(model)


def test_table_text() -> None:
    """The report's Markdown: a summary line (train and held-out agreement, LRU's, the decision cost), then
    a row per policy and budget; a missing label reads 'held-out', a missing LRU agreement 'nan', a gap not
    closable is left blank."""
    rep: dict[str, Any] = {
        "network": "m.flashmoe.bin",
        "rounds": [{"agreement": 0.1}, {"agreement": 0.5678}],
        "eval_agreement": 0.25,
        "eval_agreement_lru": 0.125,
        "decision_us": 3.14159,
        "rows": [
            {"trace_label": "held-out (2 traces)", "pct": 12.5, "policy": "lru", "hit_rate": 0.8764,
             "mb_per_token": 0.0123456, "gap_closed": 0.9},
            {"pct": 100.0, "policy": "belady", "hit_rate": 1.0, "mb_per_token": 2.0, "gap_closed": None},
            {"pct": 50, "policy": "multi", "hit_rate": 0.0, "mb_per_token": 0.0},
        ],
    }  # fmt: skip
    head = "| trace | budget | policy | hit rate | MB/token | gap closed |\n|---|---|---|---|---|---|\n"
    assert tp.table(rep) == (
        "FlashMoE policy m.flashmoe.bin: decisions where it evicts the candidate used again last (Belady's choice "
        "among those offered): train 56.8%, held-out 25.0% (LRU 12.5%); 3.1 us per decision over LRU's\n\n"
        + head
        + "| held-out (2 traces) | 12.5% | lru | 87.6% | 0.012 | 90% |\n"
        "| held-out | 100% | belady | 100.0% | 2.000 |  |\n"
        "| held-out | 50% | multi | 0.0% | 0.000 |  |\n"
    )
    del rep["eval_agreement_lru"]
    assert "held-out 25.0% (LRU nan%); 3.1 us" in tp.table(rep)


def test_report_base() -> None:
    """The report sits beside the network without its .bin (OUT.flashmoe.bin -> OUT.flashmoe); other names
    are kept whole."""
    assert tp.report_base("d/m.flashmoe.bin") == "d/m.flashmoe"
    assert tp.report_base("bin.x.bin") == "bin.x"
    assert tp.report_base("net") == "net" and tp.report_base("net.bin.md") == "net.bin.md"


def test_main_writes_the_network_report_and_table(
    traces: tuple[list[Path], list[Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every flag reaches train_policy; the table goes to stdout and to OUT.md, the report to OUT.json
    (indented by one), beside the network OUT.bin; no --eval: no held-out rows."""
    train, held = traces
    out = tmp_path / "run.flashmoe.bin"
    cfg = tp.TrainPolicyConfig(hidden=3, epochs=2, lr=2e-3, weight_decay=0.03, batch=100, rounds=1, max_rows=5000,
                               seed=7, layer_distance=True)  # fmt: skip
    want = tp.train_policy(None, train, held, out, [25.0, 50.0], cfg, (0, 2), (1, None))
    capsys.readouterr()
    args = ["--train", *map(str, train), "--eval", *map(str, held), "--budgets", "25, ,50", "--output", str(out)]
    args += ["--hidden", "3", "--epochs", "2", "--lr", "2e-3", "--weight-decay", "0.03", "--batch", "100"]
    args += ["--rounds", "1", "--max-rows", "5000", "--seed", "7", "--layer-distance"]
    assert tp.main([*args, "--train-sequences", "0:2", "--eval-sequences", "1:"]) == 0
    stdout = capsys.readouterr().out
    text = (tmp_path / "run.flashmoe.json").read_text()
    rep = json.loads(text)
    assert text == json.dumps(rep, indent=1) + "\n" and text.startswith('{\n "model": null,\n "network": ')
    assert {k: v for k, v in rep.items() if k != "decision_us"} == {k: v for k, v in want.items() if k != "decision_us"}
    assert rep["config"]["layer_distance"] is True and rep["budgets"] == [25.0, 50.0]
    assert stdout == (tmp_path / "run.flashmoe.md").read_text() == tp.table(rep)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run")) == [
        "run.flashmoe.bin", "run.flashmoe.json", "run.flashmoe.md"
    ]  # fmt: skip
    assert tp.main(["--train", str(train[0]), "-o", str(tmp_path / "e.bin"), "--budgets", "1", "--epochs", "1",
                    "--no-layer-distance"]) == 0  # fmt: skip
    rep = json.loads((tmp_path / "e.json").read_text())
    assert (rep["eval"], rep["rows"], rep["config"]["layer_distance"], rep["budgets"]) == ([], [], False, [1.0])


def test_main_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without flags: budgets 10, 25 and 50%, FlashMoE's network (hidden 128, 8 epochs, AdamW 1e-3 and 1e-2,
    batches of 512), two rounds, no layer distance, every sequence; the decision cost at the middle budget."""
    train = saved(tmp_path, "t.npz", routing(1, n_tokens=40))
    held = saved(tmp_path, "h.npz", routing(2, n_tokens=40))
    clock = FakeClock([2.0] * 3 + [1.0] * 3)
    monkeypatch.setattr(tp, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    assert tp.main(["--train", str(train), "--eval", str(held), "-o", str(tmp_path / "d.bin")]) == 0
    rep = json.loads((tmp_path / "d.json").read_text())
    assert rep["config"] == DEFAULTS
    assert (rep["budgets"], rep["train_sequences"], rep["eval_sequences"]) == ([10.0, 25.0, 50.0], None, None)
    assert len(rep["rounds"]) == 2 and len(rep["rounds"][0]["loss"]) == 8
    net = f"flashmoe:{tmp_path / 'd.bin'}"
    n = len(np.unique(decisions(Trace.load(held), rp.geometry_of(4, 8, 25.0, 1), net)["decision"]))
    assert rep["decision_us"] == 1e6 / n


def test_main_refuses_bad_budgets_and_ranges(
    traces: tuple[list[Path], list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--budgets is a comma-separated list of shares in (0, 100]; --train and -o are required; a sequence
    range that does not parse names its flag."""
    train, held = traces
    base = ["--train", str(train[0]), "-o", str(tmp_path / "x.bin"), "--epochs", "1", "--hidden", "2"]
    for budgets in ("0", "101", "100.5", ",", "", "x", "25,-5"):
        with pytest.raises(ConfigError) as e:
            tp.main([*base, "--budgets", budgets])
        assert str(e.value) == f"--budgets: {budgets!r}: each budget is a share of the experts in (0, 100]"
    with pytest.raises(ConfigError) as e:  # 100 is a budget: refused later, for holding every expert
        tp.main([*base, "--budgets", "100"])
    assert str(e.value) == "train-policy: no eviction decisions at budgets [100.0]: a budget that holds every expert?"
    for flag in ("--train-sequences", "--eval-sequences"):
        with pytest.raises(ConfigError) as e:
            tp.main([*base, "--eval", str(held[0]), flag, "1"])
        assert str(e.value) == f"{flag}: '1' is not a range A:B of sequence numbers (B may be left out)"
    for args, missing in ((base[2:], "--train"), (base[:2], "-o/--output")):
        with pytest.raises(SystemExit) as ex:
            tp.main(args)
        assert ex.value.code == 2
        assert capsys.readouterr().err.endswith(f"error: the following arguments are required: {missing}\n")
    assert not list(tmp_path.glob("x.*"))


def test_main_help_is_the_documented_one(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each flag's help, word for word, with its default: the text docs/cli.md shows."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as ex:
        tp.main(["--help"])
    assert ex.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in (
        "usage: moetier train-policy [-h] [-m MODEL] --train TRAIN [TRAIN ...] [--eval [EVAL ...]] [--train-sequences "
        "TRAIN_SEQUENCES] [--eval-sequences EVAL_SEQUENCES] [--budgets BUDGETS] -o OUTPUT [--hidden HIDDEN] [--epochs "
        "EPOCHS] [--lr LR] [--weight-decay WEIGHT_DECAY] [--batch BATCH] [--rounds ROUNDS] [--max-rows MAX_ROWS] "
        "[--seed SEED] [--layer-distance | --no-layer-distance]",
        "Train FlashMoE's learned eviction policy on routing traces to imitate Belady's evictions, and evaluate it "
        "on held-out traces; run it with policy flashmoe:OUT.",
        "-m MODEL, --model MODEL the MoE GGUF the traces were recorded on (gives the geometry); without one, the "
        "traces' layers and experts (a trace of real routing, shared format)",
        "--train TRAIN [TRAIN ...] training traces (moetier trace), not the held-out text",
        "--eval [EVAL ...] held-out traces to evaluate on",
        "--train-sequences TRAIN_SEQUENCES train on sequences A:B of each training trace only (B excluded; A: to the "
        "end; default: all)",
        "--eval-sequences EVAL_SEQUENCES evaluate on sequences A:B of the held-out traces only (numbered over them "
        "joined in order), e.g. the prompts of the training trace not trained on; a file both trained on and held "
        "out must have its two parts apart (default: all)",
        "--budgets BUDGETS budgets in % of the experts' bytes (default: 10,25,50)",
        "-o OUTPUT, --output OUTPUT network file to write, e.g. MODEL.flashmoe.bin; its report beside it as "
        "MODEL.flashmoe.json and .md",
        "--hidden HIDDEN hidden units of each of the two hidden layers (default: 128)",
        "--epochs EPOCHS passes over the decisions per round (default: 8)",
        "--lr LR AdamW learning rate (default: 0.001)",
        "--weight-decay WEIGHT_DECAY AdamW decoupled weight decay (default: 0.01)",
        "--batch BATCH candidates per gradient step (default: 512)",
        "--rounds ROUNDS 1: LRU's decisions only; more: add the trained policy's own (default: 2)",
        "--max-rows MAX_ROWS candidates kept per round (a random subset of decisions) (default: 400000)",
        "--seed SEED initialisation and sampling seed (default: 0)",
        "--layer-distance, --no-layer-distance add the layer distance as a third input and evict across layers (the "
        "paper's caches are per layer; so is this cache's partition without it)",
    ):
        assert text in out, text


def test_train_policy_refuses_training_on_what_it_holds_out(
    traces: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    """A file both trained on and held out is refused unless its trained and held-out sequences are apart;
    the held-out range counts sequences over the held-out files joined, so the check maps it onto the file."""
    train, held = traces  # every trace has 2 sequences
    cfg = tp.TrainPolicyConfig(hidden=2, epochs=1, rounds=1)
    out = tmp_path / "o.bin"
    with pytest.raises(ConfigError) as e:
        tp.train_policy(None, train, [train[0]], out, [50], cfg)
    assert str(e.value) == (
        f"{train[0]}: trained on (sequences 0:2) and held out (sequences 0:2 of it); held-out traces must be "
        "others, or other sequences (--train-sequences, --eval-sequences)"
    )
    # the same file through another spelling of its path
    alias = tmp_path / "sub" / ".." / train[1].name
    (tmp_path / "sub").mkdir()
    with pytest.raises(ConfigError, match=r"b\.npz: trained on \(sequences 1:2\) and held out \(sequences 1:2"):
        tp.train_policy(None, train, [held[0], alias], out, [50], cfg, (1, 2), (3, None))
    assert not out.exists()
    # apart: sequence 0 trained, 1 held out; and a held-out range that ends before the shared file
    tp.train_policy(None, [train[0]], [train[0]], out, [50], cfg, (0, 1), (1, None))
    tp.train_policy(None, train, [held[0], train[1]], out, [50], cfg, None, (0, 2))
    tp.train_policy(None, train, [held[0], train[1]], out, [50], cfg, (0, 1), (3, 4))


def test_train_policy_writes_its_network_only_on_success(
    traces: tuple[list[Path], list[Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rounds and the evaluation read a network beside the output; the output is replaced when all
    succeeded: a failure in the evaluation leaves the file that was there, and no temporary file."""
    train, held = traces
    cfg = tp.TrainPolicyConfig(hidden=2, epochs=1, rounds=2)
    out = tmp_path / "net.bin"
    out.write_bytes(b"the user's network")

    def broken(*a: object, **k: object) -> dict[str, Any]:
        msg = "evaluation failed"
        raise RuntimeError(msg)

    with monkeypatch.context() as m:
        m.setattr(tp, "replay_one", broken)
        with pytest.raises(RuntimeError, match="evaluation failed"):
            tp.train_policy(None, train, held, out, [50], cfg)
    assert out.read_bytes() == b"the user's network"
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".bin") == ["net.bin"]
    rep = tp.train_policy(None, train, held, out, [50], cfg)
    assert rep["network"] == str(out)
    assert out.read_bytes().startswith(tp.MAGIC)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".bin") == ["net.bin"]
