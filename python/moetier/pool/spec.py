"""The pool's configuration file: models, pipelines, budget and executors (YAML or JSON).

    budget: 1.5G            # bytes every resident model may use in all (weights, caches, KV, buffers)
    executors: 2            # workers, each with its own queue and its share of the budget
    threads: 1              # compute threads per executor
    scheduler: coserve      # or an ablation step / baseline: none, +evict, +arrange, fcfs-lru, fifo, round-robin
    profile: pool.profile.json   # written by `moetier profile`; without it the costs are estimated
    models:
      cls-a: {path: a.gguf, n_ctx: 512}
      det:   {path: moe.gguf, store: moe.experts, cache: 25%}
    pipelines:
      inspect-a:
        first: classify
        stages:
          classify: {model: cls-a, max_tokens: 4, next: {"(?i)yes": detect, default: null}}
          detect:   {model: det, prompt: "{input}\\nThe classifier said: {previous}\\n"}

A stage's `next` is a stage name (always continue there), null (the pipeline ends), or a map from
regular expressions on the stage's answer to stage names, tried in order, with `default` for none.
Every error names the file and the line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import INT32_MAX, MAX_THREADS, parse_size
from ..errors import ConfigError
from .sched import Mechanisms


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path
    store: Path | None = None
    cache: str = ""  # expert cache for a MoE: bytes ("256M") or a share of its expert bytes ("25%")
    n_ctx: int = 512
    max_batch: int = 4  # the most jobs of this model one batch runs
    line: int = field(default=0, compare=False)  # where the configuration file defines it (0: not from a file)

    def shape(self) -> list[Any]:
        """What a model's costs depend on: models of one shape cost the same (the profile measures one
        of them), and a profile of another shape is stale."""
        return [self.path.stat().st_size, self.store is not None, self.cache, self.n_ctx]


@dataclass(frozen=True)
class Stage:
    name: str
    model: str
    max_tokens: int = 32
    prompt: str = "{input}"  # {input}: the request's text; {previous}: the earlier stage's answer
    routes: tuple[tuple[str, str | None], ...] = ()  # (regex, next stage or None), tried in order
    default: str | None = None  # next stage when no route matches (None: the pipeline ends)

    def next_stage(self, answer: str) -> str | None:
        for pattern, target in self.routes:
            if re.search(pattern, answer):
                return target
        return self.default


@dataclass(frozen=True)
class Pipeline:
    name: str
    first: str
    stages: dict[str, Stage]


@dataclass(frozen=True)
class PoolSpec:
    path: Path
    budget: int
    models: dict[str, ModelSpec]
    pipelines: dict[str, Pipeline] = field(default_factory=dict)
    executors: int = 1
    threads: int = 1
    scheduler: str = "coserve"
    profile: Path | None = None

    @property
    def mechanisms(self) -> Mechanisms:
        return Mechanisms.baseline(self.scheduler)

    def deps(self) -> dict[str, set[str]]:
        """model -> the models whose answers lead to it in some pipeline."""
        out: dict[str, set[str]] = {}
        for p in self.pipelines.values():
            for s in p.stages.values():
                targets = {t for _, t in s.routes} | {s.default}
                for t in targets:
                    if t is not None and p.stages[t].model != s.model:
                        out.setdefault(p.stages[t].model, set()).add(s.model)
        return out


class _Doc:
    """A parsed file whose values remember their line, so errors can name it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, node: yaml.Node | None, what: str) -> ConfigError:
        line = f":{node.start_mark.line + 1}" if node is not None else ""
        return ConfigError(f"{self.path}{line}: {what}")

    def mapping(self, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, f"{what}: expected a mapping")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise self.error(k, f"{what}: keys must be names")
            if k.value in out:
                raise self.error(k, f"{what}: {k.value!r} given twice")
            out[str(k.value)] = (k, v)
        return out

    def scalar(self, node: yaml.Node, what: str) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(node, f"{what}: expected a single value")
        return yaml.safe_load(yaml.serialize(node))

    def string(self, node: yaml.Node, what: str) -> str:
        v = self.scalar(node, what)
        if not isinstance(v, str) or not v:
            raise self.error(node, f"{what}: expected a non-empty string, got {v!r}")
        return v

    def integer(self, node: yaml.Node, what: str, lo: int, hi: int = INT32_MAX) -> int:
        v = self.scalar(node, what)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise self.error(node, f"{what}: expected an integer >= {lo}, got {v!r}")
        if v > hi:
            raise self.error(node, f"{what}: expected an integer <= {hi}, got {v}")
        return v

    def unknown(self, m: dict[str, tuple[yaml.Node, yaml.Node]], known: set[str], what: str) -> None:
        for k, (kn, _) in m.items():
            if k not in known:
                raise self.error(kn, f"{what}: unknown key {k!r}; known: {', '.join(sorted(known))}")


