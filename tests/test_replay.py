"""Trace replay's offline bound (Belady's MIN and its byte-weighted variant), the field's policies
(ClassLRU, LFRU, least-stale), and `moetier trace` / `moetier replay` end to end."""

from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, Model, _core
from moetier.calibrate import CalibrateConfig, Trace, record_trace
from moetier.tools import replay as rp

W = [0.25, 0.25, 0.25, 0.25]


def synthetic(
    seed: int, n_tokens: int = 300, n_layers: int = 4, n_expert: int = 16, k: int = 4
) -> npt.NDArray[np.int32]:
    """Routing with skew and some temporal locality, like a MoE's: per layer a popularity order, and
    a token repeats part of the previous token's choice."""
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(n_expert, 0.5), size=n_layers)
    ids = np.zeros((n_tokens, n_layers, k), dtype=np.int32)
    for t in range(n_tokens):
        for il in range(n_layers):
            keep = list(ids[t - 1, il, : rng.integers(0, k)]) if t else []
            rest = [int(e) for e in rng.choice(n_expert, size=n_expert, replace=False, p=pop[il]) if e not in keep]
            ids[t, il] = (keep + rest)[:k]
    return ids


def min_reference(ids: npt.NDArray[np.int32], n_slots: int) -> int:
    """Belady's MIN from scratch, with the cache's rules: a resolve (token, layer) pins what it uses,
    experts in ascending order, free slots from slot 0 up, the victim the slot whose expert comes
    back last (a use in this resolve counts), ties to the lowest slot. Returns the misses."""
    n_tokens, n_layers, _ = ids.shape
    uses: dict[tuple[int, int], list[int]] = {}
    for t in range(n_tokens):
        for il in range(n_layers):
            for e in sorted(set(ids[t, il].tolist())):
                uses.setdefault((il, e), []).append(t * n_layers + il)
    slots: list[tuple[int, int] | None] = [None] * n_slots
    misses = 0
    for t in range(n_tokens):
        for il in range(n_layers):
            now = t * n_layers + il
            pinned: set[int] = set()
            for e in sorted(set(ids[t, il].tolist())):
                if (il, e) in slots:
                    pinned.add(slots.index((il, e)))
                    continue
                misses += 1
                if None in slots:
                    s = slots.index(None)
                else:

                    def next_use(i: int, now: int = now) -> float:
                        key = slots[i]
                        assert key is not None
                        later = [u for u in uses[key] if u >= now]
                        return later[0] if later else float("inf")

                    s = max((i for i in range(n_slots) if i not in pinned), key=lambda i: (next_use(i), -i))
                slots[s] = (il, e)
                pinned.add(s)
    return misses


def _replay(
    ids: npt.NDArray[np.int32],
    policy: str,
    n_slots: int,
    weights: npt.NDArray[np.float32] | None = None,
    t1: float = 1.0,
    bytes_low: int = 0,
    n_low: int = 0,
) -> _core.LayerStats:
    return _core.replay(ids, weights, 16, 1000, bytes_low, n_slots, n_low, policy, W, t1, 1.0)


@pytest.mark.parametrize(("seed", "n_slots"), [(1, 16), (2, 24), (3, 40)])
def test_belady_is_min_and_bounds_every_policy(seed: int, n_slots: int) -> None:
    ids = synthetic(seed)
    b = _replay(ids, "belady", n_slots)
    assert b.n_misses == min_reference(ids, n_slots)
    assert b.n_bytes_read == 1000 * b.n_misses
    online = {p: _replay(ids, p, n_slots).n_misses for p in _core.policy_names()}
    assert all(b.n_misses <= m for m in online.values()), (b.n_misses, online)
    assert b.n_misses < online["lru"]  # a bound that is not LRU itself
    # with every expert in high precision, weighing bytes changes nothing
    c = _replay(ids, "belady-cost", n_slots)
    assert (c.n_misses, c.n_bytes_read) == (b.n_misses, b.n_bytes_read)


def test_belady_cost_reads_fewer_bytes_in_mixed_precision() -> None:
    """With low copies, a miss that the rule serves in low precision costs a quarter: the byte-weighted
    look-ahead keeps the high ones and reads no more bytes than the count-only one here."""
    ids = synthetic(4, n_tokens=400)
    rng = np.random.default_rng(4)
    w = np.sort(rng.dirichlet(np.full(4, 0.7), size=ids.shape[:2]).astype(np.float32), axis=-1)[..., ::-1].copy()
    b, c, lru = (_replay(ids, p, 24, w, t1=0.3, bytes_low=250, n_low=8) for p in ("belady", "belady-cost", "lru"))
    assert b.n_loads_low > 0 and c.n_loads_low > 0
    assert c.n_bytes_read <= b.n_bytes_read < lru.n_bytes_read


def test_vram_tier_in_replay() -> None:
    """The engine's VRAM tier code over the replayed cache: its counters add up, a tier as large as the
    cache under the same policy makes the cache's decisions (it sees the same lookups), Belady bounds it,
    and one that holds every expert copies each once."""
    ids = synthetic(4)
    n_lookups = _replay(ids, "lru", 24).n_lookups

    def tier(policy: str, n_ram: int, n_vram: int) -> _core.LayerStats:
        return _core.replay(ids, None, 16, 1000, 0, n_ram, 0, policy, W, 1.0, 1.0, [0], n_vram)

    for policy in ("lru", "reuse-rank"):
        s = tier(policy, 24, 20)
        assert s.n_vram_hits + s.n_vram_copies == s.n_lookups == n_lookups
        assert s.n_vram_bytes == 1000 * s.n_vram_copies and s.n_vram_cpu == 0
        same = tier(policy, 24, 24)
        assert same.n_vram_copies == same.n_misses
    assert tier("belady", 64, 20).n_vram_copies <= tier("lru", 64, 20).n_vram_copies
    every = tier("lru", 64, 64)
    assert every.n_vram_copies == len({(il, int(e)) for t in ids for il, row in enumerate(t) for e in row})
    with pytest.raises(ValueError, match="8 VRAM slots is below one layer's 16 experts"):
        tier("lru", 24, 8)


def test_offline_policies_are_replay_only() -> None:
    assert set(_core.offline_policy_names()) == {"belady", "belady-cost"}
    assert not set(_core.offline_policy_names()) & set(_core.policy_names())
    with pytest.raises(ConfigError, match="trace replay only"):
        CacheConfig(budget="64M", policy="belady")
    with pytest.raises(ValueError, match="looks into the future"):
        _core.Policy("belady", 2, W)  # no future to look into


