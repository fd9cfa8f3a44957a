"""docs/cli.md, the command reference, is what the code prints: every command's --help, every flag."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli-reference.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_page_lists_every_command() -> None:
    from moetier import cli

    text = (ROOT / "docs" / "cli.md").read_text()
    for name in cli.COMMAND_HELP:
        assert f"\n## moetier {name}\n" in text
        assert f"usage: moetier {name}" in text


def test_page_matches_the_code() -> None:
    ref = _script()
    made = ref.written_by()
    if made != ref.python_version():
        pytest.skip(f"docs/cli.md was written under Python {made}; argparse lays out help differently in {sys.version}")
    text = (ROOT / "docs" / "cli.md").read_text()
    new = ref.page()
    if text != new:
        # the first line that differs, so the failure says which flag changed
        old_lines, new_lines = text.splitlines(), new.splitlines()
        pairs = zip(old_lines, new_lines, strict=False)
        i = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(old_lines), len(new_lines)))
        pytest.fail(
            f"docs/cli.md is out of date at line {i + 1} (run python scripts/cli-reference.py):\n"
            f"  page: {old_lines[i] if i < len(old_lines) else '(end)'}\n"
            f"  code: {new_lines[i] if i < len(new_lines) else '(end)'}"
        )


def test_help_is_the_same_on_every_machine() -> None:
    """A default that depends on the machine (its core count) is described, not printed as a number."""
    ref = _script()
    text = " ".join(ref.command_help(["run"]).split())
    assert "--n-threads N_THREADS compute threads (also the threads that read missed experts) " in text
    assert "(default: the machine's cores, at most 8)" in text