def load_spec(path: str | os.PathLike[str]) -> PoolSpec:
    """Reads and checks a pool configuration; ConfigError naming the file and line on bad input."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        msg = f"{p}: cannot read the pool configuration: {e.strerror or e}"
        raise ConfigError(msg) from None
    doc = _Doc(p)
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        msg = f"{p}{line}: not valid YAML or JSON: {getattr(e, 'problem', None) or e}"
        raise ConfigError(msg) from None
    if root is None:
        msg = f"{p}: empty pool configuration"
        raise ConfigError(msg)
    top = doc.mapping(root, "pool")
    doc.unknown(top, {"budget", "executors", "threads", "scheduler", "profile", "models", "pipelines"}, "pool")
    base = p.parent

    def rel(node: yaml.Node, what: str) -> Path:
        q = Path(doc.string(node, what)).expanduser()
        return q if q.is_absolute() else base / q

    if "budget" not in top:
        raise doc.error(root, "pool: 'budget' is required (bytes, e.g. 1.5G)")
    vb = top["budget"][1]
    raw_budget = doc.scalar(vb, "budget")  # its own error names the line: not wrapped below
    try:
        budget = parse_size(raw_budget, "budget")
    except ConfigError as e:
        raise doc.error(vb, str(e)) from None
    if budget <= 0:
        raise doc.error(vb, "budget: must be positive")
    executors = doc.integer(top["executors"][1], "executors", 1) if "executors" in top else 1
    threads = doc.integer(top["threads"][1], "threads", 1, MAX_THREADS) if "threads" in top else 1
    scheduler = doc.string(top["scheduler"][1], "scheduler") if "scheduler" in top else "coserve"
    try:
        Mechanisms.baseline(scheduler)
    except ConfigError as e:
        raise doc.error(top["scheduler"][1], str(e)) from None
    profile = rel(top["profile"][1], "profile") if "profile" in top else None

    if "models" not in top:
        raise doc.error(root, "pool: 'models' is required")
    models: dict[str, ModelSpec] = {}
    for name, (_, vn) in doc.mapping(top["models"][1], "models").items():
        what = f"models.{name}"
        m = doc.mapping(vn, what)
        doc.unknown(m, {"path", "store", "cache", "n_ctx", "max_batch"}, what)
        if "path" not in m:
            raise doc.error(vn, f"{what}: 'path' is required")
        mpath = rel(m["path"][1], f"{what}.path")
        if not mpath.is_file():
            raise doc.error(m["path"][1], f"{what}.path: {mpath} does not exist")
        store = rel(m["store"][1], f"{what}.store") if "store" in m else None
        if store is not None and not store.exists():
            raise doc.error(m["store"][1], f"{what}.store: {store} does not exist")
        cache = str(doc.scalar(m["cache"][1], f"{what}.cache")) if "cache" in m else ""
        if cache and store is None:
            raise doc.error(m["cache"][1], f"{what}.cache: an expert cache needs a store (moetier pack); add store:")
        if cache.endswith("%"):
            try:
                share = float(cache[:-1])
            except ValueError:
                share = -1.0
            if not 0 < share <= 100:
                raise doc.error(m["cache"][1], f"{what}.cache: {cache!r} is not a share above 0% and at most 100%")
        elif cache:
            try:
                parse_size(cache, f"{what}.cache")
            except ConfigError as e:
                raise doc.error(m["cache"][1], str(e)) from None
        if store is not None and not cache:
            raise doc.error(vn, f"{what}: a store needs a cache (bytes or a share of the expert bytes, e.g. 25%)")
        n_ctx = doc.integer(m["n_ctx"][1], f"{what}.n_ctx", 64) if "n_ctx" in m else 512
        max_batch = doc.integer(m["max_batch"][1], f"{what}.max_batch", 1) if "max_batch" in m else 4
        models[name] = ModelSpec(name, mpath, store, cache, n_ctx, max_batch, vn.start_mark.line + 1)
    if not models:
        raise doc.error(top["models"][1], "models: at least one model is needed")

    pipelines: dict[str, Pipeline] = {}
    if "pipelines" in top:
        for name, (kn, vn) in doc.mapping(top["pipelines"][1], "pipelines").items():
            if name in models:
                raise doc.error(kn, f"pipelines.{name}: the name is also a model's; names must be unique")
            pipelines[name] = _pipeline(doc, name, vn, models)
    return PoolSpec(p, budget, models, pipelines, executors, threads, scheduler, profile)


def _pipeline(doc: _Doc, name: str, node: yaml.Node, models: dict[str, ModelSpec]) -> Pipeline:
    what = f"pipelines.{name}"
    m = doc.mapping(node, what)
    doc.unknown(m, {"first", "stages"}, what)
    if "stages" not in m:
        raise doc.error(node, f"{what}: 'stages' is required")
    raw = doc.mapping(m["stages"][1], f"{what}.stages")
    if not raw:
        raise doc.error(m["stages"][1], f"{what}.stages: at least one stage is needed")
    first = doc.string(m["first"][1], f"{what}.first") if "first" in m else next(iter(raw))
    if first not in raw:
        raise doc.error(m["first"][1], f"{what}.first: no stage named {first!r}")
    stages: dict[str, Stage] = {}
    lines: dict[str, yaml.Node] = {}
    for sname, (_, sn) in raw.items():
        sw = f"{what}.stages.{sname}"
        s = doc.mapping(sn, sw)
        doc.unknown(s, {"model", "max_tokens", "prompt", "next"}, sw)
        if "model" not in s:
            raise doc.error(sn, f"{sw}: 'model' is required")
        model = doc.string(s["model"][1], f"{sw}.model")
        if model not in models:
            raise doc.error(s["model"][1], f"{sw}.model: unknown model {model!r}; models: {', '.join(models)}")
        max_tokens = doc.integer(s["max_tokens"][1], f"{sw}.max_tokens", 1) if "max_tokens" in s else 32
        prompt = doc.string(s["prompt"][1], f"{sw}.prompt") if "prompt" in s else "{input}"
        for token in re.findall(r"{(\w+)}", prompt):  # other braces (a JSON example) are text
            if token not in ("input", "previous"):
                what_ = f"{sw}.prompt: unknown field {{{token}}}; use {{input}} or {{previous}}"
                raise doc.error(s["prompt"][1], what_)
        routes: list[tuple[str, str | None]] = []
        default: str | None = None
        if "next" in s:
            nn = s["next"][1]
            lines[sname] = nn
            if isinstance(nn, yaml.MappingNode):
                for pat, (pk, pv) in doc.mapping(nn, f"{sw}.next").items():
                    target = doc.scalar(pv, f"{sw}.next.{pat}")
                    if target is not None and not isinstance(target, str):
                        raise doc.error(pv, f"{sw}.next.{pat}: expected a stage name or null")
                    if pat == "default":
                        default = target
                        continue
                    try:
                        re.compile(pat)
                    except re.error as e:
                        raise doc.error(pk, f"{sw}.next: {pat!r} is not a regular expression: {e}") from None
                    routes.append((pat, target))
            else:
                target = doc.scalar(nn, f"{sw}.next")
                if target is not None and not isinstance(target, str):
                    raise doc.error(nn, f"{sw}.next: expected a stage name, null or a map of patterns")
                default = target
        stages[sname] = Stage(sname, model, max_tokens, prompt, tuple(routes), default)
    for sname, st in stages.items():
        for t in [t for _, t in st.routes] + [st.default]:
            if t is not None and t not in stages:
                raise doc.error(lines.get(sname), f"{what}.stages.{sname}.next: no stage named {t!r} (dangling)")
    # stages must form a DAG: a cycle would never end
    state: dict[str, int] = {}

    def visit(s: str, path: list[str]) -> None:
        state[s] = 1
        st = stages[s]
        for t in {t for _, t in st.routes} | {st.default}:
            if t is None:
                continue
            if state.get(t) == 1:
                cyc = " -> ".join([*path[path.index(t) :], t]) if t in path else f"{s} -> {t}"
                raise doc.error(lines.get(s), f"{what}: the stages form a cycle: {cyc}")
            if t not in state:
                visit(t, [*path, t])
        state[s] = 2

    visit(first, [first])
    for sname in stages:
        if sname not in state:
            raise doc.error(raw[sname][0], f"{what}.stages.{sname}: unreachable from the first stage {first!r}")
    return Pipeline(name, first, stages)
