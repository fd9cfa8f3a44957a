"""The pool behind an OpenAI-compatible HTTP API (`moetier serve-pool`).

`model` in a request names a model or a pipeline of the pool's configuration; /v1/models lists both;
/metrics shows residency, loads, switches, queue depths and the scheduler's own time. A pipeline
request runs its stages, each scheduled like a request, and returns the last stage's answer with
every stage's model and timing under the response's `moetier` key."""

from __future__ import annotations

import json
import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from ..errors import ConfigError, MoetierError
from ..model import check_text
from .executor import Answer, ModelCounters, Pool, Stopping, Work, rss_bytes
from .spec import Pipeline, PoolSpec


class Service(Protocol):
    """What the HTTP layer serves: the names, the metrics text, and one request's response."""

    def names(self) -> list[dict[str, Any]]: ...

    def metrics(self) -> str: ...

    def run(self, body: dict[str, Any], chat: bool) -> dict[str, Any]: ...


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Run:
    """One request in flight: its pipeline position and the stages answered so far."""

    name: str
    text: str  # the request's input (a completion's prompt, a chat's last user message)
    messages: list[tuple[str, str]] | None  # a chat request to a model: the whole conversation
    max_tokens: int | None
    temperature: float
    seed: int
    pipeline: Pipeline | None
    stages: list[dict[str, Any]] = field(default_factory=list)
    answer: Answer | None = None
    error: BaseException | None = None
    event: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Request:
    """An API request's fields, checked."""

    name: str
    text: str  # a completion's prompt, a chat's last user message
    messages: list[tuple[str, str]] | None  # a chat's conversation
    max_tokens: int | None
    temperature: float
    seed: int


# OpenAI request fields this server does not implement -> the values that ask for nothing (accepted)
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "stop": (None, [], ""),
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "top_p": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


def prompt_refused(e: ConfigError) -> bool:
    """A model's generate refused the request's own input (`MODEL: generate: the prompt of N tokens does
    not fit ...`, an empty prompt): the client's error, not the server's."""
    return re.match(r"(?:.*?: )?generate: ", str(e)) is not None


def _text(value: str, what: str) -> str:
    """value, if the model can take it as text; a 400 naming what otherwise."""
    try:
        return check_text(value, what)
    except ConfigError as e:
        raise RequestError(400, str(e)) from None


def parse_request(body: dict[str, Any], chat: bool, known: list[str], served: str) -> Request:
    """The fields of a completion (chat: chat completion) request; RequestError for bad ones.
    known: the names `model` may take ("unknown model ...; {served}: ...")."""
    name = body.get("model")
    if not isinstance(name, str) or name not in known:
        raise RequestError(404, f"unknown model {name!r}; {served}: {', '.join(known)}")
    for key, neutral in _UNSUPPORTED.items():
        if key in body and body[key] not in neutral:
            raise RequestError(400, f"{key}: not supported by this server; leave it out")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 2**31 - 1
    ):
        raise RequestError(400, f"max_tokens: {max_tokens!r} must be a positive integer")
    temperature = body.get("temperature")
    temperature = 0.0 if temperature is None else temperature  # null: the default, as OpenAI takes it
    try:
        number = (
            isinstance(temperature, (int, float))
            and not isinstance(temperature, bool)
            and 0 <= float(temperature) < math.inf
        )
    except (TypeError, ValueError, OverflowError):
        number = False
    if not number:
        raise RequestError(400, f"temperature: {temperature!r} must be a number >= 0")
    seed = body.get("seed")
    seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**32 - 1:
        raise RequestError(400, f"seed: {seed!r} must be an integer in [0, {2**32 - 1}]")
    messages: list[tuple[str, str]] | None = None
    if chat:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise RequestError(400, "messages: a non-empty list of {role, content} is required")
        messages = []
        for m in raw:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError(400, "messages: each message needs a string role and a string content")
            messages.append((_text(m["role"], "messages: a role"), _text(m["content"], "messages: a content")))
        users = [c for r, c in messages if r == "user"]
        text = users[-1] if users else messages[-1][1]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError(400, "prompt: a string is required")
        if not prompt:
            # refused whatever the model: one that adds no BOS token would have nothing to continue from
            raise RequestError(400, "prompt: an empty prompt has no tokens to continue")
        text = _text(prompt, "prompt")
    return Request(name, text, messages, max_tokens, float(temperature), seed)


