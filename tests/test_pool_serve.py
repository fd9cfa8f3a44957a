"""The pool behind the OpenAI API, on real (tiny) GGUF models: answers equal each model's alone,
pipelines route by the answer, switches under a budget, bad input and failed loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from openai import InternalServerError, NotFoundError, OpenAI

from conftest import ModelFactory
from moetier import CacheConfig, ConfigError, Model, ModelError, pack
from moetier.config import ContextConfig
from moetier.pool import executor
from moetier.pool.executor import (
    DISK_BYTES_PER_SECOND,
    Pool,
    Work,
    _deliver,
    cache_bytes,
    drop_page_cache,
    estimate_cost,
    footprint,
    gguf_bytes,
    open_model,
    read_profile,
    rss_bytes,
)
from moetier.pool.sched import Cost, Scheduler
from moetier.pool.server import PoolService, make_server
from moetier.pool.spec import ModelSpec, Pipeline, PoolSpec, Stage, load_spec

PROMPTS = ["hello there", "the cat sat", "one two three", "abc def"]


def pool_yaml(tmp: Path, tiny_model: ModelFactory, budget_models: float, scheduler: str = "coserve") -> Path:
    dense = [tiny_model("qwen2", seed=s) for s in (1, 2, 3)]
    moe = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3, seed=4)
    store = tmp / "moe.experts"
    if not store.exists():
        pack(moe, store, progress=False)
    broken = tmp / "broken.gguf"
    broken.write_bytes(dense[0].read_bytes()[:4096])  # a GGUF header and nothing after it
    per = max(estimate_cost(load_spec_one(tmp, dense[0])).nbytes, 1)
    cfg = {
        "budget": int(per * budget_models),
        "executors": 1,
        "scheduler": scheduler,
        "models": {
            "d1": {"path": str(dense[0]), "n_ctx": 256},
            "d2": {"path": str(dense[1]), "n_ctx": 256},
            "d3": {"path": str(dense[2]), "n_ctx": 256},
            "moe": {"path": str(moe), "store": str(store), "cache": "50%", "n_ctx": 256},
            "broken": {"path": str(broken), "n_ctx": 256},
        },
        "pipelines": {
            "fixed": {"stages": {"a": {"model": "d1", "max_tokens": 4, "next": "b"}, "b": {"model": "moe"}}},
            "routed": {
                "first": "r",
                "stages": {
                    "r": {"model": "d2", "max_tokens": 4, "next": {"^$": "never", "default": "x"}},
                    "never": {"model": "d1"},
                    "x": {"model": "d3", "prompt": "{previous} | {input}"},
                },
            },
        },
    }
    p = tmp / f"pool-{scheduler}.json"
    p.write_text(json.dumps(cfg))
    return p


def load_spec_one(tmp: Path, model: Path) -> object:
    p = tmp / "one.json"
    p.write_text(json.dumps({"budget": "1G", "models": {"m": {"path": str(model), "n_ctx": 256}}}))
    return load_spec(p).models["m"]


def alone(path: Path, prompt: str, n: int, store: Path | None = None) -> str:
    cache = CacheConfig(budget="64M") if store else None
    m = Model(path, store=store, cache=cache, n_ctx=256, n_threads=1)
    try:
        return m.generate(prompt, max_tokens=n).text
    finally:
        m.close()


@pytest.fixture
def served(tmp_path: Path, tiny_model: ModelFactory) -> Iterator[tuple[OpenAI, Pool, Path]]:
    spec = load_spec(pool_yaml(tmp_path, tiny_model, budget_models=2.5))
    pool = Pool(spec)
    server = make_server(PoolService(spec, pool), "127.0.0.1", 0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    client = OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="none", max_retries=0)
    try:
        yield client, pool, spec.path
    finally:
        client.close()
        server.shutdown()
        server.server_close()
        pool.close()


def test_every_answer_equals_the_model_alone_under_interleaved_load(
    served: tuple[OpenAI, Pool, Path], tiny_model: ModelFactory
) -> None:
    client, pool, cfg = served
    spec = load_spec(cfg)
    names = ["d1", "d2", "d3", "moe"]
    want = {(m, p): alone(spec.models[m].path, p, 8, spec.models[m].store) for m in names for p in PROMPTS}
    jobs = [(names[(i * 7) % 4], PROMPTS[i % 4]) for i in range(24)]

    def ask(job: tuple[str, str]) -> tuple[str, str, str, str]:
        r = client.completions.create(model=job[0], prompt=job[1], max_tokens=8, temperature=0)
        return job[0], job[1], r.model, r.choices[0].text

    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(ask, jobs))
    for m, p, rm, text in got:
        assert rm == m
        assert text == want[(m, p)], (m, p)
    # four models, room for two: the pool switched, and never held more than its budget
    assert pool.sched.stats.loads >= 3
    assert sum(c.loads for c in pool.counters.values()) >= 3


def test_pipelines_route_by_rule_and_by_answer(served: tuple[OpenAI, Pool, Path]) -> None:
    client, _, cfg = served
    spec = load_spec(cfg)
    r = client.completions.create(model="fixed", prompt="hello there", max_tokens=6)
    first = alone(spec.models["d1"].path, "hello there", 4)
    assert r.choices[0].text == alone(spec.models["moe"].path, "hello there", 6, spec.models["moe"].store)
    stages = r.model_extra["moetier"]["stages"]  # type: ignore[index]
    assert [s["model"] for s in stages] == ["d1", "moe"]
    assert stages[0]["completion_tokens"] == len(Model(spec.models["d1"].path).tokenize(first, False)) or first
    r = client.completions.create(model="routed", prompt="the cat sat", max_tokens=5)
    routed_first = alone(spec.models["d2"].path, "the cat sat", 4)
    assert routed_first  # the pattern ^$ matches only an empty answer, so the default stage runs
    assert [s["model"] for s in r.model_extra["moetier"]["stages"]] == ["d2", "d3"]  # type: ignore[index]
    assert r.choices[0].text == alone(spec.models["d3"].path, f"{routed_first} | the cat sat", 5)


def test_chat_uses_the_models_template(served: tuple[OpenAI, Pool, Path]) -> None:
    client, _, cfg = served
    spec = load_spec(cfg)
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="d1", messages=msgs, max_tokens=6)  # type: ignore[arg-type]
    m = Model(spec.models["d1"].path, n_ctx=256, n_threads=1)
    assert r.choices[0].message.content == m.generate(m.chat_prompt([("user", "hi")]), max_tokens=6).text


def test_unknown_models_failed_loads_and_metrics(served: tuple[OpenAI, Pool, Path]) -> None:
    client, pool, _ = served
    with pytest.raises(NotFoundError, match="unknown model 'nope'; this pool serves: d1, d2"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(InternalServerError, match="broken"):
        client.completions.create(model="broken", prompt="x", max_tokens=2)
    # the failed load failed only its own request
    assert client.completions.create(model="d1", prompt="x", max_tokens=2).choices[0].text is not None
    ids = {m.id: m.model_extra["moetier"]["kind"] for m in client.models.list()}  # type: ignore[index]
    assert ids == {
        "d1": "model",
        "d2": "model",
        "d3": "model",
        "moe": "model",
        "broken": "model",
        "fixed": "pipeline",
        "routed": "pipeline",
    }
    base = str(client.base_url).removesuffix("/v1/")
    with urllib.request.urlopen(f"{base}/metrics") as resp:
        text = resp.read().decode()
    assert 'moetier_pool_model_load_failures_total{model="broken"} 1' in text
    assert 'moetier_pool_model_resident{model="d1"} 1' in text
    switches = int(re.search(r"^moetier_pool_switches_total (\d+)$", text, re.M).group(1))  # type: ignore[union-attr]
    loaded = int(re.search(r"^moetier_pool_loaded_bytes_total (\d+)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert switches == pool.sched.stats.loads and loaded == pool.sched.stats.bytes_loaded > 0
    assert pool.counters["broken"].failures == 1
    req = urllib.request.Request(f"{base}/v1/completions", b"{}", {"Content-Length": "x"})
    with pytest.raises(urllib.error.HTTPError, match="400"):
        urllib.request.urlopen(req)


def test_budget_and_config_errors(tmp_path: Path, tiny_model: ModelFactory) -> None:
    cfg = pool_yaml(tmp_path, tiny_model, budget_models=0.5)
    spec = load_spec(cfg)
    with pytest.raises(ConfigError) as e:
        Pool(spec)
    # the file and the line of the model (one JSON line holds the whole file)
    assert str(e.value).startswith(f"{cfg}:1: model d1: needs ")
    assert "bytes resident, more than one executor's share of the budget" in str(e.value)


def test_serve_pool_command(tmp_path: Path, tiny_model: ModelFactory) -> None:
    cfg = pool_yaml(tmp_path, tiny_model, budget_models=2.5, scheduler="fcfs-lru")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetier.cli", "serve-pool", str(cfg), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline() for _ in range(2)]
        assert "broken.gguf: cannot read" in lines[0]  # said at start; only its requests will fail
        line = lines[1]
        assert "scheduler fcfs-lru" in line, line
        port = int(line.rsplit(":", 1)[1])
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        spec = load_spec(cfg)
        with client:
            r = client.completions.create(model="d2", prompt="abc def", max_tokens=5)
        assert r.choices[0].text == alone(spec.models["d2"].path, "abc def", 5)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_serve_pool_stopped_answers_every_request(tmp_path: Path, tiny_model: ModelFactory) -> None:
    """SIGTERM (a service manager's stop) ends serve-pool with status 0 after the running batch; every
    request it holds gets an answer, the queued ones a 503 saying the pool is stopping, none a dropped
    connection (the process used to exit before its handler threads wrote those answers)."""
    # a model slow enough (about a second a request on one thread) that most requests wait in the queue
    slow = tiny_model("qwen2", n_embd=512, n_head=8, n_head_kv=8, n_ff_exp=1536, n_layer=8, seed=7)
    cfg = tmp_path / "pool.json"
    cfg.write_text(json.dumps({"budget": "2G", "models": {"slow": {"path": str(slow), "n_ctx": 256}}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetier.cli", "serve-pool", str(cfg), "--port", "0", "--no-profile"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "listening on" in line, line
        port = int(line.rsplit(":", 1)[1])

        def ask(i: int) -> tuple[int, str]:
            body = json.dumps({"model": "slow", "prompt": f"the cat sat on {i}", "max_tokens": 200}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body)
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    return resp.status, ""
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()
            except OSError as e:  # a dropped connection
                return -1, repr(e)

        def received() -> int:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
                m = re.search(r"^moetier_pool_requests_total (\d+)$", resp.read().decode(), re.M)
            assert m is not None
            return int(m.group(1))

        with ThreadPoolExecutor(12) as tp:
            futures = [tp.submit(ask, i) for i in range(12)]
            while received() < 12:  # every request is in the pool (running, queued or answered)
                time.sleep(0.01)
            proc.terminate()
            got = [f.result() for f in futures]
        assert proc.wait(timeout=60) == 0
        assert all(status in (200, 503) for status, _ in got), got
        stopped = [text for status, text in got if status == 503]
        assert stopped and all("the pool is shutting down; the request was not run" in t for t in stopped), got
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_drain_waits_for_the_answers_being_written() -> None:
    """The server counts the requests it is answering; drain() waits for them (a stopping server
    exits only after its last answers are written) and says how many are left when it gives up."""
    release = threading.Event()

    class Held:
        def names(self) -> list[dict[str, Any]]:
            return []

        def metrics(self) -> str:
            return ""

        def run(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
            release.wait(30)
            return {"ok": True}

    server = make_server(Held(), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    got: list[int] = []

    def post() -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/v1/completions", b"{}")
        with urllib.request.urlopen(req, timeout=30) as resp:
            got.append(resp.status)

    client = threading.Thread(target=post)
    try:
        assert server.drain(0.0) == 0
        client.start()
        wait_for(lambda: server.drain(0.0) == 1)  # the request is being answered
        t = time.monotonic()
        assert server.drain(0.2) == 1 and time.monotonic() - t >= 0.2
        threading.Timer(0.2, release.set).start()
        assert server.drain(10.0) == 0
        client.join(10)
        assert got == [200]
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_profile_command_measures_each_shape_once(tmp_path: Path, tiny_model: ModelFactory) -> None:
    cfg = pool_yaml(tmp_path, tiny_model, budget_models=2.5)
    data = json.loads(cfg.read_text())
    del data["models"]["broken"]
    cfg.write_text(json.dumps(data))
    out = tmp_path / "prof.json"
    usage = tmp_path / "usage.json"
    usage.write_text(json.dumps({"fixed": 3, "d3": 1}))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moetier.cli",
            "profile",
            str(cfg),
            "-o",
            str(out),
            "--usage",
            str(usage),
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    prof = json.loads(out.read_text())["models"]
    assert {m["profiled_as"] for m in prof.values()} == {"d1", "moe"}  # the three dense copies: one shape
    assert prof["d1"]["p"] == pytest.approx(3 / 7) and prof["moe"]["p"] == pytest.approx(3 / 7)
    assert prof["d2"]["p"] == 0 and prof["d3"]["p"] == pytest.approx(1 / 7)
    for m in prof.values():
        assert m["load"] > 0 and m["nbytes"] > 0 and m["k"] >= 0 and m["b"] >= 0 and m["k"] + m["b"] > 0
    data["profile"] = str(out)
    data["budget"] = "256M"  # what a process grows by is noisy at these sizes: room for all of them
    cfg.write_text(json.dumps(data))
    pool = Pool(load_spec(cfg))
    try:
        assert pool.costs["d2"].nbytes == prof["d2"]["nbytes"]
        assert pool.resident()  # the preload dealt the used models by their usage
    finally:
        pool.close()
    data["models"]["d2"]["n_ctx"] = 512  # the profile measured another context: stale
    cfg.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"d2 was profiled as .* run `moetier profile"):
        Pool(load_spec(cfg))
    data["models"]["d2"]["n_ctx"] = 256
    data["models"]["extra"] = data["models"]["d1"]
    cfg.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="no costs for extra; run `moetier profile"):
        Pool(load_spec(cfg))


def test_a_model_that_failed_to_load_does_not_evict_others_again(
    tmp_path: Path, tiny_model: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests for a model whose load just failed fail at once with that error, without evicting the
    resident models for a load that would fail the same way; when its file changes, or RETRY_LOAD_S after
    the failure, the next request tries the load again."""
    import dataclasses

    spec = load_spec(pool_yaml(tmp_path, tiny_model, budget_models=1.5))  # one model at a time
    pool = Pool(spec)
    with pool._cv:  # sized by its file (a header only), it would fit beside d1: make it as large as d1
        pool.sched.costs["broken"] = dataclasses.replace(pool.sched.costs["broken"], nbytes=pool.costs["d1"].nbytes)

    def ask(model: str) -> tuple[object, BaseException | None]:
        got: list[tuple[object, BaseException | None]] = []
        done = threading.Event()
        pool.submit(model, Work("x", None, 2, lambda a, e: (got.append((a, e)), done.set())))
        assert done.wait(60)
        return got[0]

    try:
        assert ask("d1")[1] is None
        _, e1 = ask("broken")  # loading it evicts d1, and fails
        assert e1 is not None and "broken.gguf" in str(e1)
        assert ask("d1")[1] is None
        loads = pool.counters["d1"].loads
        _, e2 = ask("broken")  # fails at once: d1 stays
        assert str(e2).startswith(f"{e1} (its load failed ")
        assert str(e2).endswith(" s ago; it is tried again 30 s after that, or as soon as its files change)")
        assert ask("d1")[1] is None and pool.counters["d1"].loads == loads
        assert pool.counters["d1"].unloads == 1  # by the first failed load only
        b = pool.counters["broken"]
        assert (b.load_failures, b.jobs, b.failures) == (1, 2, 2)
        broken = spec.models["broken"].path
        broken.write_bytes(broken.read_bytes() + b"x")  # the file changed: tried again
        _, e3 = ask("broken")
        assert e3 is not None and "its load failed" not in str(e3) and b.load_failures == 2
        monkeypatch.setattr(executor, "RETRY_LOAD_S", 0.0)  # and again once the wait is over
        ask("broken")
        assert b.load_failures == 3
    finally:
        pool.close()


def test_close_answers_what_is_still_queued(tmp_path: Path, tiny_model: ModelFactory) -> None:
    spec = load_spec(pool_yaml(tmp_path, tiny_model, budget_models=2.5))
    gate, loading = threading.Event(), threading.Event()

    def opener(m: ModelSpec, threads: int) -> Model:
        loading.set()
        gate.wait(30)
        return open_model(m, threads)

    pool = Pool(spec, opener=opener)
    got: list[tuple[str, object, BaseException | None]] = []
    for name in ("d1", "d2", "d3"):
        pool.submit(name, Work("x", None, 2, lambda a, e, n=name: got.append((n, a, e))))
    assert loading.wait(30)  # the executor has taken d1's batch
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.2)
    gate.set()
    closer.join(30)
    assert sorted(n for n, _, _ in got) == ["d1", "d2", "d3"]  # every request answered
    done = {n: (a, e) for n, a, e in got}
    assert done["d1"][0] is not None, done  # the running batch finished
    for n in ("d2", "d3"):
        assert isinstance(done[n][1], ModelError)
        assert str(done[n][1]) == "the pool is shutting down; the request was not run"
    assert pool.queue_depths() == {}  # nothing shows as queued after close


