"""`moetier consolidate`: which experts several fine-tuned variants of one MoE can share.

The multi-MoE paper's algorithm 1 (Imani et al., "QoS-Efficient Serving of Multiple MoE LLMs Using
Partial Runtime Reconfiguration", section 3.1): every (layer, expert) position is ranked by the
summed L2 distance between the variants' copies of that expert (gate, up and down weights flattened
and concatenated), most similar first; the C most similar positions are shared, dealt to the
variants in turn (rank r goes to variant r mod |M|), so that a request of any variant computes a
shared position with that one variant's copy, and the other positions with its own. Sharing is
lossy: the map says which copy stands in for which.

The map also holds, per layer, the mean distance between the variants' copies of one position and
between different positions (the paper's figure 2: fine-tunes of one base stay close to their own
position, far from any other), so a user can see whether the variants are worth consolidating.

    moetier consolidate base-code.gguf base-prose.gguf --capacity 50% -o variants.map.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._files import replacing, write_text
from ..errors import ConfigError

PROJS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Variant:
    path: Path
    arch: str
    layers: dict[int, dict[str, Any]]  # MoE layer -> projection -> the gguf reader's tensor


def _open(path: Path) -> Variant:
    from gguf import GGUFReader

    try:
        r = GGUFReader(str(path))
    except FileNotFoundError:
        msg = f"{path}: the variant's GGUF does not exist"
        raise ConfigError(msg) from None
    except (OSError, ValueError, IndexError, KeyError) as e:  # gguf's errors on a file cut short
        msg = f"{path}: not a readable GGUF file ({type(e).__name__}: {e})"
        raise ConfigError(msg) from None
    f = r.fields.get("general.architecture")
    arch = bytes(f.parts[f.data[0]]).decode() if f is not None else ""
    layers: dict[int, dict[str, Any]] = {}
    for t in r.tensors:
        parts = t.name.split(".")
        # the weights only: some architectures (gpt-oss) give their experts biases under the same name
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in PROJS and parts[3] == "weight":
            layers.setdefault(int(parts[1]), {})[parts[2]] = t
    if not layers:
        msg = f"{path}: no expert tensors (blk.N.ffn_*_exps): not a MoE model"
        raise ConfigError(msg)
    for il, projs in layers.items():
        missing = [p for p in PROJS if p not in projs]
        if missing:
            msg = f"{path}: layer {il} lacks {', '.join(missing)}"
            raise ConfigError(msg)
    return Variant(path, arch, dict(sorted(layers.items())))


def _check_same(vs: list[Variant]) -> None:
    a = vs[0]
    for v in vs[1:]:
        if v.arch != a.arch:
            msg = f"{v.path}: architecture {v.arch!r}, but {a.path} is {a.arch!r}; variants must share one architecture"
            raise ConfigError(msg)
        if list(v.layers) != list(a.layers):
            msg = f"{v.path}: MoE layers {list(v.layers)} differ from {a.path}'s {list(a.layers)}"
            raise ConfigError(msg)
        for il in a.layers:
            for p in PROJS:
                sa, sv = (tuple(int(x) for x in u.layers[il][p].shape) for u in (a, v))
                if sa != sv:
                    msg = f"{v.path}: blk.{il}.{p} has shape {sv}, but {a.path}'s is {sa}; variants need one shape"
                    raise ConfigError(msg)


def _experts(t: Any) -> F32:
    """One projection's experts as float32 rows: (n_expert, everything else flattened)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = np.asarray(t.data)
    qt = GGMLQuantizationType(int(t.tensor_type))
    w = data.astype(np.float32) if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else dequantize(data, qt)
    n_expert = int(t.shape[-1])  # gguf shapes are ne0 first: the expert index is the last
    return np.asarray(w, dtype=np.float32).reshape(n_expert, -1)


