"""Files the tools write (reports, configs, traces, plots, maps) replace the old one whole: a write that
fails leaves the old file, or none, never part of a new one, and no temporary file beside it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from moetier._files import replacing, write_text


def test_write_text_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    write_text(out, "old\n")
    write_text(str(out), "new\n")  # str paths too
    assert out.read_text() == "new\n"
    assert [f.name for f in tmp_path.iterdir()] == ["report.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    out = tmp_path / "config.json"
    out.write_text("old\n")
    with pytest.raises(RuntimeError, match="half way"), replacing(out) as tmp:
        tmp.write_text("ne")
        msg = "half way"
        raise RuntimeError(msg)
    assert out.read_text() == "old\n"
    assert [f.name for f in tmp_path.iterdir()] == ["config.json"]
    # where there was no file, there still is none
    with pytest.raises(KeyboardInterrupt), replacing(tmp_path / "new.json") as tmp:
        tmp.write_text("{")
        raise KeyboardInterrupt
    assert [f.name for f in tmp_path.iterdir()] == ["config.json"]


def test_the_temporary_name_keeps_the_suffix_and_the_process(tmp_path: Path) -> None:
    """numpy appends .npz to a name without it, matplotlib picks the format by the suffix."""
    with replacing(tmp_path / "trace.npz") as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".npz" and str(os.getpid()) in tmp.name
        assert tmp.name != "trace.npz"
        tmp.write_bytes(b"x")
    assert (tmp_path / "trace.npz").read_bytes() == b"x"


def test_an_error_about_the_temporary_file_names_the_file_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "missing" / "report.json"
    with pytest.raises(FileNotFoundError) as e:
        write_text(out, "x")
    assert e.value.filename == str(out) and e.value.errno == errno.ENOENT
    # an error about another file (an input the block reads) keeps its own name
    with pytest.raises(FileNotFoundError) as e, replacing(tmp_path / "r.json"):
        (tmp_path / "input.txt").read_text()
    assert e.value.filename == str(tmp_path / "input.txt")


def test_a_plot_that_fails_to_write_keeps_the_old_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills while matplotlib writes: the old picture stays, whole."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from moetier.plot import bench_plot
    from test_bench_plot import _report

    out = tmp_path / "plot.png"
    bench_plot(_report(), out)
    before = out.read_bytes()

    def full_disk(self: Figure, fname: str | os.PathLike[str], **kw: object) -> None:
        Path(fname).write_bytes(before[:100])
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left") as e:
        bench_plot(_report(), out)
    assert e.value.filename == str(out)
    assert out.read_bytes() == before
    assert [f.name for f in tmp_path.iterdir()] == ["plot.png"]


def test_a_link_is_followed_and_the_mode_kept(tmp_path: Path) -> None:
    """A config reached through a symbolic link: the file it names gets the new text, the link stays
    a link; a file readable by its owner only stays so."""
    real = tmp_path / "configs" / "q.json"
    real.parent.mkdir()
    real.write_text("old\n")
    real.chmod(0o600)
    link = tmp_path / "c.json"
    link.symlink_to(real)
    write_text(link, "new\n")
    assert link.is_symlink() and real.read_text() == "new\n"
    assert real.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in real.parent.iterdir()) == ["q.json"]


@pytest.mark.parametrize("name", [".", ""])
def test_a_directory_name_is_refused(name: str) -> None:
    with pytest.raises(IsADirectoryError):
        write_text(name, "x")
