"""Runs the patched llama.cpp binaries shipped in the package (llama-server and friends)."""

from __future__ import annotations

import os
from pathlib import Path

from .config import CacheConfig
from .errors import ModelError

BIN_DIR = Path(__file__).resolve().parent / "bin"
TOOLS = ("llama-server", "llama-cli", "llama-perplexity", "llama-bench", "ggml-rpc-server")


def tool_path(name: str) -> Path:
    """Path of a shipped binary; ModelError if the package was built without tools."""
    if name not in TOOLS:
        msg = f"unknown tool {name!r}; shipped: {', '.join(TOOLS)}"
        raise ModelError(msg)
    p = BIN_DIR / name
    if not p.is_file():
        msg = f"{p}: not installed (the package was built with MOETIER_TOOLS=OFF?)"
        raise ModelError(msg)
    return p


def cache_flags(cache: CacheConfig, store: str | None = None) -> list[str]:
    """The expert cache flags the patched binaries accept (added to llama.cpp's common arguments)."""
    out = ["--expert-cache", cache.budget_text, "--expert-policy", cache.policy, "--expert-opt", cache.opts()]
    if store:
        out += ["--expert-store", store]
    return out


def exec_tool(name: str, args: list[str]) -> None:
    """Replaces this process with the tool (signals and exit codes pass straight through)."""
    p = tool_path(name)
    os.execv(str(p), [str(p), *args])
