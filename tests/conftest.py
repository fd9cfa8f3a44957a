"""Fixture models are generated (never downloaded): tiny qwen2moe/qwen3moe GGUFs, a few MB each."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from moetier.tools.tiny import write_tiny_model

ModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    """tiny_model(arch, n_expert=8, n_expert_used=2, seed=1, **kw) -> path, cached per session."""
    cache: dict[tuple[object, ...], Path] = {}
    root = tmp_path_factory.mktemp("models")

    def make(arch: str = "qwen2moe", **kw: object) -> Path:
        key = (arch, *sorted(kw.items()))
        if key not in cache:
            name = arch + "".join(f"-{k}{v}" for k, v in sorted(kw.items())) + ".gguf"
            cache[key] = write_tiny_model(root / name, arch, **kw)  # type: ignore[arg-type]
        return cache[key]

    return make


StoredModel = tuple[Path, Path, int]


@pytest.fixture
def stored_tiny(tiny_model: ModelFactory, tmp_path: Path) -> StoredModel:
    """A tiny qwen2moe (8 experts, top-2, 3 layers), its store packed under tmp_path, and the smallest
    cache budget it takes: (model, store, bytes)."""
    from moetier import CacheConfig, Model, pack

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    store = pack(path, tmp_path / "store", progress=False)
    lo = int(Model(path, store=store, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
    return path, store, lo


@pytest.fixture(autouse=True, scope="module")
def thaw_after_module() -> Iterator[None]:
    """What cold_start froze becomes collectable again once its module ends: a module fixture's model,
    or a failed test's frames, that turned into cyclic garbage is freed then, not kept to the end."""
    yield
    gc.unfreeze()
    gc.collect()


# per-test tmp_path folders of tests that have ended: no later test reads them, so the sidecar scan skips them
_ENDED: set[str] = set()


@pytest.fixture(autouse=True)
def cold_start(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test starts with cold caches: the warm-start sidecars that earlier tests' models wrote
    next to the shared fixture models and stores are removed (tests of warm starts write their own)."""
    # models freed late would write theirs during this test; freezing what survives keeps each collection
    # to the objects made since the last one (a full collection of the heap cost 0.2 s a test, and grew)
    gc.collect()
    gc.freeze()
    base = tmp_path_factory.getbasetemp()
    for top in base.iterdir():
        if top.name in _ENDED or not top.is_dir():
            continue
        for pattern in ("*.cache-state", "cache-state.bin"):
            for f in top.rglob(pattern):
                f.unlink(missing_ok=True)
    yield
    own = request.node.funcargs.get("tmp_path") if "tmp_path" in request.fixturenames else None
    if isinstance(own, Path) and own.parent == base:
        _ENDED.add(own.name)


LONG_PROMPT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
)


def fake_proc_tree(root: Path, cgroup: str, files: dict[str, str], meminfo_kb: int = 8 << 20) -> Path:
    """A fake /proc and /sys under root for the core's memory readers: /proc/self/cgroup, a meminfo
    with MemTotal (twice meminfo_kb) and MemAvailable (meminfo_kb), and the given files."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/meminfo").write_text(f"MemTotal: {2 * meminfo_kb} kB\nMemAvailable: {meminfo_kb} kB\n")
    for name, text in files.items():
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


def text_flag_refusals_and_help(
    main: Callable[[list[str]], int],
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """For a tool whose `main` takes MODEL --text FILE: an unreadable --text is refused naming the
    flag and the file, a missing one by argparse (status 2); returns its --help at 200 columns."""
    from moetier import ConfigError

    missing = tmp_path / "none.txt"
    with pytest.raises(ConfigError) as e:
        main([str(model), "--text", str(missing)])
    assert str(e.value) == f"--text {missing}: cannot read it (No such file or directory); give text files"
    with pytest.raises(SystemExit) as ex:
        main([str(model)])
    assert ex.value.code == 2 and "the following arguments are required: --text" in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["--help"])
    return capsys.readouterr().out
