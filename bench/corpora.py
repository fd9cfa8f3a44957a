"""Real offline text for calibration and evaluation, from Debian packages and the Python stdlib.

Corpora (documents are files; each goes wholly to one split, by a hash of its path):

    py-tutorial   the Python 3.11 tutorial (HTML of Debian python3.11-doc, as plain text)
    py-library    the Python 3.11 library reference (same package)
    linux-doc     the Linux 6.1 Documentation/ reStructuredText (Debian linux-doc-6.1)
    py-stdlib     the running Python's standard library sources, top level *.py ("code")
    fortunes      general English prose: quotes, literature, definitions (Debian fortunes)
    fortunes-de   German prose: quotes, anecdotes, recipes, proverbs (Debian fortunes-de)
    fortunes-es   Spanish prose: quotes, proverbs, humour (Debian fortunes-es)

The .deb files are fetched with `apt-get download` (no install, no root needed to read them) and
read as tar streams from `dpkg-deb --fsys-tarfile`. Built text is cached under
`$MOETIER_CACHE/corpora/` as NAME.calib.txt, NAME.eval.txt and NAME.json (documents, sizes, source).

    python bench/corpora.py build                 # every corpus; prints chars per split
    python bench/corpora.py show py-tutorial eval --chars 2000
    python bench/corpora.py mix calib fortunes linux-doc py-library py-stdlib -o calib.txt
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from tqdm import tqdm

SPLITS = ("calib", "eval")
EVAL_PERCENT = 20
DOC_SEPARATOR = "\n\n"


class CorpusError(Exception):
    """A corpus is unknown, or its source package cannot be downloaded or read."""


def default_cache() -> Path:
    return Path(os.environ.get("MOETIER_CACHE", str(Path.home() / ".cache" / "moetier")))


# ---------------------------------------------------------------------------------------------
# HTML to text


_BLOCK = frozenset(
    {
        "address",
        "article",
        "aside",
        "blockquote",
        "caption",
        "dd",
        "details",
        "div",
        "dl",
        "dt",
        "figcaption",
        "figure",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "hr",
        "li",
        "main",
        "ol",
        "p",
        "pre",
        "section",
        "summary",
        "table",
        "tbody",
        "thead",
        "tr",
        "ul",
    }
)
_LINE = frozenset({"br", "dd", "dt", "li", "tr"})
_SKIP_TAGS = frozenset(
    {"button", "footer", "form", "head", "header", "nav", "noscript", "script", "style", "template", "title"}
)
_SKIP_CLASSES = frozenset(
    {"copybutton", "footer", "headerlink", "inline-search", "menu-wrapper", "mobile-nav", "related", "sphinxsidebar"}
)
_VOID = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
)
_WS = re.compile(r"\s+")


class _TextExtractor(HTMLParser):
    """Plain text of an HTML page: navigation, headers, footers, scripts and permalinks dropped,
    whitespace of running text collapsed, <pre> blocks kept verbatim, blocks separated by blank lines."""

    def __init__(self, main_only: bool) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.pending = 0  # newlines owed before the next text
        self.line_start = True
        self.pre = 0
        self.cell = 0  # inside a table cell: blocks are run together
        self.skip: tuple[str, int] | None = None  # tag being skipped, nesting depth of that tag
        self.main: tuple[str, int] | None = None  # tag of the main region while inside it
        self.main_only = main_only

    def _active(self) -> bool:
        return self.skip is None and (not self.main_only or self.main is not None)

    def _break(self, n: int) -> None:
        if self.out and self.out[-1] == "- " and not self.pending:
            return  # the first block of a list item starts on the item's line
        self.pending = max(self.pending, n)

    def _emit(self, s: str) -> None:
        if not s:
            return
        if self.pending and self.out:
            self.out.append("\n" * self.pending)
            self.line_start = True
        self.pending = 0
        self.out.append(s)
        self.line_start = s.endswith("\n")

    def _space(self) -> None:
        if not (self.line_start or self.pending or (self.out and self.out[-1].endswith(" "))):
            self._emit(" ")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.skip is not None:
            if tag == self.skip[0]:
                self.skip = (tag, self.skip[1] + 1)
            return
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        if tag in _SKIP_TAGS or classes & _SKIP_CLASSES or a.get("role") == "navigation":
            if tag not in _VOID:
                self.skip = (tag, 1)
            return
        if self.main is not None and tag == self.main[0]:
            self.main = (tag, self.main[1] + 1)
        elif self.main is None and a.get("role") == "main" and tag not in _VOID:
            self.main = (tag, 1)
        if not self._active():
            return
        if tag == "pre":
            self._break(2)
            self.pre += 1
        elif tag in _LINE:
            self._break(1)
            if tag == "li":
                self._emit("- ")
        elif tag in ("td", "th"):
            self.cell += 1
            self._space()
        elif tag in _BLOCK and self.cell:
            self._space()
        elif tag in _BLOCK:
            self._break(2)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._active() and tag in ("br", "hr"):
            self._break(1 if tag == "br" else 2)

    def handle_endtag(self, tag: str) -> None:
        if self.skip is not None:
            if tag == self.skip[0]:
                depth = self.skip[1] - 1
                self.skip = (tag, depth) if depth else None
            return
        if not self._active():
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
            self._break(2)
        elif tag in ("td", "th"):
            self.cell = max(0, self.cell - 1)
        elif tag in _BLOCK and not self.cell:
            self._break(1 if tag in _LINE else 2)
        if self.main is not None and tag == self.main[0]:
            depth = self.main[1] - 1
            self.main = (tag, depth) if depth else None

    def handle_data(self, data: str) -> None:
        if not self._active():
            return
        if self.pre:
            self._emit(data)
            return
        s = _WS.sub(" ", data)
        if self.line_start or self.pending or (self.out and self.out[-1].endswith(" ")):
            s = s.lstrip(" ")
        self._emit(s)


def html_to_text(html: str) -> str:
    """Plain text of an HTML page. If the page marks a main region (role="main", as Sphinx does),
    only that region is kept; otherwise the whole page less navigation, headers and footers."""
    p = _TextExtractor(main_only='role="main"' in html)
    p.feed(html)
    p.close()
    lines = [line.rstrip() for line in "".join(p.out).split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


# ---------------------------------------------------------------------------------------------
# Splits


def split_of(doc_id: str, eval_percent: int = EVAL_PERCENT) -> str:
    """'eval' for about `eval_percent`% of document ids, else 'calib'; depends on the id alone."""
    bucket = int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "eval" if bucket < eval_percent else "calib"


def assign_splits(doc_ids: Iterable[str], eval_percent: int = EVAL_PERCENT) -> dict[str, list[str]]:
    """Sorted document ids per split. Each document is in exactly one split; a document's split does
    not depend on the others, except that with two or more documents neither split is left empty
    (the document with the lowest hash moves to eval, or the highest to calib)."""
    ids = sorted(set(doc_ids))
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for d in ids:
        out[split_of(d, eval_percent)].append(d)
    if len(ids) >= 2:

        def key(d: str) -> str:
            return hashlib.sha256(d.encode("utf-8")).hexdigest()

        if not out["eval"]:
            d = min(out["calib"], key=key)
            out["calib"].remove(d)
            out["eval"].append(d)
        elif not out["calib"]:
            d = max(out["eval"], key=key)
            out["eval"].remove(d)
            out["calib"].append(d)
    return out


def join_documents(docs: dict[str, str], ids: Sequence[str]) -> str:
    """The text of a split: its non-empty documents in id order, separated by a blank line."""
    parts = [docs[d].strip() for d in ids]
    return DOC_SEPARATOR.join(p for p in parts if p) + "\n"


# ---------------------------------------------------------------------------------------------
# Sources


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _gunzip(data: bytes) -> str:
    return _decode(gzip.decompress(data))


def _html(data: bytes) -> str:
    return html_to_text(_decode(data))


@dataclass(frozen=True)
class CorpusSpec:
    """Files under `root` ending in `suffix` (recursively or not), each one document."""

    name: str
    description: str
    root: str  # inside the package's file system tree, or "stdlib" for the running Python's stdlib
    suffix: str
    convert: Callable[[bytes], str]
    deb: str = ""  # Debian package; empty for the stdlib
    recursive: bool = False
    skip: tuple[str, ...] = ()  # name endings that are not documents (index files, links)

    def matches(self, rel: str) -> bool:
        """Whether `rel` (a path relative to `root`) is a document of this corpus."""
        return (
            rel.endswith(self.suffix) and not rel.endswith(self.skip or ("\0",)) and (self.recursive or "/" not in rel)
        )


def _fortunes(data: bytes) -> str:
    """A fortune file: entries separated by lines holding only '%'."""
    return re.sub(r"\n%\n", "\n\n", "\n" + _decode(data)).strip() + "\n"


PYDOC = "usr/share/doc/python3.11/html"
CORPORA: dict[str, CorpusSpec] = {
    s.name: s
    for s in (
        CorpusSpec(
            "py-tutorial",
            "Python 3.11 tutorial (python3.11-doc HTML as text)",
            f"{PYDOC}/tutorial",
            ".html",
            _html,
            deb="python3.11-doc",
        ),
        CorpusSpec(
            "py-library",
            "Python 3.11 library reference (python3.11-doc HTML as text)",
            f"{PYDOC}/library",
            ".html",
            _html,
            deb="python3.11-doc",
        ),
        CorpusSpec(
            "linux-doc",
            "Linux 6.1 Documentation/**/*.rst (linux-doc-6.1)",
            "usr/share/doc/linux-doc-6.1/Documentation",
            ".rst.gz",
            _gunzip,
            deb="linux-doc-6.1",
            recursive=True,
        ),
        CorpusSpec("py-stdlib", "Python standard library sources, top level *.py", "stdlib", ".py", _decode),
        CorpusSpec(
            "fortunes",
            "general English prose: quotes, literature, definitions, humour (Debian fortunes, '%' lines dropped)",
            "usr/share/games/fortunes",
            "",
            _fortunes,
            deb="fortunes",
            skip=(".dat", ".u8", "ascii-art", "art"),
        ),
        CorpusSpec(
            "fortunes-de",
            "German prose: quotes, anecdotes, recipes, proverbs (Debian fortunes-de)",
            "usr/share/games/fortunes/de",
            "",
            _fortunes,
            deb="fortunes-de",
            skip=(".u8", "asciiart"),
        ),
        CorpusSpec(
            "fortunes-es",
            "Spanish prose: quotes, proverbs, humour (Debian fortunes-es)",
            "usr/share/games/fortunes/es",
            ".fortunes",
            _fortunes,
            deb="fortunes-es",
        ),
    )
}


def _progress(total: int | None, desc: str, quiet: bool) -> tqdm[Any]:
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet or not sys.stderr.isatty()
    )


def deb_file(package: str, cache: Path) -> Path:
    """The .deb of `package` in CACHE/corpora/debs, downloaded with `apt-get download` if not there."""
    dest = cache / "corpora" / "debs"
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"{package}_*.deb"))
    if not found:
        r = subprocess.run(["apt-get", "download", package], cwd=dest, capture_output=True, text=True, check=False)
        found = sorted(dest.glob(f"{package}_*.deb"))
        if r.returncode != 0 or not found:
            msg = (
                f"apt-get download {package} failed ({r.stderr.strip().splitlines()[-1:] or r.returncode}); "
                "run apt-get update first, or check that the package exists"
            )
            raise CorpusError(msg)
    return found[-1]


def _deb_documents(spec: CorpusSpec, deb: Path, quiet: bool) -> Iterator[tuple[str, bytes]]:
    installed = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Installed-Size"], capture_output=True, text=True, check=True
    ).stdout.strip()
    total = int(installed) * 1024 if installed.isdigit() else None
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    prefix = spec.root.strip("/") + "/"
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as t, _progress(total, f"read {deb.name}", quiet) as bar:
            for m in t:
                bar.update(m.size)
                name = m.name.removeprefix("./")
                if not (m.isfile() and name.startswith(prefix)):
                    continue
                rel = name[len(prefix) :]
                if spec.matches(rel):
                    f = t.extractfile(m)
                    assert f is not None
                    yield rel, f.read()
    finally:
        proc.stdout.close()
        if proc.wait() != 0:
            msg = f"dpkg-deb --fsys-tarfile {deb} exited {proc.returncode}"
            raise CorpusError(msg)


def _stdlib_documents(spec: CorpusSpec, quiet: bool) -> Iterator[tuple[str, bytes]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in (root.rglob("*") if spec.recursive else root.iterdir())
        if p.is_file() and spec.matches(p.relative_to(root).as_posix())
    )
    with _progress(sum(p.stat().st_size for p in files), f"read {root}", quiet) as bar:
        for p in files:
            data = p.read_bytes()
            bar.update(len(data))
            yield p.relative_to(root).as_posix(), data


def source_version(spec: CorpusSpec, cache: Path) -> str:
    if spec.deb:
        return deb_file(spec.deb, cache).name
    return f"python {sys.version.split()[0]} stdlib at {sysconfig.get_paths()['stdlib']}"


def documents(spec: CorpusSpec, cache: Path, quiet: bool = False) -> dict[str, str]:
    """Document id (path under the corpus root) -> plain text."""
    raw = _deb_documents(spec, deb_file(spec.deb, cache), quiet) if spec.deb else _stdlib_documents(spec, quiet)
    return {rel: spec.convert(data) for rel, data in raw}


# ---------------------------------------------------------------------------------------------
# Build and read


def _paths(name: str, cache: Path) -> dict[str, Path]:
    d = cache / "corpora"
    return {**{s: d / f"{name}.{s}.txt" for s in SPLITS}, "meta": d / f"{name}.json"}


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def build(name: str, cache_dir: Path | None = None, *, force: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Build (or, when cached and not `force`, read) a corpus; returns its metadata."""
    if name not in CORPORA:
        msg = f"unknown corpus {name!r}; known: {', '.join(CORPORA)}"
        raise CorpusError(msg)
    cache = cache_dir or default_cache()
    paths = _paths(name, cache)
    if not force and all(p.exists() for p in paths.values()):
        meta: dict[str, Any] = json.loads(paths["meta"].read_text())
        return meta
    spec = CORPORA[name]
    docs = documents(spec, cache, quiet)
    if not docs:
        msg = f"{name}: no document under {spec.root} ending in {spec.suffix}"
        raise CorpusError(msg)
    splits = assign_splits(docs)
    paths["meta"].parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "name": name,
        "description": spec.description,
        "source": source_version(spec, cache),
        "eval_percent": EVAL_PERCENT,
        "splits": {},
    }
    for s in SPLITS:
        text = join_documents(docs, splits[s])
        _write(paths[s], text)
        meta["splits"][s] = {
            "documents": len(splits[s]),
            "chars": len(text),
            "bytes": len(text.encode("utf-8")),
            "ids": splits[s],
        }
    _write(paths["meta"], json.dumps(meta, indent=1) + "\n")
    return meta


