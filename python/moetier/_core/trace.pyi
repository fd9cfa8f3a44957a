"""Stubs of moetier._core.trace (csrc/bindings/register-trace.cpp)."""

import numpy as np
import numpy.typing as npt

from . import Model

def collect(
    model: Model, tokens: list[int], names: list[str], n_chunk: int = 512
) -> dict[str, npt.NDArray[np.float32]]: ...
def node_order(model: Model, tokens: list[int]) -> list[str]: ...
