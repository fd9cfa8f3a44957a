"""moetier consolidate: the multi-MoE paper's algorithm 1 on tiny generated variants of one MoE."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import ModelFactory
from moetier import ConfigError
from moetier.cli import main
from moetier.tools.consolidate import consolidate

N_LAYER, N_EXPERT = 3, 8


def variant(base: Path, out: Path, seed: int) -> Path:
    """A copy of base whose expert (l, e) moved by noise of scale (l * N_EXPERT + e + 1) * 1e-3:
    the positions' distances rank in position order."""
    shutil.copyfile(base, out)
    rng = np.random.default_rng(seed)
    tensors = [t for t in GGUFReader(str(base)).tensors if "_exps." in t.name]
    with open(out, "r+b") as f:
        for t in tensors:
            il = int(t.name.split(".")[1])
            w = np.asarray(t.data, dtype=np.float16).astype(np.float32).copy()  # (expert, rows, cols)
            for e in range(w.shape[0]):
                w[e] += rng.standard_normal(w[e].shape).astype(np.float32) * (il * N_EXPERT + e + 1) * 1e-3
            f.seek(int(t.data_offset))
            f.write(w.astype(np.float16).tobytes())
    return out


@pytest.fixture
def variants(tiny_model: ModelFactory, tmp_path: Path) -> list[Path]:
    base = tiny_model("qwen2moe", n_expert=N_EXPERT, n_expert_used=2, n_layer=N_LAYER)
    return [variant(base, tmp_path / f"v{i}.gguf", i) for i in range(3)]


def test_the_closest_positions_are_shared_round_robin(variants: list[Path]) -> None:
    m = consolidate(variants, 10)
    flat = [x for row in m["map"] for x in row]
    # position p = l * 8 + e ranks p-th: the first 10 are shared, dealt to variants 0, 1, 2, 0, ...
    assert flat[:10] == [r % 3 for r in range(10)]
    assert flat[10:] == [-1] * (N_LAYER * N_EXPERT - 10)
    d = [x for row in m["distance"] for x in row]
    assert d == sorted(d) and d[0] > 0
    # the variants stay near their own position, far from the others (the paper's figure 2)
    assert all(s < c / 3 for s, c in zip(m["same_position_mean"], m["cross_position_mean"], strict=True))
    assert consolidate(variants, 0.5)["capacity"] == 12
    assert all(x == -1 for row in consolidate(variants, 0)["map"] for x in row)


