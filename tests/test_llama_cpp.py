"""llama-cpp-python's Llama (its Python package, no native build of its own) on moetier's patched
libllama, with the experts served by the expert cache: moetier.Llama is a llama_cpp.Llama."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import moetier
from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, Model, ModelError, StoreError, _log, pack
from moetier.lcpp import INSTALL_HINT, import_llama_cpp

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip(f"llama-cpp-python is not installed: {INSTALL_HINT}", allow_module_level=True)
llama_cpp = import_llama_cpp()  # on moetier's libllama


@pytest.fixture(scope="module")
def model_path(tiny_model: ModelFactory) -> Path:
    return tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)


@pytest.fixture(autouse=True)
def fresh_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """moetier.Llama is built once per process; each test builds its own, so that what it checks
    comes from the code of the class as it is now (mutation testing changes code between tests)."""
    monkeypatch.setattr(moetier.lcpp, "_cls", None)


def _llama(path: Path, cache: CacheConfig | None = None, **kw: object) -> llama_cpp.Llama:
    return moetier.Llama(str(path), cache=cache, n_ctx=512, n_threads=2, verbose=False, seed=1, **kw)


def _greedy(llm: llama_cpp.Llama, n: int) -> list[int]:
    """The first n greedy tokens after LONG_PROMPT."""
    out: list[int] = []
    for t in llm.generate(llm.tokenize(LONG_PROMPT.encode()), temp=0.0, top_k=1):
        out.append(t)
        if len(out) == n:
            break
    return out


def _min_budget(path: Path) -> int:
    return int(Model(path, cache=CacheConfig.exact(budget="64M", warm=False)).cache_info()["min_cache_bytes"])


def test_is_a_llama_cpp_llama_on_moetier_libllama(model_path: Path) -> None:
    llm = _llama(model_path)
    assert isinstance(llm, llama_cpp.Llama)
    assert Path(llama_cpp.llama_cpp._lib._name).resolve().parent == Path(moetier.__file__).resolve().parent
    # stock (no cache): llama_model_params is stock llama.cpp's, so the ctypes struct matches
    assert not llm.has_expert_cache
    assert llm("Hello", max_tokens=4, temperature=0)["choices"][0]["text"] is not None


def test_the_class_is_moetier_llama(model_path: Path) -> None:
    cls = moetier.Llama
    assert (cls.__module__, cls.__qualname__, cls.__name__) == ("moetier", "Llama", "Llama")
    assert issubclass(cls, llama_cpp.Llama) and cls is not llama_cpp.Llama
    # llama_cpp's own arguments pass through as they are: a positional one it does not take is refused
    with pytest.raises(TypeError, match="positional"):
        moetier.Llama(str(model_path), 512, verbose=False)
    # llama_cpp's own refusal of a path comes through as a ModelError with its message
    with pytest.raises(ModelError, match=r"^Model path does not exist: /nonexistent\.gguf$"):
        moetier.Llama("/nonexistent.gguf", cache=CacheConfig.exact(budget="16M"), verbose=False)


def test_auto_budget_leaves_room_for_the_context_llama_cpp_allocates(model_path: Path) -> None:
    """cache=CacheConfig() sizes the cache from the memory limit less the KV cache of the context
    llama_cpp will allocate: its n_ctx, 512 when not given (llama_cpp's default)."""
    note = moetier.Llama(str(model_path), cache=CacheConfig(), verbose=False).budget_note
    assert note.startswith("expert cache auto: ") and "(n_ctx 512)" in note
    assert "(n_ctx 1024)" in moetier.Llama(str(model_path), cache=CacheConfig(), n_ctx=1024, verbose=False).budget_note
    assert _llama(model_path, CacheConfig.exact(budget="16M")).budget_note == "expert cache: 16.00 MiB (given)"
    assert _llama(model_path).budget_note == ""


def test_store_reads_and_a_damaged_expert_names_the_file(model_path: Path, tmp_path: Path) -> None:
    """With a store, the experts come from it (O_DIRECT); an expert whose bytes do not match the
    store's checksum fails the call with the file, layer and expert named (llama_cpp alone says only
    "llama_decode returned 2"), for completions and embeddings alike, and the same Llama answers
    as before once the file is restored."""
    store = pack(model_path, tmp_path / "store", progress=False)
    stock = _greedy(_llama(model_path), 8)
    budget = _min_budget(model_path)
    llm = _llama(model_path, CacheConfig.exact(budget=budget, warm=False), store=str(store))
    assert llm.cache_info()["from_store"]
    emb = _llama(model_path, CacheConfig.exact(budget=budget, warm=False), store=str(store), embedding=True)
    data = store / "experts.bin"
    good = data.read_bytes()
    raw = bytearray(good)
    for layer in json.loads((store / "manifest.json").read_text())["layers"]:
        for o in layer["projections"][0]["offset_high"]:  # every expert: whatever is routed is damaged
            raw[o + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    named = rf"^{model_path}: decode failed: {data}: checksum mismatch for layer \d+ expert \d+ "
    with pytest.raises(StoreError, match=named):
        _greedy(llm, 8)
    with pytest.raises(StoreError, match=named):
        emb.embed("hello world", return_count=True)
    data.write_bytes(good)
    llm.reset()
    assert _greedy(llm, 8) == stock
    # embed's own arguments pass through
    vectors, n_tokens = emb.embed("hello world", return_count=True)
    assert n_tokens == len(emb.tokenize(b"hello world")) and len(vectors) > 0
    assert llm.cache_stats().n_misses > 0


def test_close_frees_the_model_now(model_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """close() frees the model and its cache at once (the cache logs its totals as it is freed), not
    when the object is collected; the closed Llama refuses to report a freed cache's counters."""
    llm = _llama(model_path, CacheConfig.exact(budget=_min_budget(model_path), warm=False))
    _greedy(llm, 2)
    capfd.readouterr()
    _log.set_level("info")
    try:
        llm.close()
    finally:
        _log.set_level("warn")  # the library's default
    assert "moetier: expert cache totals:" in capfd.readouterr().err
    with pytest.raises(moetier.ModelError, match=r"the model is closed$"):
        llm.cache_info()


def test_oracle_same_greedy_tokens_as_model_and_stock(model_path: Path) -> None:
    budget = _min_budget(model_path)
    stock = Model(model_path, n_ctx=512).generate(LONG_PROMPT, max_tokens=16)
    cached = Model(model_path, cache=CacheConfig.exact(budget=budget, warm=False), n_ctx=512)
    ours = cached.generate(LONG_PROMPT, max_tokens=16)
    cfg = CacheConfig.exact(budget=budget, warm=False)
    llm = _llama(model_path, cfg)
    assert llm.expert_cache_config is cfg
    assert llm.has_expert_cache and llm.cache_info()["cache_bytes"] == cached.cache_info()["cache_bytes"]
    assert _greedy(llm, 16) == ours.tokens == stock.tokens
    s = llm.cache_stats()
    assert s.n_lookups > 0 and s.n_misses > 0 and s.n_hits + s.n_misses == s.n_lookups
    # per MoE layer too, summing to the totals
    assert len(s.layers) == 3 and sum(x.n_lookups for x in s.layers) == s.n_lookups


def test_vram_tier_through_llama_cpp(model_path: Path) -> None:
    """The VRAM tier's code (in host memory here: vram_host) under llama-cpp-python's Llama: the same
    greedy tokens as stock, and its counters in cache_stats()."""
    budget = _min_budget(model_path)
    stock = Model(model_path, n_ctx=512).generate(LONG_PROMPT, max_tokens=12)
    cfg = CacheConfig.exact(budget=2 * budget, warm=False, vram=budget + 2 * (budget // 8), vram_host=True)
    llm = _llama(model_path, cfg)
    assert llm.cache_info()["n_slots_vram"] == 8
    assert _greedy(llm, 12) == stock.tokens
    s = llm.cache_stats()
    assert s.n_vram_copies > 0 and s.n_vram_hits + s.n_vram_copies == s.n_lookups


def _batched_logits(llm: llama_cpp.Llama, prompts: list[str], steps: int) -> np.ndarray:
    """Greedy decoding of several sequences in shared batches on a second context of llm's model
    (what llama-server's slots do): sequence s joins at step 2 * s, so its prompt is prefilled in the
    same ubatch as the others' decode tokens. Returns every step's logits, (steps, n_seq, n_vocab)."""
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 1024, 512, 512, len(prompts)
    cp.n_threads = cp.n_threads_batch = 2
    ctx = llama_cpp.llama_init_from_model(llm._model.model, cp)
    batch = llama_cpp.llama_batch_init(512, 0, len(prompts))
    n_vocab = llm.n_vocab()
    toks = [llm.tokenize(p.encode()) for p in prompts]
    last = [0] * len(prompts)
    pos = [0] * len(prompts)
    active: list[int] = []
    out = np.zeros((steps, len(prompts), n_vocab), dtype=np.float32)
    try:
        for step in range(steps):
            batch.n_tokens = 0
            rows: list[int] = []

            def add(t: int, s: int, want: bool) -> None:
                k = batch.n_tokens
                batch.token[k], batch.pos[k], batch.n_seq_id[k], batch.logits[k] = t, pos[s], 1, want
                batch.seq_id[k][0] = s
                batch.n_tokens += 1
                pos[s] += 1

            for s in active:
                add(last[s], s, True)
                rows.append(s)
            if step % 2 == 0 and step // 2 < len(prompts):
                s = step // 2
                for i, t in enumerate(toks[s]):
                    add(t, s, i == len(toks[s]) - 1)
                active.append(s)
                rows.append(s)
            assert llama_cpp.llama_decode(ctx, batch) == 0
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(len(rows), n_vocab))
            for k, s in enumerate(rows):
                out[step, s] = logits[k]
                last[s] = int(logits[k].argmax())
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return out


def test_multi_sequence_batches_bit_equal_stock(model_path: Path) -> None:
    """Sequences sharing ubatches, prompts prefilled beside other sequences' decode tokens: at the
    minimum budget every logit equals stock's bit for bit. (A server's answers still depend on which
    requests share a batch, in stock llama.cpp as in ours: the batches must be the same to compare.)"""
    prompts = [LONG_PROMPT, "Hello there, how are", "def add(a, b):\n    return", "One two three four"]
    stock = _batched_logits(_llama(model_path), prompts, 12)
    llm = _llama(model_path, CacheConfig.exact(budget=_min_budget(model_path), warm=False))
    ours = _batched_logits(llm, prompts, 12)
    assert np.isfinite(stock).all() and np.abs(stock).max() > 0
    assert np.array_equal(ours, stock)
    assert llm.cache_stats().n_misses > 0


def test_completion_chat_stream_and_grammar(model_path: Path) -> None:
    llm = _llama(model_path, CacheConfig.exact(budget=_min_budget(model_path), warm=False))
    done = llm.create_completion(LONG_PROMPT, max_tokens=12, temperature=0)
    text = done["choices"][0]["text"]
    streamed = "".join(
        c["choices"][0]["text"] for c in llm.create_completion(LONG_PROMPT, max_tokens=12, temperature=0, stream=True)
    )
    assert streamed == text and done["usage"]["completion_tokens"] > 0

    messages = [{"role": "user", "content": "Say something."}]
    chat = llm.create_chat_completion(messages=messages, max_tokens=8, temperature=0)
    reply = chat["choices"][0]["message"]
    assert reply["role"] == "assistant" and isinstance(reply["content"], str)
    chunks = llm.create_chat_completion(messages=messages, max_tokens=8, temperature=0, stream=True)
    joined = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert joined == reply["content"]

    grammar = llama_cpp.LlamaGrammar.from_string('root ::= "yes" | "no"', verbose=False)
    answer = llm.create_completion("Is the sky blue? Answer:", max_tokens=4, temperature=0, grammar=grammar)
    assert answer["choices"][0]["text"] in ("yes", "no")
    assert llm.cache_stats().n_lookups > 0


def test_embeddings(model_path: Path) -> None:
    llm = _llama(model_path, CacheConfig.exact(budget=_min_budget(model_path), warm=False), embedding=True)
    v = llm.embed("hello world")
    assert len(v) > 0 and all(isinstance(x, float) for x in (v[0] if isinstance(v[0], list) else v))


def test_bad_cache_config_is_a_clear_error(model_path: Path) -> None:
    with pytest.raises(ModelError, match="below the minimum"):
        _llama(model_path, CacheConfig.exact(budget="1K", warm=False))
    # the failed load left nothing pending: the next plain load is stock
    assert not _llama(model_path).has_expert_cache
    # a configuration left pending by a load that never ran does not reach a stock Llama
    moetier._core.configure_load(str(model_path), CacheConfig.exact(budget="64M").params())
    llm = _llama(model_path)
    assert not llm.has_expert_cache
    llm.close()
    with pytest.raises(moetier.ModelError, match=r"the model is closed$"):
        llm.cache_stats()


def test_store_without_cache_is_a_clear_error(model_path: Path, tmp_path: Path) -> None:
    """Refused before llama_cpp's own __init__ ran: the half-made object is collected quietly (an
    "Exception ignored in __del__" would fail this test: pytest turns it into an error)."""
    with pytest.raises(ConfigError, match="an expert store needs an expert cache"):
        moetier.Llama(str(model_path), store=str(tmp_path / "model.experts"), verbose=False)
    gc.collect()


def test_cache_that_never_reached_libllama_is_an_error(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration that does not reach the libllama llama_cpp runs on (as when a second copy of
    libllama is loaded) would run stock silently: it is an error naming what is loaded."""
    monkeypatch.setattr(moetier._core, "configure_load", lambda path, params: None)
    with pytest.raises(ModelError, match=r"configured but libllama did not create it \(libllama loaded: /"):
        _llama(model_path, CacheConfig.exact(budget=_min_budget(model_path), warm=False))


def test_plain_import_after_moetier_loads_moetiers_libllama() -> None:
    """llama-cpp-python installed without its native build has no libllama: after `import moetier`, a
    plain `import llama_cpp` loads moetier's instead of failing with "Shared library ... not found"."""
    pytest.importorskip("llama_cpp")
    code = "import moetier, llama_cpp; print(llama_cpp.llama_cpp._lib._name)"
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()).resolve().parent == Path(moetier.__file__).resolve().parent


@pytest.mark.parametrize("cached", [True, False])
def test_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool) -> None:
    """`python -m moetier.lcpp install` installs llama-cpp-python's Python package without its native
    build: from the sdist the moetier build fetched when it is there, else from the index (pip itself
    is not run here)."""
    import moetier.lcpp as lcpp

    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path))
    sdist = tmp_path / f"llama_cpp_python-{lcpp.LLAMA_CPP_VERSION}.tar.gz"
    if cached:
        sdist.write_bytes(b"x")
    calls: list[tuple[list[str], dict[str, str]]] = []

    def fake_run(cmd: list[str], env: dict[str, str], check: bool) -> subprocess.CompletedProcess[bytes]:
        assert check is False  # pip's failure is its return code, not a traceback
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert lcpp.install(["install"]) == 3  # pip's return code
    ((cmd, env),) = calls
    target = str(sdist) if cached else f"llama-cpp-python=={lcpp.LLAMA_CPP_VERSION}"
    assert cmd == [sys.executable, "-m", "pip", "install", "-q", target]
    assert env["CMAKE_ARGS"] == "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"
    with pytest.raises(SystemExit):
        lcpp.install(["uninstall"])


def _lcpp_run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env}, timeout=120
    )


