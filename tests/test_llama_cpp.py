"""llama-cpp-python's Llama (its Python package, no native build of its own) on moetier's patched
libllama, with the experts served by the expert cache: moetier.Llama is a llama_cpp.Llama."""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import moetier
from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, Model, ModelError
from moetier.lcpp import INSTALL_HINT, import_llama_cpp

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip(f"llama-cpp-python is not installed: {INSTALL_HINT}", allow_module_level=True)
llama_cpp = import_llama_cpp()  # on moetier's libllama


@pytest.fixture(scope="module")
def model_path(tiny_model: ModelFactory) -> Path:
    return tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)


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


def test_oracle_same_greedy_tokens_as_model_and_stock(model_path: Path) -> None:
    budget = _min_budget(model_path)
    stock = Model(model_path, n_ctx=512).generate(LONG_PROMPT, max_tokens=16)
    cached = Model(model_path, cache=CacheConfig.exact(budget=budget, warm=False), n_ctx=512)
    ours = cached.generate(LONG_PROMPT, max_tokens=16)
    llm = _llama(model_path, CacheConfig.exact(budget=budget, warm=False))
    assert llm.has_expert_cache and llm.cache_info()["cache_bytes"] == cached.cache_info()["cache_bytes"]
    assert _greedy(llm, 16) == ours.tokens == stock.tokens
    s = llm.cache_stats()
    assert s.n_lookups > 0 and s.n_misses > 0 and s.n_hits + s.n_misses == s.n_lookups


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
    with pytest.raises(ValueError, match="null pointer"):
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
