"""Fine-tuned variants of one MoE served from one expert cache (moetier.Variants, serve-variants),
on tiny generated variants: exact without consolidation, the materialized map's answer with it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, Model, StoreError, Variants, VariantSpec, pack
from moetier.pool.server import RequestError
from moetier.pool.variant_service import VariantService
from moetier.tools.consolidate import consolidate, write_consolidated
from moetier.tools.moefy import MoefyConfig, moefy
from moetier.tools.tiny import write_tiny_model
from test_consolidate import variant

PROMPTS = ["the cat sat on", LONG_PROMPT[:120], "abc abc abc"]
CFG = CacheConfig.exact(budget="1M", prefetch=0, warm=False)


def alone(path: Path, store: Path) -> list[list[int]]:
    m = Model(path, store=store, cache=CFG, n_ctx=256)
    return [m.generate(p, max_tokens=10).tokens for p in PROMPTS]


@pytest.fixture
def seeded(tmp_path: Path) -> list[VariantSpec]:
    """Three tiny MoEs of one shape whose every weight differs (seeds 1-3), each with its store."""
    out = []
    for i in range(3):
        p = write_tiny_model(tmp_path / f"v{i}.gguf", "qwen2moe", n_expert=8, n_expert_used=2, n_layer=3, seed=i + 1)
        out.append(VariantSpec(f"v{i}", p, pack(p, tmp_path / f"s{i}", progress=False)))
    return out


def test_variants_share_one_cache_and_each_answers_as_alone(seeded: list[VariantSpec]) -> None:
    want = [alone(v.model, v.store) for v in seeded]
    assert len({str(w) for w in want}) == 3, "the variants answer differently: a misrouted request would show"
    vs = Variants(seeded, CFG, n_ctx=256)
    # one cache for all, keyed by variant: more slots than one variant's 3 layers x 8 experts, fewer than all
    assert 3 * 8 < int(vs.cache_info()["n_slots"]) < 3 * 3 * 8
    assert not vs.consolidated
    for _ in range(2):  # interleaved: each variant's requests between the others'
        for qi in range(len(PROMPTS)):
            for i in (2, 0, 1):
                r = vs.generate(f"v{i}", PROMPTS[qi], max_tokens=10)
                assert r.tokens == want[i][qi], f"variant {i} prompt {qi}"
    # the slots hold more experts than one variant has: the variants' copies live side by side
    assert int(vs.cache_info()["n_held"]) > 3 * 8
    st = vs.generate("v1", PROMPTS[0], max_tokens=10).stats
    assert st.n_lookups > 0 and st.n_hits < st.n_lookups
    with pytest.raises(ConfigError, match=r"^unknown variant 'v9'; these are served: v0, v1, v2$"):
        vs.generate("v9", "x")
    firsts: list[int] = []
    vs.generate("v2", PROMPTS[0], max_tokens=3, on_first_token=lambda: firsts.append(1))
    assert firsts == [1]

    # concurrent requests of all variants: answered one at a time, each its own
    import threading

    got: dict[tuple[int, int], list[int]] = {}

    def ask(i: int, qi: int) -> None:
        got[i, qi] = vs.generate(f"v{i}", PROMPTS[qi], max_tokens=10).tokens

    threads = [threading.Thread(target=ask, args=(i, qi)) for qi in range(len(PROMPTS)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {(i, qi): want[i][qi] for i in range(3) for qi in range(len(PROMPTS))}
    vs.close()
    with pytest.raises(ConfigError, match=r"^variants: closed$"):
        vs.generate("v0", "x")


def test_consolidation_serves_shared_positions_with_one_copy(tiny_model: ModelFactory, tmp_path: Path) -> None:
    base = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    paths = [variant(base, tmp_path / f"c{i}.gguf", i) for i in range(3)]
    specs = [VariantSpec(f"c{i}", p, pack(p, tmp_path / f"cs{i}", progress=False)) for i, p in enumerate(paths)]
    m = consolidate(paths, 0.5)
    mp = tmp_path / "map.json"
    mp.write_text(json.dumps(m))
    vs = Variants(specs, CFG, consolidation=mp, n_ctx=256)
    assert vs.consolidated
    got = {i: [vs.generate(f"c{i}", p, max_tokens=10).tokens for p in PROMPTS] for i in (1, 2, 0)}
    vs.close()
    for i in range(3):
        # the oracle: the variant's GGUF with every shared position's expert taken from its owner
        ref = tmp_path / f"ref{i}.gguf"
        write_consolidated(m, i, ref)
        assert got[i] == alone(ref, pack(ref, tmp_path / f"rs{i}", progress=False)), f"variant {i}"
    # sharing changed what some variant computes (a map left unapplied would show)
    assert any(got[i] != alone(p, s.store) for i, (p, s) in enumerate(zip(paths, specs, strict=True)))
    # capacity 0 shares nothing: not consolidated, exact
    m0 = tmp_path / "map0.json"
    m0.write_text(json.dumps(consolidate(paths, 0)))
    vs0 = Variants(specs, CFG, consolidation=m0, n_ctx=256)
    assert not vs0.consolidated
    assert [vs0.generate("c2", p, max_tokens=10).tokens for p in PROMPTS] == alone(paths[2], specs[2].store)
    vs0.close()


def test_bad_variant_sets_are_clear_errors(seeded: list[VariantSpec], tmp_path: Path) -> None:
    other = write_tiny_model(tmp_path / "wide.gguf", "qwen2moe", n_expert=4, n_expert_used=2, n_layer=3, seed=9)
    odd = VariantSpec("wide", other, pack(other, tmp_path / "sw", progress=False))
    with pytest.raises(ConfigError, match=r"wide\.gguf: .*experts.*one shape"):
        Variants([seeded[0], odd], CFG, n_ctx=256)
    with pytest.raises(ConfigError, match="given twice"):
        Variants([seeded[0], seeded[0]], CFG, n_ctx=256)
    with pytest.raises(ConfigError, match="prefetch is off"):
        Variants(seeded, CacheConfig.exact(budget="1M", prefetch=2), n_ctx=256)
    with pytest.raises(ConfigError, match="a budget in bytes"):
        Variants(seeded, CacheConfig.exact(budget="auto", prefetch=0, warm=False), n_ctx=256)
    # the C API refuses one model given twice, and a model that decoded already
    from moetier import _core

    a = Model(seeded[0].model, store=seeded[0].store, cache=CFG, n_ctx=256)
    with pytest.raises(ConfigError, match="given twice"):
        _core.share_cache([a._m, a._m])
    b = Model(seeded[1].model, store=seeded[1].store, cache=CFG, n_ctx=256)
    b.generate("x", max_tokens=2)
    with pytest.raises(ConfigError, match="has decoded already"):
        _core.share_cache([a._m, b._m])
    # a map of other files, or of the same files in another order
    mp = tmp_path / "map.json"
    mp.write_text(json.dumps(consolidate([v.model for v in seeded], 4)))
    with pytest.raises(ConfigError, match=r"map\.json: variant 0 of the map is .*v0\.gguf, but .*v1\.gguf"):
        Variants([seeded[1], seeded[0], seeded[2]], CFG, consolidation=mp, n_ctx=256)
    with pytest.raises(ConfigError, match="the map is of 3 variants, 2"):
        Variants(seeded[:2], CFG, consolidation=mp, n_ctx=256)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match=r"bad\.json: not a consolidation map"):
        Variants(seeded, CFG, consolidation=bad, n_ctx=256)


def test_a_damaged_variant_store_fails_with_its_file_named(seeded: list[VariantSpec]) -> None:
    data = next(seeded[1].store.glob("*.bin"))
    size = data.stat().st_size
    with open(data, "r+b") as f:  # every expert of variant 1 garbled (past the header); 0 and 2 untouched
        f.seek(4096)
        f.write(os.urandom(size - 4096))
    vs = Variants(seeded, CFG, n_ctx=256)
    assert vs.generate("v0", PROMPTS[0], max_tokens=4).tokens == alone(seeded[0].model, seeded[0].store)[0][:4]
    with pytest.raises(StoreError, match=rf"{seeded[1].store.name}.*checksum mismatch"):
        vs.generate("v1", PROMPTS[0], max_tokens=4)
    # the other variants go on answering, their own answers
    assert vs.generate("v2", PROMPTS[1], max_tokens=10).tokens == alone(seeded[2].model, seeded[2].store)[1]
    vs.close()


def test_serve_variants_answers_each_variant_through_the_openai_client(seeded: list[VariantSpec]) -> None:
    from openai import OpenAI

    want = {v.name: alone(v.model, v.store) for v in seeded}
    detok = Model(seeded[0].model)  # one vocabulary for all
    cmd = [sys.executable, "-m", "moetier.cli", "serve-variants", *[str(v.model) for v in seeded]]
    cmd += ["--stores", *[str(v.store) for v in seeded], "--cache", "1M", "-c", "256", "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        port = 0
        t0 = time.time()
        assert proc.stderr is not None
        while time.time() - t0 < 60:
            line = proc.stderr.readline()
            if "listening on http://" in line:
                port = int(line.rsplit(":", 1)[1].strip())
                break
            assert proc.poll() is None, line
        assert port, "the server did not start"
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        assert sorted(m.id for m in client.models.list()) == ["v0", "v1", "v2"]
        for qi, p in enumerate(PROMPTS):
            for name in ("v2", "v0", "v1"):
                r = client.completions.create(model=name, prompt=p, max_tokens=10)
                assert r.usage is not None and r.usage.completion_tokens == 10
                assert r.choices[0].text == detok.detokenize(want[name][qi]), (name, qi)
        with pytest.raises(Exception, match="unknown model 'v7'"):
            client.completions.create(model="v7", prompt="x", max_tokens=2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as resp:
            metrics = resp.read().decode()
        assert 'moetier_variants_requests_total{variant="v1"} 3' in metrics
        assert "moetier_variants_consolidated 0" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def test_moefy_shares_one_partition_across_variants(tmp_path: Path) -> None:
    calib = (LONG_PROMPT + " 0123456789 (){}[] <> +-*/=\n") * 12
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024)
    base = write_tiny_model(tmp_path / "base.gguf", "qwen2", n_layer=2, n_ff_exp=512, seed=3)
    ft = write_tiny_model(tmp_path / "ft.gguf", "qwen2", n_layer=2, n_ff_exp=512, seed=4)
    part = tmp_path / "part.npz"
    moefy(base, tmp_path / "base-moe.gguf", calib, cfg, progress=False, save_partition=part)
    moefy(ft, tmp_path / "ft-moe.gguf", calib, cfg, progress=False, partition=part)
    moefy(ft, tmp_path / "ft-own.gguf", calib, cfg, progress=False)
    import numpy as np
    from gguf import GGUFReader

    def gate_rows(path: Path) -> np.ndarray:
        t = {x.name: x for x in GGUFReader(str(path)).tensors}
        return np.asarray(t["blk.0.ffn_gate_exps.weight"].data)

    def dense_gate(path: Path) -> np.ndarray:
        t = {x.name: x for x in GGUFReader(str(path)).tensors}
        return np.asarray(t["blk.0.ffn_gate.weight"].data)

    with np.load(part) as z:
        groups = z["groups_0"]
    # expert e of the variant holds the variant's neurons that the base's expert e holds
    np.testing.assert_array_equal(gate_rows(tmp_path / "ft-moe.gguf"), dense_gate(ft)[groups])
    assert not np.array_equal(gate_rows(tmp_path / "ft-own.gguf"), gate_rows(tmp_path / "ft-moe.gguf"))
    # a partition of another shape is refused with its file named
    small = write_tiny_model(tmp_path / "small.gguf", "qwen2", n_layer=2, n_ff_exp=256, seed=5)
    with pytest.raises(ConfigError, match=r"part\.npz: n_ff 512 in the partition .* 256 here"):
        moefy(small, tmp_path / "x.gguf", calib, cfg, progress=False, partition=part)
    with pytest.raises(ConfigError, match=r"part\.npz: n_expert"):
        moefy(
            ft,
            tmp_path / "x.gguf",
            calib,
            MoefyConfig(n_expert=2, n_expert_used=1, calib_tokens=1024),
            progress=False,
            partition=part,
        )


def test_variant_config_errors_say_what_to_change(tmp_path: Path) -> None:
    """Each setting a shared cache cannot take is refused before any model loads, with its own message."""
    specs = [VariantSpec(f"v{i}", tmp_path / f"v{i}.gguf", tmp_path / f"s{i}") for i in range(2)]
    cases = [
        (specs[:1], CFG, "variants: serve at least two (one variant is a plain model: moetier serve)"),
        (specs, CacheConfig.exact(budget="1M", prefetch=2, warm=False), "variants: prefetch is off for variants"),
        (specs, CacheConfig.exact(budget="auto", prefetch=0), "variants: give the shared cache a budget in bytes"),
        (specs, CacheConfig.exact(budget="1M", prefetch=0, grow=1), "variants: the shared cache keeps its budget"),
        (specs, CacheConfig(budget="1M", prefetch=0, t1=0.5), "variants: mixed precision (t1/t2 below 1)"),
        (specs, CacheConfig(budget="1M", prefetch=0, t1=0.5, t2=0.9), "variants: mixed precision (t1/t2 below 1)"),
    ]
    for vs, cfg, want in cases:
        with pytest.raises(ConfigError) as e:
            Variants(vs, cfg, n_ctx=256)
        assert str(e.value).startswith(want), str(e.value)


def test_consolidation_map_errors_name_the_file(seeded: list[VariantSpec], tmp_path: Path) -> None:
    from moetier.variants import read_map

    gone = tmp_path / "gone.json"
    with pytest.raises(ConfigError, match=rf"^{gone}: the consolidation map does not exist$"):
        read_map(gone, seeded)
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    with pytest.raises(ConfigError, match=rf"^{junk}: not a consolidation map \("):
        read_map(junk, seeded)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"format": "moetier-consolidation-1"}))  # no variants listed
    with pytest.raises(ConfigError, match=rf"^{bare}: the map is of 0 variants, 3 are served$"):
        read_map(bare, seeded)
    mp = tmp_path / "map.json"
    mp.write_text(json.dumps(consolidate([v.model for v in seeded], 4)))
    assert read_map(mp, seeded)["format"] == "moetier-consolidation-1"
    with pytest.raises(ConfigError, match=r"write the map again with `moetier consolidate`$"):
        read_map(mp, [seeded[1], seeded[0], seeded[2]])
    # a map of the right files but another shape names the file too
    m = json.loads(mp.read_text())
    m["map"] = m["map"][:-1]
    short = tmp_path / "short.json"
    short.write_text(json.dumps(m))
    with pytest.raises(ConfigError, match=rf"^{short}: the map is of another shape than the variants' 3 MoE layers"):
        Variants(seeded, CFG, consolidation=short, n_ctx=256)


def test_a_malformed_map_is_refused_and_sharing_rows_are_lossy_whatever_the_capacity(
    seeded: list[VariantSpec], tmp_path: Path
) -> None:
    """Variants that are not entries, a capacity that is not a count, a row of strings or a position naming
    no variant: ConfigErrors naming the file. A map whose capacity says 0 but whose rows share a copy is
    consolidated (lossy), as its answers show; paths given as str work with a map."""
    from moetier.variants import read_map

    good = consolidate([v.model for v in seeded], 4)
    for change, says in (
        ({"variants": 5}, "variants must be a list of the variants' entries"),
        ({"variants": [1, 2, 3]}, "variants must be a list of the variants' entries"),
        ({"capacity": "lots"}, "capacity 'lots' must be a number of shared positions"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**good, **change}))
        with pytest.raises(ConfigError, match=rf"^{bad}: {re.escape(says)}"):
            read_map(bad, seeded)
    n_layers, n_expert = len(good["map"]), len(good["map"][0])
    for value, shown in (("x", "'x'"), (-7, "-7"), (3, "3")):
        rows = [[-1] * n_expert for _ in range(n_layers)]
        rows[1][2] = value
        bad = tmp_path / "rows.json"
        bad.write_text(json.dumps({**good, "map": rows}))
        with pytest.raises(ConfigError, match=rf"^{bad}: layer 1, expert 2: {re.escape(shown)} is neither -1"):
            Variants(seeded, CFG, consolidation=bad, n_ctx=256)
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps({**good, "capacity": 0, "map": [[0] * n_expert for _ in range(n_layers)]}))
    as_str = [VariantSpec(v.name, str(v.model), str(v.store)) for v in seeded]  # type: ignore[arg-type]
    vs = Variants(as_str, CFG, consolidation=shared, n_ctx=256)
    try:
        assert vs.consolidated
    finally:
        vs.close()
    with pytest.raises(ConfigError, match=r"^VariantSpec v0: model None must be a path$"):
        VariantSpec("v0", None, seeded[0].store)  # type: ignore[arg-type]


def test_variants_take_the_default_prefetch_and_the_context(seeded: list[VariantSpec]) -> None:
    """The default prefetch is accepted and turned off (its predictions would be one model's); n_ctx
    and n_threads reach every variant's model."""
    vs = Variants(seeded, CacheConfig.exact(budget="1M"), n_ctx=192, n_threads=1)
    assert vs.cache.prefetch == 0 and not vs.cache.warm
    assert all(m.context.n_ctx == 192 and m.context.n_threads == 1 for m in vs._models)
    vs.close()


def test_cache_info_does_not_wait_for_a_running_decode(seeded: list[VariantSpec]) -> None:
    """A /metrics scrape reads the shared cache's pools while a long answer is being decoded (it hung
    behind it); after close() the variants say they are closed."""
    import threading

    vs = Variants(seeded, CacheConfig.exact(budget="1M"))
    started, release = threading.Event(), threading.Event()

    def first() -> None:
        started.set()
        release.wait(30)

    decode = threading.Thread(target=lambda: vs.generate(vs.names[0], "hi", 8, on_first_token=first))
    decode.start()
    try:
        assert started.wait(30)
        got: list[dict[str, int | bool]] = []
        reader = threading.Thread(target=lambda: got.append(vs.cache_info()))
        reader.start()
        reader.join(10)
        assert got and got[0]["n_slots"] > 0, "cache_info waited for the decode"
    finally:
        release.set()
        decode.join(30)
    vs.close()
    with pytest.raises(ConfigError, match=r"^variants: closed$"):
        vs.cache_info()


class Recorder:
    """Variants.generate as it is, with each call's arguments and result kept."""

    def __init__(self, vs: Variants) -> None:
        self.real = vs.generate
        self.calls: list[tuple[tuple[Any, ...], Any]] = []

    def __call__(self, *args: Any, **kw: Any) -> Any:
        assert not kw
        r = self.real(*args)
        self.calls.append((args, r))
        return r


@pytest.fixture
def service(seeded: list[VariantSpec], monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[VariantService, Recorder]]:
    """The three seeded variants behind a VariantService whose chat default is 5 tokens."""
    vs = Variants(seeded, CFG, n_ctx=256)
    rec = Recorder(vs)
    monkeypatch.setattr(vs, "generate", rec)
    try:
        yield VariantService(vs, 5), rec
    finally:
        vs.close()


def test_variant_service_lists_each_variant_and_whether_it_is_consolidated(seeded: list[VariantSpec]) -> None:
    """The variant service lists every variant in order, owned by moetier, of kind variant, not consolidated."""
    vs = Variants(seeded, CFG, n_ctx=256)
    try:
        meta = {"kind": "variant", "consolidated": False}
        assert VariantService(vs, 256).names() == [
            {"id": n, "object": "model", "owned_by": "moetier", "moetier": meta} for n in ("v0", "v1", "v2")
        ]
    finally:
        vs.close()


def test_variant_service_completion_is_the_variants_answer_with_openais_defaults(
    service: tuple[VariantService, Recorder], seeded: list[VariantSpec]
) -> None:
    """A completion runs the named variant, 16 greedy tokens by default, and returns its text, counts and timings."""
    svc, rec = service
    t0 = time.perf_counter()
    out = svc.run({"model": "v1", "prompt": PROMPTS[0]}, False)
    wall = time.perf_counter() - t0
    ((args, r),) = rec.calls
    assert args == ("v1", PROMPTS[0], 16, 0.0, 0)
    assert r.tokens[:10] == alone(seeded[1].model, seeded[1].store)[0]
    assert (out["object"], out["model"]) == ("text_completion", "v1")
    assert out["choices"] == [{"index": 0, "text": r.text, "finish_reason": "length", "logprobs": None}]
    assert out["usage"] == {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": 16,
        "total_tokens": r.prompt_tokens + 16,
    }
    meta = out["moetier"]
    assert {k: meta[k] for k in ("variant", "consolidated", "prefill_seconds", "decode_seconds")} == {
        "variant": "v1",
        "consolidated": False,
        "prefill_seconds": round(r.prefill_seconds, 4),
        "decode_seconds": round(r.decode_seconds, 4),
    }
    assert meta["seconds"] == round(meta["seconds"], 4)
    assert round(r.seconds, 4) - 1e-4 <= meta["seconds"] <= round(wall, 4) + 1e-4  # the request's own time


def test_variant_service_passes_max_tokens_sampling_and_says_why_it_stopped(
    service: tuple[VariantService, Recorder],
) -> None:
    """max_tokens, temperature and seed reach the variant; an answer cut by the context or by max_tokens ends
    in length, as OpenAI's."""
    svc, rec = service
    out = svc.run({"model": "v0", "prompt": "a" * 250, "max_tokens": 16}, False)
    assert rec.calls[-1][0] == ("v0", "a" * 250, 16, 0.0, 0)
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == (6, "length")  # 256 positions
    out = svc.run({"model": "v0", "prompt": "a" * 250, "max_tokens": 6}, False)
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == (6, "length")
    out = svc.run({"model": "v2", "prompt": "hi", "max_tokens": 3, "temperature": 0.8, "seed": 11}, False)
    args, r = rec.calls[-1]
    assert args == ("v2", "hi", 3, 0.8, 11)
    assert out["choices"][0]["text"] == r.text


def test_variant_service_chat_renders_the_variants_template_and_defaults_to_its_context(
    service: tuple[VariantService, Recorder],
) -> None:
    """A chat is rendered by the variant's template and runs up to the service's context length by default."""
    svc, rec = service
    out = svc.run({"model": "v2", "messages": [{"role": "user", "content": "hi"}]}, True)
    args, r = rec.calls[-1]
    assert args == ("v2", svc.variants.chat_prompt("v2", [("user", "hi")]), 5, 0.0, 0)
    assert args[1].startswith("<|im_start|>user\nhi")
    assert out["object"] == "chat.completion"
    assert out["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": r.text}, "finish_reason": "length"}
    ]
    assert out["usage"]["completion_tokens"] == len(r.tokens) == 5


