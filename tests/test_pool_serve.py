"""The pool behind the OpenAI API, on real (tiny) GGUF models: answers equal each model's alone,
pipelines route by the answer, switches under a budget, bad input and failed loads."""

from __future__ import annotations

import json
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

import pytest
from openai import InternalServerError, NotFoundError, OpenAI

from conftest import ModelFactory
from moetier import CacheConfig, ConfigError, Model, ModelError, pack
from moetier.pool.executor import Pool, Work, estimate_cost, open_model
from moetier.pool.server import PoolService, make_server
from moetier.pool.spec import ModelSpec, load_spec

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
    spec = load_spec(pool_yaml(tmp_path, tiny_model, budget_models=0.5))
    with pytest.raises(ConfigError, match=r"model d1: needs \d+ bytes resident, more than"):
        Pool(spec)


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
        assert m["load"] > 0 and m["nbytes"] > 0 and m["k"] > 0 and m["b"] >= 0
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
        assert isinstance(done[n][1], ModelError) and "shutting down" in str(done[n][1])


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
        ({"model": "a", "prompt": "x", "seed": 1.5}, False, 400, "seed: 1.5 must be an integer"),
        ({"model": "a", "prompt": "x", "seed": True}, False, 400, "seed: True must be an integer"),
        ({"model": "a"}, False, 400, "prompt: a string is required"),
        ({"model": "a", "prompt": ["x", "y"]}, False, 400, "prompt: a string is required"),
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
    assert call("POST", "/v1/completions", b"", headers) == error(400, "Content-Length: not a number")
    failed = call("POST", "/completions", b'{"model": "broken", "prompt": "x", "max_tokens": 2}')
    assert failed[0] == 500 and failed[2]["error"]["type"] == "server_error" and failed[2]["error"]["code"] == 500
    # the endpoints' short names: a completion and a chat
    ok = call("POST", "/completions", b'{"model": "d1", "prompt": "x", "max_tokens": 2}')
    assert ok[:2] == (200, "application/json") and ok[2]["object"] == "text_completion"
    chat = b'{"model": "d1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}'
    ok = call("POST", "/chat/completions", chat)
    assert ok[0] == 200 and ok[2]["object"] == "chat.completion"
