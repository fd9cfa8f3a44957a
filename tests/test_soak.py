"""Load under a memory cap, the short version of bench/soak.py: 8 streaming clients against
`moetier serve --parallel 4` in a cgroup v1 memory group, every answer checked against stock
llama-server's answers under the same load; and the checker itself on made-up replies."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from conftest import ModelFactory
from moetier import CacheConfig, Model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import cgroup
import soak

PROMPTS = [
    "The quick brown fox jumps over",
    "def fib(n):\n    return",
    "Sphinx of black quartz, judge",
    "In the Linux kernel, a memory cgroup",
    "Pack my box with five dozen",
    "import numpy as np\nx =",
    "Once upon a time, in a land",
    "SELECT name FROM users WHERE",
]


def _r(prompt: int, text: str, **kw: object) -> soak.Reply:
    return soak.Reply(client=0, prompt=prompt, text=text, finish=kw.pop("finish", "length"), **kw)  # type: ignore[arg-type]


def test_classify_counts_each_kind() -> None:
    ref = {0: ["alpha beta gamma", "alpha beta gamma"], 1: ["one two three"]}
    replies = [
        _r(0, "alpha beta gamma"),  # exact
        _r(0, "alpha beta delta"),  # drifted late: closest to its own prompt's answers
        _r(1, "alpha beta gamma"),  # prompt 0's answer delivered to prompt 1
        _r(1, "one two", finish=None),  # stream ended without a finish reason
        _r(1, "", finish=None, error="APIConnectionError: reset"),
    ]
    c = soak.classify(replies, ref)
    assert (c["exact"], c["diverged"], c["mixed"], c["lost"], c["checked"]) == (1, 1, 1, 2, 5)
    assert c["diverged_at_chars_median"] == len("alpha beta ")
    # against itself, a reply is not its own reference: the lone answer of prompt 1 has none
    replies = [_r(0, "a b"), _r(0, "a b"), _r(1, "x")]
    self_check = soak.classify(replies, {0: ["a b", "a b"], 1: ["x"]}, leave_one_out=True)
    assert (self_check["exact"], self_check["checked"]) == (2, 2)


def test_reference_adds_each_prompts_answer_alone() -> None:
    ref = soak.with_alone({0: ["a", "b"]}, ["c", "d"])
    assert ref == {0: ["a", "b", "c"], 1: ["d"]}
    assert soak.classify([_r(1, "d"), _r(0, "c")], ref)["exact"] == 2


def test_summary_percentiles_and_rate() -> None:
    replies = [_r(0, "x", latency=float(i), ttft=i / 10, chunks=4) for i in range(1, 101)]
    replies.append(_r(0, "", finish=None, error="boom", latency=1000.0, chunks=9))
    s = soak.summarize(replies, wall=10.0)
    assert (s["requests"], s["served"], s["generated_tokens"]) == (101, 100, 400)
    assert s["tok_s"] == 40.0 and s["latency_p50_s"] in (50.0, 51.0) and s["latency_p99_s"] == 99.0
    assert s["ttft_p99_s"] == pytest.approx(9.9)


def test_prompts_from_held_out_text_are_distinct_and_cut_at_spaces() -> None:
    text = " ".join(f"word{i}" for i in range(5000))
    ps = soak.prompts_from([text, text.upper()], 6, chars=80)
    assert len(ps) == 6 == len(set(ps))
    assert all(0 < len(p) <= 80 and not p.startswith(" ") and p.split()[0].lower().startswith("word") for p in ps)


@pytest.mark.skipif(not cgroup.available(), reason="needs a writable cgroup v1 memory controller")
def test_eight_clients_under_a_cap_lose_nothing(tiny_model: ModelFactory, tmp_path: Path) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    info = Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()
    a = argparse.Namespace(clients=8, n_predict=16)
    common = ["-m", str(path), "--parallel", "4", "-c", "1024", "-t", "2", "--metrics"]
    ref_replies, ref = soak.phase("stock", common, PROMPTS, a, tmp_path, None, 6.0)
    reference = soak.by_prompt(ref_replies)
    assert ref["served"] == ref["requests"] >= len(PROMPTS) and len(reference) == len(PROMPTS)
    assert len({t for ts in reference.values() for t in ts}) >= len(PROMPTS)  # the answers tell prompts apart

    cap = cgroup.MemoryCap(f"moetier-soak-test-{id(tmp_path)}", 768 << 20)
    try:
        cache = ["--cache", str(int(info["min_cache_bytes"])), "--cache-t1", "1", "--cache-t2", "1"]

        def memory(_: soak.ServerRun) -> dict[str, int]:
            return {"cgroup_peak_bytes": cap.max_usage(), "oom_kills": soak.oom_kills(cap)}

        replies, run = soak.phase("moetier", common + cache, PROMPTS, a, tmp_path, cap, 6.0, memory)
    finally:
        cap.close()
    check = soak.classify(replies, reference)
    assert run["requests"] >= len(PROMPTS) and check["checked"] == run["requests"]
    assert check["lost"] == 0 and check["mixed"] == 0, check["examples"]
    # on this model the answers are batch-invariant (test_server_openai), so drift would be a bug too
    assert check["exact"] == run["requests"], check["examples"]
    assert run["healthy_after"] and run["exited_during_run"] is None and run["oom_kills"] == 0
    assert 0 < run["cgroup_peak_bytes"] <= 768 << 20
    assert run["metrics"]["expert_cache_misses_total"] > 0