def test_cli_writes_the_map(variants: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "map.json"
    assert main(["consolidate", *map(str, variants), "--capacity", "25%", "-o", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["capacity"] == 6 and [v["path"] for v in m["variants"]] == list(map(str, variants))
    assert "6 of 24 positions shared (2 from variant 0, 2 from variant 1, 2 from variant 2)" in capsys.readouterr().out


def test_variants_of_other_shapes_or_models_are_refused(
    variants: list[Path], tiny_model: ModelFactory, tmp_path: Path
) -> None:
    other = tiny_model("qwen2moe", n_expert=4, n_expert_used=2, n_layer=N_LAYER)
    shape = r"other\.gguf: blk\.0\.ffn_gate_exps has shape \(64, 64, 4\), but .*v0\.gguf's is \(64, 64, 8\)"
    with pytest.raises(ConfigError, match=shape):
        consolidate([variants[0], shutil.copyfile(other, tmp_path / "other.gguf")], 1)
    with pytest.raises(ConfigError, match="architecture 'qwen3moe'"):
        consolidate([variants[0], tiny_model("qwen3moe", n_expert=N_EXPERT, n_expert_used=2, n_layer=N_LAYER)], 1)
    with pytest.raises(ConfigError, match="not a MoE model"):
        consolidate([variants[0], tiny_model("qwen2")], 1)
    with pytest.raises(ConfigError, match="there are 24"):
        consolidate(variants, 25)
    with pytest.raises(ConfigError, match="does not exist"):
        consolidate([variants[0], tmp_path / "none.gguf"], 1)


def test_written_variants_take_the_owners_experts_and_the_average_the_mean(
    variants: list[Path], tmp_path: Path
) -> None:
    from moetier.tools.consolidate import write_average, write_consolidated

    m = consolidate(variants, 10)
    out = tmp_path / "v1-consolidated.gguf"
    write_consolidated(m, 1, out)
    got = {t.name: t for t in GGUFReader(str(out)).tensors}
    srcs = [{t.name: t for t in GGUFReader(str(v)).tensors} for v in variants]
    for il, row in zip(m["layers"], m["map"], strict=True):
        for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            name = f"blk.{il}.{p}.weight"
            for e, owner in enumerate(row):
                want = srcs[owner if owner >= 0 else 1][name].data[e]
                assert np.array_equal(np.asarray(got[name].data[e]), np.asarray(want)), (name, e, owner)
    # every other tensor is variant 1's own
    assert np.array_equal(np.asarray(got["output.weight"].data), np.asarray(srcs[1]["output.weight"].data))

    avg = tmp_path / "avg.gguf"
    write_average(variants, avg)
    a = {t.name: t for t in GGUFReader(str(avg)).tensors}
    name = "blk.2.ffn_up_exps.weight"
    mean = np.mean([np.asarray(s[name].data, dtype=np.float32) for s in srcs], axis=0)
    assert np.allclose(np.asarray(a[name].data, dtype=np.float32), mean, atol=2e-3)  # back in f16
    assert not np.array_equal(np.asarray(a[name].data), np.asarray(srcs[0][name].data))
    # tensors the variants share are copied as they are
    assert np.array_equal(np.asarray(a["output.weight"].data), np.asarray(srcs[0]["output.weight"].data))
    with pytest.raises(ConfigError, match="variant 5: the map has 3 variants"):
        write_consolidated(m, 5, tmp_path / "x.gguf")


def test_distances_are_the_papers_sums_over_ordered_pairs(variants: list[Path]) -> None:
    """Each position's distance is the sum over ordered pairs of variants of the L2 distance between
    their copies of that expert (gate, up and down together), recomputed here from the files."""
    readers = [GGUFReader(str(p)) for p in variants]
    m = consolidate(variants, 5)
    assert m["layers"] == list(range(N_LAYER)) and m["n_expert"] == N_EXPERT

    def rows(r: GGUFReader, il: int) -> np.ndarray:
        parts = []
        for proj in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            t = next(t for t in r.tensors if t.name == f"blk.{il}.{proj}.weight")
            parts.append(np.asarray(t.data, dtype=np.float32).reshape(N_EXPERT, -1))
        return np.concatenate(parts, axis=1)

    for il in range(N_LAYER):
        rs = [rows(r, il) for r in readers]
        want = sum(np.linalg.norm(rs[i] - rs[j], axis=1) for i in range(3) for j in range(3) if i != j)
        np.testing.assert_allclose(m["distance"][il], want, rtol=1e-5)
        same = np.linalg.norm(rs[0] - rs[1], axis=1).mean()
        assert m["same_position_mean"][il] == pytest.approx(same, rel=1e-5)


def test_capacity_bounds(variants: list[Path]) -> None:
    n_pos = N_LAYER * N_EXPERT
    assert consolidate(variants, n_pos)["capacity"] == n_pos  # every position shared
    assert consolidate(variants, 1.0)["capacity"] == n_pos
    with pytest.raises(ConfigError, match=rf"^capacity: {n_pos + 1} gives {n_pos + 1} positions; there are {n_pos} "):
        consolidate(variants, n_pos + 1)
    with pytest.raises(ConfigError, match=r"^capacity: -1 gives -1 positions"):
        consolidate(variants, -1)
    with pytest.raises(ConfigError, match=r"^consolidate: give at least two variants$"):
        consolidate(variants[:1], 1)
