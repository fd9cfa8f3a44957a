#!/usr/bin/env python3
"""Checks the layering of csrc/ (STYLE.md section 1: calls go one way, one concept per file).

A module is a csrc file path without its extension (moetier-cache.h + moetier-cache.cpp are
"moetier-cache", policies/lru.cpp is "policies/lru"). Module A includes module B when a file of A has
`#include "X"` and X resolves to a file of B inside csrc/ (first relative to the including file, then
to csrc/); llama.cpp, ggml and system headers are ignored. The checks:

  a. the module include graph has no cycle;
  b. a member of a class or struct declared with a body in csrc/X.h is defined (`NAME::member(`)
     only in module X;
  c. no `thread_local` outside THREAD_LOCAL_ALLOWED.

It prints the modules as levels (a module's level is 1 + the highest level of what it includes;
level 0 includes nothing in csrc), then the violations and OK or FAIL. Exit status 0 or 1.
Comments and string literals are skipped with a rough lexer, not a C++ parser.

    python scripts/check-layers.py [--csrc DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# thread_local variables allowed in csrc/, as "path relative to csrc:variable name" -> why.
# Each entry needs its reason; an entry that matches no thread_local is reported, so the list stays true.
# Example:
#   "moetier-impl.cpp:g_last_error": "the C API's last error is per calling thread, as errno is",
THREAD_LOCAL_ALLOWED: dict[str, str] = {
    "moetier-impl.cpp:g_last_error": "the C API's last error (moetier_last_error) is per calling thread, as errno is",
    "moetier-params.cpp:g_opts_error": "storage of the message moetier_params_set_opts/check return, per thread",
    "moetier.cpp:msg": "storage of the string moetier_model_error returns, per calling thread",
    "moetier-configure.cpp:g_pending": "a cache configuration is for the next load on the thread that set it "
    "(llama_model_load runs on its caller's thread): two threads loading one file never swap them",
}

# Public C headers: declarations only, included by every layer. Each is a module of its own (its
# name with the suffix), apart from the .cpp that implements it at the top (llama.h / llama.cpp).
PUBLIC_HEADERS = ("moetier.h",)

SOURCE_SUFFIXES = (".h", ".cpp")

INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
# `class NAME {`, `struct NAME final : base<T> {`: a declaration with a body (not a forward declaration,
# not `template <class T>`, not a function returning `struct NAME *`); group 1 is `enum ` for an enum class
CLASS_RE = re.compile(
    r"(?<!\w)(enum\s+)?(?:class|struct)\s+(?:alignas\s*\([^)]*\)\s*)?(\w+)(?=\s*(?:final\b\s*)?(?::[^;{}()]*)?\{)"
)
MEMBER_DEF_RE = re.compile(r"(?<![\w:])(\w+)\s*::\s*(~?\w+|operator\b[^(;{}]*)\s*\(")
THREAD_LOCAL_RE = re.compile(r"\bthread_local\b")
# the string of `extern "C"` is blanked by then: any `extern "..." {` opens a linkage block
NAMESPACE_OPEN_RE = re.compile(r'(?:\bnamespace(?:\s+[\w:]+)?|\bextern\s*"[^"]*")\s*$')


@dataclass
class SourceFile:
    """One csrc file: its module, its text with comments blanked, and with comments and strings blanked."""

    path: Path  # relative to csrc
    module: str
    code: str  # comments blanked (string literals kept: include names)
    bare: str  # comments and string/char literal contents blanked
    depth: list[int] = field(default_factory=list)  # brace depth at each offset of `bare`, namespaces not counted

    def line_of(self, offset: int) -> int:
        return self.code.count("\n", 0, offset) + 1


def blank(text: str, keep_strings: bool) -> str:
    """`text` with comments (and, unless keep_strings, string and char literal contents) replaced by
    spaces; newlines are kept, so offsets and line numbers stay those of the file."""
    out = list(text)
    i, n = 0, len(text)

    def wipe(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            wipe(i, j)
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.compile(r'R"([^ ()\\\t\n]{0,16})\(').match(text, i)
            if m is None:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', m.end())
            end = n if end < 0 else end + len(m.group(1)) + 2
            if not keep_strings:
                wipe(i + 2, end - 1)
            i = end
        elif c == '"' or (c == "'" and (i == 0 or not text[i - 1].isalnum())):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            if not keep_strings:
                wipe(i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def brace_depths(bare: str) -> list[int]:
    """Brace depth before each offset; the braces of `namespace ... {` and `extern "C" {` do not count,
    so depth 0 is namespace scope."""
    depth = [0] * (len(bare) + 1)
    stack: list[bool] = []  # True: a counted brace
    d = 0
    last_stmt = 0  # offset after the last `;`, `{` or `}`
    for i, c in enumerate(bare):
        depth[i] = d
        if c == "{":
            counted = NAMESPACE_OPEN_RE.search(bare, last_stmt, i) is None
            stack.append(counted)
            d += counted
            last_stmt = i + 1
        elif c == "}":
            if stack and stack.pop():
                d -= 1
            last_stmt = i + 1
        elif c == ";":
            last_stmt = i + 1
    depth[len(bare)] = d
    return depth


def load(csrc: Path) -> dict[Path, SourceFile]:
    files: dict[Path, SourceFile] = {}
    for p in sorted(csrc.rglob("*")):
        if p.suffix not in SOURCE_SUFFIXES or not p.is_file():
            continue
        rel = p.relative_to(csrc)
        text = p.read_text(encoding="utf-8", errors="replace")
        bare = blank(text, keep_strings=False)
        module = rel.as_posix() if rel.as_posix() in PUBLIC_HEADERS else rel.with_suffix("").as_posix()
        files[rel] = SourceFile(rel, module, blank(text, keep_strings=True), bare, brace_depths(bare))
    return files


def resolve(csrc: Path, src: Path, name: str, files: dict[Path, SourceFile]) -> Path | None:
    """The csrc-relative path `#include "name"` in csrc/`src` names, or None outside csrc."""
    root = csrc.resolve()
    for base in (root / src.parent, root):
        cand = (base / name).resolve()
        try:
            rel = cand.relative_to(root)
        except ValueError:
            continue
        if rel in files:
            return rel
    return None


def include_graph(csrc: Path, files: dict[Path, SourceFile]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {f.module: set() for f in files.values()}
    for f in files.values():
        for m in INCLUDE_RE.finditer(f.code):
            target = resolve(csrc, f.path, m.group(1), files)
            if target is not None and files[target].module != f.module:
                graph[f.module].add(files[target].module)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative; each component sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp: list[str] = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    comps.append(sorted(comp))
    return comps


def cycle_in(comp: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through the first module of a strongly connected component: A -> ... -> A."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first: the shortest cycle back to start
        nxt: list[str] = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start, start]


def levels(graph: dict[str, set[str]], comps: list[list[str]]) -> dict[str, int]:
    """Level of each module: 1 + the highest level it includes, 0 for none; a cycle's modules share one."""
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    level: dict[int, int] = {}
    # Tarjan emits a component after every component it reaches: this order is bottom-up
    for i, comp in enumerate(comps):
        below = [level[comp_of[w]] for m in comp for w in graph[m] if comp_of[w] != i]
        level[i] = 1 + max(below) if below else 0
    return {m: level[comp_of[m]] for m in graph}