def test_a_field_inside_the_request_text_stays_text(served: tuple[OpenAI, Pool, Path]) -> None:
    client, _, cfg = served
    spec = load_spec(cfg)
    text = "say {previous} and {input}"
    r = client.completions.create(model="routed", prompt=text, max_tokens=5)
    first = alone(spec.models["d2"].path, text, 4)
    assert r.choices[0].text == alone(spec.models["d3"].path, f"{first} | {text}", 5)


def test_a_failing_callback_does_not_stop_the_executor(tmp_path: Path, tiny_model: ModelFactory) -> None:
    pool = Pool(load_spec(pool_yaml(tmp_path, tiny_model, budget_models=2.5)))
    got: list[str] = []
    done = threading.Event()

    def broken(a: object, e: BaseException | None) -> None:
        msg = "a bug in the caller"
        raise RuntimeError(msg)

    def ok(a: object, e: BaseException | None) -> None:
        got.append("answered" if a is not None else repr(e))
        done.set()

    try:
        pool.submit("d1", Work("x", None, 2, broken))
        pool.submit("d1", Work("y", None, 2, ok))
        assert done.wait(60) and got == ["answered"]
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("body", "chat", "status", "msg"),
    [
        ({"model": "zz", "prompt": "x"}, False, 404, "unknown model 'zz'; this pool serves: a, p"),
        ({"prompt": "x"}, False, 404, "unknown model None; this pool serves: a, p"),
        ({"model": "a", "prompt": "x", "max_tokens": 0}, False, 400, "max_tokens: 0 must be a positive integer"),
        ({"model": "a", "prompt": "x", "max_tokens": True}, False, 400, "max_tokens: True must be a positive integer"),
        ({"model": "a", "prompt": "x", "max_tokens": 2.0}, False, 400, "max_tokens: 2.0 must be a positive integer"),
        (
            {"model": "a", "prompt": "x", "max_completion_tokens": -1},
            False,
            400,
            "max_tokens: -1 must be a positive integer",
        ),
        ({"model": "a", "prompt": "x", "temperature": -0.5}, False, 400, "temperature: -0.5 must be a number >= 0"),
        ({"model": "a", "prompt": "x", "temperature": "1"}, False, 400, "temperature: '1' must be a number >= 0"),
        ({"model": "a", "prompt": "x", "temperature": False}, False, 400, "temperature: False must be a number >= 0"),
        ({"model": "a", "prompt": "x", "seed": 1.5}, False, 400, "seed: 1.5 must be an integer in [0, 4294967295]"),
        ({"model": "a", "prompt": "x", "seed": True}, False, 400, "seed: True must be an integer in [0, 4294967295]"),
        ({"model": "a", "prompt": "x", "seed": -1}, False, 400, "seed: -1 must be an integer in [0, 4294967295]"),
        (
            {"model": "a", "prompt": "x", "seed": 2**32},
            False,
            400,
            "seed: 4294967296 must be an integer in [0, 4294967295]",
        ),
        (
            {"model": "a", "prompt": "x", "max_tokens": 2**31},
            False,
            400,
            "max_tokens: 2147483648 must be a positive integer",
        ),
        ({"model": "a"}, False, 400, "prompt: a string is required"),
        ({"model": "a", "prompt": ["x", "y"]}, False, 400, "prompt: a string is required"),
        ({"model": "a", "prompt": ""}, False, 400, "prompt: an empty prompt has no tokens to continue"),
        ({"model": "a", "prompt": [""]}, False, 400, "prompt: an empty prompt has no tokens to continue"),
        ({"model": "a"}, True, 400, "messages: a non-empty list of {role, content} is required"),
        ({"model": "a", "messages": []}, True, 400, "messages: a non-empty list of {role, content} is required"),
        (
            {"model": "a", "messages": [{"role": "user"}]},
            True,
            400,
            "messages: each message needs a string role and a string content",
        ),
        (
            {"model": "a", "messages": ["hi"]},
            True,
            400,
            "messages: each message needs a string role and a string content",
        ),
        (
            {"model": "a", "messages": [{"role": 1, "content": "x"}]},
            True,
            400,
            "messages: each message needs a string role and a string content",
        ),
    ],
)
def test_bad_requests_get_their_status_and_message(body: dict[str, object], chat: bool, status: int, msg: str) -> None:
    from moetier.pool.server import RequestError, parse_request

    with pytest.raises(RequestError) as e:
        parse_request(body, chat, ["a", "p"], "this pool serves")
    assert (e.value.status, str(e.value)) == (status, msg)