def test_least_stale_evicts_what_this_pass_used_first() -> None:
    p = _core.Policy("least-stale", 4, W)
    for tick, slot in ((1, 0), (2, 1), (3, 2), (4, 3)):  # pass 1: layer = slot
        p.set_clock(tick, 0, 1, 1, slot, 4)
        p.on_load(slot, slot, 0, True)
    p.set_clock(5, 0, 2, 2, 0, 4)
    p.on_hit(0, 0, 0, True)  # pass 2, layer 0
    p.set_clock(6, 0, 2, 2, 1, 4)
    p.on_hit(1, 1, 0, True)  # layer 1
    p.set_clock(7, 0, 2, 2, 2, 4)  # resolving layer 2: layers 0 and 1 are done for this pass
    assert p.victim([0, 0, 1, 0]) == 1  # the most recent of this pass's: its layer comes back last
    assert p.victim([0, 1, 1, 0]) == 0
    assert p.victim([1, 1, 1, 0]) == 3  # none of this pass left: the least recently used
    assert p.across_layers


def test_classlru_divides_age_by_its_frequency_class() -> None:
    p = _core.Policy("classlru", 2, W)
    for pass_ in range(1, 9):  # slot 0 used in 8 passes: count 7.85, decayed to 7.36 by pass 20: class 2
        p.set_clock(pass_, 0, pass_, pass_, 0, 1)
        (p.on_load if pass_ == 1 else p.on_hit)(0, 0, 0, True)
    p.set_clock(9, 0, 9, 9, 0, 1)
    p.on_load(1, 0, 1, True)  # slot 1 once: class 0
    p.set_clock(20, 0, 20, 20, 0, 1)
    # ages 12 and 11: LRU would evict slot 0; 12 / 2^2 < 11 / 2^0
    assert p.victim([0, 0]) == 1
    lru = _core.Policy("lru", 2, W)
    lru.set_clock(8, 0, 8, 8, 0, 1)
    lru.on_load(0, 0, 0, True)
    lru.set_clock(9, 0, 9, 9, 0, 1)
    lru.on_load(1, 0, 1, True)
    assert lru.victim([0, 0]) == 0
    # 128-pass half-life: ten half-lives later the count is below 1, class 0, and age alone decides
    p.set_clock(1300, 0, 1300, 1300, 0, 1)
    assert p.victim([0, 0]) == 0
    assert not p.across_layers


def test_lfru_weighs_uses_by_recency() -> None:
    p = _core.Policy("lfru", 2, W)
    for pass_ in range(1, 6):
        p.set_clock(pass_, 0, pass_, pass_, 0, 1)
        (p.on_load if pass_ == 1 else p.on_hit)(0, 0, 0, True)  # 5 uses, last in pass 5
    p.set_clock(6, 0, 6, 6, 0, 1)
    p.on_load(1, 0, 1, True)  # 1 use in pass 6
    p.set_clock(7, 0, 7, 7, 0, 1)
    assert p.victim([0, 0]) == 1  # 5/3 > 1/2
    p.set_clock(30, 0, 30, 30, 0, 1)
    p.on_hit(1, 0, 1, True)  # 2 uses, just now
    assert p.victim([0, 0]) == 0  # 5/26 < 2/1


def test_reuse_evicts_the_longest_expected_time_to_next_use() -> None:
    """reuse weighs layer distance against use frequency in one unit, resolves: a rarely used expert
    of the next layer goes before a popular one of the layer that just ran (FLD would evict the
    latter); at equal frequency, the farther layer goes first."""
    p = _core.Policy("reuse", 3, W)
    fld = _core.Policy("fld", 3, W)
    tick = 0
    for pass_ in range(1, 11):  # 4 layers; slot 0 holds layer 1's expert 0 (pass 1 only), slot 1 layer 3's (every pass)
        for layer in range(4):
            tick += 1
            for q in (p, fld):
                q.set_clock(tick, 0, pass_, pass_, layer, 4)
                if layer == 1 and pass_ == 1:
                    q.on_load(0, 1, 0, True)
                if layer == 3:
                    (q.on_load if pass_ == 1 else q.on_hit)(1, 3, 0, True)
                if layer == 2 and pass_ == 10:
                    q.on_load(2, 2, 5, True)  # slot 2: layer 2, once, just now
    for q in (p, fld):
        q.set_clock(tick + 1, 0, 11, 11, 0, 4)  # resolving layer 0 of pass 11
    assert fld.victim([0, 0, 1]) == 1  # the layer that just ran
    assert p.victim([0, 0, 1]) == 0  # used once, 10 passes ago: its next use is far off
    assert p.victim([1, 0, 0]) == 2  # layer 2 once vs layer 3 every pass
    assert p.across_layers
    with pytest.raises(ConfigError, match="half-life"):
        CacheConfig(budget="64M", policy="reuse:x")
    CacheConfig(budget="64M", policy="reuse:16")


def test_reuse_rank_learns_how_often_a_gate_rank_comes_back() -> None:
    """reuse-rank counts, per gate rank at the last use and passes since, how often an expert came
    back; at equal frequency and recency it keeps the one whose rank comes back: rank 0 here (every
    pass for one expert, every other for another), not rank 7 (never at the next pass). reuse sees a
    tie. A read no token used (rank -1, a prefetch) is no use and goes first."""
    p = _core.Policy("reuse-rank", 5, W)
    reuse = _core.Policy("reuse", 5, W)
    tick = 0
    for pass_ in range(1, 22):  # 2 layers; the experts are layer 1's, used while it resolves
        tick += 2
        for q in (p, reuse):
            q.set_clock(tick, 0, pass_, pass_, 1, 2)
            q.on_hit(2, 1, 0, True, rank=0)  # every pass, ranked first
            if pass_ % 2:
                q.on_hit(0, 1, 3, True, rank=0)  # odd passes, ranked first
                q.on_hit(1, 1, 1, True, rank=7)  # odd passes, ranked last
            else:
                q.on_hit(3, 1, 2, True, rank=7)  # even passes, ranked last
    for q in (p, reuse):
        q.set_clock(tick + 1, 0, 22, 22, 0, 2)  # resolving layer 0 of pass 22: layer 1 is next
    assert p.victim([0, 0, 1, 1, 1]) == 1  # rank 7 after one pass: it never came back
    assert reuse.victim([0, 0, 1, 1, 1]) == 0  # same frequency, same last use: the first slot
    p.on_load(4, 1, 5, True, rank=-1)
    assert p.victim([0, 0, 1, 1, 0]) == 4
    assert p.across_layers
    with pytest.raises(ConfigError, match="half-life"):
        CacheConfig(budget="64M", policy="reuse-rank:0")


def test_reuse_rank_reads_the_rank_from_the_gate_weights() -> None:
    """The cache hands reuse-rank each expert's rank by gate weight: a token here keeps a prefix of
    the previous token's choice, the top of it, so with the weights in that order it misses less
    than with the same weights shuffled within each token (ranks that say nothing; the table is
    learned online, so any fixed relabelling of the ranks would do as well as the right one)."""
    ids = synthetic(5, n_tokens=600, k=8)
    w = np.broadcast_to(np.linspace(0.2, 0.05, 8, dtype=np.float32), ids.shape).copy()
    shuffled = np.random.default_rng(0).permuted(w, axis=2)
    right = _replay(ids, "reuse-rank", 40, w).n_misses
    assert right < _replay(ids, "reuse-rank", 40, shuffled).n_misses
    assert right < _replay(ids, "reuse:16", 40).n_misses


