"""Bad input gets a clear error naming the file and the problem, never a crash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, Model, ModelError, PackConfig, StoreError, pack


def min_budget(path: Path) -> int:
    return int(Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])


def test_budget_below_minimum(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    lo = min_budget(path)
    with pytest.raises(ModelError, match=rf"{path.name}.*below the minimum.*at least {lo} bytes"):
        Model(path, cache=CacheConfig.exact(budget=lo - 1))


def test_dense_model_with_cache(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2")
    with pytest.raises(ModelError, match=rf"{path.name}.*no expert tensors"):
        Model(path, cache=CacheConfig.exact(budget="16M"))
    # without a cache it is just a model
    assert len(Model(path).generate("hi", max_tokens=4).tokens) <= 4


@pytest.mark.parametrize("bad", ["12Q", "-1M", "lots", ""])
def test_bad_size(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"cache\.budget"):
        CacheConfig.exact(budget=bad)


def test_unknown_policy() -> None:
    with pytest.raises(ConfigError, match=r"unknown policy 'nope'.*lru"):
        CacheConfig.exact(budget="1M", policy="nope")


def test_missing_model(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        Model(tmp_path / "nope.gguf")


@pytest.fixture
def packed(tiny_model: ModelFactory, tmp_path: Path) -> tuple[Path, Path]:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    store = pack(path, tmp_path / "store", progress=False)
    return path, store


def test_missing_store(tiny_model: ModelFactory, tmp_path: Path) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    with pytest.raises(StoreError, match=rf"{tmp_path / 'absent'}.*does not exist"):
        Model(path, store=tmp_path / "absent", cache=CacheConfig.exact(budget="16M"))


def test_store_without_manifest(packed: tuple[Path, Path]) -> None:
    path, store = packed
    (store / "manifest.json").unlink()
    with pytest.raises(StoreError, match=r"manifest.json.*missing"):
        Model(path, store=store, cache=CacheConfig.exact(budget="16M"))


def test_truncated_store(packed: tuple[Path, Path]) -> None:
    path, store = packed
    data = store / "experts.bin"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 4096)
    with pytest.raises(StoreError, match=r"experts.bin.*truncated"):
        Model(path, store=store, cache=CacheConfig.exact(budget="16M"))


def test_corrupt_manifest(packed: tuple[Path, Path]) -> None:
    path, store = packed
    (store / "manifest.json").write_text('{"format": "moetier-store", "version": 1, "layers": [')
    with pytest.raises(StoreError, match=r"manifest.json.*corrupt"):
        Model(path, store=store, cache=CacheConfig.exact(budget="16M"))


def test_manifest_of_another_store(packed: tuple[Path, Path], tmp_path: Path) -> None:
    path, store = packed
    other = pack(path, tmp_path / "other", progress=False)
    shutil.copy(other / "manifest.json", store / "manifest.json")
    with pytest.raises(StoreError, match=r"experts.bin.*does not belong"):
        Model(path, store=store, cache=CacheConfig.exact(budget="16M"))


def test_store_of_another_model(packed: tuple[Path, Path], tiny_model: ModelFactory) -> None:
    _, store = packed
    other = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, seed=7)
    with pytest.raises(StoreError, match=r"manifest.json.*different model"):
        Model(other, store=store, cache=CacheConfig.exact(budget="16M"))


@pytest.mark.parametrize("io_uring", [0, 1])
def test_corrupt_expert_data_fails_decode(packed: tuple[Path, Path], io_uring: int) -> None:
    path, store = packed
    manifest = json.loads((store / "manifest.json").read_text())
    off = manifest["layers"][0]["projections"][0]["offset_high"]
    data = store / "experts.bin"
    raw = bytearray(data.read_bytes())
    for o in off:  # every expert of layer 0, first projection: whatever is routed is corrupt
        raw[o + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    m = Model(path, store=store, cache=CacheConfig.exact(budget="16M", io_uring=io_uring))
    # a corrupt store is a StoreError at decode as at load (the kind travels with the message)
    with pytest.raises(StoreError, match=r"experts.bin.*checksum mismatch"):
        m.generate(LONG_PROMPT, max_tokens=4)
    # the failed slots are dropped, not cached: the next decode reads (and fails) again
    with pytest.raises(StoreError, match="checksum mismatch"):
        m.generate(LONG_PROMPT, max_tokens=4)


def test_bad_low_type(tiny_model: ModelFactory, tmp_path: Path) -> None:
    from moetier import PackConfig

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    with pytest.raises(StoreError, match="unknown low-precision type 'q9_9'"):
        pack(path, tmp_path / "s", PackConfig(low_type="q9_9"), progress=False)
    assert not (tmp_path / "s" / "manifest.json").exists()


@pytest.mark.parametrize("io_uring", [0, 1])
def test_graph_aborted_between_resolve_and_load(packed: tuple[Path, Path], io_uring: int) -> None:
    """A graph stopped after a layer's resolve and before its load (a user's abort callback, a
    cancelled request): the slots that resolve assigned were never read, so the pass must forget them
    and the next decode must read those experts again, giving stock's logits."""
    import numpy as np

    path, store = packed
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    want = stock.logits(tokens)
    m = Model(path, store=store, cache=CacheConfig.exact(budget=min_budget(path), io_uring=io_uring))
    aborted = 0
    for k in range(len(m.graph_nodes(tokens))):  # stop after k computed nodes: every point of the graph
        m._m._abort_after(k)
        try:
            m.logits(tokens)
        except ModelError as e:
            assert "llama_decode returned 2" in str(e)
            aborted += 1
            np.testing.assert_allclose(m.logits(tokens), want, rtol=0, atol=1e-5, err_msg=f"stopped after {k}")
        else:
            break  # the graph has fewer computed nodes than k: no stop left to try
    m._m._abort_after(-1)
    assert aborted > 10