def corpus(name: str, split: str, cache_dir: Path | None = None) -> str:
    """The text of one split ('calib' or 'eval') of a corpus, built and cached on first use."""
    if split not in SPLITS:
        msg = f"unknown split {split!r}; use one of {', '.join(SPLITS)}"
        raise CorpusError(msg)
    cache = cache_dir or default_cache()
    build(name, cache)
    return _paths(name, cache)[split].read_text(encoding="utf-8")


def mix(
    names: Sequence[str],
    split: str,
    n_chars: int,
    slice_chars: int = 3000,
    cache_dir: Path | None = None,
    extra: Sequence[str] = (),
) -> str:
    """One text of n_chars from several corpora's split (and the texts of extra, each as one more
    corpus), interleaved slice by slice (so the first tokens of it, which a calibration takes, hold
    every corpus in its share). A name may carry a weight, NAME:W: W consecutive slices of it a
    round (default 1)."""
    texts: list[tuple[str, int]] = []
    for spec in names:
        name, _, w = spec.partition(":")
        if w and (not w.isdigit() or int(w) < 1):
            msg = f"mix: weight of {spec!r} must be a positive integer"
            raise CorpusError(msg)
        texts.append((corpus(name, split, cache_dir), int(w or 1)))
    texts += [(t, 1) for t in extra]
    out: list[str] = []
    total = 0
    pos = [0] * len(texts)
    while total < n_chars and any(p < len(t) for p, (t, _) in zip(pos, texts, strict=True)):
        for j, (t, w) in enumerate(texts):
            piece = t[pos[j] : pos[j] + w * slice_chars]
            pos[j] += w * slice_chars
            out.append(piece)
            total += len(piece)
    return "".join(out)[:n_chars]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache directory (default: $MOETIER_CACHE or ~/.cache/moetier); text goes to CACHE/corpora",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build corpora (default: all) and print their sizes")
    b.add_argument("names", nargs="*", metavar="NAME", help=f"corpora to build (default: all of {', '.join(CORPORA)})")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    s = sub.add_parser("show", help="print the start of a corpus split")
    s.add_argument("name", choices=list(CORPORA), help="corpus")
    s.add_argument("split", choices=SPLITS, help="split")
    s.add_argument("--chars", type=int, default=2000, help="characters to print (default: 2000)")
    x = sub.add_parser("mix", help="interleave several corpora's split into one text (a calibration mix)")
    x.add_argument("split", choices=SPLITS, help="split")
    x.add_argument(
        "names",
        nargs="+",
        metavar="NAME[:W]",
        help=f"corpora to mix ({', '.join(CORPORA)}); :W takes W slices of it for each one of the others",
    )
    x.add_argument("--chars", type=int, default=400_000, help="characters to write (default: 400000)")
    x.add_argument("-o", "--output", type=Path, required=True, help="text file to write")
    x.add_argument(
        "--prose-model",
        default=None,
        help="also mix in everyday prose this (dense) GGUF writes itself (moetier.tools.moefy.generated_prose)",
    )
    x.add_argument("--prose-tokens", type=int, default=4096, help="tokens of that prose (default: 4096)")
    a = ap.parse_args(argv)
    if a.cmd == "build" and (unknown := set(a.names) - set(CORPORA)):
        ap.error(f"unknown corpus {', '.join(sorted(unknown))}; known: {', '.join(CORPORA)}")
    try:
        if a.cmd == "build":
            print("| corpus | split | documents | chars | source |")
            print("|---|---|---|---|---|")
            for name in a.names or CORPORA:
                meta = build(name, a.cache, force=a.force, quiet=a.quiet)
                for sp in SPLITS:
                    m = meta["splits"][sp]
                    print(f"| {name} | {sp} | {m['documents']} | {m['chars']:,} | {meta['source']} |")
        elif a.cmd == "mix":
            extra = []
            if a.prose_model:
                from moetier.tools.moefy import generated_prose

                extra.append("\n\n".join(generated_prose(a.prose_model, a.prose_tokens)))
            text = mix(a.names, a.split, a.chars, cache_dir=a.cache, extra=extra)
            a.output.write_text(text, encoding="utf-8")
            more = f" + {a.prose_tokens} tokens of {a.prose_model}'s own prose" if a.prose_model else ""
            print(f"{a.output}: {len(text):,} characters of {', '.join(a.names)} ({a.split}){more}")
        else:
            print(corpus(a.name, a.split, a.cache)[: a.chars])
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