def test_import_llama_cpp_says_what_is_wrong(tmp_path: Path) -> None:
    from moetier.lcpp import LIB_DIR, LLAMA_CPP_VERSION

    call = (
        "from moetier.lcpp import import_llama_cpp\ntry:\n    import_llama_cpp()\nexcept Exception as e:\n    print(e)"
    )
    # a library path of the user's that is not moetier's
    r = _lcpp_run(call, LLAMA_CPP_LIB_PATH=str(tmp_path))
    assert r.stdout == f"LLAMA_CPP_LIB_PATH={tmp_path}: moetier.Llama needs moetier's libllama ({LIB_DIR}); unset it\n"
    # moetier's own folder, given by the user, is fine
    r = _lcpp_run(call.replace("print(e)", "raise") + "\nprint('ok')", LLAMA_CPP_LIB_PATH=str(LIB_DIR))
    assert r.stdout == "ok\n", r.stderr[-2000:]
    # llama-cpp-python missing
    r = _lcpp_run("import sys; sys.modules['llama_cpp'] = None\n" + call)
    assert r.stdout.startswith(f"moetier.Llama needs llama-cpp-python {LLAMA_CPP_VERSION} (Python package only): ")
    assert INSTALL_HINT in r.stdout
    # another version of it
    r = _lcpp_run("import moetier, llama_cpp; llama_cpp.__version__ = '0.0.1'\n" + call)
    assert (
        r.stdout
        == f"llama-cpp-python 0.0.1 is installed; moetier's libllama is {LLAMA_CPP_VERSION}'s: {INSTALL_HINT}\n"
    )
    # loaded on another libllama (its path made to look like another folder's)
    fake = "import moetier, llama_cpp; llama_cpp.llama_cpp._lib._name = '/elsewhere/libllama.so'\n"
    r = _lcpp_run(fake + call)
    assert r.stdout == (
        "llama_cpp was imported before moetier.Llama and loaded /elsewhere/libllama.so; import moetier first "
        f"(or set LLAMA_CPP_LIB_PATH={LIB_DIR})\n"
    )


