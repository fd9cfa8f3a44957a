"""Exception classes of moetier. Messages name the file, the problem and what was expected.

The classes are defined by the compiled core (csrc/bindings/register-errors.cpp), which raises them
by the kind of error the C API reports (moetier_error_kind): a corrupt store is a StoreError whether
it is found at load or at decode. Python code raises the same classes."""

from __future__ import annotations

from ._core import ConfigError, ModelError, MoetierError, StoreError

__all__ = ["ConfigError", "ModelError", "MoetierError", "StoreError"]
