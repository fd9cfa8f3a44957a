"""The one ggml change: mul_mat_id with a negative id yields a zero row; valid ids are unchanged."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from moetier import _core

F32 = np.ndarray


def _case(
    seed: int, shape: tuple[int, int, int, int, int], negative: list[tuple[int, int | slice, int]]
) -> tuple[F32, F32, F32]:
    """E random matrices [N, K], inputs [T, U, K] and ids [T, U] for shape (E, N, K, T, U), with
    ids[t, u] = v for each (t, u, v) in negative."""
    E, N, K, T, U = shape
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((E, N, K), dtype=np.float32)
    b = rng.standard_normal((T, U, K), dtype=np.float32)
    ids = rng.integers(0, E, size=(T, U)).astype(np.int32)
    for t, u, v in negative:
        ids[t, u] = v
    return a, b, ids


def _check_rows(got: F32, ids: F32, want: Callable[[int, int], F32], tol: float) -> None:
    """Rows of negative ids are zero; the others equal want(t, u) within tol."""
    T, U = ids.shape
    for t in range(T):
        for u in range(U):
            if ids[t, u] < 0:
                assert not got[t, u].any(), f"row ({t},{u}) must be zero"
            else:
                assert got[t, u].any()
                np.testing.assert_allclose(got[t, u], want(t, u), rtol=tol, atol=tol)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_negative_id_zero_row(n_threads: int) -> None:
    a, b, ids = _case(0, (5, 7, 32, 6, 3), [(0, 1, -1), (3, slice(None), -1), (5, 2, -7)])
    got = _core.mul_mat_id(a, b, ids, n_threads)
    _check_rows(got, ids, lambda t, u: a[ids[t, u]] @ b[t, u], 1e-5)


def test_valid_ids_match_reference() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 16, 64), dtype=np.float32)
    b = rng.standard_normal((4, 2, 64), dtype=np.float32)
    ids = rng.integers(0, 8, size=(4, 2)).astype(np.int32)
    got = _core.mul_mat_id(a, b, ids, 2)
    want = np.einsum("tunk,tuk->tun", a[ids], b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_K"])
def test_repacked_kernels_negative_id_zero_row(qtype: str) -> None:
    """The expert cache's repacked pools run llama.cpp's repacked (CPU_REPACK) kernels: a negative id
    is a zero row there too, and valid ids give what the plain kernels give for the same quantized
    weights (up to the kernels' own summation order)."""
    a, b, ids = _case(2, (4, 16, 256, 5, 3), [(1, 2, -1), (4, slice(None), -1)])
    try:
        got = _core.mul_mat_id(a, b, ids, 2, qtype, True)
    except RuntimeError as e:
        if "no repacked kernel" in str(e):
            pytest.skip(str(e))
        raise
    plain = _core.mul_mat_id(a, b, ids, 2, qtype, False)
    _check_rows(got, ids, lambda t, u: plain[t, u], 1e-4)


def test_an_id_past_the_last_matrix_is_refused() -> None:
    """ggml checks ids only in debug builds: an id of E or more would write past its row counts."""
    a = np.zeros((2, 4, 32), dtype=np.float32)
    b = np.zeros((1, 1, 32), dtype=np.float32)
    with pytest.raises(ValueError, match="id 2 at position 0 is not below E=2"):
        _core.mul_mat_id(a, b, np.array([[2]], dtype=np.int32), 1)


def test_an_id_past_int32_does_not_wrap_into_range() -> None:
    """ids given as int64: 2**32 + 1 is refused, not read as 1."""
    a = np.zeros((2, 4, 32), dtype=np.float32)
    b = np.zeros((1, 1, 32), dtype=np.float32)
    with pytest.raises(ValueError, match="is not below E=2"):
        _core.mul_mat_id(a, b, np.array([[2**32 + 1]], dtype=np.int64), 1)
