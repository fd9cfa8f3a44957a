#!/usr/bin/env python3
"""Writes docs/cli.md, the command reference: `moetier --help` and every command's `--help`.

The page is made from the installed package's parsers, at a fixed width of 100 columns, so that it
is the same on every machine; tests/test_cli_reference.py fails when the page and the code disagree
(run this script after changing a flag or its help). argparse's layout changes between Python
versions, so the page names the version that wrote it and the test compares only under that one.

    python scripts/cli-reference.py            # write docs/cli.md
    python scripts/cli-reference.py --check    # exit 1 if docs/cli.md is out of date
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"
WIDTH = "100"


def command_help(argv: list[str], entry: Callable[[list[str]], int] | None = None) -> str:
    """What `moetier ARGV --help` prints (or entry's, another command's main), run in this process."""
    from moetier import cli

    out = io.StringIO()
    with (
        mock.patch.dict(os.environ, {"COLUMNS": WIDTH}),
        contextlib.redirect_stdout(out),
        contextlib.suppress(SystemExit),
    ):
        (entry or cli.main)([*argv, "--help"])
    return out.getvalue().rstrip() + "\n"


def python_version() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def page() -> str:
    from moetier import cli, lcpp

    lines = [
        "# Command reference",
        "",
        "What `moetier --help` and `moetier COMMAND --help` print, for every command. The",
        "[tools page](tools.md) explains the tools with examples; this page lists every flag.",
        "",
        f"Made by `python scripts/cli-reference.py` (Python {python_version()}, 100 columns) from the",
        "package's own parsers; a test fails when this page and the code disagree.",
        "",
        "## moetier",
        "",
        "```text",
        command_help([]).rstrip(),
        "```",
    ]
    for name, group, text in cli.COMMANDS:
        lines += ["", f"## moetier {name}", "", f"{group}: {text}.", "", "```text"]
        lines += [command_help([name]).rstrip(), "```"]
    lines += ["", "## python -m moetier.lcpp", "", "Installs llama-cpp-python for `moetier.Llama`.", "", "```text"]
    lines += [command_help([], lcpp.install).rstrip(), "```"]
    return "\n".join(lines) + "\n"


def written_by() -> str | None:
    """The Python version docs/cli.md names as the one that wrote it, if any."""
    if not PAGE.exists():
        return None
    for line in PAGE.read_text().splitlines():
        if line.startswith("Made by `python scripts/cli-reference.py` (Python "):
            return line.split("(Python ", 1)[1].split(",", 1)[0]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is out of date; write nothing")
    a = ap.parse_args()
    text = page()
    if a.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            sys.stderr.write(f"{PAGE}: out of date: run python scripts/cli-reference.py\n")
            return 1
        return 0
    PAGE.write_text(text)
    sys.stdout.write(f"{PAGE}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
