"""bench/moefy_eval.py: its results are keyed by each text's file stem."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import moefy_eval


def test_two_texts_of_one_stem_are_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """fortunes.eval and fortunes.eval2 share the stem 'fortunes': one result would overwrite the
    other's cell (it did once), so the script stops before it runs anything."""
    argv = ["moefy_eval.py", "--dense", "d.gguf", "--moe", "m.gguf", "--text", "a/fortunes.eval", "b/fortunes.eval2"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        moefy_eval.main()
    assert "same name" in capsys.readouterr().err
