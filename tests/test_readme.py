"""The README's examples run as written, on a tiny generated model, so the front page cannot rot.

Each fenced `python` block of README.md runs in a fresh interpreter with the README's placeholder
names pointed at test files: `model.gguf` at a tiny MoE, `model.experts` at its packed store, and the
OpenAI example's `http://127.0.0.1:8080` at a `moetier serve` started here on the same model. Every
`moetier COMMAND` the README shows must be a command the CLI has."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _server import serve
from conftest import ModelFactory
from moetier import cli
from moetier.pack import pack

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SERVER_URL = "http://127.0.0.1:8080"


def _blocks(lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(README.read_text()) if tag == lang]


def _run(code: str, tmp_path: Path, name: str) -> str:
    script = tmp_path / f"readme_example_{name}.py"  # not openai.py: that would shadow the package
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, f"README example {name} failed:\n{code}\n--- stderr:\n{res.stderr[-4000:]}"
    return res.stdout


def _tiny(tiny_model: ModelFactory, tmp_path: Path) -> tuple[Path, Path]:
    model = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    store = tmp_path / "model.experts"
    pack(model, store)
    return model, store


def _bind(code: str, model: Path, store: Path) -> str:
    # the README's names, pointed at the test's files (longest first: model.experts holds "model.")
    return code.replace('"model.experts"', repr(str(store))).replace('"model.gguf"', repr(str(model)))


def test_readme_has_examples() -> None:
    py = _blocks("python")
    assert len(py) >= 2, "README.md should show the Python API and an OpenAI client"
    assert any("OpenAI(" in b for b in py) and any("moetier.Model(" in b for b in py)


def test_python_examples_run(tiny_model: ModelFactory, tmp_path: Path) -> None:
    model, store = _tiny(tiny_model, tmp_path)
    for i, code in enumerate(b for b in _blocks("python") if "OpenAI(" not in b):
        assert '"model.gguf"' in code, "a README example should use the placeholder model.gguf"
        out = _run(_bind(code, model, store), tmp_path, f"python{i}")
        assert out.strip(), "a README example printed nothing"


def test_openai_example_runs(tiny_model: ModelFactory, tmp_path: Path) -> None:
    model, store = _tiny(tiny_model, tmp_path)
    (code,) = (b for b in _blocks("python") if "OpenAI(" in b)
    assert SERVER_URL in code
    # the server command the example's comment names, with the test's files and a small budget
    serve_line = re.search(r"`(moetier serve [^`]*)`", code)
    assert serve_line, "the OpenAI example should name the `moetier serve` command it runs against"
    args = serve_line.group(1).split()[2:]
    args = [str(model) if a == "model.gguf" else str(store) if a == "model.experts" else a for a in args]
    port = args.index("--port")
    del args[port : port + 2]  # start() picks a free port
    with serve(args, tmp_path / "server.log") as srv:
        out = _run(code.replace(SERVER_URL, srv.url), tmp_path, "openai")
    assert out.strip(), "the OpenAI example printed no answer"


def test_readme_commands_exist() -> None:
    (sub,) = (a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)
    shown = set(re.findall(r"^\s*moetier ([a-z][a-z-]+)", "\n".join(_blocks("sh")), re.M))
    assert shown, "README.md should show the CLI"
    assert shown <= commands, f"README.md shows commands the CLI does not have: {sorted(shown - commands)}"


@pytest.mark.parametrize("block", range(len(_blocks("python"))))
def test_examples_are_short(block: int) -> None:
    # the front page's examples stay readable: the Python API in about ten lines
    assert len(_blocks("python")[block].strip().splitlines()) <= 12
