"""The one ggml change: mul_mat_id with a negative id yields a zero row; valid ids are unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from moetier import _core


@pytest.mark.parametrize("n_threads", [1, 2])
def test_negative_id_zero_row(n_threads: int) -> None:
    rng = np.random.default_rng(0)
    E, N, K, T, U = 5, 7, 32, 6, 3
    a = rng.standard_normal((E, N, K), dtype=np.float32)
    b = rng.standard_normal((T, U, K), dtype=np.float32)
    ids = rng.integers(0, E, size=(T, U)).astype(np.int32)
    ids[0, 1] = -1
    ids[3, :] = -1
    ids[5, 2] = -7
    got = _core.mul_mat_id(a, b, ids, n_threads)
    for t in range(T):
        for u in range(U):
            if ids[t, u] < 0:
                assert not got[t, u].any(), f"row ({t},{u}) must be zero"
            else:
                np.testing.assert_allclose(got[t, u], a[ids[t, u]] @ b[t, u], rtol=1e-5, atol=1e-5)


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
    rng = np.random.default_rng(2)
    E, N, K, T, U = 4, 16, 256, 5, 3
    a = rng.standard_normal((E, N, K), dtype=np.float32)
    b = rng.standard_normal((T, U, K), dtype=np.float32)
    ids = rng.integers(0, E, size=(T, U)).astype(np.int32)
    ids[1, 2] = -1
    ids[4, :] = -1
    try:
        got = _core.mul_mat_id(a, b, ids, 2, qtype, True)
    except RuntimeError as e:
        if "no repacked kernel" in str(e):
            pytest.skip(str(e))
        raise
    plain = _core.mul_mat_id(a, b, ids, 2, qtype, False)
    for t in range(T):
        for u in range(U):
            if ids[t, u] < 0:
                assert not got[t, u].any(), f"row ({t},{u}) must be zero"
            else:
                assert got[t, u].any()
                np.testing.assert_allclose(got[t, u], plain[t, u], rtol=1e-4, atol=1e-4)
