"""bench/trace_predictors.py: history-only predictors judged on a trace split by sequence."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import trace_predictors


def test_predictors_find_what_the_routing_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Routing built so that each signal is exact where it should be: layer l + 1 picks layer l's
    experts shifted by one (affinity names all of them), and each token id always routes the same
    (the token memory names all of them once the id was seen); popularity, with 8 of 16 experts
    equally likely, cannot."""
    rng = np.random.default_rng(0)
    n_tok, n_layers, k, n_expert = 600, 4, 2, 16
    vocab = rng.integers(0, 16, size=n_tok)
    first = {v: rng.choice(8, size=k, replace=False) for v in range(16)}  # layer 0: experts 0-7
    ids = np.zeros((n_tok, n_layers, k), dtype=np.uint8)
    for t, v in enumerate(vocab):
        for il in range(n_layers):
            ids[t, il] = (first[int(v)] + il) % n_expert
    path = tmp_path / "trace.npz"
    np.savez(path, ids=ids, seq_offsets=np.array([0, 200, 400, 600]), n_experts=np.int32(n_expert), top_k=np.int32(k))
    toks = tmp_path / "tokens.jsonl"
    toks.write_text(
        "\n".join(json.dumps({"tokens": [f"t{v}" for v in vocab[a:b]]}) for a, b in ((0, 200), (200, 400), (400, 600)))
        + "\n"
    )
    out = tmp_path / "r"
    argv = ["trace_predictors.py", str(path), "--split", "2", "--tokens-file", str(toks), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert trace_predictors.main() == 0
    rep = json.loads(Path(str(out) + ".json").read_text())
    got = {(r["target"], r["predictor"]): r["overlap"] for r in rep["rows"]}
    assert rep["fit_tokens"] == 400 and rep["judge_tokens"] == 200
    assert got[("layer l+1, same token", "affinity")] == pytest.approx(1.0)
    assert got[("layer l+2, same token", "token-memory")] > 0.99  # every id was seen in the fitted part
    assert got[("next token, same layer", "token-memory")] > 0.99
    assert got[("layer l+1, same token", "popularity")] < 0.6
    assert "| layer l+3, same token | path |" in capsys.readouterr().out