def consolidate(paths: Sequence[str | os.PathLike[str]], capacity: int | float) -> dict[str, Any]:
    """The consolidation map of the variants: capacity is a count of positions (int) or a share of
    all positions (float in (0, 1]). Returns the map's JSON object (see the module's docstring)."""
    if len(paths) < 2:
        msg = "consolidate: give at least two variants"
        raise ConfigError(msg)
    vs = [_open(Path(p)) for p in paths]
    _check_same(vs)
    layers = list(vs[0].layers)
    n_expert = int(vs[0].layers[layers[0]]["ffn_gate_exps"].shape[-1])
    n_pos = len(layers) * n_expert
    if isinstance(capacity, bool):
        msg = f"capacity: {capacity} is not a count or a share of the positions"
        raise ConfigError(msg)
    c = round(float(capacity) * n_pos) if isinstance(capacity, (float, np.floating)) else int(capacity)
    if not 0 <= c <= n_pos:
        msg = f"capacity: {capacity} gives {c} positions; there are {n_pos} ({len(layers)} layers x {n_expert} experts)"
        raise ConfigError(msg)
    dist = np.zeros((len(layers), n_expert), dtype=np.float64)
    same_mean: list[float] = []
    cross_mean: list[float] = []
    for li, il in enumerate(layers):
        rows = [np.concatenate([_experts(v.layers[il][p]) for p in PROJS], axis=1) for v in vs]
        for v, experts in zip(vs, rows, strict=True):
            bad = np.flatnonzero(~np.isfinite(experts).all(axis=1))
            if len(bad):  # its distances would be NaN, which sorts as the closest: a broken expert shared
                msg = f"{v.path}: layer {il}, expert {int(bad[0])} holds a weight that is not a finite number"
                raise ConfigError(msg)
        for i in range(len(vs)):
            for j in range(i + 1, len(vs)):
                # ordered pairs (i, j) and (j, i) both count, (i, i) adds nothing: twice the unordered sum
                dist[li] += 2.0 * np.linalg.norm(rows[i] - rows[j], axis=1)
        a, b = rows[0], rows[1]
        same_mean.append(float(np.mean(np.linalg.norm(a - b, axis=1))))
        # ||a_e - b_f||^2 = |a_e|^2 + |b_f|^2 - 2 a_e.b_f for every pair of positions e != f
        sq = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
        off = ~np.eye(n_expert, dtype=bool)
        cross_mean.append(float(np.mean(np.sqrt(np.maximum(sq[off], 0.0)))) if n_expert > 1 else 0.0)
    order = sorted((float(dist[li, e]), layers[li], e) for li in range(len(layers)) for e in range(n_expert))
    owner = {il: [-1] * n_expert for il in layers}
    for r, (_, il, e) in enumerate(order[:c]):
        owner[il][e] = r % len(vs)
    return {
        "format": "moetier-consolidation-1",
        "variants": [
            {
                "path": str(v.path),
                "bytes": v.path.stat().st_size,
                "sha256_head": _head_digest(v.path),
                "sha256_experts": _experts_digest(v),
            }
            for v in vs
        ],
        "arch": vs[0].arch,
        "n_expert": n_expert,
        "capacity": c,
        "layers": layers,
        "map": [owner[il] for il in layers],  # per layer, per expert: the variant whose copy is shared, or -1
        "distance": [[round(float(x), 6) for x in row] for row in dist],
        "same_position_mean": same_mean,  # variants 0 and 1, per layer
        "cross_position_mean": cross_mean,
    }


def _expert_bytes(t: Any) -> npt.NDArray[np.uint8]:
    """One projection's raw bytes, one row per expert."""
    return np.asarray(t.data).view(np.uint8).reshape(int(t.shape[-1]), -1)