def test_requests_are_read_field_by_field() -> None:
    from moetier.pool.server import Request, parse_request

    known, served = ["a"], "serves"
    assert parse_request({"model": "a", "prompt": "hi"}, False, known, served) == Request("a", "hi", None, None, 0.0, 0)
    assert parse_request(
        {"model": "a", "prompt": ["hi"], "max_tokens": 3, "temperature": 1, "seed": 7}, False, known, served
    ) == Request("a", "hi", None, 3, 1.0, 7)
    assert (
        parse_request({"model": "a", "prompt": "x", "max_completion_tokens": 5}, False, known, served).max_tokens == 5
    )
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]
    r = parse_request({"model": "a", "messages": msgs}, True, known, served)
    assert r == Request("a", "q1", [("system", "be brief"), ("user", "q1"), ("assistant", "a1")], None, 0.0, 0)
    only_system = parse_request({"model": "a", "messages": msgs[:1]}, True, known, served)
    assert only_system.text == "be brief"  # no user message: the last message's text


def test_models_list_and_metrics_say_everything(served: tuple[OpenAI, Pool, Path]) -> None:
    client, pool, _ = served
    client.completions.create(model="d1", prompt="x", max_tokens=2)
    with pytest.raises(NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)  # a bad request: not counted
    with pytest.raises(InternalServerError):
        client.completions.create(model="broken", prompt="x", max_tokens=2)  # failed in the pool
    listed = [m.model_dump() for m in client.models.list()]
    by_id = {m["id"]: m for m in listed}
    assert [m["id"] for m in listed] == ["d1", "d2", "d3", "moe", "broken", "fixed", "routed"]
    assert all(m["object"] == "model" and m["owned_by"] == "moetier" for m in listed)
    assert by_id["d1"]["moetier"] == {"kind": "model", "resident": True}
    assert by_id["d2"]["moetier"] == {"kind": "model", "resident": "d2" in pool.resident()}
    assert by_id["routed"]["moetier"] == {
        "kind": "pipeline",
        "stages": [{"stage": "r", "model": "d2"}, {"stage": "never", "model": "d1"}, {"stage": "x", "model": "d3"}],
    }
    base = str(client.base_url).removesuffix("/v1/")
    with urllib.request.urlopen(f"{base}/metrics") as resp:
        text = resp.read().decode()
    assert text.endswith("\n")
    values = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            values[k] = float(v)
    assert values["moetier_pool_budget_bytes"] == pool.spec.budget
    assert values["moetier_pool_resident_bytes"] == pool.resident_bytes() > 0
    assert values["moetier_pool_rss_bytes"] > values["moetier_pool_resident_bytes"] / 100
    assert values["moetier_pool_switches_total"] == pool.sched.stats.loads
    assert values["moetier_pool_loaded_bytes_total"] == pool.sched.stats.bytes_loaded
    assert values["moetier_pool_requests_total"] == 2 and values['moetier_pool_requests_total{outcome="failed"}'] == 1
    assert values["moetier_pool_scheduler_seconds_total"] >= 0
    assert values['moetier_pool_executor_busy_seconds_total{executor="0"}'] > 0
    for m, c in pool.counters.items():
        assert values[f'moetier_pool_model_resident{{model="{m}"}}'] == (1 if m in pool.resident() else 0)
        assert values[f'moetier_pool_model_queue_depth{{model="{m}"}}'] == 0
        assert values[f'moetier_pool_model_loads_total{{model="{m}"}}'] == c.loads
        assert values[f'moetier_pool_model_load_seconds_total{{model="{m}"}}'] == round(c.load_seconds, 6)
        assert values[f'moetier_pool_model_unloads_total{{model="{m}"}}'] == c.unloads
        assert values[f'moetier_pool_model_load_failures_total{{model="{m}"}}'] == c.load_failures
        assert values[f'moetier_pool_model_jobs_total{{model="{m}"}}'] == c.jobs
        assert values[f'moetier_pool_model_job_failures_total{{model="{m}"}}'] == c.failures
    assert pool.counters["d1"].jobs == 1 and pool.counters["d1"].loads >= 1
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert types == [
        "# TYPE moetier_pool_budget_bytes gauge",
        "# TYPE moetier_pool_resident_bytes gauge",
        "# TYPE moetier_pool_rss_bytes gauge",
        "# TYPE moetier_pool_switches_total counter",
        "# TYPE moetier_pool_loaded_bytes_total counter",
        "# TYPE moetier_pool_requests_total counter",
        "# TYPE moetier_pool_scheduler_seconds_total counter",
        "# TYPE moetier_pool_executor_busy_seconds_total counter",
        "# TYPE moetier_pool_model_resident gauge",
        "# TYPE moetier_pool_model_queue_depth gauge",
        "# TYPE moetier_pool_model_loads_total counter",
        "# TYPE moetier_pool_model_load_seconds_total counter",
        "# TYPE moetier_pool_model_unloads_total counter",
        "# TYPE moetier_pool_model_load_failures_total counter",
        "# TYPE moetier_pool_model_jobs_total counter",
        "# TYPE moetier_pool_model_job_failures_total counter",
    ]
    helps = [line.split(" ", 3)[2] for line in text.splitlines() if line.startswith("# HELP")]
    assert helps == [t.split()[2] for t in types[:7]]  # every pool-wide series says what it counts


