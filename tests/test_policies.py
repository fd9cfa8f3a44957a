"""Eviction policies on their own (the C++ code the cache runs): HOBBIT's priority (eq. 3) and its
four parts."""

from __future__ import annotations

import pytest

from moetier import _core


def _policy(name: str, n_slots: int, weights: list[float] | None = None) -> _core.Policy:
    return _core.Policy(name, n_slots, weights or [0.25, 0.25, 0.25, 0.25])


def test_lru_evicts_oldest() -> None:
    p = _policy("lru", 3)
    for tick, slot in ((1, 0), (2, 1), (3, 2)):
        p.set_clock(tick, 0, 1, 1, 0, 4)
        p.on_load(slot, 0, slot, True)
    p.set_clock(4, 0, 2, 2, 0, 4)
    p.on_hit(0, 0, 0, True)
    assert p.victim([0, 0, 0]) == 1
    assert p.victim([0, 1, 0]) == 2
    assert not p.across_layers


def test_lfu_counts_passes_of_the_sequence() -> None:
    p = _policy("lfu", 2)
    p.set_clock(1, 0, 1, 1, 0, 2)
    p.on_load(0, 0, 0, True)
    p.on_load(1, 0, 1, True)
    for pass_ in (2, 3):
        p.set_clock(pass_ * 2, 0, pass_, pass_, 0, 2)
        p.on_hit(1, 0, 1, True)
        p.on_hit(1, 0, 1, True)  # a second use in the same pass counts once
    assert p.victim([0, 0]) == 0
    # a new sequence forgets frequencies: ties go to the least recently used
    p.reset_sequence()
    p.set_clock(7, 7, 4, 1, 0, 2)
    assert p.victim([0, 0]) == 0
    p.on_hit(0, 0, 0, True)
    assert p.victim([0, 0]) == 1


def test_lhu_counts_high_precision_uses_only() -> None:
    p = _policy("lhu", 2)
    for pass_ in (1, 2, 3):
        p.set_clock(pass_, 0, pass_, pass_, 0, 2)
        if pass_ == 1:
            p.on_load(0, 0, 0, True)
            p.on_load(1, 0, 1, False)
        else:
            p.on_hit(0, 0, 0, True)
            p.on_hit(1, 0, 1, False)
    # same frequency, but slot 1 is a low-precision expert: LHU evicts it
    assert p.victim([0, 0]) == 1
    lfu = _policy("lfu", 2)
    lfu.set_clock(1, 0, 1, 1, 0, 2)
    lfu.on_load(1, 0, 1, False)
    lfu.set_clock(2, 0, 1, 1, 0, 2)
    lfu.on_load(0, 0, 0, True)
    assert lfu.victim([0, 0]) == 1  # same frequency: the least recently used


def test_fld_evicts_the_layer_that_just_ran() -> None:
    p = _policy("fld", 4)
    p.set_clock(1, 0, 1, 1, 0, 4)
    for slot, layer in enumerate((0, 1, 2, 3)):
        p.on_load(slot, layer, 0, True)
    # resolving layer 2: layer 1 ran last (distance 3 of 4), layer 3 runs next (distance 1)
    p.set_clock(2, 0, 1, 1, 2, 4)
    assert p.victim([0, 0, 0, 0]) == 1
    assert p.victim([0, 1, 0, 0]) == 0
    assert p.across_layers


def test_multi_priority_is_the_weighted_sum() -> None:
    # eq. 3 by hand for two slots of layer 0 while resolving layer 1 of 2 layers, 4 passes in:
    # slot 0: last use tick 2, used in 1 pass (high); slot 1: last use tick 8, 3 passes, low
    def build(w: list[float]) -> _core.Policy:
        p = _policy("multi", 2, w)
        p.set_clock(2, 0, 1, 1, 0, 2)
        p.on_load(0, 0, 0, True)
        p.on_load(1, 0, 1, False)
        for tick, pass_ in ((4, 2), (8, 3)):
            p.set_clock(tick, 0, pass_, pass_, 0, 2)
            p.on_hit(1, 0, 1, False)
        p.set_clock(10, 0, 4, 4, 1, 2)
        return p

    # p0 = lru 2/10 + lfu 1/4 + lhu 1/4 + fld (1 - 1/2); p1 = lru 8/10 + lfu 3/4 + lhu 0 + fld 1/2
    cases = {
        (1.0, 0.0, 0.0, 0.0): 0,  # 0.2 vs 0.8
        (0.0, 1.0, 0.0, 0.0): 0,  # 0.25 vs 0.75
        (0.0, 0.0, 1.0, 0.0): 1,  # 0.25 vs 0
        (0.1, 0.1, 0.8, 0.0): 1,  # 0.245 vs 0.155
        (0.25, 0.25, 0.25, 0.25): 0,  # 0.3 vs 0.5125
    }
    for w, victim in cases.items():
        assert build(list(w)).victim([0, 0]) == victim, w


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        _core.Policy("nope", 2, [0.25, 0.25, 0.25, 0.25])
    assert {"lru", "lfu", "lhu", "fld", "multi"} <= set(_core.policy_names())
