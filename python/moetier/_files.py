"""Files written whole or not at all: a report, a config, a trace or a model written by a tool replaces
the old one in one rename, so that a write that fails (a full disk, a killed process) leaves the old
file, or no file, and never the first part of a new one."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write; renamed over `path` when the block ends.
    Its name keeps `path`'s suffix, for writers that choose the format by it (numpy, matplotlib) and
    holds the process and thread, for two writers of one file. A symbolic link is followed (the file
    it names is replaced; the link stays) and an existing file's permissions are kept. If the block
    fails, the temporary file is removed and `path` is as it was; an OSError about the temporary file
    names `path` instead."""
    out = Path(path)
    if out.name in ("", ".", ".."):
        raise IsADirectoryError(errno.EISDIR, "a directory, not a file to write", str(path))
    target = Path(os.path.realpath(out)) if out.is_symlink() else out
    tmp = target.with_name(f"{target.stem}.tmp{os.getpid()}-{threading.get_ident()}{target.suffix}")
    try:
        yield tmp
        if target.exists():
            shutil.copymode(target, tmp)
        tmp.replace(target)
    except OSError as e:
        if e.filename is not None and Path(e.filename) == tmp:
            raise OSError(e.errno, e.strerror, str(out)) from None
        raise
    finally:
        with contextlib.suppress(OSError):  # the error that brought us here is the one to see
            tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """`text` written to `path` whole or not at all (see `replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(text)
