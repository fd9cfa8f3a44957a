"""Log level of the stream that llama.cpp and moetier share (the C++ log callback, _core)."""

from __future__ import annotations

from . import _core
from .errors import ConfigError

LEVELS: dict[str, int] = {
    "debug": _core.LOG_DEBUG,
    "info": _core.LOG_INFO,
    "warn": _core.LOG_WARN,
    "error": _core.LOG_ERROR,
    "none": _core.LOG_NONE,
}


def set_level(name: str) -> None:
    """Show messages at or above `name` (debug, info, warn, error; none shows nothing)."""
    level = LEVELS.get(name)
    if level is None:
        msg = f"log level: {name!r} is not a level; use one of {', '.join(LEVELS)}"
        raise ConfigError(msg)
    _core.set_log_level(level)