def _write_like(path: Path, out: Path, data: dict[str, Any]) -> None:
    """The GGUF at path with the tensors named in data replaced (raw bytes or float32 of the same type)."""
    import gguf

    from .moefy import _kv_copy

    r = gguf.GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    with replacing(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        try:  # closed on a failure too: the temporary file is then removed
            _kv_copy(r, w, arch, arch)
            for t in r.tensors:
                a = data.get(t.name, np.asarray(t.data))
                w.add_tensor(t.name, a, raw_shape=a.shape, raw_dtype=t.tensor_type)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()


def check_rows(rows: Any, n_layers: int, n_expert: int, n_variants: int, where: str) -> None:
    """A map's rows fit its variants: one per MoE layer, one owner per expert, each -1 (every variant
    its own) or a variant's index. ConfigError starting with `where` otherwise."""
    if (
        not isinstance(rows, list)
        or len(rows) != n_layers
        or any(not isinstance(r, list) or len(r) != n_expert for r in rows)
    ):
        msg = f"{where}: the map is of another shape than the variants' {n_layers} MoE layers x {n_expert} experts"
        raise ConfigError(msg)
    for il, row in enumerate(rows):
        for e, o in enumerate(row):
            if isinstance(o, bool) or not isinstance(o, int) or not -1 <= o < n_variants:
                msg = (
                    f"{where}: layer {il}, expert {e}: {o!r} is neither -1 (each variant's own) nor a variant "
                    f"(0 to {n_variants - 1})"
                )
                raise ConfigError(msg)


def write_consolidated(m: dict[str, Any], index: int, out: str | os.PathLike[str]) -> None:
    """Variant `index` of the map m as its requests compute under consolidation: every shared position's
    expert replaced by the copy of the variant the map gives it. What serving with the map computes,
    as one GGUF: the reference its quality is measured on."""
    vs = [_open(Path(v["path"])) for v in m["variants"]]
    _check_same(vs)
    if not 0 <= index < len(vs):
        msg = f"variant {index}: the map has {len(vs)} variants"
        raise ConfigError(msg)
    n_expert = int(next(iter(vs[0].layers.values()))["ffn_gate_exps"].shape[-1])
    if m["layers"] != list(vs[0].layers):
        msg = f"the map: layers {m['layers']}, but its variants' MoE layers are {list(vs[0].layers)}"
        raise ConfigError(msg)
    check_rows(m["map"], len(vs[0].layers), n_expert, len(vs), "the map")
    me = vs[index]
    data: dict[str, Any] = {}
    for il, row in zip(m["layers"], m["map"], strict=True):
        for p in PROJS:
            t = me.layers[il][p]
            raw = _expert_bytes(t).copy()
            for e, owner in enumerate(row):
                if owner >= 0 and owner != index:
                    src = vs[owner].layers[il][p]
                    if src.tensor_type != t.tensor_type:
                        msg = (
                            f"{vs[owner].path}: blk.{il}.{p} is {src.tensor_type.name}, but {me.path}'s is "
                            f"{t.tensor_type.name}; a shared expert is copied as it is, so the variants need one type"
                        )
                        raise ConfigError(msg)
                    raw[e] = _expert_bytes(src)[e]
            data[t.name] = raw.reshape(np.asarray(t.data).view(np.uint8).shape)
    _write_like(me.path, Path(out), data)


def write_average(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> None:
    """The weight average of the variants (the multi-MoE paper's baseline): every tensor that differs
    between them dequantized, averaged and quantized back to the first variant's type."""
    import gguf

    from .. import _core
    from .moefy import _ggml_type_name

    vs = [_open(Path(p)) for p in paths]  # first: its errors name the file
    _check_same(vs)
    readers = [gguf.GGUFReader(str(p)) for p in paths]
    data: dict[str, Any] = {}
    others = [{t.name: t for t in r.tensors} for r in readers[1:]]
    for t in readers[0].tensors:
        for p, o in zip(paths[1:], others, strict=True):
            if t.name not in o or o[t.name].data.shape != t.data.shape:
                msg = (
                    f"{p}: {t.name} is missing or of another shape than in {paths[0]}; the average needs the "
                    "same tensors in every variant"
                )
                raise ConfigError(msg)
        copies = [t] + [o[t.name] for o in others]
        raws = [np.asarray(c.data).view(np.uint8) for c in copies]
        if all(np.array_equal(raws[0], r) for r in raws[1:]):
            continue
        qt = t.tensor_type
        fl = [np.asarray(_experts_flat(c), dtype=np.float64) for c in copies]
        mean = np.mean(np.stack(fl), axis=0).astype(np.float32)
        if qt == gguf.GGMLQuantizationType.F32:
            data[t.name] = mean.reshape(np.asarray(t.data).shape)
        elif qt == gguf.GGMLQuantizationType.F16:
            data[t.name] = mean.astype(np.float16).reshape(np.asarray(t.data).shape)
        else:
            ne0 = int(t.shape[0])
            q = _core.quantize(np.ascontiguousarray(mean.reshape(-1, ne0)), _ggml_type_name(qt), None)
            data[t.name] = q.reshape(raws[0].shape)
    _write_like(Path(paths[0]), Path(out), data)


def _experts_flat(t: Any) -> F32:
    """Any tensor dequantized to float32, flattened."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = np.asarray(t.data)
    qt = GGMLQuantizationType(int(t.tensor_type))
    w = data.astype(np.float32) if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else dequantize(data, qt)
    return np.asarray(w, dtype=np.float32).reshape(-1)


def _experts_digest(v: Variant) -> str:
    """sha256 of the first 4 KiB of 8 experts of every expert tensor: variants of one base share their
    header (tokenizer, shapes; often more than a MiB), so only their experts tell them apart."""
    h = hashlib.sha256()
    for il, projs in v.layers.items():
        for name in PROJS:
            data = np.asarray(projs[name].data).reshape(-1).view(np.uint8)
            n_expert = int(projs[name].shape[-1])
            per = data.size // n_expert
            for e in sorted({int(x) for x in np.linspace(0, n_expert - 1, 8)}):
                h.update(f"{il}.{name}.{e}".encode())
                h.update(data[e * per : e * per + min(per, 4096)].tobytes())
    return h.hexdigest()


def experts_digest(path: Path) -> str:
    """_experts_digest of the GGUF at path (ConfigError naming it if it is no MoE GGUF)."""
    return _experts_digest(_open(path))


def _head_digest(path: Path) -> str:
    """sha256 of the file's first MiB and its size: enough to tell a map's variants from other files."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    h.update(str(path.stat().st_size).encode())
    return h.hexdigest()


def summary(m: dict[str, Any]) -> str:
    n = len(m["layers"]) * m["n_expert"]
    per = [sum(1 for row in m["map"] for x in row if x == i) for i in range(len(m["variants"]))]
    lines = [
        f"{len(m['variants'])} variants of {m['arch']}, {len(m['layers'])} MoE layers x {m['n_expert']} experts: "
        f"{m['capacity']} of {n} positions shared ({', '.join(f'{k} from variant {i}' for i, k in enumerate(per))})",
        "layer  same-position distance  cross-position distance",
    ]
    for il, s, c in zip(m["layers"], m["same_position_mean"], m["cross_position_mean"], strict=True):
        lines.append(f"{il:5d}  {s:22.4f}  {c:23.4f}")
    return "\n".join(lines)


def _capacity(text: str) -> int | float:
    try:
        if text.endswith("%"):
            v = float(text[:-1]) / 100.0
            if not 0 <= v <= 1:
                raise ValueError
            return v
        return int(text)
    except ValueError:
        msg = f"--capacity: {text!r} is not a count of positions or a share like 50%"
        raise argparse.ArgumentTypeError(msg) from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="moetier consolidate",
        description="Ranks every (layer, expert) position of several fine-tuned variants of one MoE by the summed "
        "L2 distance between their copies (the multi-MoE paper's algorithm 1) and shares the most similar "
        "positions, dealt to the variants in turn; writes the map and prints the same- and cross-position "
        "distances per layer.",
    )
    ap.add_argument("variants", nargs="+", help="the variants' GGUF files (one architecture, one shape)")
    ap.add_argument(
        "--capacity",
        type=_capacity,
        required=True,
        help="positions to share: a count, or a share of all positions (50%%); 0 shares nothing",
    )
    ap.add_argument("-o", "--output", required=True, help="the map to write (JSON)")
    ns = ap.parse_args(argv)
    m = consolidate(ns.variants, ns.capacity)
    out = Path(ns.output)
    write_text(out, json.dumps(m, indent=1) + "\n")
    sys.stdout.write(summary(m) + f"\nwrote {out}\n")
    return 0