def completion(name: str, a: Answer, chat: bool, meta: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI response object of an answer (meta under the `moetier` key)."""
    usage = {
        "prompt_tokens": a.prompt_tokens,
        "completion_tokens": a.completion_tokens,
        "total_tokens": a.prompt_tokens + a.completion_tokens,
    }
    base = {"id": f"moetier-{uuid.uuid4().hex[:16]}", "created": int(time.time()), "model": name}
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": a.text},
            "finish_reason": a.finish_reason,
        }
        return {**base, "object": "chat.completion", "choices": [choice], "usage": usage, "moetier": meta}
    choice = {"index": 0, "text": a.text, "finish_reason": a.finish_reason, "logprobs": None}
    return {**base, "object": "text_completion", "choices": [choice], "usage": usage, "moetier": meta}


class PoolService:
    """Turns API requests into jobs on the pool and pipelines into chains of jobs."""

    def __init__(self, spec: PoolSpec, pool: Pool) -> None:
        self.spec = spec
        self.pool = pool
        self.requests = 0
        self.failed = 0
        self._lock = threading.Lock()

    def names(self) -> list[dict[str, Any]]:
        resident = self.pool.resident()
        out = [
            {"id": m, "object": "model", "owned_by": "moetier", "moetier": {"kind": "model", "resident": m in resident}}
            for m in self.spec.models
        ]
        for name, p in self.spec.pipelines.items():
            stages = [{"stage": s.name, "model": s.model} for s in p.stages.values()]
            out.append(
                {
                    "id": name,
                    "object": "model",
                    "owned_by": "moetier",
                    "moetier": {"kind": "pipeline", "stages": stages},
                }
            )
        return out

    def run(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        req = parse_request(body, chat, [*self.spec.models, *self.spec.pipelines], "this pool serves")
        name, text, messages, max_tokens = req.name, req.text, req.messages, req.max_tokens
        temperature, seed = req.temperature, req.seed
        pipeline = self.spec.pipelines.get(name)
        run = _Run(name, text, messages if pipeline is None else None, max_tokens, float(temperature), seed, pipeline)
        with self._lock:
            self.requests += 1
        if pipeline is None:
            # OpenAI's defaults: 16 tokens for a completion; a chat runs until the model stops or its
            # context is full
            default = self.spec.models[name].n_ctx if chat else 16
            self._submit(run, name, text, max_tokens or default, chat, stage="")
        else:
            self._stage(run, pipeline.first, "", chat)
        run.event.wait()
        if run.error is not None:
            with self._lock:
                self.failed += 1
            # the request was checked above, but only the model knows that its prompt does not fit
            if isinstance(run.error, ConfigError) and prompt_refused(run.error):
                raise RequestError(400, str(run.error))
            if isinstance(run.error, Stopping):  # not run at all: the client may try again
                raise RequestError(503, str(run.error))
            # what fails now (a load, a model) is the server's
            if isinstance(run.error, MoetierError):
                raise RequestError(500, str(run.error))
            raise RequestError(500, f"{type(run.error).__name__}: {run.error}")
        assert run.answer is not None
        return self._response(run, chat)

    def _stage(self, run: _Run, stage_name: str, previous: str, chat: bool) -> None:
        assert run.pipeline is not None
        st = run.pipeline.stages[stage_name]
        # one pass: a {previous} inside the request's own text stays as it was written
        fields = {"{input}": run.text, "{previous}": previous}
        text = re.sub(r"\{input\}|\{previous\}", lambda m: fields[m.group(0)], st.prompt)
        max_tokens = run.max_tokens if run.max_tokens is not None and st.default is None and not st.routes else None
        self._submit(run, st.model, text, max_tokens or st.max_tokens, chat, stage=stage_name)

    def _submit(self, run: _Run, model: str, text: str, max_tokens: int, chat: bool, stage: str) -> None:
        messages = run.messages if run.messages is not None else ([("user", text)] if chat else None)

        def done(answer: Answer | None, error: BaseException | None) -> None:
            if error is not None or answer is None:
                run.error = error or RuntimeError("no answer")
                run.event.set()
                return
            run.stages.append(
                {
                    "stage": stage or model,
                    "model": answer.model,
                    "executor": answer.executor,
                    "queued_s": round(answer.queued_seconds, 4),
                    "load_s": round(answer.load_seconds, 4),
                    "run_s": round(answer.run_seconds, 4),
                    "completion_tokens": answer.completion_tokens,
                }
            )
            run.answer = answer
            nxt = run.pipeline.stages[stage].next_stage(answer.text) if run.pipeline is not None else None
            if nxt is None:
                run.event.set()
                return
            try:
                self._stage(run, nxt, answer.text, chat)
            except BaseException as e:  # never leave the client waiting
                run.error = e
                run.event.set()

        self.pool.submit(model, Work(None if messages else text, messages, max_tokens, done, run.temperature, run.seed))

    def _response(self, run: _Run, chat: bool) -> dict[str, Any]:
        assert run.answer is not None
        meta = {"stages": run.stages, "seconds": round(time.perf_counter() - run.started, 4)}
        return completion(run.name, run.answer, chat, meta)

    def metrics(self) -> str:
        pool = self.pool
        resident = pool.resident()
        depths = pool.queue_depths()
        lines = [
            "# HELP moetier_pool_budget_bytes The pool's memory budget.",
            "# TYPE moetier_pool_budget_bytes gauge",
            f"moetier_pool_budget_bytes {self.spec.budget}",
            "# HELP moetier_pool_resident_bytes Bytes the resident models occupy (profiled or estimated).",
            "# TYPE moetier_pool_resident_bytes gauge",
            f"moetier_pool_resident_bytes {pool.resident_bytes()}",
            "# HELP moetier_pool_rss_bytes This process's resident memory.",
            "# TYPE moetier_pool_rss_bytes gauge",
            f"moetier_pool_rss_bytes {rss_bytes()}",
            "# HELP moetier_pool_switches_total Models loaded after the preload.",
            "# TYPE moetier_pool_switches_total counter",
            f"moetier_pool_switches_total {pool.sched.stats.loads}",
            "# HELP moetier_pool_loaded_bytes_total Bytes of the models loaded after the preload (profiled sizes).",
            "# TYPE moetier_pool_loaded_bytes_total counter",
            f"moetier_pool_loaded_bytes_total {pool.sched.stats.bytes_loaded}",
            "# HELP moetier_pool_requests_total API requests the pool ran, and those that failed in it.",
            "# TYPE moetier_pool_requests_total counter",
            f"moetier_pool_requests_total {self.requests}",
            f'moetier_pool_requests_total{{outcome="failed"}} {self.failed}',
            "# HELP moetier_pool_scheduler_seconds_total Time spent in the scheduler.",
            "# TYPE moetier_pool_scheduler_seconds_total counter",
            f"moetier_pool_scheduler_seconds_total {pool.sched_seconds:.6f}",
            "# TYPE moetier_pool_executor_busy_seconds_total counter",
        ]
        lines += [
            f'moetier_pool_executor_busy_seconds_total{{executor="{q}"}} {s:.6f}'
            for q, s in enumerate(pool.busy_seconds)
        ]
        per: list[tuple[str, str, Callable[[str, ModelCounters], object]]] = [
            ("resident", "gauge", lambda m, c: 1 if m in resident else 0),
            ("queue_depth", "gauge", lambda m, c: depths.get(m, 0)),
            ("loads_total", "counter", lambda m, c: c.loads),
            ("load_seconds_total", "counter", lambda m, c: round(c.load_seconds, 6)),
            ("unloads_total", "counter", lambda m, c: c.unloads),
            ("load_failures_total", "counter", lambda m, c: c.load_failures),
            ("jobs_total", "counter", lambda m, c: c.jobs),
            ("job_failures_total", "counter", lambda m, c: c.failures),
        ]
        for key, kind, get in per:
            lines.append(f"# TYPE moetier_pool_model_{key} {kind}")
            lines += [f'moetier_pool_model_{key}{{model="{m}"}} {get(m, c)}' for m, c in pool.counters.items()]
        return "\n".join(lines) + "\n"


MAX_BODY = 64 << 20  # bytes of one request body: prompts, not uploads


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer that counts the requests it is answering, so that a shutdown can wait until
    the answers (errors included) of the requests it stopped are written before the process exits."""

    # socketserver's default backlog of 5 reset or delayed (SYN retries, 1 s and more) a burst of clients
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._busy = 0
        self._idle = threading.Condition()

    def enter(self) -> None:
        with self._idle:
            self._busy += 1

    def leave(self) -> None:
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()

    def drain(self, timeout: float) -> int:
        """Waits up to timeout seconds for every request being answered to be answered; returns how
        many still are (a client that does not read its answer)."""
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0, timeout)
            return self._busy