def topics(seed: int, n_seq: int = 6, seq_len: int = 300, hot: int = 6, p_hot: float = 0.7) -> npt.NDArray[np.int32]:
    """Routing with a topic per sequence, as real MoEs route text: each sequence gives each of 4 layers
    a hot set of 6 of its 16 experts that a token draws from with probability p_hot (else from all);
    4 experts per token."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((n_seq * seq_len, 4, 4), dtype=np.int32)
    for s in range(n_seq):
        sets = [rng.choice(16, size=hot, replace=False) for _ in range(4)]
        for t in range(s * seq_len, (s + 1) * seq_len):
            for il in range(4):
                chosen: list[int] = []
                while len(chosen) < 4:
                    e = int(rng.choice(sets[il])) if rng.random() < p_hot else int(rng.integers(16))
                    if e not in chosen:
                        chosen.append(e)
                ids[t, il] = chosen
    return ids


@pytest.mark.parametrize(("seed", "n_slots"), [(0, 16), (1, 24), (2, 32)])
def test_reuse_learned_learns_the_topics_of_routing(seed: int, n_slots: int) -> None:
    """reuse-learned learns from each expert's gaps between uses how often an expert with its history
    (passes since, use frequency at two time scales) comes back. With a hot set per sequence it keeps
    the hot experts: far fewer misses than LRU and than reuse's one decayed frequency, about as few
    as reuse-rank's rank x age table (the ranks here say nothing), without gate weights. A table that
    learned nothing would leave only the layer distance, far worse than LRU."""
    ids = topics(seed)
    m = {p: _replay(ids, p, n_slots).n_misses for p in ("lru", "reuse", "reuse-rank", "reuse-learned", "belady")}
    assert m["reuse-learned"] < 0.9 * m["lru"], m
    assert m["reuse-learned"] < m["reuse"], m
    assert m["reuse-learned"] < 1.03 * m["reuse-rank"], m
    assert m["belady"] < m["reuse-learned"], m
    p = _core.Policy("reuse-learned", 4, W)
    assert p.across_layers
    with pytest.raises(ConfigError, match="half-life"):
        CacheConfig(budget="64M", policy="reuse-learned:0")
    CacheConfig(budget="64M", policy="reuse-learned:32")


def test_a_miss_never_evicts_what_the_same_resolve_uses() -> None:
    """Every hit of a resolve is pinned before its misses take slots. Layer 0's experts 8-15 fill
    half the cache, all last used together; the next token needs expert 0 and 8-14: expert 0 takes
    15's slot. Pinning in expert order let it take 8's, whose read then took 9's, and so on."""
    t0 = [list(range(8, 16)), list(range(8))]
    t1 = [[0, *range(8, 15)], list(range(8))]
    ids = np.array([t0, t1], dtype=np.int32)
    assert _replay(ids, "lru", 16).n_misses == 16 + 1
    for policy in _core.policy_names():
        assert _replay(ids, policy, 16).n_misses <= 16 + 2, policy


@pytest.fixture(scope="module")
def moe(tiny_model: ModelFactory) -> Path:
    return tiny_model("qwen3moe", n_expert=16, n_expert_used=4, n_layer=4, expert_type="f16")