def test_variant_service_errors_and_metrics(service: tuple[VariantService, Recorder]) -> None:
    """Metrics sum the requests' cache counters; an unknown variant is a 404 not counted failed, a closed set a 500."""
    svc, rec = service
    for name in ("v1", "v1", "v2"):
        svc.run({"model": name, "prompt": "the cat", "max_tokens": 4}, False)
    with pytest.raises(RequestError) as e:
        svc.run({"model": "v9", "prompt": "x"}, False)
    assert (e.value.status, str(e.value)) == (404, "unknown model 'v9'; the variants served: v0, v1, v2")
    with pytest.raises(RequestError) as e:  # a client's mistake, answered, not a dropped connection
        svc.run({"model": "v1", "prompt": ""}, False)
    assert (e.value.status, str(e.value)) == (400, "prompt: an empty prompt has no tokens to continue")
    stats = [r.stats for _, r in rec.calls]
    lookups, hits, reads = (sum(getattr(s, f) for s in stats) for f in ("n_lookups", "n_hits", "n_bytes_read"))
    assert lookups > hits > 0 and reads > 0
    info = svc.variants.cache_info()

    def want(failed: int) -> str:
        return (
            "# TYPE moetier_variants_slots gauge\n"
            f"moetier_variants_slots {info['n_slots']}\n"
            "# TYPE moetier_variants_slots_held gauge\n"
            f"moetier_variants_slots_held {info['n_held']}\n"
            "# TYPE moetier_variants_cache_bytes gauge\n"
            f"moetier_variants_cache_bytes {info['cache_bytes']}\n"
            "# TYPE moetier_variants_consolidated gauge\n"
            "moetier_variants_consolidated 0\n"
            "# TYPE moetier_variants_expert_lookups_total counter\n"
            f"moetier_variants_expert_lookups_total {lookups}\n"
            "# TYPE moetier_variants_expert_hits_total counter\n"
            f"moetier_variants_expert_hits_total {hits}\n"
            "# TYPE moetier_variants_bytes_read_total counter\n"
            f"moetier_variants_bytes_read_total {reads}\n"
            "# TYPE moetier_variants_failed_total counter\n"
            f"moetier_variants_failed_total {failed}\n"
            "# TYPE moetier_variants_requests_total counter\n"
            'moetier_variants_requests_total{variant="v0"} 0\n'
            'moetier_variants_requests_total{variant="v1"} 2\n'
            'moetier_variants_requests_total{variant="v2"} 1\n'
        )

    assert svc.metrics() == want(0)
    assert (svc.lookups, svc.hits, svc.reads, svc.failed) == (lookups, hits, reads, 0)
    svc.variants.close()
    for chat in (False, True):  # the chat template and the generate fail alike
        body = {"model": "v0", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
        with pytest.raises(RequestError) as e:
            svc.run(body, chat)
        assert (e.value.status, str(e.value)) == (
            503,
            "the server is shutting down; the request was not run (variants: closed)",
        )
    assert svc.failed == 2


def test_variant_service_says_when_its_variants_are_consolidated(seeded: list[VariantSpec], tmp_path: Path) -> None:
    """With a map that shares positions, the listing, each response and /metrics say the variants are consolidated."""
    mp = tmp_path / "map.json"
    mp.write_text(json.dumps(consolidate([v.model for v in seeded], 4)))
    vs = Variants(seeded, CFG, consolidation=mp, n_ctx=256)
    try:
        svc = VariantService(vs, 256)
        assert all(m["moetier"] == {"kind": "variant", "consolidated": True} for m in svc.names())
        out = svc.run({"model": "v0", "prompt": "hi", "max_tokens": 2}, False)
        assert out["moetier"]["consolidated"] is True
        assert "\nmoetier_variants_consolidated 1\n" in svc.metrics()
    finally:
        vs.close()