def misplaced_members(files: dict[Path, SourceFile]) -> list[str]:
    owners: dict[str, set[str]] = {}
    where: dict[str, set[str]] = {}
    for f in files.values():
        if f.path.suffix != ".h":
            continue
        for m in CLASS_RE.finditer(f.bare):
            if m.group(1) is None:
                owners.setdefault(m.group(2), set()).add(f.module)
                where.setdefault(m.group(2), set()).add(f"csrc/{f.path.as_posix()}")
    out: list[str] = []
    for f in files.values():
        for m in MEMBER_DEF_RE.finditer(f.bare):
            name = m.group(1)
            if name not in owners or f.module in owners[name] or f.depth[m.start()] != 0:
                continue
            # a definition starts its statement; `x = NAME::f(...)` at namespace scope is a call
            stmt = max(f.bare.rfind(c, 0, m.start()) for c in ";{}")
            if "=" in f.bare[stmt + 1 : m.start()]:
                continue
            member = re.sub(r"\s+", " ", m.group(2)).strip()
            out.append(
                f"csrc/{f.path.as_posix()}:{f.line_of(m.start())}: {name}::{member} is defined outside "
                f"{' / '.join(sorted(where[name]))}"
            )
    return out


def thread_locals(files: dict[Path, SourceFile]) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for f in files.values():
        for m in THREAD_LOCAL_RE.finditer(f.bare):
            end = len(f.bare)
            for c in ";={([":
                k = f.bare.find(c, m.end())
                if k >= 0:
                    end = min(end, k)
            names = re.findall(r"\w+", f.bare[m.end() : end])
            key = f"{f.path.as_posix()}:{names[-1] if names else '?'}"
            seen.add(key)
            if key not in THREAD_LOCAL_ALLOWED:
                out.append(f"csrc/{f.path.as_posix()}:{f.line_of(m.start())}: thread_local {key.split(':')[1]}")
    for key in sorted(THREAD_LOCAL_ALLOWED.keys() - seen):
        out.append(f"THREAD_LOCAL_ALLOWED[{key!r}] matches no thread_local: remove the entry")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--csrc", type=Path, default=Path(__file__).resolve().parent.parent / "csrc", help="csrc directory")
    ns = ap.parse_args(argv)
    csrc: Path = ns.csrc
    files = load(csrc)
    if not files:
        sys.stderr.write(f"check-layers: {csrc}: no .h or .cpp files\n")
        return 1
    graph = include_graph(csrc, files)
    comps = strongly_connected(graph)
    lvl = levels(graph, comps)
    cyclic = {m for c in comps if len(c) > 1 for m in c}

    w = sys.stdout.write
    n_edges = sum(len(v) for v in graph.values())
    w(f"csrc modules: {len(graph)}, include edges: {n_edges}; a module includes only lower levels\n")
    for n in range(max(lvl.values()) + 1):
        mods = sorted(m for m in lvl if lvl[m] == n)
        if mods:
            w(f"level {n}: {', '.join(m + ('*' if m in cyclic else '') for m in mods)}\n")
    if cyclic:
        w("(* in an include cycle: its modules share a level)\n")

    problems: list[tuple[str, list[str]]] = [
        ("include cycles", [" -> ".join(cycle_in(c, graph)) for c in comps if len(c) > 1]),
        ("member functions defined outside their class's module", misplaced_members(files)),
        ("thread_local outside THREAD_LOCAL_ALLOWED (scripts/check-layers.py)", thread_locals(files)),
    ]
    total = 0
    for title, items in problems:
        if items:
            w(f"\n{title} ({len(items)}):\n")
            for item in items:
                w(f"  {item}\n")
            total += len(items)
    w("\nOK\n" if total == 0 else f"\nFAIL: {total} violations\n")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
