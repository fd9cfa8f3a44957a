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
from moetier.tools.consolidate import consolidate, experts_digest

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
    assert out.read_text() == json.dumps(m, indent=1) + "\n"  # one value per line: a map a person can diff
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
    for index in (3, -1):
        with pytest.raises(ConfigError, match=rf"^variant {index}: the map has 3 variants$"):
            write_consolidated(m, index, tmp_path / "x.gguf")


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


def _dequantized_rows(path: Path, il: int, n_expert: int) -> np.ndarray:
    """A layer's experts (gate, up and down) as float32 rows, dequantized with gguf's own code."""
    from gguf.quants import dequantize

    parts = []
    for proj in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        t = next(t for t in GGUFReader(str(path)).tensors if t.name == f"blk.{il}.{proj}.weight")
        parts.append(np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32).reshape(n_expert, -1))
    return np.concatenate(parts, axis=1)


def test_quantized_variants_distances_map_and_average(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """q8_0 experts are compared dequantized; the map records each variant's size and digest; the
    cross-position mean is over every pair of different positions; the weight average of q8_0 experts
    is quantized back to q8_0, of f32 tensors exact."""
    import hashlib

    from moetier.tools.consolidate import summary, write_average

    n_expert = 4
    vs = [
        # n_ff_exp 96: rows of the down projection are 96 values, of the others 64 (n_embd)
        tiny_model("qwen2moe", n_expert=n_expert, n_expert_used=2, n_layer=2, n_ff_exp=96, expert_type="q8_0", seed=s)
        for s in (1, 2)
    ]
    m = consolidate(vs, 3)
    assert m["arch"] == "qwen2moe" and m["capacity"] == 3
    for v, p in zip(m["variants"], vs, strict=True):
        h = hashlib.sha256(p.read_bytes()[: 1 << 20])
        h.update(str(p.stat().st_size).encode())
        assert v == {
            "path": str(p),
            "bytes": p.stat().st_size,
            "sha256_head": h.hexdigest(),
            "sha256_experts": experts_digest(p),
        }
    # the experts' digest: the first 4 KiB of 8 experts of every expert tensor (here 4 experts: all)
    want = hashlib.sha256()
    for t in sorted(
        (t for t in GGUFReader(str(vs[0])).tensors if "_exps." in t.name),
        key=lambda t: (
            int(t.name.split(".")[1]),
            ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"].index(t.name.split(".")[2]),
        ),
    ):
        data = np.asarray(t.data).reshape(-1).view(np.uint8)
        per = data.size // n_expert
        for e in range(n_expert):
            want.update(f"{t.name.split('.')[1]}.{t.name.split('.')[2]}.{e}".encode())
            want.update(data[e * per : e * per + min(per, 4096)].tobytes())
    assert m["variants"][0]["sha256_experts"] == want.hexdigest()
    for il in range(2):
        a, b = (_dequantized_rows(p, il, n_expert) for p in vs)
        np.testing.assert_allclose(m["distance"][il], 2 * np.linalg.norm(a - b, axis=1), rtol=1e-5)
        cross = [np.linalg.norm(a[e] - b[f]) for e in range(n_expert) for f in range(n_expert) if e != f]
        assert m["cross_position_mean"][il] == pytest.approx(float(np.mean(cross)), rel=1e-4)
    # three positions shared, dealt to variants 0, 1, 0 in order of distance
    order = sorted((d, il, e) for il, row in enumerate(m["distance"]) for e, d in enumerate(row))
    assert [m["map"][il][e] for _, il, e in order[:3]] == [0, 1, 0]
    assert sum(x >= 0 for row in m["map"] for x in row) == 3
    text = summary(m).splitlines()
    shared = "3 of 8 positions shared (2 from variant 0, 1 from variant 1)"
    assert text[0] == f"2 variants of qwen2moe, 2 MoE layers x 4 experts: {shared}"
    assert text[1] == "layer  same-position distance  cross-position distance"
    assert text[2] == f"    0  {m['same_position_mean'][0]:22.4f}  {m['cross_position_mean'][0]:23.4f}"

    avg = tmp_path / "avg.gguf"
    write_average(vs, avg)
    got = {t.name: t for t in GGUFReader(str(avg)).tensors}
    srcs = [{t.name: t for t in GGUFReader(str(p)).tensors} for p in vs]
    name = "blk.1.ffn_down_exps.weight"
    assert got[name].tensor_type.name == "Q8_0"
    mean = (_dequantized_rows(vs[0], 1, n_expert) + _dequantized_rows(vs[1], 1, n_expert)) / 2
    back = _dequantized_rows(avg, 1, n_expert)
    scale = np.abs(mean).max()
    assert np.abs(back - mean).max() <= scale / 127  # q8_0's rounding, no more
    norm = "blk.0.attn_norm.weight"  # f32: the mean itself
    want = (np.asarray(srcs[0][norm].data, dtype=np.float32) + np.asarray(srcs[1][norm].data, dtype=np.float32)) / 2
    np.testing.assert_array_equal(np.asarray(got[norm].data), want)


def test_unreadable_or_incomplete_variants_are_named(
    variants: list[Path], tiny_model: ModelFactory, tmp_path: Path
) -> None:
    from gguf import GGUFWriter

    text = tmp_path / "notes.gguf"
    text.write_text("not a gguf\n")
    with pytest.raises(ConfigError, match=rf"^{text}: not a readable GGUF file \("):
        consolidate([variants[0], text], 1)
    # a MoE layer without its up and down projections
    lacking = tmp_path / "lacking.gguf"
    w = GGUFWriter(str(lacking), "qwen2moe")
    for t in GGUFReader(str(variants[0])).tensors:
        if t.name not in ("blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"):
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=rf"^{lacking}: layer 1 lacks ffn_up_exps, ffn_down_exps$"):
        consolidate([variants[0], lacking], 1)
    # another number of MoE layers
    deeper = tiny_model("qwen2moe", n_expert=N_EXPERT, n_expert_used=2, n_layer=N_LAYER + 1)
    with pytest.raises(
        ConfigError, match=rf"^{deeper}: MoE layers \[0, 1, 2, 3\] differ from {variants[0]}'s \[0, 1, 2\]$"
    ):
        consolidate([variants[0], deeper], 1)