def _post(base: str, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(f"{base}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_responses_carry_openais_fields_and_each_stages_account(served: tuple[OpenAI, Pool, Path]) -> None:
    client, _, _ = served
    base = str(client.base_url).removesuffix("/v1/")
    status, r = _post(base, "/v1/completions", {"model": "d1", "prompt": "the cat"})
    assert status == 200 and r["object"] == "text_completion" and r["model"] == "d1"
    assert str(r["id"]).startswith("moetier-") and len(str(r["id"])) == len("moetier-") + 16
    assert abs(int(r["created"]) - time.time()) < 60  # type: ignore[call-overload]
    (choice,) = r["choices"]  # type: ignore[misc]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")
    usage = r["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]  # type: ignore[index]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 16  # type: ignore[index]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 16  # type: ignore[index]  # OpenAI's default for a completion
    (stage,) = r["moetier"]["stages"]  # type: ignore[index]
    assert set(stage) == {"stage", "model", "executor", "queued_s", "load_s", "run_s", "completion_tokens"}
    assert (stage["stage"], stage["model"], stage["executor"]) == ("d1", "d1", 0)
    assert stage["completion_tokens"] == usage["completion_tokens"]  # type: ignore[index]
    assert r["moetier"]["seconds"] >= stage["run_s"] > 0  # type: ignore[index]
    # a pipeline in a chat: each stage's account, the last stage's answer; later stages get the user turn
    status, r = _post(
        base,
        "/v1/chat/completions",
        {"model": "fixed", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert status == 200 and r["object"] == "chat.completion" and r["model"] == "fixed"
    (choice,) = r["choices"]  # type: ignore[misc]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert [(s["stage"], s["model"]) for s in r["moetier"]["stages"]] == [("a", "d1"), ("b", "moe")]  # type: ignore[index]
    assert r["moetier"]["stages"][0]["completion_tokens"] <= 4  # type: ignore[index]  # the stage's own cap
    # a failure in the pool: 500 with the model's error, the request's own name in it
    status, r = _post(base, "/v1/completions", {"model": "broken", "prompt": "x", "max_tokens": 2})
    assert status == 500 and "broken.gguf" in r["error"]["message"]  # type: ignore[index]


def _raw(base: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple:
    import http.client

    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body, headers or {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type"), resp.read()
    finally:
        conn.close()


def test_the_http_surface_answers_every_path_and_error_as_openai_does(served: tuple[OpenAI, Pool, Path]) -> None:
    client, _, _ = served
    base = str(client.base_url).removesuffix("/v1/")
    for path in ("/v1/models", "/models?x=1"):
        status, ctype, body = _raw(base, "GET", path)
        listed = json.loads(body)
        assert (status, ctype, listed["object"], len(listed["data"])) == (200, "application/json", "list", 7)
    assert _raw(base, "GET", "/health?verbose=1") == (200, "application/json", b'{"status": "ok"}')
    status, ctype, _ = _raw(base, "GET", "/metrics")
    assert (status, ctype) == (200, "text/plain; version=0.0.4")

    def error(status: int, message: str) -> tuple[int, str, dict[str, object]]:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return status, "application/json", {"error": {"message": message, "type": kind, "code": status}}

    def call(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple:
        status, ctype, raw = _raw(base, method, path, body, headers)
        return status, ctype, json.loads(raw)

    assert call("GET", "/v2/x?y") == error(404, "no such endpoint: /v2/x")
    assert call("POST", "/v1/embeddings", b"{}") == error(404, "no such endpoint: /v1/embeddings")
    assert call("POST", "/v1/completions", b"[1]") == error(400, "the request body must be a JSON object")
    assert call("POST", "/v1/completions", b'{"model": "d1", "prompt": "x", "stream": true}') == error(
        400, "stream: streaming is not supported by this server; send stream=false"
    )
    assert call("POST", "/v1/completions", b"{}") == error(
        404,
        "unknown model None; this pool serves: " + ", ".join(["d1", "d2", "d3", "moe", "broken", "fixed", "routed"]),
    )
    status, _, bad = call("POST", "/v1/completions", b"{x")
    assert status == 400 and bad["error"]["message"].startswith("the request body is not JSON: ")
    headers = {"Content-Type": "application/json", "Content-Length": "lots"}
    assert call("POST", "/v1/completions", b"", headers) == error(
        400, "Content-Length: 'lots' is not a number of bytes"
    )
    failed = call("POST", "/completions", b'{"model": "broken", "prompt": "x", "max_tokens": 2}')
    assert failed[0] == 500 and failed[2]["error"]["type"] == "server_error" and failed[2]["error"]["code"] == 500
    # the endpoints' short names: a completion and a chat
    ok = call("POST", "/completions", b'{"model": "d1", "prompt": "x", "max_tokens": 2}')
    assert ok[:2] == (200, "application/json") and ok[2]["object"] == "text_completion"
    chat = b'{"model": "d1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}'
    ok = call("POST", "/chat/completions", chat)
    assert ok[0] == 200 and ok[2]["object"] == "chat.completion"


# -- the executor module, in-process: sizes from the GGUF, the profile reader, and the pool's threads --------------


def test_the_expert_cache_is_a_share_or_a_size_and_nothing_without_a_store() -> None:
    """The expert cache is 0 without a store, else a share (rounded down) or a size; bad values name the setting."""
    store = Path("m.experts")
    assert cache_bytes(ModelSpec("m", Path("m.gguf"), cache="50%"), 1000) == 0
    assert cache_bytes(ModelSpec("m", Path("m.gguf"), store, "25%"), 1000) == 250
    assert cache_bytes(ModelSpec("m", Path("m.gguf"), store, "100%"), 1000) == 1000
    assert cache_bytes(ModelSpec("m", Path("m.gguf"), store, "12.55%"), 1000) == 125
    assert cache_bytes(ModelSpec("m", Path("m.gguf"), store, "0.1%"), 1000) == 1
    assert cache_bytes(ModelSpec("m", Path("m.gguf"), store, "3M"), 1000) == 3 << 20
    assert cache_bytes(ModelSpec("m", Path("m.gguf"), store, "4096"), 1000) == 4096
    cases = [
        ("half%", "models.m.cache: 'half%' is not a share; use e.g. 25%"),
        ("0%", "models.m.cache: '0%' must be above 0% and at most 100%"),
        ("-5%", "models.m.cache: '-5%' must be above 0% and at most 100%"),
        ("100.5%", "models.m.cache: '100.5%' must be above 0% and at most 100%"),
        ("lots", "models.m.cache: 'lots' is not a size; use e.g. 512M"),
    ]
    for cache, msg in cases:
        with pytest.raises(ConfigError) as e:
            cache_bytes(ModelSpec("m", Path("m.gguf"), store, cache), 1000)
        assert str(e.value) == msg


def test_gguf_sizes_split_dense_and_expert_tensors_and_read_the_hyperparameters(
    tiny_model: ModelFactory, tmp_path: Path
) -> None:
    """gguf_bytes matches the GGUF reader's bytes, experts apart, and rereads a file whose size or time changed."""
    from gguf import GGUFReader

    moe = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3, seed=4)
    tensors = GGUFReader(str(moe)).tensors
    expert = sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
    total = sum(int(t.n_bytes) for t in tensors)
    assert 0 < expert < total
    hp = {
        "arch": "qwen2moe",
        "n_layer": 3,
        "n_embd": 64,
        "n_head": 4,
        "n_head_kv": 2,
        "k_dim": 16,
        "v_dim": 16,
        "n_vocab": 128,
    }
    assert gguf_bytes(ModelSpec("m", moe)) == (total - expert, expert, hp)
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_model("qwen2", seed=1).read_bytes())
    dense = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    assert gguf_bytes(ModelSpec("m", path)) == (dense, 0, {**hp, "arch": "qwen2", "n_layer": 2})
    # a file of the same size changed later, then one of another size with the same time: both are read again
    mtime = path.stat().st_mtime_ns
    path.write_bytes(tiny_model("qwen2", n_head=8, n_head_kv=4, seed=1).read_bytes())
    os.utime(path, ns=(mtime, mtime + 10**9))
    assert path.stat().st_size == tiny_model("qwen2", seed=1).stat().st_size
    assert gguf_bytes(ModelSpec("m", path))[2]["n_head"] == 8
    path.write_bytes(tiny_model("qwen2", n_layer=3, seed=1).read_bytes())
    os.utime(path, ns=(mtime, mtime + 10**9))
    assert gguf_bytes(ModelSpec("m", path))[2]["n_layer"] == 3


def test_a_gguf_without_hyperparameters_is_sized_with_their_defaults(tmp_path: Path) -> None:
    """A GGUF missing hyperparameter keys gets no layers, width 0, one head, KV heads = heads, architecture ''."""
    import numpy as np
    from gguf import GGUFWriter

    def write(name: str, heads: int | None, arch: bool = True) -> Path:
        path = tmp_path / name
        w = GGUFWriter(str(path), "bare")
        if not arch:
            del w.kv_data[0]["general.architecture"]
        if heads is not None:
            w.add_uint32("bare.attention.head_count", heads)
        w.add_tensor("token_embd.weight", np.zeros((5, 4), dtype=np.float32))  # 5 tokens of width 4
        w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((2, 3, 4), dtype=np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    bare = ModelSpec("m", write("bare.gguf", None), n_ctx=64)
    hp = {"arch": "bare", "n_layer": 0, "n_embd": 0, "n_head": 1, "n_head_kv": 1, "k_dim": 0, "v_dim": 0, "n_vocab": 5}
    assert gguf_bytes(bare) == (5 * 4 * 4, 2 * 3 * 4 * 2, hp)
    assert footprint(bare) == (80 + 48, 0, 4 * 64 * 5 + 4 * 64 * 256 * 1)  # 64 positions make 256 KV cells
    assert gguf_bytes(ModelSpec("m", write("heads.gguf", 4)))[2] == {**hp, "n_head": 4, "n_head_kv": 4}
    assert gguf_bytes(ModelSpec("m", write("anon.gguf", None, arch=False)))[2] == {**hp, "arch": ""}


def test_footprint_reads_head_sizes_and_per_layer_counts(tmp_path: Path) -> None:
    """Heads wider than n_embd / n_head (Qwen3-30B-A3B: key_length 128 against 2048 / 32) size the KV
    cache; a count given per layer (an array) counts at its largest."""
    import numpy as np
    from gguf import GGUFValueType, GGUFWriter

    def write(name: str, **keys: int | list[int]) -> Path:
        path = tmp_path / name
        w = GGUFWriter(str(path), "qwen3moe")
        w.add_uint32("qwen3moe.block_count", 2)
        w.add_uint32("qwen3moe.embedding_length", 2048)
        w.add_uint32("qwen3moe.attention.head_count", 32)
        for k, v in keys.items():
            if isinstance(v, list):
                w.add_key_value(f"qwen3moe.attention.{k}", v, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
            else:
                w.add_uint32(f"qwen3moe.attention.{k}", v)
        w.add_tensor("token_embd.weight", np.zeros((5, 4), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    plain = gguf_bytes(ModelSpec("m", write("plain.gguf", head_count_kv=4)))[2]
    assert (plain["n_head_kv"], plain["k_dim"], plain["v_dim"]) == (4, 64, 64)
    wide = ModelSpec("m", write("wide.gguf", head_count_kv=4, key_length=128, value_length=96), n_ctx=256)
    hp = gguf_bytes(wide)[2]
    assert (hp["k_dim"], hp["v_dim"]) == (128, 96)
    assert footprint(wide)[1] == 2 * 256 * 4 * (128 + 96) * 2  # layers, cells, KV heads, K + V widths, f16
    per_layer = gguf_bytes(ModelSpec("m", write("layers.gguf", head_count_kv=[2, 8])))[2]
    assert per_layer["n_head_kv"] == 8 and per_layer["n_head"] == 32


def test_footprint_and_estimate_follow_the_context_and_the_cache(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """Footprint and estimate: weights (or dense + cache), f16 KV per position, compute over a ubatch <= 512."""
    dense = tiny_model("qwen2", seed=1)
    d_bytes, _, _ = gguf_bytes(ModelSpec("d", dense))
    head_dim = 64 // 4
    m = ModelSpec("d", dense, n_ctx=256, max_batch=3)
    kv, compute = 2 * 2 * 256 * 2 * head_dim * 2, 4 * 256 * (128 + 8 * 64) + 4 * 256 * 256 * 4
    assert footprint(m) == (d_bytes, kv, compute)
    c = estimate_cost(m)
    assert c == Cost(k=0.05, b=0.01, load=d_bytes / 300e6, nbytes=d_bytes + kv + compute, max_batch=3, p=0.0)
    assert DISK_BYTES_PER_SECOND == 300e6
    big = ModelSpec("d", dense, n_ctx=1024)
    assert footprint(big) == (d_bytes, 4 * kv, 4 * 512 * (128 + 8 * 64) + 4 * 512 * 1024 * 4)  # ubatch capped at 512
    # llama.cpp makes a multiple of 256 KV cells: a context of 300 takes 512
    odd = ModelSpec("d", dense, n_ctx=300)
    assert footprint(odd) == (d_bytes, 2 * kv, 4 * 300 * (128 + 8 * 64) + 4 * 300 * 512 * 4)
    moe = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3, seed=4)
    store = tmp_path / "moe.experts"
    store.mkdir()
    m_dense, m_expert, _ = gguf_bytes(ModelSpec("m", moe))
    assert footprint(ModelSpec("m", moe, n_ctx=256))[0] == m_dense + m_expert  # no store: every expert loads
    assert footprint(ModelSpec("m", moe, store, "50%", n_ctx=256))[0] == m_dense + m_expert // 2
    assert footprint(ModelSpec("m", moe, store, "1M", n_ctx=256))[0] == m_dense + (1 << 20)


def profile_row(m: ModelSpec, **kw: object) -> dict[str, object]:
    return {"path": str(m.path), "shape": m.shape(), "k": 0.1, "b": 0.2, "load": 0.3, "nbytes": 1000, **kw}


def test_read_profile_takes_each_models_costs_and_the_pools_max_batch(tmp_path: Path) -> None:
    """read_profile takes costs from the file and max_batch from the pool, skips unknown rows, keeps pool order."""
    for n in ("a", "b"):
        (tmp_path / f"{n}.gguf").write_bytes(b"GGUF")
    ms = {n: ModelSpec(n, tmp_path / f"{n}.gguf", max_batch=i + 2) for i, n in enumerate(("b", "a"))}
    spec = PoolSpec(tmp_path / "pool.yaml", 1 << 30, ms)
    rows = {
        "gone": {"path": "x"},
        "a": profile_row(ms["a"], max_batch=99, p=1),
        "b": profile_row(ms["b"], k=0, b=0, load=0, nbytes=1),
    }
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"models": rows}))
    got = read_profile(path, spec)
    assert list(got) == ["b", "a"]
    assert got["a"] == Cost(k=0.1, b=0.2, load=0.3, nbytes=1000, max_batch=3, p=1.0)
    assert got["b"] == Cost(k=0.0, b=0.0, load=0.0, nbytes=1, max_batch=2, p=0.0)
    rows["b"]["p"] = 0
    path.write_text(json.dumps({"models": rows}))
    assert read_profile(path, spec)["b"].p == 0.0
    # measured with the pool's threads (1), or not saying: taken; with other threads: stale
    path.write_text(json.dumps({"threads": 1, "models": rows}))
    assert read_profile(path, spec)["a"].k == 0.1
    path.write_text(json.dumps({"threads": 4, "models": rows}))
    with pytest.raises(ConfigError) as e:
        read_profile(path, spec)
    assert str(e.value) == (
        f"{path}: measured with 4 threads per executor, the pool runs 1; its times do not hold: run "
        f"`moetier profile {spec.path}` again (or serve without the profile)"
    )


def test_read_profile_refuses_costs_out_of_range_with_the_model_and_its_costs(tmp_path: Path) -> None:
    """read_profile refuses no bytes, negative or infinite times and shares outside 0..1, naming model and costs."""
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    m = ModelSpec("a", tmp_path / "a.gguf")
    spec = PoolSpec(tmp_path / "pool.yaml", 1 << 30, {"a": m})
    path = tmp_path / "p.json"
    for bad in ({"nbytes": 0}, {"k": -0.1}, {"b": -1}, {"load": float("inf")}, {"load": float("nan")}, {"p": 1.5},
                {"p": -0.1}):  # fmt: skip
        row = profile_row(m, **bad)
        path.write_text(json.dumps({"models": {"a": row}}))
        c = Cost(float(row["k"]), float(row["b"]), float(row["load"]), int(row["nbytes"]), 4, float(row.get("p", 0)))
        with pytest.raises(ConfigError) as e:
            read_profile(path, spec)
        assert str(e.value) == f"{path}: a: costs out of range ({c}); run `moetier profile {spec.path}` again", bad


def test_read_profile_errors_name_the_file_and_what_to_do(tmp_path: Path) -> None:
    """read_profile's messages for a missing file, bad JSON, a missing field, a stale shape and a missing model."""
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    ms = {n: ModelSpec(n, tmp_path / f"{n}.gguf") for n in ("a", "b", "c")}
    spec = PoolSpec(tmp_path / "pool.yaml", 1 << 30, {n: ms[n] for n in ("a", "b")})
    path = tmp_path / "p.json"

    def error() -> str:
        with pytest.raises(ConfigError) as e:
            read_profile(path, spec)
        return str(e.value)

    assert error() == f"{path}: cannot read the profile: No such file or directory"
    path.write_text("{not json")
    assert error().startswith(f"{path}: not a profile written by `moetier profile` (JSONDecodeError(")
    assert error().endswith("); run it again")
    row = profile_row(ms["a"])
    del row["load"]
    path.write_text(json.dumps({"models": {"a": row}}))
    assert error() == f"{path}: not a profile written by `moetier profile` (KeyError('load')); run it again"
    path.write_text(json.dumps({"models": {"a": profile_row(ms["a"], shape=[1, False, "", 512])}}))
    stale = (
        f"{path}: a was profiled as {ms['a'].path} [1, False, '', 512], it is {ms['a'].path} {ms['a'].shape()} now; "
        f"run `moetier profile {spec.path}` again"
    )
    assert error() == stale
    path.write_text(json.dumps({"models": {"a": profile_row(ms["a"], path="/elsewhere/a.gguf")}}))
    assert error().startswith(f"{path}: a was profiled as /elsewhere/a.gguf {ms['a'].shape()}, it is {ms['a'].path} ")
    # "models" not an object, a size JSON allows but no integer holds: not a profile, no traceback
    path.write_text(json.dumps({"models": []}))
    assert error().startswith(f"{path}: not a profile written by `moetier profile` (AttributeError(")
    row = profile_row(ms["a"])
    path.write_text(json.dumps({"models": {"a": {**row, "nbytes": float("inf")}}}))
    assert error().startswith(f"{path}: not a profile written by `moetier profile` (OverflowError(")
    path.write_text(json.dumps({"models": {}}))
    spec = PoolSpec(tmp_path / "pool.yaml", 1 << 30, {n: ms[n] for n in ("b", "a")})
    assert error() == f"{path}: no costs for a, b; run `moetier profile {spec.path}` again"


def test_resident_memory_is_procs_resident_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """rss_bytes is the resident (not virtual) size from /proc/self/statm, and 0 when /proc cannot be read."""
    page = os.sysconf("SC_PAGE_SIZE")
    size, resident = (int(x) * page for x in Path("/proc/self/statm").read_text().split()[:2])
    got = rss_bytes()
    assert abs(got - resident) < 32 << 20 and abs(got - resident) < abs(got - size)

    def no_proc(*a: object, **k: object) -> object:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(executor, "open", no_proc, raising=False)
    assert rss_bytes() == 0


def test_dropping_a_files_pages_advises_the_whole_file_and_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drop_page_cache advises DONTNEED on the whole file and closes it even on error; a missing file is skipped."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 8192)
    calls: list[tuple[int, int, int, int]] = []
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append((fd, offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    assert drop_page_cache(f) is None
    ((fd, offset, length, advice),) = calls
    assert (offset, length, advice) == (0, 0, os.POSIX_FADV_DONTNEED)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    assert drop_page_cache(tmp_path / "gone.gguf") is None

    def refuse(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append((fd, offset, length, advice))
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    with pytest.raises(OSError, match="Invalid argument"):
        drop_page_cache(f)
    with pytest.raises(OSError):
        os.fstat(calls[-1][0])


def test_a_callback_that_raises_is_reported_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """A job's callback gets the answer and error; an exception from it is written to stderr, not raised."""
    seen: list[tuple[object, object]] = []
    err = ModelError("boom")
    _deliver(Work("x", None, 1, lambda a, e: seen.append((a, e))), None, err)
    assert seen == [(None, err)]

    def broken(a: object, e: object) -> None:
        msg = "a bug in the caller"
        raise RuntimeError(msg)

    _deliver(Work("x", None, 1, broken), None, None)
    assert capsys.readouterr().err == "moetier pool: a request's callback failed: RuntimeError: a bug in the caller\n"


def test_open_model_gives_the_context_threads_and_cache_the_spec_says(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """open_model sets n_ctx, threads and batches of at most 512; a MoE with a store gets a fixed cache of its share."""
    dense = tiny_model("qwen2", seed=1)
    m = open_model(ModelSpec("d", dense, n_ctx=256), 2)
    assert m.context == ContextConfig(n_ctx=256, n_threads=2, n_batch=256, n_ubatch=256)
    assert m.cache is None and m.store is None
    m.close()
    m = open_model(ModelSpec("d", dense, n_ctx=1024), 1)
    assert (m.context.n_ctx, m.context.n_threads, m.context.n_batch, m.context.n_ubatch) == (1024, 1, 512, 512)
    m.close()
    moe = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3, seed=4)
    store = tmp_path / "moe.experts"
    pack(moe, store, progress=False)
    spec = ModelSpec("m", moe, store, "50%", n_ctx=256)
    m = open_model(spec, 1)
    _, expert, _ = gguf_bytes(spec)
    assert m.cache is not None and m.store == store
    assert (m.cache.budget, m.cache.grow) == (expert // 2, 0)
    m.close()


class Spy:
    """A real model, as the pool opened it, that records its close; faults can be switched on: generate
    returning an answer with no tokens, close raising."""

    def __init__(self, m: Model, broken: bool, close_error: Exception | None) -> None:
        self.m, self.broken, self.close_error = m, broken, close_error
        self.closed = False

    def generate(self, prompt: str, **kw: Any) -> object:
        r = self.m.generate(prompt, **kw)
        return object() if self.broken else r

    def chat_prompt(self, messages: list[tuple[str, str]]) -> str:
        return self.m.chat_prompt(messages)

    def close(self) -> None:
        self.closed = True
        self.m.close()
        if self.close_error is not None:
            raise self.close_error


class Opener:
    """open_model with a record of each load (model, threads); the next `fail` loads raise, a load waits
    for `gate` when one is set, and each load takes at least `delay` seconds."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, int]] = []
        self.models: dict[str, list[Spy]] = {}
        self.fail = 0
        self.delay = 0.0
        self.gate: threading.Event | None = None
        self.loading = threading.Event()
        self.broken = False
        self.close_error: Exception | None = None

    def __call__(self, m: ModelSpec, threads: int) -> Spy:
        self.loads.append((m.name, threads))
        self.loading.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.fail:
            self.fail -= 1
            msg = f"{m.name}: cannot load (a test's fault)"
            raise ModelError(msg)
        time.sleep(self.delay)
        spy = Spy(open_model(m, threads), self.broken, self.close_error)
        self.models.setdefault(m.name, []).append(spy)
        return spy


def small_pool(
    tmp: Path,
    tiny_model: ModelFactory,
    names: tuple[str, ...] = ("d",),
    budget: int = 1 << 30,
    executors: int = 1,
    scheduler: str = "coserve",
    costs: dict[str, Cost] | None = None,
    opener: Opener | None = None,
) -> Pool:
    """A pool of tiny dense models (seeds 1, 2, ...; n_ctx 256) built in-process, no file read but the models."""
    models = {n: ModelSpec(n, tiny_model("qwen2", seed=i + 1), n_ctx=256) for i, n in enumerate(names)}
    spec = PoolSpec(tmp / "pool.yaml", budget, models, executors=executors, threads=1, scheduler=scheduler)
    return Pool(spec, costs, opener or open_model)  # type: ignore[arg-type]


def ask(pool: Pool, model: str, prompt: str | None, max_tokens: int, **kw: Any) -> tuple[Any, Any]:
    """Submits one job and waits for its (answer, error)."""
    got: list[tuple[Any, Any]] = []
    done = threading.Event()

    def callback(a: Any, e: Any) -> None:
        got.append((a, e))
        done.set()

    pool.submit(model, Work(prompt, kw.pop("messages", None), max_tokens, callback, **kw))
    assert done.wait(30)
    return got[0]


def test_a_pool_answer_is_the_models_own_with_its_load_and_run_times(tmp_path: Path, tiny_model: ModelFactory) -> None:
    """A pool answer equals the model alone, with its load, queue and run times, finish reason and counters."""
    opener = Opener()
    opener.delay = 0.4
    pool = small_pool(tmp_path, tiny_model, opener=opener)
    path = pool.spec.models["d"].path
    try:
        a, e = ask(pool, "d", "hello", 5)
        assert e is None
        assert (a.model, a.text, a.prompt_tokens, a.completion_tokens, a.finish_reason, a.executor) == (
            "d",
            alone(path, "hello", 5),
            4,
            5,
            "length",
            0,
        )
        assert a.load_seconds >= 0.4 and 0 <= a.queued_seconds < 0.35 and a.run_seconds > 0  # queued: not the load
        c = pool.counters["d"]
        assert (c.loads, c.load_seconds, c.jobs, c.failures, c.run_seconds) == (1, a.load_seconds, 1, 0, a.run_seconds)
        assert opener.loads == [("d", 1)]
        b, _ = ask(pool, "d", "a" * 250, 16)  # 250 of the context's 256 positions: cut after 6 tokens, a length
        assert (b.load_seconds, b.completion_tokens, b.finish_reason) == (0.0, 6, "length")
        assert b.text == alone(path, "a" * 250, 16)
        full, _ = ask(pool, "d", "a" * 250, 6)
        assert (full.completion_tokens, full.finish_reason) == (6, "length")
        assert (c.loads, c.jobs, c.run_seconds) == (1, 3, a.run_seconds + b.run_seconds + full.run_seconds)
        assert pool.resident() == {"d": 0}
        assert pool.resident_bytes() == pool.costs["d"].nbytes
    finally:
        pool.close()
    assert [s.closed for s in opener.models["d"]] == [True]  # close frees every model


def test_a_pool_job_passes_chat_messages_sampling_and_an_empty_prompt_through(
    tmp_path: Path, tiny_model: ModelFactory
) -> None:
    """A job's chat messages, temperature and seed reach the model; a job without a prompt fails with its error."""
    pool = small_pool(tmp_path, tiny_model)
    path = pool.spec.models["d"].path
    m = Model(path, n_ctx=256, n_threads=1)
    try:
        a, _ = ask(pool, "d", None, 4, messages=[("user", "hi")])
        assert a.text == m.generate(m.chat_prompt([("user", "hi")]), max_tokens=4).text
        want = [m.generate("hello", max_tokens=8, temperature=1.0, seed=s).text for s in (7, 8)]
        assert want[0] != want[1]  # the seed matters
        a, _ = ask(pool, "d", "hello", 8, temperature=1.0, seed=7)
        assert a.text == want[0]
        a, e = ask(pool, "d", None, 4)
        assert a is None and isinstance(e, ConfigError) and str(e) == "generate: empty prompt"
        c = pool.counters["d"]
        assert (c.jobs, c.failures) == (3, 1)
        assert ask(pool, "d", None, 4)[0] is None
        assert (c.jobs, c.failures) == (4, 2)  # failures add up
    finally:
        pool.close()
        m.close()


def test_pool_answers_name_the_executor_that_ran_them(tmp_path: Path, tiny_model: ModelFactory) -> None:
    """Each answer names the executor that ran it (two executors taken in turn: 0, 1, 0)."""
    pool = small_pool(tmp_path, tiny_model, executors=2, scheduler="round-robin")
    try:
        assert [ask(pool, "d", "hi", 2)[0].executor for _ in range(3)] == [0, 1, 0]
        assert pool.counters["d"].loads == 2  # one copy per executor
    finally:
        pool.close()


def test_a_failed_load_fails_its_jobs_and_the_next_job_loads_again(
    tmp_path: Path, tiny_model: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed load fails only its batch, is counted each time, and leaves the model unloaded so the next job
    loads it (here at once: the wait before a failed model is tried again is tested on its own)."""
    monkeypatch.setattr(executor, "RETRY_LOAD_S", 0.0)
    opener = Opener()
    opener.fail = 2
    pool = small_pool(tmp_path, tiny_model, opener=opener)
    try:
        a, e = ask(pool, "d", "hi", 2)
        assert a is None and isinstance(e, ModelError) and str(e) == "d: cannot load (a test's fault)"
        c = pool.counters["d"]
        assert (c.loads, c.load_failures, c.jobs, c.failures) == (0, 1, 1, 1)
        assert pool.resident() == {}
        assert ask(pool, "d", "hi", 2)[0] is None
        assert (c.loads, c.load_failures, c.jobs, c.failures) == (0, 2, 2, 2)
        a, e = ask(pool, "d", "hi", 2)
        assert e is None and a.load_seconds > 0
        assert (c.loads, c.load_failures, c.jobs, c.failures) == (1, 2, 3, 2)
        assert opener.loads == [("d", 1)] * 3
    finally:
        pool.close()


def wait_for(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_preload_loads_used_models_before_any_job_and_survives_a_failed_one(
    tmp_path: Path, tiny_model: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Used models are preloaded so the first job pays no load; a failed preload is counted and a job loads it
    (once the wait before a failed model is tried again is over: none here)."""
    monkeypatch.setattr(executor, "RETRY_LOAD_S", 0.0)
    costs = {"d": Cost(k=0.05, b=0.01, load=0.01, nbytes=1000, max_batch=4, p=0.5)}
    opener = Opener()
    pool = small_pool(tmp_path, tiny_model, costs=costs, opener=opener)
    try:
        wait_for(lambda: pool.counters["d"].loads == 1)
        assert pool.resident() == {"d": 0} and pool.resident_bytes() == 1000
        a, _ = ask(pool, "d", "hi", 2)
        assert a.load_seconds == 0.0 and opener.loads == [("d", 1)]
    finally:
        pool.close()
    opener = Opener()
    opener.fail = 1
    pool = small_pool(tmp_path, tiny_model, costs=costs, opener=opener)
    try:
        wait_for(lambda: pool.counters["d"].load_failures == 1)
        assert pool.resident() == {}
        a, e = ask(pool, "d", "hi", 2)
        assert e is None and a.load_seconds > 0 and pool.counters["d"].loads == 1
    finally:
        pool.close()


def test_a_model_the_scheduler_cannot_place_fails_its_jobs_without_a_load(
    tmp_path: Path, tiny_model: ModelFactory
) -> None:
    """When the scheduler says a model does not fit, its jobs fail with that ConfigError and nothing loads."""
    opener = Opener()
    pool = small_pool(tmp_path, tiny_model, opener=opener)
    try:
        with pool._cv:
            pool.sched.executors[0].budget = 0  # the executor's share no longer holds the model
        a, e = ask(pool, "d", "hi", 2)
        assert a is None and isinstance(e, ConfigError) and str(e) == "model d does not fit the budget"
        c = pool.counters["d"]
        assert (c.loads, c.load_failures, c.jobs, c.failures) == (0, 0, 1, 1)
        assert opener.loads == []
    finally:
        pool.close()


def test_switching_models_unloads_the_evicted_one_even_if_its_pages_cannot_be_dropped(
    tmp_path: Path, tiny_model: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Switching frees the evicted model (closed, counted, pages dropped) even if the drop fails; load times add."""
    costs = {m: Cost(k=0.05, b=0.01, load=0.01, nbytes=100, max_batch=4) for m in ("a", "b")}
    opener = Opener()
    pool = small_pool(tmp_path, tiny_model, ("a", "b"), budget=100, costs=costs, opener=opener)
    dropped: list[Path] = []

    def drop(p: Path) -> None:
        dropped.append(p)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(executor, "drop_page_cache", drop)
    try:
        first, _ = ask(pool, "a", "hi", 2)
        a, e = ask(pool, "b", "hi", 2)
        assert e is None and a.text == alone(pool.spec.models["b"].path, "hi", 2)
        assert opener.models["a"][0].closed and not opener.models["b"][0].closed
        assert (pool.counters["a"].unloads, pool.counters["b"].unloads) == (1, 0)
        assert dropped == [pool.spec.models["a"].path]
        assert pool.resident() == {"b": 0}
        again, _ = ask(pool, "a", "hi", 2)  # a second load of a: its load times add up
        c = pool.counters["a"]
        assert (c.loads, c.load_seconds) == (2, first.load_seconds + again.load_seconds)
        ask(pool, "b", "hi", 2)  # a leaves a second time: its unloads add up
        assert (c.unloads, pool.counters["b"].unloads) == (2, 1)
    finally:
        pool.close()


def test_an_error_closing_the_evicted_model_is_reported_and_the_switch_goes_on(
    tmp_path: Path, tiny_model: ModelFactory, capfd: pytest.CaptureFixture[str]
) -> None:
    """An error freeing the evicted model is said on stderr and counted as its unload; the request that
    evicted it is answered, and so are the next ones of both models."""
    costs = {m: Cost(k=0.05, b=0.01, load=0.01, nbytes=100, max_batch=4) for m in ("a", "b")}
    opener = Opener()
    pool = small_pool(tmp_path, tiny_model, ("a", "b"), budget=100, costs=costs, opener=opener)
    try:
        assert ask(pool, "a", "hi", 2)[1] is None
        opener.models["a"][0].close_error = RuntimeError("close failed")
        for name in ("b", "b", "a"):
            a, e = ask(pool, name, "hi", 2)
            assert e is None and a.text == alone(pool.spec.models[name].path, "hi", 2)
        assert "moetier pool: closing a failed (close failed); it left the pool\n" in capfd.readouterr().err
        assert pool.counters["a"].unloads == 1 and pool.resident() == {"a": 0}
    finally:
        pool.close()


def test_a_switch_that_fails_leaves_no_model_counted_as_resident(
    tmp_path: Path, tiny_model: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error while freeing the evicted model fails that batch's jobs; the model it was to load is not
    taken for resident, so its next request loads it and is answered."""
    costs = {m: Cost(k=0.05, b=0.01, load=0.01, nbytes=100, max_batch=4) for m in ("a", "b")}
    opener = Opener()
    pool = small_pool(tmp_path, tiny_model, ("a", "b"), budget=100, costs=costs, opener=opener)
    try:
        assert ask(pool, "a", "hi", 2)[1] is None
        real = executor.drop_page_cache

        def drop(p: Path) -> None:
            monkeypatch.setattr(executor, "drop_page_cache", real)  # once
            msg = "drop failed"
            raise RuntimeError(msg)

        monkeypatch.setattr(executor, "drop_page_cache", drop)
        a, e = ask(pool, "b", "hi", 2)
        assert a is None and isinstance(e, RuntimeError) and str(e) == "drop failed"
        assert "b" not in pool.resident()
        a, e = ask(pool, "b", "hi", 2)
        assert e is None and a.text == alone(pool.spec.models["b"].path, "hi", 2) and a.load_seconds > 0
    finally:
        pool.close()


def test_a_bookkeeping_error_fails_the_rest_of_the_batch_once_each(tmp_path: Path, tiny_model: ModelFactory) -> None:
    """An error building a job's answer fails it and the rest of its batch, each once; waiting jobs show as queued."""
    opener = Opener()
    opener.gate = threading.Event()
    opener.broken = True
    pool = small_pool(tmp_path, tiny_model, opener=opener)
    got: list[tuple[int, Any, Any]] = []
    all_done = threading.Event()

    def callback(i: int) -> Any:
        def done(a: Any, e: Any) -> None:
            got.append((i, a, e))
            if len(got) == 4:
                all_done.set()

        return done

    try:
        pool.submit("d", Work("hi", None, 2, callback(0)))
        assert opener.loading.wait(30)  # the executor holds job 0's batch, loading
        for i in (1, 2, 3):
            pool.submit("d", Work("hi", None, 2, callback(i)))
        assert pool.queue_depths() == {"d": 3}
        opener.gate.set()
        assert all_done.wait(30)
        time.sleep(0.1)  # a second delivery would come now
        assert sorted(i for i, _, _ in got) == [0, 1, 2, 3]
        assert all(a is None and isinstance(e, AttributeError) for _, a, e in got)
        assert pool.sched.stats.batches == 2 and pool.queue_depths() == {}
    finally:
        pool.close()


def test_submit_refuses_unknown_models_and_a_closed_pool(tmp_path: Path, tiny_model: ModelFactory) -> None:
    """submit refuses an unknown model (ConfigError) and any job after close (ModelError), with exact messages."""
    pool = small_pool(tmp_path, tiny_model)
    with pytest.raises(ConfigError) as e:
        pool.submit("nope", Work("x", None, 1, lambda a, e: None))
    assert str(e.value) == "unknown model 'nope'"
    pool.close()
    with pytest.raises(ModelError) as e2:
        pool.submit("d", Work("x", None, 1, lambda a, e: None))
    assert str(e2.value) == "the pool is shutting down; the request was not run"


def test_a_model_whose_gguf_cannot_be_read_is_sized_by_its_file(tmp_path: Path, tiny_model: ModelFactory) -> None:
    """A GGUF whose tensors cannot be read is sized by its file, with a warning naming it; the others are estimated."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_model("qwen2", seed=1).read_bytes()[:4096])
    good = tiny_model("qwen2", seed=1)
    models = {"ok": ModelSpec("ok", good, n_ctx=256), "bad": ModelSpec("bad", broken, n_ctx=256, max_batch=2)}
    pool = Pool(PoolSpec(tmp_path / "pool.yaml", 1 << 30, models))
    try:
        (w,) = pool.warnings
        assert w.startswith(f"{broken}: cannot read the GGUF's tensors to size it (")
        assert w.endswith("); sized by the file")
        assert pool.costs["bad"] == Cost(0.05, 0.01, 4096 / 300e6, 4096, 2)
        assert pool.costs["ok"] == estimate_cost(models["ok"])
    finally:
        pool.close()


def test_a_single_head_models_kv_cache_is_its_full_width(tiny_model: ModelFactory) -> None:
    """With one attention head, the head is the model's whole width (64): the KV cache holds all of it."""
    m = ModelSpec("d", tiny_model("qwen2", n_head=1, n_head_kv=1, seed=1), n_ctx=256)
    assert gguf_bytes(m)[2]["n_head"] == 1
    assert footprint(m)[1] == 2 * 2 * 256 * 1 * 64 * 2  # K and V, 2 layers, 256 positions, 1 head of 64, f16


def test_eviction_frees_a_later_stage_whose_earlier_stage_is_not_resident_first(
    tmp_path: Path, tiny_model: ModelFactory
) -> None:
    """The pool's scheduler knows the pipelines: a later stage's model (z, after a) with a not resident is
    evicted before a model of no pipeline, though usage and name order would evict that one (b) first."""
    names = ("a", "z", "b", "c")
    models = {n: ModelSpec(n, tiny_model("qwen2", seed=i + 1), n_ctx=256) for i, n in enumerate(names)}
    p = Pipeline("p", "one", {"one": Stage("one", "a", default="two"), "two": Stage("two", "z")})
    spec = PoolSpec(tmp_path / "pool.yaml", 200, models, {"p": p}, threads=1)
    costs = {n: Cost(k=0.05, b=0.01, load=0.01, nbytes=100, max_batch=4) for n in names}
    opener = Opener()
    pool = Pool(spec, costs, opener)  # type: ignore[arg-type]
    try:
        for n in ("z", "b", "c"):
            assert ask(pool, n, "hi", 2)[1] is None
        assert pool.resident() == {"b": 0, "c": 0}
        assert opener.models["z"][0].closed and not opener.models["b"][0].closed
        assert (pool.counters["z"].unloads, pool.counters["b"].unloads) == (1, 0)
    finally:
        pool.close()


def test_the_scheduler_and_busy_seconds_add_up_what_each_call_and_batch_took(
    tmp_path: Path, tiny_model: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sched_seconds adds up every submit and next_batch from 0, busy_seconds each batch's time from 0 (on a
    clock that moves 0.25 s per submit, 0.5 s per next_batch and 2 s per load)."""
    clock = SimpleNamespace(t=1000.0)
    calls = {"submit": 0, "next_batch": 0}

    class Timed(Scheduler):
        def submit(self, job: Any, now: float) -> int:
            calls["submit"] += 1
            clock.t += 0.25
            return super().submit(job, now)

        def next_batch(self, q: int, now: float) -> Any:
            calls["next_batch"] += 1
            clock.t += 0.5
            return super().next_batch(q, now)

    def opener(m: ModelSpec, threads: int) -> Model:
        clock.t += 2.0
        return open_model(m, threads)

    monkeypatch.setattr(executor, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    monkeypatch.setattr(executor, "Scheduler", Timed)
    models = {"d": ModelSpec("d", tiny_model("qwen2", seed=1), n_ctx=256)}
    pool = Pool(PoolSpec(tmp_path / "pool.yaml", 1 << 30, models, threads=1), None, opener)

    def idle() -> bool:  # its last batch finished and counted
        return pool.sched.executors[0].running is None

    try:
        for _ in range(2):
            wait_for(idle)  # the clock moves only for one thread at a time
            assert ask(pool, "d", "hi", 2)[1] is None
        wait_for(idle)
        with pool._cv:
            assert calls["submit"] == 2 and calls["next_batch"] >= 3
            assert pool.sched_seconds == 0.25 * calls["submit"] + 0.5 * calls["next_batch"]
            assert pool.busy_seconds == [2.0]  # the first batch's load; the second took no time
    finally:
        pool.close()


def test_a_job_goes_to_the_idle_executor_while_the_other_runs_a_batch(tmp_path: Path, tiny_model: ModelFactory) -> None:
    """With two executors, a job submitted while executor 0 runs a batch goes to executor 1 (the makespan rule
    sees 0's running batch); the executors are daemon threads named by their number."""
    costs = {"d": Cost(k=10.0, b=10.0, load=1.0, nbytes=100, max_batch=1)}
    opener = Opener()
    opener.gate = threading.Event()
    pool = small_pool(tmp_path, tiny_model, executors=2, costs=costs, opener=opener)
    got: dict[int, Any] = {}
    try:
        names = [(t.name, t.daemon) for t in pool._threads]
        assert names == [("moetier-executor-0", True), ("moetier-executor-1", True)]
        pool.submit("d", Work("hi", None, 2, lambda a, e: got.__setitem__(0, a)))
        assert opener.loading.wait(30)  # executor 0 runs the first batch, held in its load
        pool.submit("d", Work("hi", None, 2, lambda a, e: got.__setitem__(1, a)))
        opener.gate.set()
        wait_for(lambda: len(got) == 2)
        assert (got[0].executor, got[1].executor) == (0, 1)
    finally:
        opener.gate.set()
        pool.close()


def _exchange(base: str, raw: bytes) -> bytes:
    """raw bytes sent on one connection; everything the server answers until it closes it."""
    import socket as sk

    host, port = base.removeprefix("http://").split(":")
    with sk.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_body_the_server_does_not_read_never_becomes_a_request(served: tuple[OpenAI, Pool, Path]) -> None:
    """A bad or huge Content-Length, or a chunked body: one JSON error and the connection closed, so the
    bytes behind it are not taken for a next request (one status line in all); other methods get a JSON
    405."""
    client, _, _ = served
    base = str(client.base_url).removesuffix("/v1/")
    smuggled = b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n"
    for head, status, message in (
        (b"Content-Length: x", 400, "Content-Length: 'x' is not a number of bytes"),
        (b"Content-Length: -5", 400, "Content-Length: '-5' is not a number of bytes"),
        (b"Content-Length: 1000000000000", 413, "Content-Length: 1000000000000 bytes; a request body holds at most"),
        (b"Transfer-Encoding: chunked", 411, "Transfer-Encoding: send the body with a Content-Length instead"),
    ):
        out = _exchange(base, b"POST /v1/completions HTTP/1.1\r\n" + head + b"\r\n\r\n" + smuggled)
        assert out.count(b"HTTP/1.1 ") == 1 and out.startswith(f"HTTP/1.1 {status} ".encode()), out
        assert json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith(message)
    out = _exchange(base, b"PUT /v1/models HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 405 ") and b"PUT: this server answers GET and POST" in out


def test_requests_the_model_cannot_take_are_400s(served: tuple[OpenAI, Pool, Path]) -> None:
    """JSON nested too deep, a number of thousands of digits, a temperature too large for a float, a
    lone surrogate or a NUL in the text, a prompt longer than the context, and OpenAI fields this server
    does not implement: each a 400 naming the problem. null fields take their defaults."""
    client, _, _ = served
    base = str(client.base_url).removesuffix("/v1/")

    def call(body: bytes, path: str = "/v1/completions") -> tuple[int, str]:
        status, _, raw = _raw(base, "POST", path, body, {"Content-Type": "application/json"})
        got = json.loads(raw)
        return status, got["error"]["message"] if status != 200 else got["choices"][0]["text"]

    for body, message in (
        (b"[" * 100000, "the request body is JSON this server cannot read: RecursionError"),
        (b'{"model": "d1", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "the request body is JSON"),
        (b'{"model": "d1", "prompt": "x", "temperature": ' + b"9" * 400 + b"}", "temperature: 999"),
        (b'{"model": "d1", "prompt": "a\\ud800"}', "prompt: character 1 is a lone surrogate"),
        (b'{"model": "d1", "prompt": "a\\u0000b"}', "prompt: a NUL character at 1"),
        (b'{"model": "d1", "prompt": "x", "stop": ["a"]}', "stop: not supported by this server; leave it out"),
        (b'{"model": "d1", "prompt": "x", "n": 3}', "n: not supported by this server"),
        (b'{"model": "d1", "prompt": "x", "logprobs": 5}', "logprobs: not supported by this server"),
        (b'{"model": "d1", "prompt": "' + b"hello world " * 300 + b'"}', "generate: the prompt of "),
    ):
        status, message_got = call(body)
        assert status == 400 and message in message_got, (body[:60], status, message_got)
    chat = b'{"model": "d1", "messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}'
    assert call(chat, "/v1/chat/completions") == (
        400,
        "messages: a content: character 1 is a lone surrogate ('\\ud800'), not text UTF-8 can encode",
    )
    nulls = b'{"model": "d1", "prompt": "x", "temperature": null, "seed": null, "stop": null, "n": 1, "max_tokens": 2}'
    plain = b'{"model": "d1", "prompt": "x", "max_tokens": 2}'
    assert call(nulls)[0] == 200 and call(nulls) == call(plain)
    both = b'{"model": "d1", "prompt": "x", "max_tokens": null, "max_completion_tokens": 2}'
    status, _, raw = _raw(base, "POST", "/v1/completions", both, {"Content-Type": "application/json"})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 2


def test_an_answer_cut_by_the_context_finishes_for_length(served: tuple[OpenAI, Pool, Path]) -> None:
    """A chat with no max_tokens runs until the model stops or its context (256) is full: cut by the
    context, OpenAI's finish_reason is "length", not "stop"."""
    client, _, _ = served
    r = client.chat.completions.create(model="d1", messages=[{"role": "user", "content": "x"}])
    used = r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if used == 256 else "stop")
    assert used == 256 or r.usage.completion_tokens < 256  # a random tiny model rarely ends its answer