def test_import_of_moetier_leaves_a_users_library_path_alone(tmp_path: Path) -> None:
    code = "import os, moetier; print(os.environ.get('LLAMA_CPP_LIB_PATH'))"
    assert _lcpp_run(code, LLAMA_CPP_LIB_PATH=str(tmp_path)).stdout == f"{tmp_path}\n"
    from moetier.lcpp import LIB_DIR

    assert _lcpp_run(code).stdout == f"{LIB_DIR}\n"
    # llama_cpp imported first: moetier does not point it anywhere
    r = _lcpp_run("import sys, types; sys.modules['llama_cpp'] = types.ModuleType('llama_cpp')\n" + code)
    assert r.stdout == "None\n"


@pytest.mark.parametrize("own_lib", [False, True])
def test_point_llama_cpp_here_only_without_a_library_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_lib: bool
) -> None:
    """`import moetier` points llama_cpp at moetier's libllama when llama_cpp has none of its own
    (installed without its native build: no lib/libllama*); a llama_cpp with its own library, or none
    installed, is left alone."""
    from importlib.machinery import ModuleSpec

    from moetier import lcpp

    pkg = tmp_path / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if own_lib:
        (pkg / "lib" / "libllama.so").write_bytes(b"")
    spec = ModuleSpec("llama_cpp", None, origin=str(pkg / "__init__.py"))
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    monkeypatch.delitem(sys.modules, "llama_cpp")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "llama_cpp" else None)
    lcpp.point_llama_cpp_here()
    assert os.environ.get("LLAMA_CPP_LIB_PATH") == (None if own_lib else str(lcpp.LIB_DIR))
    # not installed at all
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    lcpp.point_llama_cpp_here()
    assert "LLAMA_CPP_LIB_PATH" not in os.environ