@pytest.mark.parametrize(
    ("value", "ok"),
    [("0", True), ("0%", True), ("100%", True), ("101%", False), ("-1%", False), ("half", False), ("2.5", False)],
)
def test_capacity_flag(
    variants: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, ok: bool
) -> None:
    out = tmp_path / "map.json"
    if ok:
        assert main(["consolidate", *map(str, variants), "--capacity", value, "-o", str(out)]) == 0
        want = {"0": 0, "0%": 0, "100%": N_LAYER * N_EXPERT}[value]
        assert json.loads(out.read_text())["capacity"] == want
        assert capsys.readouterr().out.endswith(f"\nwrote {out}\n")
        assert not out.with_name("map.json.tmp").exists()
        return
    with pytest.raises(SystemExit):
        main(["consolidate", *map(str, variants), f"--capacity={value}", "-o", str(out)])
    assert f"--capacity: {value!r} is not a count of positions or a share like 50%" in capsys.readouterr().err
    assert not out.exists()


def test_variants_of_other_types_are_compared_but_not_spliced(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """An f16 and a q8_0 variant of one shape can be ranked (both are dequantized), but a shared
    position's bytes cannot be copied from one type into the other."""
    from moetier.tools.consolidate import write_consolidated

    f16, q8 = (tiny_model("qwen2moe", n_expert=4, n_expert_used=2, n_layer=2, expert_type=t) for t in ("f16", "q8_0"))
    m = consolidate([f16, q8], 2)
    assert sorted(x for row in m["map"] for x in row if x >= 0) == [0, 1]
    with pytest.raises(
        ConfigError,
        match=rf"^{q8}: blk\.\d\.ffn_gate_exps is Q8_0, but {f16}'s is F16; a shared expert is copied as it is",
    ):
        write_consolidated(m, 0, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_a_variants_digest_is_its_first_mib_and_its_size(tmp_path: Path) -> None:
    """The map tells its variants from other files by the sha256 of their first MiB and their size
    (a whole multi-GB file would take minutes to hash)."""
    import hashlib

    from moetier.tools.consolidate import _head_digest

    p = tmp_path / "big.gguf"
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    p.write_bytes(data)
    want = hashlib.sha256(data[: 1 << 20] + str(3 << 20).encode()).hexdigest()
    assert _head_digest(p) == want
    # a change past the first MiB that keeps the size is not seen; one in it is
    p.write_bytes(data[: 2 << 20] + b"x" + data[(2 << 20) + 1 :])
    assert _head_digest(p) == want
    p.write_bytes(b"x" + data[1:])
    assert _head_digest(p) != want


def test_two_experts_have_a_cross_position_distance(tiny_model: ModelFactory) -> None:
    """With two experts per layer there is one pair of different positions, and its distance is shown."""

    two = [tiny_model("qwen2moe", n_expert=2, n_expert_used=1, n_layer=2, seed=s) for s in (1, 2)]
    m = consolidate(two, 0)
    for il in range(2):
        a, b = (_dequantized_rows(p, il, 2) for p in two)
        want = (np.linalg.norm(a[0] - b[1]) + np.linalg.norm(a[1] - b[0])) / 2
        assert m["cross_position_mean"][il] == pytest.approx(float(want), rel=1e-4) and want > 0


def test_a_variant_with_a_weight_that_is_not_a_number_is_refused(variants: list[Path], tmp_path: Path) -> None:
    """A NaN weight would make its position's distance NaN, which sorts as the closest: the broken expert
    would be shared. It is refused, naming the file, the layer and the expert."""
    broken = tmp_path / "broken.gguf"
    shutil.copyfile(variants[1], broken)
    t = next(t for t in GGUFReader(str(broken)).tensors if t.name == "blk.1.ffn_up_exps.weight")
    w = np.asarray(t.data, dtype=np.float16).copy()
    w[3, 0, 0] = np.nan
    with open(broken, "r+b") as f:
        f.seek(int(t.data_offset))
        f.write(w.tobytes())
    with pytest.raises(ConfigError) as e:
        consolidate([variants[0], broken, variants[2]], 2)
    assert str(e.value) == f"{broken}: layer 1, expert 3 holds a weight that is not a finite number"


def test_a_consolidated_variant_that_fails_to_write_keeps_the_old_file(
    variants: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while the variant is written: the file already there stays, and the temporary
    one is closed and removed."""
    import errno

    import gguf

    from moetier.tools.consolidate import write_consolidated

    m = consolidate(variants, 10)
    out = tmp_path / "out" / "v1.gguf"
    out.parent.mkdir()
    out.write_bytes(b"old variant")

    def full_disk(self: gguf.GGUFWriter, *a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_consolidated(m, 1, out)
    assert out.read_bytes() == b"old variant"
    assert [f.name for f in out.parent.iterdir()] == ["v1.gguf"]


def test_capacity_as_a_numpy_share_or_a_bool(variants: list[Path]) -> None:
    """A share given as a numpy float is a share (it was truncated to 0 positions); a bool is refused."""
    assert consolidate(variants, np.float32(0.5))["capacity"] == 12
    assert consolidate(variants, np.int64(5))["capacity"] == 5
    with pytest.raises(ConfigError, match=r"^capacity: True is not a count or a share of the positions$"):
        consolidate(variants, True)


def test_a_map_tells_variants_apart_by_their_experts(
    variants: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fine-tunes of one base share a header (tokenizer and shapes, often more than the first MiB the
    header digest reads): the map also holds a digest of a sample of each variant's experts, so a map
    applied to the variants in another order is refused even when their headers hash alike."""
    import moetier.variants as vmod
    from moetier.tools.consolidate import experts_digest
    from moetier.variants import VariantSpec, read_map

    m = consolidate(variants[:2], 4)
    digests = [v["sha256_experts"] for v in m["variants"]]
    assert digests == [experts_digest(p) for p in variants[:2]] and digests[0] != digests[1]
    path = tmp_path / "map.json"
    path.write_text(json.dumps(m))
    specs = [VariantSpec(f"v{i}", p, tmp_path / "s") for i, p in enumerate(variants[:2])]
    read_map(path, specs)
    monkeypatch.setattr(vmod, "_head_digest", lambda p: "one header")  # as variants whose first MiB is alike
    for v in m["variants"]:
        v["sha256_head"] = "one header"
    path.write_text(json.dumps(m))
    read_map(path, specs)
    with pytest.raises(ConfigError, match=r"variant 0 of the map is .*v0\.gguf, but .*v1\.gguf is served there"):
        read_map(path, specs[::-1])
    # a map written before the experts' digest is checked by its header digest alone
    for v in m["variants"]:
        del v["sha256_experts"]
    path.write_text(json.dumps(m))
    read_map(path, specs[::-1])


def test_expert_biases_do_not_enter_the_distances(variants: list[Path], tmp_path: Path) -> None:
    """Architectures with expert biases (gpt-oss: blk.N.ffn_*_exps.bias) are ranked by their weights;
    a bias written after its weight replaced it in the ranking."""
    from gguf import GGUFWriter

    from moetier.tools.moefy import _kv_copy

    def with_biases(src: Path, out: Path, value: float) -> Path:
        r = GGUFReader(str(src))
        w = GGUFWriter(str(out), "qwen2moe")
        _kv_copy(r, w, "qwen2moe", "qwen2moe")
        for t in r.tensors:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            if "_exps." in t.name:
                n_expert, rows = int(t.shape[-1]), int(t.shape[1])
                w.add_tensor(t.name.replace(".weight", ".bias"), np.full((n_expert, rows), value, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out

    plain = consolidate(variants[:2], 4)
    biased = consolidate([with_biases(p, tmp_path / f"b{i}.gguf", 1.0 + i) for i, p in enumerate(variants[:2])], 4)
    assert biased["distance"] == plain["distance"] and biased["map"] == plain["map"]


def test_a_variant_cut_short_is_named(variants: list[Path], tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(variants[0].read_bytes()[:100])
    with pytest.raises(ConfigError, match=rf"^{cut}: not a readable GGUF file \("):
        consolidate([cut, variants[1]], 1)


def test_average_and_splice_check_their_inputs(variants: list[Path], tmp_path: Path) -> None:
    """write_average names a missing variant (it opened it raw first) and one whose other tensors
    differ; write_consolidated refuses a map whose rows, layers or owners do not fit the variants."""
    from moetier.tools.consolidate import write_average, write_consolidated

    gone = tmp_path / "gone.gguf"
    with pytest.raises(ConfigError, match=rf"^{gone}: the variant's GGUF does not exist$"):
        write_average([variants[0], gone], tmp_path / "avg.gguf")
    m = consolidate(variants[:2], 4)
    with pytest.raises(ConfigError, match=r"^the map: the map is of another shape than the variants' 3 MoE layers x 8"):
        write_consolidated({**m, "map": [row[:-1] for row in m["map"]]}, 0, tmp_path / "x.gguf")
    with pytest.raises(
        ConfigError, match=r"^the map: layers \[7, 1, 2\], but its variants' MoE layers are \[0, 1, 2\]$"
    ):
        write_consolidated({**m, "layers": [7, *m["layers"][1:]]}, 0, tmp_path / "x.gguf")
    owners = [[5] * N_EXPERT for _ in m["map"]]
    with pytest.raises(ConfigError, match=r"^the map: layer 0, expert 0: 5 is neither -1 \(each variant's own\) nor a"):
        write_consolidated({**m, "map": owners}, 0, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "avg.gguf").exists()