def test_context_overflow(tiny_model: ModelFactory) -> None:
    """A prompt past the context is a ConfigError that says so (it was llama_decode's bare return
    code); generation stops where the context is full."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    m = Model(path, cache=CacheConfig.exact(budget="16M"), n_ctx=256)
    n_ctx = 256
    long = [1] * (n_ctx + 1)
    with pytest.raises(
        ConfigError, match=rf"{path.name}.*prompt of {n_ctx + 1} tokens does not fit the context of {n_ctx}"
    ):
        m.generate(long, max_tokens=4)
    with pytest.raises(ConfigError, match=rf"{path.name}.*input of {n_ctx + 1} tokens does not fit"):
        m.logits(long)
    r = m.generate([1] * (n_ctx - 5), max_tokens=64)
    assert 0 < len(r.tokens) <= 5
    assert len(m.generate([1] * 8, max_tokens=16).tokens) <= 16  # the model still works after both


def test_low_type_a_shape_cannot_take(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """q4_K packs 256 values per block; the tiny model's rows hold 64: pack refuses, naming the tensor."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    with pytest.raises(
        StoreError, match=rf"{path.name}: tensor blk\.\d+\.ffn_\w+_exps\.weight rows of 64 values.*q4_K block size 256"
    ):
        pack(path, tmp_path / "s", PackConfig(low_type="q4_K"), progress=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.pack-tmp").exists()


def test_one_model_decodes_for_one_thread_at_a_time(tiny_model: ModelFactory) -> None:
    """Threads sharing a Model take turns in its context: each answer equals the same call alone (the core
    releases the GIL while it decodes; two decodes in one context at once crashed the process)."""
    import threading

    m = Model(tiny_model("qwen2moe"), cache=CacheConfig(budget="1M"), n_threads=1)
    alone = m.generate("hello there", max_tokens=24).tokens
    got: list[list[int]] = []

    def work() -> None:
        for _ in range(3):
            got.append(m.generate("hello there", max_tokens=24).tokens)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [alone] * 12


@pytest.mark.parametrize("io_uring", [False, True])
def test_counters_read_from_another_thread_leave_a_decode_alone(
    stored_tiny: tuple[Path, Path, int], io_uring: bool
) -> None:
    """A monitoring thread reading the counters (stats, prefetch_stats, cache_info) while
    another decodes: every answer is the one decoded alone. Reading them finishes the open layer
    passes; under a running decode, that dropped the slots its next load was about to fill."""
    import threading

    path, store, lo = stored_tiny
    cache = CacheConfig.exact(budget=lo, prefetch=2, io_uring=io_uring)
    m = Model(path, store=store, cache=cache, n_threads=2)
    alone = m.generate(LONG_PROMPT, max_tokens=32).tokens
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            m.stats()
            m.prefetch_stats()
            m.cache_info()

    t = threading.Thread(target=monitor)
    t.start()
    try:
        got = [m.generate(LONG_PROMPT, max_tokens=32).tokens for _ in range(6)]
    finally:
        stop.set()
        t.join()
    assert got == [alone] * 6


def test_text_and_arguments_the_model_cannot_take_are_config_errors(tiny_model: ModelFactory) -> None:
    """Not text, a lone surrogate or a NUL; a chat message that is not a (role, content) pair; a prompt of
    bytes; a temperature that is a bool or too large for a float: each a ConfigError naming it."""
    m = Model(tiny_model("qwen2"))
    cases = [
        (lambda: m.tokenize(None), "tokenize: NoneType is not text (a str)"),  # type: ignore[arg-type]
        (lambda: m.tokenize("a\ud800"), "tokenize: character 1 is a lone surrogate ('\\ud800')"),
        (lambda: m.tokenize("ab\x00c"), "tokenize: a NUL character at 2; the text would end there"),
        (lambda: m.generate("a\ud800"), "tokenize: character 1 is a lone surrogate"),
        (lambda: m.chat_prompt([("user", "a\x00b")]), "chat_prompt: message 0's content: a NUL character at 1"),
        (lambda: m.chat_prompt([{"role": "user", "content": "hi"}]), "chat_prompt: message 0 is {'role'"),  # type: ignore[list-item]
        (lambda: m.chat_prompt([(None, None)]), "chat_prompt: message 0's role: NoneType is not text"),  # type: ignore[list-item]
        (lambda: m.chat_prompt("hi"), "chat_prompt: messages must be a sequence of (role, content) pairs"),  # type: ignore[arg-type]
        (lambda: m.generate(b"abc"), "generate: the prompt is bytes; give text"),  # type: ignore[arg-type]
        (lambda: m.generate("hi", temperature=True), "generate: temperature True must be a finite number"),
        (lambda: m.generate("hi", temperature=10**400), "generate: temperature 1000"),
    ]
    for call, says in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value).startswith(says), (says, str(e.value))
    assert m.generate("hi", max_tokens=2).tokens  # the model is fine after all of them


