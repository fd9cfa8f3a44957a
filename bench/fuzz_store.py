"""Fuzzes what moetier reads from files it did not write itself: a store's manifest.json
(parser and the expert-range checks), the head of its experts.bin, and the GGUF header of the model
(the fields moetier reads: architecture, expert counts and shapes, tensor types).

    python bench/fuzz_store.py manifest -max_total_time=600
    python bench/fuzz_store.py gguf -max_total_time=600 -rss_limit_mb=4096

One target per run, driven by atheris (libFuzzer's mutation engine): each input is written over a
copy of a tiny packed model (tools/tiny.py), which is then loaded with an expert cache and, when
it loads, decoded. Every outcome must be a success or a moetier error (StoreError, ModelError,
ConfigError) whose message names the damaged file; anything else (another exception type, a crash,
a hang past -timeout, an RSS past -rss_limit_mb) is a finding, reported by libFuzzer with the input
that caused it. Half of the manifest inputs are structure-aware: the seed manifest with a few
fields set to boundary values (libFuzzer alone rarely keeps JSON valid). moetier's native code is
not built with coverage instrumentation, so the search is mutational around the seeds, not
coverage-guided. Prints the number of inputs tried and of each outcome as it goes (every 1000 inputs).
"""

from __future__ import annotations

import atexit
import collections
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import atheris
import gguf

from moetier import CacheConfig, Model, MoetierError, pack
from moetier.tools.tiny import write_tiny_model

WORK = Path(tempfile.mkdtemp(prefix="moetier-fuzz-"))
MODEL = write_tiny_model(WORK / "m.gguf", "qwen2moe", n_expert=8, n_expert_used=2)
STORE = pack(MODEL, WORK / "store", progress=False)
SEED_MANIFEST = (STORE / "manifest.json").read_bytes()
SEED_GGUF = MODEL.read_bytes()
GGUF_HEAD = int(gguf.GGUFReader(MODEL).data_offset)  # metadata and tensor infos end here
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
# boundary values for the structure-aware mutations
VALUES: list[Any] = [
    0,
    -1,
    1,
    4095,
    4096,
    2**31 - 1,
    2**31,
    2**32,
    2**53,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    1e308,
    "",
    "\u00ff",
    "q9_9",
    "f16",
    None,
    [],
    {},
    [0],
    True,
]
outcomes: collections.Counter[str] = collections.Counter()


def _leaves(o: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(o, dict):
        return [path] + [p for k, v in o.items() for p in _leaves(v, (*path, k))]
    if isinstance(o, list):
        return [path] + [p for i, v in enumerate(o) for p in _leaves(v, (*path, i))]
    return [path]


SEED_DOC = json.loads(SEED_MANIFEST)
PATHS = [p for p in _leaves(SEED_DOC) if p]


def _structured(fdp: atheris.FuzzedDataProvider) -> bytes:
    doc = json.loads(SEED_MANIFEST)
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        path = PATHS[fdp.ConsumeIntInRange(0, len(PATHS) - 1)]
        parent: Any = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            if fdp.ConsumeBool():
                parent[path[-1]] = VALUES[fdp.ConsumeIntInRange(0, len(VALUES) - 1)]
            elif isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent.pop(path[-1])
        except (KeyError, IndexError, TypeError, AttributeError):
            continue  # an earlier edit removed the path
    return json.dumps(doc).encode()


def _edited(seed: bytes, fdp: atheris.FuzzedDataProvider, span: int) -> bytes:
    """The seed with a few byte edits in its first span bytes (set, insert, delete, a number
    replaced by a boundary value, a cut): without coverage feedback libFuzzer keeps no corpus of its
    own, so every input is read as edits of the real file rather than as the file itself."""
    b = bytearray(seed)
    for _ in range(fdp.ConsumeIntInRange(1, 6)):
        if not b:
            break
        pos = fdp.ConsumeIntInRange(0, min(span, len(b)) - 1)
        op = fdp.ConsumeIntInRange(0, 9)
        if op <= 3:
            b[pos] = fdp.ConsumeIntInRange(0, 255)
        elif op <= 5:
            b[pos:pos] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
        elif op <= 7:
            del b[pos : pos + fdp.ConsumeIntInRange(1, 8)]
        elif op == 8:
            v = VALUES[fdp.ConsumeIntInRange(0, 12)]  # the integers
            end = pos
            while end < len(b) and chr(b[end]).isdigit():
                end += 1
            b[pos:end] = str(v).encode()
        else:
            del b[pos:]
    return bytes(b)


def _run(model: Path, store: Path | None, damaged: Path) -> None:
    try:
        m = Model(model, store=store, cache=CacheConfig.exact(budget="16M"))
        m.generate(PROMPT, max_tokens=4)
        outcomes["loaded and decoded"] += 1
    except MoetierError as e:
        # the message must say which file is at fault (the store directory or the model)
        if str(damaged.parent) not in str(e) and str(damaged) not in str(e):
            msg = f"the error does not name {damaged}: {e}"
            raise AssertionError(msg) from None
        outcomes[type(e).__name__] += 1
    n = sum(outcomes.values())
    if n & (n - 1) == 0 or n % 1000 == 0:  # libFuzzer exits without atexit: report as we go
        report()


def report() -> None:
    n = sum(outcomes.values())
    print(
        f"fuzz_store {sys.argv[1]}: {n} inputs: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()),
        file=sys.stderr,
        flush=True,
    )


def fuzz_manifest(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    text = _structured(fdp) if fdp.ConsumeBool() else _edited(SEED_MANIFEST, fdp, len(SEED_MANIFEST))
    d = WORK / "case"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(STORE, d)
    (d / "manifest.json").write_bytes(text)
    _run(MODEL, d, d / "manifest.json")


def fuzz_data_head(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    d = WORK / "case"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(STORE, d)
    raw = (STORE / "experts.bin").read_bytes()
    # edits of the header block (magic and store id) and the first expert, or a cut anywhere
    if fdp.ConsumeIntInRange(0, 9) == 0:
        raw = raw[: fdp.ConsumeIntInRange(0, len(raw) - 1)]
    else:
        raw = _edited(raw, fdp, 8192)
    (d / "experts.bin").write_bytes(raw)
    _run(MODEL, d, d / "experts.bin")


def fuzz_gguf(data: bytes) -> None:
    # edits of the model file's head (metadata and tensor infos); the store is packed from the
    # original, so a load that gets past the GGUF parser meets the identity check
    path = WORK / "case.gguf"
    path.write_bytes(_edited(SEED_GGUF, atheris.FuzzedDataProvider(data), GGUF_HEAD))
    _run(path, STORE, path)


TARGETS = {
    "manifest": (fuzz_manifest, [bytes(range(256)) * 2]),
    "data-head": (fuzz_data_head, [bytes(range(256)) * 2]),
    "gguf": (fuzz_gguf, [bytes(range(256)) * 2]),
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: fuzz_store.py {{{'|'.join(TARGETS)}}} [libFuzzer flags]")
    fn, seeds = TARGETS[sys.argv[1]]
    corpus = WORK / "corpus"
    corpus.mkdir()
    for i, s in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(s)
    atexit.register(shutil.rmtree, WORK, ignore_errors=True)

    # a file argument re-runs that input (a finding); otherwise the corpus directory is fuzzed
    files = [a for a in sys.argv[2:] if not a.startswith("-")]
    atheris.Setup([sys.argv[0], *sys.argv[2:], *([] if files else [str(corpus)])], fn)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
