"""llama.cpp's RPC backend on loopback: a ggml-rpc-server process (shipped as `moetier tool
ggml-rpc-server`) holds some layers, moetier serves the rest with its expert cache, and the greedy
tokens equal stock llama.cpp's with the same split. Layers whose experts the server holds compute
them there, as stock; configurations that cannot work are refused with the reason."""

from __future__ import annotations

import gc
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from _server import serve
from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, Model, ModelError, pack
from moetier.server import tool_path

N_LAYER = 4
N_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server() -> tuple[subprocess.Popen[str], str]:
    """A ggml-rpc-server on 127.0.0.1 (its CPU device, one thread), and its HOST:PORT."""
    port = free_port()
    proc = subprocess.Popen(
        [str(tool_path("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"ggml-rpc-server did not start: {proc.communicate()[1]}")
            time.sleep(0.05)
    return proc, f"127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen[str]) -> None:
    # models still holding the server's buffers free them first: llama.cpp's RPC client aborts the
    # process when a server it has buffers on is gone
    gc.collect()
    proc.terminate()
    proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def rpc_server() -> Iterator[str]:
    proc, endpoint = start_server()
    yield endpoint
    stop_server(proc)


@pytest.fixture(scope="module")
def model_and_store(tiny_model: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=N_LAYER)
    store = pack(path, tmp_path_factory.mktemp("rpc") / "store", progress=False)
    info = Model(path, store=store, cache=CacheConfig.exact(budget="64M")).cache_info()
    # 25% of the expert bytes, or the smallest budget the model takes if that is more
    budget = max(int(info["expert_bytes"]) // 4, int(info["min_cache_bytes"]))
    return path, store, budget


def tokens(m: Model) -> list[int]:
    return m.generate(LONG_PROMPT, max_tokens=N_TOKENS).tokens


@pytest.mark.parametrize(
    ("n_gpu_layers", "overrides", "served"),
    [
        (3, [], [0, 1]),  # layers 2 and 3 (and the output) on the server, experts and all: the cache serves 0, 1
        (99, ["exps=CPU"], [0, 1, 2, 3]),  # every layer there but the experts: the cache serves them all
    ],
)
def test_split_over_rpc_equals_stock_with_the_same_split(
    rpc_server: str, model_and_store: tuple[Path, Path, int], n_gpu_layers: int, overrides: list[str], served: list[int]
) -> None:
    path, store, budget = model_and_store
    split = {"n_gpu_layers": n_gpu_layers, "rpc": rpc_server, "tensor_overrides": overrides}
    want = tokens(Model(path, **split))  # type: ignore[arg-type]
    m = Model(path, store=store, cache=CacheConfig.exact(budget=budget), **split)  # type: ignore[arg-type]
    assert tokens(m) == want
    layers = sorted(s.layer for s in m.stats().layers)
    assert layers == served
    assert m.stats().n_lookups > 0 and m.stats().n_misses > 0


def test_every_layer_on_the_server_is_refused(rpc_server: str, model_and_store: tuple[Path, Path, int]) -> None:
    path, store, budget = model_and_store
    with pytest.raises(
        ModelError, match=r"every MoE layer's experts are on the RPC server RPC\d+ \(127\.0\.0\.1:\d+\)"
    ):
        Model(path, store=store, cache=CacheConfig.exact(budget=budget), n_gpu_layers=99, rpc=rpc_server)


@pytest.mark.parametrize("overrides", [["ffn_down_exps=CPU"], ["ffn_(up|gate)_exps=CPU"]])
def test_a_layer_whose_experts_are_split_over_rpc_is_refused(
    rpc_server: str, model_and_store: tuple[Path, Path, int], overrides: list[str]
) -> None:
    """Some of a layer's expert tensors on the server and the others here: the server would be sent
    slot ids, or this machine would compute with the server's tensors missing. Refused, naming the layer."""
    path, store, budget = model_and_store
    with pytest.raises(ModelError, match=r"layer \d+'s expert tensors are split between the RPC server RPC\d+"):
        Model(
            path,
            store=store,
            cache=CacheConfig.exact(budget=budget),
            n_gpu_layers=99,
            rpc=rpc_server,
            tensor_overrides=overrides,
        )


def test_vram_tier_on_an_rpc_device_is_refused(rpc_server: str, model_and_store: tuple[Path, Path, int]) -> None:
    path, store, budget = model_and_store
    cache = CacheConfig.exact(budget=budget, vram="64M")
    with pytest.raises(ModelError, match=r"runs on the RPC server .* cannot hold a VRAM tier"):
        Model(path, store=store, cache=cache, n_gpu_layers=99, rpc=rpc_server, tensor_overrides=["exps=CPU"])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"rpc": "nonsense"}, "'nonsense' is not HOST:PORT"),
        ({"rpc": ","}, "'' is not HOST:PORT"),
        ({"rpc": "127.0.0.1:PORT"}, r"cannot connect to 127\.0\.0\.1:\d+ \(Connection refused\)"),
        ({"tensor_overrides": ["exps"]}, "expected PATTERN=BUFFER_TYPE"),
        ({"tensor_overrides": ["exps=NOPE0"]}, "unknown buffer type 'NOPE0'; the devices here have: CPU"),
        ({"tensor_overrides": "exps=CPU"}, "must be a sequence of PATTERN=BUFFER_TYPE strings"),
        ({"rpc": ["127.0.0.1:1"]}, "must be a string of HOST:PORT"),
    ],
)
def test_bad_rpc_and_override_arguments(
    model_and_store: tuple[Path, Path, int], kw: dict[str, object], message: str
) -> None:
    path, _, _ = model_and_store
    if kw.get("rpc") == "127.0.0.1:PORT":
        kw = {"rpc": f"127.0.0.1:{free_port()}"}  # nothing listens there
    with pytest.raises(ConfigError, match=message):
        Model(path, **kw)  # type: ignore[arg-type]


def test_moetier_run_passes_rpc_and_overrides(rpc_server: str, model_and_store: tuple[Path, Path, int]) -> None:
    path, store, budget = model_and_store
    base = ["moetier", "run", "-m", str(path), "-p", LONG_PROMPT, "-n", str(N_TOKENS), "--temperature", "0"]
    split = ["-ngl", "99", "--rpc", rpc_server, "-ot", "exps=CPU"]
    stock = subprocess.run([*base, *split, "--no-cache"], capture_output=True, text=True, timeout=300)
    assert stock.returncode == 0, stock.stderr
    ours = subprocess.run(
        [*base, *split, "--store", str(store), "--cache", str(budget)], capture_output=True, text=True, timeout=300
    )
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == stock.stdout
    assert "compute their experts on the RPC server" not in ours.stderr  # every layer's experts are here


def test_a_load_without_rpc_never_touches_a_server_that_is_gone(model_and_store: tuple[Path, Path, int]) -> None:
    """A server stays registered in the process once named; a later load that does not name it uses
    none of its devices, so its going away does not abort that load (llama.cpp would ask it for its
    free memory)."""
    path, store, budget = model_and_store
    proc, endpoint = start_server()
    m = Model(path, store=store, cache=CacheConfig.exact(budget=budget), n_gpu_layers=3, rpc=endpoint)
    want = tokens(m)
    del m
    stop_server(proc)
    assert tokens(Model(path, store=store, cache=CacheConfig.exact(budget=budget))) == want


def test_moetier_serve_passes_rpc_and_overrides(
    rpc_server: str, model_and_store: tuple[Path, Path, int], tmp_path: Path
) -> None:
    """`moetier serve` hands --rpc and -ot to llama-server: its answers with the cache equal stock
    llama-server's with the same split, and /metrics counts the cache's lookups."""
    path, store, budget = model_and_store
    split = ["-ngl", "99", "--rpc", rpc_server, "-ot", "exps=CPU"]
    answers = {}
    for name, extra in (("stock", ["--metrics"]), ("cache", ["--store", str(store), "--cache", str(budget)])):
        with serve(["-m", str(path), *split, *extra], tmp_path / f"{name}.log") as srv:
            answers[name] = srv.complete(LONG_PROMPT, n_predict=N_TOKENS)["content"]
            lookups = srv.metric("expert_cache_lookups_total")
        assert (lookups > 0) == (name == "cache")
    assert answers["cache"] == answers["stock"] and answers["stock"]