def test_a_closed_model_says_so(tiny_model: ModelFactory) -> None:
    """Every use of a closed model is a ModelError naming its file, not an AttributeError on None."""
    path = tiny_model("qwen2")
    m = Model(path)
    m.close()
    for call in (lambda: m.generate("hi"), lambda: m.tokenize("hi"), lambda: m.n_vocab, m.cache_info, m.stats):
        with pytest.raises(ModelError) as e:
            call()
        assert str(e.value) == f"{path}: the model is closed"


def test_a_star_import_leaves_llama_cpp_python_alone() -> None:
    """`from moetier import *` gives the API without building moetier.Llama (which imports the optional
    llama-cpp-python and takes llama.cpp's log); moetier.Llama stays there when asked for."""
    import subprocess
    import sys

    code = "from moetier import *; import sys; print('llama_cpp' in sys.modules, 'Llama' in dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_config_values_no_64_bit_field_holds_are_config_errors(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """Sizes of 2^64 or more, a float size, a threshold too large for a float, a policy that is not a
    name, unknown overrides, a lossy exact config, and a pack config that is not one: ConfigErrors."""
    import dataclasses

    from moetier import parse_size

    cases = [
        (lambda: CacheConfig(budget=2**70), "cache.budget: 1180591620717411303424 bytes is more than a 64-bit size"),
        (lambda: CacheConfig(reserve=2**64 - 1), "cache.reserve: 18446744073709551615 bytes is more than"),
        (lambda: CacheConfig(budget=1.5), "cache.budget: 1.5 is not a size; give bytes (an int) or a string"),  # type: ignore[arg-type]
        (lambda: CacheConfig(t1=10**400), "cache.t1: 1000"),
        (lambda: CacheConfig(policy=None), "cache.policy: None must be a policy name (a str)"),  # type: ignore[arg-type]
        (lambda: CacheConfig.exact("64M", t1=0.5), "CacheConfig.exact: t1 would make it lossy"),
        (lambda: parse_size(2**64, "x"), "x: 18446744073709551616 bytes is more than a 64-bit size holds"),
        (lambda: PackConfig(low_type=None), "pack.low_type: None must be a ggml type name"),  # type: ignore[arg-type]
        (lambda: pack(tiny_model("qwen2moe"), tmp_path / "s", "q4_0"), "pack: config 'q4_0' must be a PackConfig"),  # type: ignore[arg-type]
    ]
    for call, says in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value).startswith(says), (says, str(e.value))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"policy": "lru"}))
    with pytest.raises(ConfigError, match=r"^cache config overrides: unknown field\(s\) nope; known: "):
        CacheConfig.from_file(cfg, nope=1)
    # the normalised auto budget survives a replace, and the largest size below it is one
    assert dataclasses.replace(CacheConfig(), t1=0.5).budget_text == "auto"
    assert CacheConfig(budget=2**64 - 2).budget_bytes == 2**64 - 2


def test_model_arguments_and_token_ids_of_the_wrong_kind_are_config_errors(tiny_model: ModelFactory) -> None:
    """A path, cache, context, store, repack or override of the wrong type, and token ids that are not ids
    of the vocabulary: ConfigErrors naming them. Arrays, tuples and numpy ints of valid ids are taken."""
    import numpy as np

    from moetier import ContextConfig

    path = tiny_model("qwen2")
    for kw, says in (
        ({"path": None}, "Model: path None must be a file name"),
        ({"cache": "64M"}, "Model: cache '64M' must be a CacheConfig or None"),
        ({"context": "x"}, "Model: context 'x' must be a ContextConfig or None"),
        ({"store": 123, "cache": CacheConfig()}, "Model: store 123 must be a directory name"),
        ({"repack": None}, "Model: repack None must be True or False"),
        ({"tensor_overrides": None}, "tensor_overrides: None must be a sequence"),
    ):
        args = {"path": path, **kw}
        with pytest.raises(ConfigError) as e:
            Model(**args)  # type: ignore[arg-type]
        assert str(e.value).startswith(says), (says, str(e.value))
    m = Model(path, context=ContextConfig(n_ctx=256))
    n = m.n_vocab
    for call, says in (
        (lambda: m.detokenize([-1]), f"detokenize: token 0 is -1, not an id of the vocabulary (0 to {n - 1})"),
        (lambda: m.detokenize([1, 1.5]), "detokenize: token 1 is 1.5, not an id"),
        (lambda: m.detokenize("ab"), "detokenize: the tokens must be a list of token ids (int), not str"),
        (lambda: m.logits([n]), f"logits: token 0 is {n}, not an id"),
        (lambda: m.logits([]), "logits: no tokens to evaluate"),
        (lambda: m.generate([5, -5]), "generate: token 1 is -5, not an id"),
        (lambda: m.generate([1], on_first_token=5), "generate: on_first_token 5 must be callable or None"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value).startswith(says), (says, str(e.value))
    ids = m.tokenize("hello there")
    assert m.generate(np.array(ids), max_tokens=3).tokens == m.generate(tuple(ids), max_tokens=3).tokens
    assert np.array_equal(m.logits([np.int64(i) for i in ids]), m.logits(ids))


def test_cache_settings_that_cannot_act_are_in_the_warnings(tiny_model: ModelFactory) -> None:
    """A reserve beside a fixed budget, low_frac with no low-precision reads, prefetch_waste with prefetch
    off: each a warning of the model (the API's and every tool's); where they act, none."""
    path = tiny_model("qwen2moe")
    idle = CacheConfig(budget="1M", reserve="1M", low_frac=0.3, prefetch=0, prefetch_waste=5, warm=False)
    assert [w.split(" has no effect")[0] for w in Model(path, cache=idle).warnings] == [
        "low_frac=0.3",
        "reserve=1.00 MiB",
        "prefetch_waste=5",
    ]
    acting = CacheConfig(budget="auto", reserve="1M", prefetch=1, prefetch_waste=5, warm=False)
    assert not [w for w in Model(path, cache=acting).warnings if "has no effect" in w]
    lo = int(Model(path, cache=CacheConfig(warm=False)).cache_info()["min_cache_bytes"])  # room left to grow into
    grows = CacheConfig(budget=lo, reserve="1M", grow=1, warm=False)
    assert not [w for w in Model(path, cache=grows).warnings if w.startswith("reserve=")]


def test_generate_says_why_it_stopped(tiny_model: ModelFactory) -> None:
    """stop: "length" after max_tokens, "context" where the context is full (its 256 positions hold the
    prompt and every token generated), "eog" where the model ended its answer, as its last token shows."""
    from moetier import ContextConfig

    m = Model(tiny_model("qwen2"), context=ContextConfig(n_ctx=256))
    r = m.generate("hello", max_tokens=2)
    assert (r.stop, len(r.tokens)) == ("length", 2)
    r = m.generate("hello", max_tokens=1000)
    assert r.stop in ("context", "eog")
    assert (r.stop == "context") == (r.prompt_tokens + len(r.tokens) == 256)


def test_a_padded_context_is_reported(tiny_model: ModelFactory) -> None:
    """llama.cpp pads the context to a multiple of 256: the model's n_ctx is the real one, a warning says
    so, and a prompt that fits the real context is taken; a multiple of 256 is kept as asked, silently."""
    path = tiny_model("qwen2")
    m = Model(path, n_ctx=300)
    assert (m.context.n_ctx, m.n_ctx) == (300, 512)
    assert "n_ctx=300 is 512 here: llama.cpp pads the context to a multiple of 256" in m.warnings
    prompt = list(range(1, 101)) * 4  # 400 tokens: over the 300 asked, within the 512 made
    assert m.generate(prompt, max_tokens=2).stop in ("length", "eog")
    exact = Model(path, n_ctx=256)
    assert exact.n_ctx == 256 and not [w for w in exact.warnings if w.startswith("n_ctx=")]
