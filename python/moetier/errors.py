"""Exception classes of moetier. Messages name the file, the problem and what was expected."""

from __future__ import annotations


class MoetierError(Exception):
    """Base of every error moetier raises on purpose."""


class ConfigError(MoetierError, ValueError):
    """A configuration value is invalid (size, range, unknown name)."""


class StoreError(MoetierError):
    """An expert store is missing, incomplete, corrupt or belongs to another model."""


class ModelError(MoetierError):
    """A model could not be loaded or run."""