def test_a_closed_llama_says_so_and_bad_arguments_are_config_errors(model_path: Path) -> None:
    """After close() every call that would reach the freed model is a ModelError (llama.cpp would read
    freed memory); a cache that is not a CacheConfig and an n_ctx that is not a count are ConfigErrors."""
    llm = _llama(model_path, CacheConfig.exact(budget=_min_budget(model_path), warm=False))
    assert llm.tokenize(b"hi") and llm.cache_stats().n_lookups == 0
    llm.close()
    for call in (
        lambda: llm.tokenize(b"hi"),
        lambda: llm.detokenize([1]),
        lambda: llm("hi", max_tokens=2),
        lambda: llm.eval([1]),
        llm.cache_stats,
        llm.cache_info,
        lambda: llm.has_expert_cache,
        lambda: llm.budget_note,
    ):
        with pytest.raises(moetier.ModelError) as e:
            call()
        assert str(e.value) == f"{model_path}: the model is closed"
    with pytest.raises(moetier.ConfigError, match=r"^moetier.Llama: cache '64M' must be a CacheConfig or None$"):
        moetier.Llama(str(model_path), cache="64M", verbose=False)
    with pytest.raises(moetier.ConfigError, match=r"^moetier.Llama: n_ctx None must be a number of tokens"):
        moetier.Llama(str(model_path), n_ctx=None, verbose=False)