def test_new_policies_decode_exactly(moe: Path) -> None:
    budget = int(Model(moe, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"]) * 2
    stock = Model(moe).generate("def fibonacci(n):", max_tokens=24).tokens
    for policy in ("classlru", "lfru", "least-stale", "reuse", "reuse:8", "reuse-rank", "reuse-learned"):
        m = Model(moe, cache=CacheConfig.exact(budget, policy=policy))
        out = m.generate("def fibonacci(n):", max_tokens=24)
        assert out.tokens == stock, policy
        assert out.stats.n_misses > 0 and out.stats.n_hits > 0, policy


def test_trace_and_replay_commands(moe: Path, tmp_path: Path, tiny_model: ModelFactory) -> None:
    text = tmp_path / "held-out.txt"
    text.write_text(LONG_PROMPT * 3)
    trace = tmp_path / "t.npz"
    assert rp.trace_main([str(moe), "--text", str(text), "--tokens", "200", "--seq-len", "64", "-o", str(trace)]) == 0
    tr = Trace.load(trace)
    n = tr.ids.shape[0]
    assert tr.seq_starts == tuple(range(0, n, 64)) and tr.ubatch_starts == tr.seq_starts  # ubatch 64 = seq
    out = tmp_path / "replay-0.5b.json"
    policies = "lru,multi,least-stale,classlru,lfru,belady,belady-cost"
    args = [str(trace), "-m", str(moe), "--budgets", "25,50", "--policies", policies, "-o", str(out), "-q"]
    assert rp.replay_main(args) == 0
    rep = json.loads(out.read_text())
    assert (tmp_path / "replay-0.5b.md").exists()  # the name keeps its inner dot
    assert rep["tokens"] == n and [g["n_slots"] for g in rep["geometry"]] == [16, 32]
    for pct in (25, 50):
        rows = {r["policy"]: r for r in rep["rows"] if r["pct"] == pct}
        assert set(rows) == set(policies.split(","))
        best = rows["belady"]
        assert all(best["n_bytes_read"] <= r["n_bytes_read"] for r in rows.values())
        assert all(best["hit_rate"] >= r["hit_rate"] - 1e-12 for r in rows.values())
        assert rows["lru"]["gap_closed"] == 0 and rows["belady"]["gap_closed"] == 1
        assert rows["lru"]["mb_per_token"] == pytest.approx(rows["lru"]["n_bytes_read"] / n / 1e6)
    # a VRAM tier of 10% over each budget: its columns, fewer of its hits than the cache's
    vr = rp.replay(trace, moe, [25, 50], ["lru"], progress=False, vram=10)
    assert vr["vram"] == 10 and "VRAM hit rate" in rp.table(vr)
    for r in vr["rows"]:
        assert 0 < r["vram_hit_rate"] <= r["hit_rate"] and r["vram_mb_per_token"] > 0
    # a trace of another model, an unknown policy, a damaged trace: errors that say so
    other = tiny_model("qwen3moe", n_expert=8, n_expert_used=2, n_layer=4, expert_type="f16")
    with pytest.raises(ConfigError, match=r"t\.npz: the trace has 4 MoE layers of 16 experts"):
        rp.replay(trace, other, [50], ["lru"], progress=False)
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        rp.replay(trace, moe, [50], ["lru", "nope"], progress=False)
    bad = tmp_path / "bad.npz"
    Trace(tr.ids + 16, tr.weights, tr.layers, tr.n_expert, tr.seq_starts).save(bad)
    with pytest.raises(ConfigError, match=r"bad\.npz: expert ids must lie in \[0, 16\)"):
        Trace.load(bad)


def _net(tmp_path: Path, hidden: int = 8, seed: int = 3, n_in: int = 2) -> Path:
    from moetier.tools.train_policy import new_net, save_net

    path = tmp_path / f"net-{hidden}-{seed}-{n_in}.bin"
    save_net(new_net(hidden, np.random.default_rng(seed), n_in), path)
    return path


@pytest.mark.parametrize("n_in", [2, 3])
def test_flashmoe_network_is_the_one_python_wrote(tmp_path: Path, n_in: int) -> None:
    """The C++ policy evicts the candidate the numpy network scores highest, on its own inputs as the
    recorder logs them: the file format and the forward pass agree. Three inputs (+ layer distance)
    choose among every layer's slots, two among the partition's donor layer."""
    from moetier.tools.train_policy import new_net, scores

    net_path = _net(tmp_path, n_in=n_in)
    net = new_net(8, np.random.default_rng(3), n_in)
    ids = synthetic(5)
    _, rows = _core.replay_decisions(ids, None, 16, 1000, 0, 24, 0, f"flashmoe:{net_path}", W, 1.0, 1.0)
    d, x, chosen = rows["decision"], rows["x"], rows["chosen"]
    assert len(np.unique(d)) > 50 and np.all((x >= 0) & (x < 1.0001))
    layers_per_decision = [len(np.unique(x[d == k, 2])) for k in np.unique(d)[:200]]
    assert (max(layers_per_decision) > 1) == (n_in == 3)
    assert _core.Policy(f"flashmoe:{net_path}", 4, W).across_layers == (n_in == 3)
    if n_in == 3:  # the policy scores each layer's least recently used slot only: the chosen among them
        from moetier.tools.train_policy import oldest_per_layer

        k = oldest_per_layer(x, d)
        assert len(k) < len(d)
        x, d, chosen = x[k], d[k], chosen[k]
    score = scores(net, x[:, :n_in])
    checked = 0
    for k in np.unique(d):
        m = d == k
        s = score[m]
        if np.sum(s == s.max()) == 1:  # ties go to the least recently used
            assert chosen[m][np.argmax(s)], k
            checked += 1
    assert checked > 50
    assert np.all(np.bincount(d, weights=chosen) == 1)  # one victim per decision


def test_decisions_log_belady_view_of_any_policy() -> None:
    ids = synthetic(6)
    c, rows = _core.replay_decisions(ids, None, 16, 1000, 0, 24, 0, "lru", W, 1.0, 1.0)
    assert c.n_misses == _replay(ids, "lru", 24).n_misses  # logging changes nothing
    d, x, nxt = rows["decision"], rows["x"], rows["next_use"]
    assert np.all(nxt >= 0)
    # LRU evicts the candidate with the oldest pass (smallest 1/r) of its decision
    for k in np.unique(d)[:100]:
        m = d == k
        assert x[m][rows["chosen"][m], 0][0] == x[m][:, 0].min()
    # and Belady's own decisions always pick the farthest next use
    _, b = _core.replay_decisions(ids, None, 16, 1000, 0, 24, 0, "belady", W, 1.0, 1.0)
    far = np.full(b["decision"].max() + 1, -1.0)
    np.maximum.at(far, b["decision"], b["next_use"])
    assert np.all(b["next_use"][b["chosen"]] == far)


def test_bad_network_files_are_named(tmp_path: Path) -> None:
    good = _net(tmp_path).read_bytes()
    cases = {
        "missing.bin": None,
        "short.bin": good[:-4],
        "magic.bin": b"NOTANET!" + good[8:],
        "hidden.bin": good[:12] + (5000).to_bytes(4, "little") + good[16:],
        "inputs.bin": good[:8] + (4).to_bytes(4, "little") + good[12:],
        "nan.bin": good[:16] + np.float32(np.nan).tobytes() + good[20:],
        "nanb3.bin": good[:-4] + np.float32(np.nan).tobytes(),
    }
    why = {
        "missing.bin": "No such file",
        "short.bin": "size is not that of a 8-hidden network",
        "magic.bin": "not a flashmoe policy network",
        "hidden.bin": "5000 hidden units",
        "inputs.bin": "4 inputs",
        "nan.bin": "not finite",
        "nanb3.bin": "not finite",
    }
    for name, data in cases.items():
        p = tmp_path / name
        if data is not None:
            p.write_bytes(data)
        with pytest.raises(ConfigError, match=f"{name}: .*{why[name]}"):
            CacheConfig(budget="64M", policy=f"flashmoe:{p}")


def test_train_policy_end_to_end(moe: Path, tmp_path: Path) -> None:
    from moetier.tools import train_policy as tp

    text, other = tmp_path / "t.txt", tmp_path / "o.txt"
    text.write_text(LONG_PROMPT * 4)
    other.write_text(" ".join(reversed(LONG_PROMPT.split())) * 3)  # held-out: not the training text
    train, held = tmp_path / "train.npz", tmp_path / "held.npz"
    assert rp.trace_main([str(moe), "--text", str(text), "--tokens", "160", "--seq-len", "80", "-o", str(train)]) == 0
    assert rp.trace_main([str(moe), "--text", str(other), "--tokens", "96", "--seq-len", "96", "-o", str(held)]) == 0
    out = tmp_path / "moe.flashmoe.bin"
    args = ["-m", str(moe), "--train", str(train), "--eval", str(held), "--budgets", "25,50", "-o", str(out)]
    assert tp.main([*args, "--hidden", "16", "--epochs", "2", "--rounds", "2"]) == 0
    rep = json.loads((tmp_path / "moe.flashmoe.json").read_text())
    assert [r["driver"] for r in rep["rounds"]] == ["lru", "flashmoe"]
    assert all(0 <= r["agreement"] <= 1 and r["decisions"] > 0 for r in rep["rounds"])
    assert {r["policy"] for r in rep["rows"]} == {"lru", "multi", "flashmoe", "belady"}
    for pct in (25, 50):
        at = {r["policy"]: r for r in rep["rows"] if r["pct"] == pct}
        assert all(at["belady"]["n_bytes_read"] <= r["n_bytes_read"] for r in at.values())
    assert rep["decision_us"] >= 0 and 0 <= rep["eval_agreement_lru"] <= 1
    # replay runs the trained network as any other policy
    assert rp.replay([held], moe, [25], ["lru", f"flashmoe:{out}"], progress=False)["rows"][1]["n_misses"] > 0
    with pytest.raises(ConfigError, match="no eviction decisions"):
        tp.main([*args[:-4], "--budgets", "100", "-o", str(out), "--epochs", "1", "--rounds", "1"])
    # the layer-distance variant starts from a policy that offers every layer's slots
    assert tp.main([*args, "--hidden", "8", "--epochs", "1", "--rounds", "1", "--layer-distance"]) == 0
    rep = json.loads((tmp_path / "moe.flashmoe.json").read_text())
    assert rep["rounds"][0]["driver"] == "multi" and rep["config"]["layer_distance"]
    # the model runs it, exactly
    budget = int(Model(moe, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"]) * 2
    stock = Model(moe).generate("def fibonacci(n):", max_tokens=16).tokens
    m = Model(moe, cache=CacheConfig.exact(budget, policy=f"flashmoe:{out}"))
    got = m.generate("def fibonacci(n):", max_tokens=16)
    assert got.tokens == stock and got.stats.n_misses > 0


def test_replay_leaves_no_warm_start_sidecar(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """Replay's probes of the model are not runs of it: no <model>.cache-state appears beside it."""
    model = tmp_path / "m.gguf"
    shutil.copy(tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3), model)
    info = rp.probe(model, None)
    rp.geometry(model, None, info, 50, 1.0, 1.0, 0.0)
    gc.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def shared_format(path: Path, ids: npt.NDArray[np.int32], offsets: list[int], **extra: object) -> Path:
    """A trace in the shared format of real routing recorded by other tools (uint8 ids, seq_offsets)."""
    np.savez(
        path,
        ids=ids.astype(np.uint8),
        seq_offsets=np.asarray(offsets, dtype=np.int64),
        is_decode=np.ones(ids.shape[0], dtype=bool),
        layers=np.arange(1, ids.shape[1] + 1, dtype=np.int16),
        n_experts=np.int32(16),
        top_k=np.int32(ids.shape[2]),
        **extra,  # type: ignore[arg-type]
    )
    return path


def test_replay_reads_real_traces_without_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = synthetic(5)
    path = shared_format(tmp_path / "real.npz", ids, [0, 120, 300])
    tr = Trace.load(path)
    # each token one step, each selected expert 1/K without gate weights, the sequences kept
    assert not tr.has_weights and tr.seq_starts == (0, 120) and tr.ubatch_starts == tuple(range(300))
    assert tr.layers == (1, 2, 3, 4) and np.array_equal(tr.ids, ids) and np.allclose(tr.weights, 0.25)
    rep = rp.replay(path, None, [25.0], ["lru", "reuse-rank", "belady"], progress=False)
    geo = rep["geometry"][0]
    assert (geo["n_layers"], geo["n_expert"], geo["n_slots"]) == (4, 16, 16)
    at = {r["policy"]: r for r in rep["rows"]}
    # the same routing in moetier's own format replays to the same counters
    own = Trace(ids, np.full(ids.shape, 0.25, np.float32), (1, 2, 3, 4), 16, (0, 120), tuple(range(300)))
    for p in ("lru", "belady"):
        c = rp.replay_one(own, geo, p, 1.0, 1.0, W)
        assert c["n_misses"] == at[p]["n_misses"]
    assert at["belady"]["n_misses"] < at["lru"]["n_misses"] and at["belady"]["gap_closed"] == 1.0
    # gate weights, where the trace has them, are used
    w = np.random.default_rng(0).random(ids.shape).astype(np.float32)
    assert Trace.load(shared_format(tmp_path / "w.npz", ids, [0, 300], weights=w)).has_weights
    # the command: no -m, sizes given as numbers
    assert (
        rp.replay_main([str(path), "--budgets", "10,50", "--policies", "lru,belady", "-q", "--expert-bytes", "2M"]) == 0
    )
    out = capsys.readouterr().out
    assert "4 layers x 16 experts" in out and "no gate weights" in out
    with pytest.raises(ConfigError, match="--expert-bytes: the model"):
        rp.replay_main([str(path), "-m", "x.gguf", "--expert-bytes", "5M"])
    with pytest.raises(ConfigError, match="need the model"):
        rp.replay(path, None, [25.0], ["lru"], t1=0.5, progress=False)


def test_a_trace_split_by_sequence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--sequences A:B replays those sequences of a trace only, each starting as it did: the same
    counters as a trace holding only them; train-policy trains on one part of a real trace and judges
    on another, with no model file (the geometry is the trace's)."""
    from moetier.tools import train_policy as tp

    ids = synthetic(7, n_tokens=400)
    path = shared_format(tmp_path / "real.npz", ids, [0, 100, 250, 400])
    part = shared_format(tmp_path / "part.npz", ids[100:], [0, 150, 300])
    for seqs, ref in (((1, None), part), ((1, 3), part)):
        got = rp.replay(path, None, [25.0], ["lru", "reuse-learned"], progress=False, sequences=seqs)
        want = rp.replay(ref, None, [25.0], ["lru", "reuse-learned"], progress=False)
        assert got["tokens"] == 300 and got["sequences"] == list(seqs)
        assert [r["n_misses"] for r in got["rows"]] == [r["n_misses"] for r in want["rows"]]
    one = rp.replay(path, None, [25.0], ["lru"], progress=False, sequences=(1, 2))
    assert one["tokens"] == 150
    assert rp.replay_main([str(path), "--sequences", "2:", "--policies", "lru", "-q"]) == 0
    assert "(sequences 2:, 150 tokens" in capsys.readouterr().out
    for bad in ("2:2", "0:4", "x"):
        with pytest.raises(ConfigError, match=r"--sequences|within its 3 sequences"):
            rp.replay_main([str(path), "--sequences", bad, "-q"])
    out = tmp_path / "net.bin"
    args = ["--train", str(path), "--eval", str(path), "--train-sequences", "0:2", "--eval-sequences", "2:"]
    assert tp.main([*args, "--budgets", "25", "-o", str(out), "--hidden", "8", "--epochs", "1", "--rounds", "1"]) == 0
    rep = json.loads((tmp_path / "net.json").read_text())
    assert rep["model"] is None and rep["train_sequences"] == [0, 2] and rep["eval_sequences"] == [2, None]
    assert {r["policy"] for r in rep["rows"]} == {"lru", "multi", "flashmoe", "belady"}
    lru = next(r for r in rep["rows"] if r["policy"] == "lru")
    assert (
        lru["n_misses"]
        == rp.replay(path, None, [25.0], ["lru"], progress=False, sequences=(2, None))["rows"][0]["n_misses"]
    )


def test_bad_real_traces_are_named(tmp_path: Path) -> None:
    ids = synthetic(6, n_tokens=50)
    with pytest.raises(ConfigError, match=r"gap\.npz: seq_offsets must rise strictly from 0 to the 50 tokens"):
        Trace.load(shared_format(tmp_path / "gap.npz", ids, [0, 30, 40]))
    big = ids.copy()
    big[3, 1, 0] = 20  # past n_experts = 16
    with pytest.raises(ConfigError, match=r"ids\.npz: expert ids must lie in \[0, 16\)"):
        Trace.load(shared_format(tmp_path / "ids.npz", big, [0, 50]))
    with pytest.raises(ConfigError, match=r"w\.npz: weights .* differ in shape"):
        Trace.load(shared_format(tmp_path / "w.npz", ids, [0, 50], weights=np.ones((50, 4, 3), np.float32)))


def _rows() -> list[dict[str, Any]]:
    def row(policy: str, pct: float, hit: float, mb: float, gap: float | None) -> dict[str, Any]:
        return {
            "policy": policy,
            "pct": pct,
            "hit_rate": hit,
            "misses_per_token": 10 * (1 - hit),
            "mb_per_token": mb,
            "n_bytes_read": int(mb * 1e6),
            "n_loads_low": 3,
            "n_skipped": 0,
            "gap_closed": gap,
            "vram_hit_rate": hit / 2,
            "vram_mb_per_token": mb / 4,
        }

    return [
        row("lru", 10, 0.25, 4.0, 0.0),
        row("belady", 10, 0.5, 2.0, None),
        row("reuse-rank", 10, 0.3, 3.5, 0.25),
        row("lru", 25, 0.5, 2.0, 0.0),
        row("belady", 25, 0.75, 1.0, None),
        row("reuse-rank", 25, 0.6, 1.5, 0.5),
    ]


def test_replay_table_of_a_model_and_of_a_bare_trace() -> None:
    from moetier.tools.replay import table

    geo = [{"pct": 10, "n_slots": 16, "n_slots_low": 0}, {"pct": 25, "n_slots": 40, "n_slots_low": 2}]
    rep = {"model": "/m/x.gguf", "trace": "t.npz", "tokens": 300, "n_used": 8, "t1": 1.0, "t2": 1.0}
    rep |= {"geometry": geo, "rows": _rows()}
    head = (
        "| budget | slots | policy | hit rate | misses/token | MB/token | low loads | skipped | gap closed |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    body = (
        "| 10% | 16+0 | belady | 50.0% | 5.00 | 2.00 | 3 | 0 |  |\n"
        "| 10% | 16+0 | reuse-rank | 30.0% | 7.00 | 3.50 | 3 | 0 | 25% |\n"
        "| 10% | 16+0 | lru | 25.0% | 7.50 | 4.00 | 3 | 0 | 0% |\n"
        "| 25% | 40+2 | belady | 75.0% | 2.50 | 1.00 | 3 | 0 |  |\n"
        "| 25% | 40+2 | reuse-rank | 60.0% | 4.00 | 1.50 | 3 | 0 | 50% |\n"
        "| 25% | 40+2 | lru | 50.0% | 5.00 | 2.00 | 3 | 0 | 0% |\n"
    )
    gap = "gap closed: share of the bytes between LRU and Belady a policy saves."
    assert table(rep) == f"Replay of t.npz (300 tokens, top-8) on x.gguf; t1=1, t2=1. {gap}\n\n" + head + body
    # no model: the trace's geometry; MB/token counts misses when no expert size is known; no weights
    bare = {**rep, "model": None, "expert_bytes": 1, "has_weights": False, "sequences": (40, None), "t1": 0.25}
    bare["geometry"] = [{**g, "n_layers": 26, "n_expert": 64} for g in geo]
    first = table(bare).splitlines()[0]
    assert first == (
        "Replay of t.npz (sequences 40:, 300 tokens, top-8) on the trace's geometry (26 layers x 64 experts; "
        f"MB/token counts misses, 1 byte each); t1=0.25, t2=1. {gap} The trace has no gate weights: ranks "
        "follow its id order."
    )
    sized = table({**bare, "expert_bytes": 4096, "has_weights": True, "sequences": (0, 40)}).splitlines()[0]
    assert "(sequences 0:40, 300 tokens" in sized and "(26 layers x 64 experts);" in sized
    assert not sized.endswith("id order.")
    # a VRAM tier: two more columns
    lines = table({**rep, "vram": 5}).splitlines()
    assert lines[0].endswith(" A VRAM tier of 5% of the experts over the cache: its hit rate and MB copied in.")
    assert lines[2].endswith("| gap closed | VRAM hit rate | VRAM MB/token |") and lines[3].endswith("|---|---|---|")
    assert lines[4] == "| 10% | 16+0 | belady | 50.0% | 5.00 | 2.00 | 3 | 0 |  | 25.0% | 0.50 |"


def test_replay_plot_draws_every_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from moetier.tools.replay import plot

    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)
    rows = [*_rows(), {**_rows()[1], "policy": "belady-cost", "pct": 10}]
    rep = {"model": None, "trace": "/data/deepseek/trace.npz,/x/other.npz", "tokens": 300, "rows": rows}
    assert plot(rep, tmp_path / "p.png") and (tmp_path / "p.png").is_file()
    (fig,) = kept
    hits, mb = fig.axes
    assert fig._suptitle.get_text() == "deepseek: 300 traced tokens replayed" and fig._suptitle.get_fontsize() == 9
    assert list(fig.get_size_inches()) == [11.0, 4.2]
    got = {ln.get_label(): ln for ln in hits.get_lines()}
    assert list(got) == ["lru", "belady", "reuse-rank", "belady-cost"]
    assert list(got["lru"].get_xdata()) == [10, 25] and list(got["lru"].get_ydata()) == [25.0, 50.0]
    assert list(mb.get_lines()[2].get_ydata()) == [3.5, 1.5]
    # Belady black and thick on top (its cost-aware variant dotted), the online policies thin with markers
    b, bc, r = got["belady"], got["belady-cost"], got["reuse-rank"]
    assert (b.get_color(), b.get_linewidth(), b.get_zorder(), b.get_linestyle()) == ("k", 2.5, 5, "-")
    assert (bc.get_color(), bc.get_linestyle()) == ("k", ":")
    assert (r.get_linewidth(), r.get_marker(), r.get_markersize()) == (1.2, "o", 3)
    assert (hits.get_xlabel(), hits.get_ylabel(), hits.get_title()) == (
        "cache budget (% of expert bytes)",
        "hit rate (%)",
        "hits",
    )
    assert (mb.get_xlabel(), mb.get_ylabel(), mb.get_title()) == (
        "cache budget (% of expert bytes)",
        "MB read per token",
        "bytes",
    )
    legend = mb.get_legend()
    assert legend is not None and legend.get_texts()[0].get_fontsize() == 7 and legend._ncols == 2
    assert hits.get_legend() is None
    plot({**rep, "model": "/m/x.gguf"}, tmp_path / "q.png")
    assert kept[1]._suptitle.get_text() == "x.gguf: 300 traced tokens replayed"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot(rep, tmp_path / "r.png") is False


def test_geometry_without_a_model() -> None:
    want = {"pct": 10, "budget_bytes": int(1664 * 4096 * 10 / 100), "n_layers": 26, "n_expert": 64, "n_slots": 166}
    want |= {"n_slots_low": 0, "bytes_high": 4096, "bytes_low": 0}
    assert rp.geometry_of(26, 64, 10, 4096) == want
    assert rp.geometry_of(26, 64, 10, 4096)["budget_bytes"] == 681574
    assert rp.geometry_of(26, 64, 1, 4096)["n_slots"] == 64  # one layer's experts at least
    assert rp.geometry_of(26, 64, 100, 1)["n_slots"] == 1664


def test_select_sequences_keeps_each_start() -> None:
    ids = np.arange(8 * 2 * 2, dtype=np.int32).reshape(8, 2, 2) % 8
    tr = Trace(ids, np.full(ids.shape, 0.5, np.float32), (3, 4), 8, (0, 3, 5), (0, 1, 3, 4, 5, 6, 7), False)
    one = rp.select_sequences(tr, 1, 2, "t.npz")
    assert np.array_equal(one.ids, ids[3:5]) and np.array_equal(one.weights, tr.weights[3:5])
    assert (one.layers, one.n_expert, one.seq_starts, one.ubatch_starts, one.has_weights) == (
        (3, 4),
        8,
        (0,),
        (0, 1),
        False,
    )
    rest = rp.select_sequences(tr, 1, None, "t.npz")
    assert rest.ids.shape[0] == 5 and rest.seq_starts == (0, 2) and rest.ubatch_starts == (0, 1, 2, 3, 4)
    # a part whose first ubatch began earlier starts one of its own
    coarse = Trace(ids, tr.weights, (3, 4), 8, (0, 3, 5), (0, 4), True)
    assert rp.select_sequences(coarse, 1, 3, "t.npz").ubatch_starts == (0, 1)
    assert rp.select_sequences(coarse, 2, 3, "t.npz").ubatch_starts == (0,)
    for first, last, says in ((2, 1, "2:1"), (3, None, "3:"), (0, 4, "0:4"), (-1, 2, "-1:2")):
        with pytest.raises(ConfigError) as e:
            rp.select_sequences(tr, first, last, "t.npz")
        assert str(e.value) == f"t.npz: sequences {says} is not a range within its 3 sequences"


def test_replay_command_files_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shared_format(tmp_path / "real.npz", synthetic(5), [0, 120, 300])
    args = [str(path), "--budgets", "25,100", "--policies", "lru,belady", "--expert-bytes", "2M"]
    assert rp.replay_main([*args, "-o", str(tmp_path / "r.1.json")]) == 0
    cap = capsys.readouterr()
    assert cap.err  # the progress bar
    base = tmp_path / "r.1"
    assert cap.out.endswith(f"moetier: wrote {base}.json, {base}.md, {base}.png\n")
    rep = json.loads((tmp_path / "r.1.json").read_text())
    assert (tmp_path / "r.1.json").read_text() == json.dumps(rep, indent=1) + "\n"
    assert (tmp_path / "r.1.md").read_text() == rp.table(rep) and cap.out.startswith(rp.table(rep))
    assert [g["pct"] for g in rep["geometry"]] == [25.0, 100.0] and rep["geometry"][0]["bytes_high"] == 2 << 20
    # an output name without .json gets it; -q draws no bar; t1/t2/vram are numbers
    assert rp.replay_main([*args, "-q", "-o", str(tmp_path / "plain"), "--vram", "5", "--t1", "1", "--t2", "1"]) == 0
    cap = capsys.readouterr()
    assert not cap.err and (tmp_path / "plain.json").is_file() and (tmp_path / "plain.md").is_file()
    assert json.loads((tmp_path / "plain.json").read_text())["vram"] == 5.0
    bad = [
        (["--budgets", "0"], "--budgets: '0': each budget is a share of the experts in (0, 100]"),
        (["--budgets", "101"], "--budgets: '101': each budget is a share of the experts in (0, 100]"),
        (["--budgets", ","], "--budgets: ',': each budget is a share of the experts in (0, 100]"),
        (["--budgets", "x"], "--budgets: 'x' is not a comma-separated list of numbers"),
        (["--weights", "1,2"], "--weights: '1,2' needs 4 finite numbers, 0 or more (w_lru,w_lfu,w_lhu,w_fld)"),
        (["--weights", "a,b,c,d"], "--weights: 'a,b,c,d' is not a comma-separated list of numbers"),
        (["--expert-bytes", "0"], "--expert-bytes: '0' is not a size of at least 1 byte"),
        (["--expert-bytes", "lots"], "--expert-bytes: 'lots' is not a size of at least 1 byte"),
        (
            ["-m", "x.gguf", "--expert-bytes", "5M"],
            "--expert-bytes: the model (-m) gives the experts' sizes; give one or the other",
        ),
    ]
    for extra, says in bad:
        with pytest.raises(ConfigError) as e:
            rp.replay_main([str(path), "-q", *extra])
        assert str(e.value) == says


def test_replay_help_is_the_documented_one(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each flag's help, word for word: the text users read (docs/tools.md's table says the same)."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        rp.replay_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    policies = ", ".join(rp.policies_all())
    for text in (
        "usage: moetier replay [-h]",
        "Replay a routing trace through the engine's cache code for every policy and budget, beside Belady's MIN "
        "(the offline optimum): hits, misses and bytes read per token; a table, a JSON report and a plot.",
        "trace routing trace(s), replayed one after another: .npz of moetier trace or calibrate, or the shared format "
        "of real routing (ids, seq_offsets, n_experts; gate weights optional)",
        "-m MODEL, --model MODEL the MoE GGUF the trace was recorded on (gives the geometry); without one, the "
        "trace's layers and experts, each of --expert-bytes",
        "--expert-bytes EXPERT_BYTES without -m: bytes of one expert, e.g. 5M (default 1: the byte columns count "
        "misses)",
        "--store STORE expert store (gives the low-precision sizes; default: none)",
        "--budgets BUDGETS cache budgets in % of all experts' bytes, comma-separated (default: 10,25,50)",
        f"--policies POLICIES policies, comma-separated (default: all: {policies})",
        "--t1 T1 precision threshold t1 (default 1: all high)",
        "--t2 T2 precision threshold t2 (default 1: nothing skipped)",
        "--low-frac LOW_FRAC share of the budget for low slots (default: engine's)",
        "--weights WEIGHTS w_lru,w_lfu,w_lhu,w_fld of policy multi (default: equal)",
        "--sequences SEQUENCES replay only sequences A:B of the trace (from A up to B excluded, counted from 0; A: "
        "to the end), e.g. prompts held out from what a policy was tuned on (default: all)",
        "--tokens TOKENS replay only the first N tokens (after --sequences; default: all)",
        "--vram VRAM a VRAM tier over the cache of this % of the experts (the engine's tier code): its hits and the "
        "MB copied into it per token beside the cache's (default 0: none)",
        "-o OUTPUT, --output OUTPUT JSON report to write; OUT.md and OUT.png beside it",
        "-q, --quiet no progress bar",
    ):
        assert text in out, text


def test_trace_command_defaults_flags_and_help(
    moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "t.txt"
    text.write_text(LONG_PROMPT * 60)  # more than 4096 tokens of the tiny byte-level vocab
    assert rp.trace_main([str(moe), "--text", str(text), "-o", str(tmp_path / "tr"), "-t", "1"]) == 0
    tr = Trace.load(tmp_path / "tr.npz")
    # the defaults: 4096 tokens in sequences of 512
    assert tr.ids.shape[0] == 4096 and tr.seq_starts == tuple(range(0, 4096, 512))
    out = capsys.readouterr().out
    assert (
        out
        == f"moetier: wrote {tmp_path / 'tr.npz'}: 4096 tokens x 4 MoE layers x top-4 of 16, 8 sequences, 8 ubatches\n"
    )
    for missing in (["--text", str(text)], ["-o", str(tmp_path / "x")]):
        with pytest.raises(SystemExit):
            rp.trace_main([str(moe), *missing])
    assert "required" in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        rp.trace_main(["--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    for s in (
        "Record a MoE's routing on text (the stock model through llama.cpp): the experts and gate weights per token, "
        "layer and ubatch, in the .npz format moetier calibrate writes.",
        "model MoE GGUF",
        "--text TEXT [TEXT ...] text file(s) to route, concatenated",
        "-o OUTPUT, --output OUTPUT trace to write (.npz)",
        "--tokens TOKENS tokens to record (default: 4096)",
        "--seq-len SEQ_LEN tokens per sequence; each starts from an empty context (default: 512)",
        "-t THREADS, --threads THREADS compute threads (default: the machine's cores, at most 8)",
    ):
        assert s in helptext, s


def test_replay_cuts_tokens_and_counts_per_token(tmp_path: Path) -> None:
    ids = synthetic(5)
    path = shared_format(tmp_path / "real.npz", ids, [0, 120, 300])
    # two traces replayed one after another, cut to the first 150 tokens: 3 sequences start before it
    rep = rp.replay([path, path], None, [25.0], ["lru"], tokens=150, progress=False, expert_bytes=1000)
    assert rep["trace"] == f"{path}, {path}" and rep["tokens"] == 150
    cut = Trace(ids[:150], np.full((150, 4, 4), 0.25, np.float32), (1, 2, 3, 4), 16, (0, 120), tuple(range(150)))
    c = rp.replay_one(cut, rep["geometry"][0], "lru", 1.0, 1.0, W)
    (row,) = rep["rows"]
    assert row["n_misses"] == c["n_misses"] and row["n_bytes_read"] == c["n_bytes_read"] == 1000 * c["n_misses"]
    # the per-token figures
    assert row["misses_per_token"] == row["n_misses"] / 150
    assert row["mb_per_token"] == row["n_bytes_read"] / 150 / 1e6
    assert row["hit_rate"] == row["n_hits"] / row["n_lookups"] and row["n_lookups"] == 150 * 4 * 4
    # more tokens than the trace has: all of them
    assert rp.replay(path, None, [25.0], ["lru"], tokens=10_000, progress=False)["tokens"] == 300
    # a VRAM tier: its share is checked, its hits and copies counted per token
    v = rp.replay(path, None, [50.0], ["lru"], vram=25.0, progress=False, expert_bytes=1000)
    (vr,) = v["rows"]
    assert v["geometry"][0]["n_slots_vram"] == 16 and 0 < vr["n_vram_hits"] < vr["n_hits"]
    assert vr["vram_hit_rate"] == vr["n_vram_hits"] / vr["n_lookups"]
    assert vr["vram_mb_per_token"] == vr["n_vram_bytes"] / 300 / 1e6 > 0
    rp.replay(path, None, [50.0], ["lru"], vram=100.0, progress=False)  # the whole model is a share too
    for bad in (-1.0, 100.5):
        with pytest.raises(ConfigError) as e:
            rp.replay(path, None, [50.0], ["lru"], vram=bad, progress=False)
        assert str(e.value) == f"replay: vram={bad:g}: a share of the experts in [0, 100]"
    with pytest.raises(ConfigError) as e:
        rp.replay(path, None, [25.0], ["lru"], store=tmp_path, progress=False)
    assert str(e.value) == "replay: a store and mixed precision need the model (-m) for their sizes"


def test_replay_with_a_store_sizes_both_pools(moe: Path, tmp_path: Path) -> None:
    from moetier import PackConfig, pack

    store = pack(moe, tmp_path / "s", PackConfig(low_type="q4_0"), progress=False)
    tr = record_trace(moe, LONG_PROMPT, CalibrateConfig(tokens=40, seq_len=40))
    tr.save(tmp_path / "t.npz")
    rep = rp.replay(
        tmp_path / "t.npz", moe, [50.0], ["lru"], store=store, t1=0.1, t2=1.0, low_frac=0.25, progress=False
    )
    geo = rep["geometry"][0]
    info = Model(moe, store=store, cache=CacheConfig(budget=geo["budget_bytes"], t1=0.1, low_frac=0.25)).cache_info()
    n = int(info["n_layers"]) * int(info["n_expert"])
    assert geo["n_slots_low"] == int(info["n_slots_low"]) > 0
    assert geo["bytes_low"] == int(info["expert_bytes_low"]) // n > 0
    assert geo["bytes_high"] == int(info["expert_bytes"]) // n > geo["bytes_low"]
    assert rep["rows"][0]["n_loads_low"] > 0 and rep["store"] == str(store) and rep["low_frac"] == 0.25


def test_replay_command_passes_each_flag_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = shared_format(tmp_path / "real.npz", synthetic(5), [0, 120, 300])
    out = tmp_path / "r.json"
    argv = [str(path), str(path), "--budgets", "0.5,25", "--policies", "lru", "--tokens", "350"]
    argv += ["--sequences", "1:", "-q", "-o", str(out)]
    assert rp.replay_main(argv) == 0
    rep = json.loads(out.read_text())
    # two traces, sequences 1 on (180 + 300 tokens), cut to 350; a budget under 1% is a budget
    assert rep["trace"] == f"{path}, {path}" and rep["sequences"] == [1, None] and rep["tokens"] == 350
    assert [g["pct"] for g in rep["geometry"]] == [0.5, 25.0]
    assert (tmp_path / "r.png").is_file()
    capsys.readouterr()
    # without matplotlib: no plot, and the summary does not list one
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert rp.replay_main([str(path), "--policies", "lru", "-q", "-o", str(tmp_path / "s.json")]) == 0
    assert capsys.readouterr().out.endswith(f"moetier: wrote {tmp_path / 's.json'}, {tmp_path / 's.md'}\n")
    assert not (tmp_path / "s.png").exists()


def test_replay_report_fields(moe: Path, tmp_path: Path) -> None:
    path = shared_format(tmp_path / "real.npz", synthetic(5), [0, 300])
    rep = rp.replay(path, None, [25.0], ["lru"], weights=[0.1, 0.2, 0.3, 0.4], progress=False, expert_bytes=7)
    assert (rep["model"], rep["expert_bytes"], rep["store"], rep["weights"]) == (None, 7, None, [0.1, 0.2, 0.3, 0.4])
    assert rep["rows"][0]["n_slots"] == rep["geometry"][0]["n_slots"]
    tr = record_trace(moe, LONG_PROMPT, CalibrateConfig(tokens=32, seq_len=32))
    tr.save(tmp_path / "t.npz")
    own = rp.replay(tmp_path / "t.npz", moe, [50.0], ["lru"], progress=False)
    assert (own["model"], own["expert_bytes"], own["store"]) == (str(moe), None, None)
    with pytest.raises(ConfigError) as e:
        rp.parse_sequences("1:2:3")
    assert str(e.value) == "--sequences: '1:2:3' is not a range A:B of sequence numbers (B may be left out)"
    assert rp.parse_sequences("2:") == (2, None) and rp.parse_sequences("0:4") == (0, 4)