def make_server(service: Service, host: str, port: int) -> Server:
    """A threaded HTTP server (one thread per connection) over the service; serve_forever() runs it."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj: Any) -> None:
            self._send(status, json.dumps(obj).encode())

        def _error(self, status: int, message: str) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._json(status, {"error": {"message": message, "type": kind, "code": status}})

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path in ("/v1/models", "/models"):
                self._json(200, {"object": "list", "data": service.names()})
            elif path == "/health":
                self._json(200, {"status": "ok"})
            elif path == "/metrics":
                self._send(200, service.metrics().encode(), "text/plain; version=0.0.4")
            else:
                self._error(404, f"no such endpoint: {path}")

        def _refuse(self, status: int, message: str) -> None:
            """An error after which the connection's bytes cannot be trusted (a body not read): closed."""
            self.close_connection = True
            self._error(status, message)

        def do_POST(self) -> None:
            assert isinstance(self.server, Server)
            self.server.enter()
            try:
                self._post()
            finally:
                self.server.leave()

        def _post(self) -> None:
            path = self.path.split("?")[0]
            if self.headers.get("Transfer-Encoding"):
                self._refuse(411, "Transfer-Encoding: send the body with a Content-Length instead")
                return
            text = self.headers.get("Content-Length") or "0"
            if not text.isdigit():
                self._refuse(400, f"Content-Length: {text!r} is not a number of bytes")
                return
            n = int(text)
            if n > MAX_BODY:
                self._refuse(413, f"Content-Length: {n} bytes; a request body holds at most {MAX_BODY}")
                return
            raw = self.rfile.read(n) if n > 0 else b""
            if path not in ("/v1/completions", "/completions", "/v1/chat/completions", "/chat/completions"):
                self._error(404, f"no such endpoint: {path}")
                return
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise RequestError(400, "the request body must be a JSON object")
                if body.get("stream"):
                    raise RequestError(400, "stream: streaming is not supported by this server; send stream=false")
                self._json(200, service.run(body, chat="chat" in path))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                self._error(400, f"the request body is not JSON: {e}")
            except (RecursionError, ValueError) as e:  # nested too deep, a number of too many digits
                self._error(400, f"the request body is JSON this server cannot read: {type(e).__name__}: {e}")
            except RequestError as e:
                self._error(e.status, str(e))
            except MoetierError as e:  # the pool refused the request (it is shutting down)
                self._error(503, str(e))

        def _no_method(self) -> None:
            self._refuse(405, f"{self.command}: this server answers GET and POST")

        do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _no_method

    return Server((host, port), Handler)
