"""A copy of a MoE GGUF with its expert tensors (blk.N.ffn_{gate,up,down}_exps) re-quantized to a
smaller type, everything else byte for byte: the "stock llama.cpp on a smaller quantization" a lossy
mode is set against. The experts are dequantized from the file's own types and quantized
with ggml's reference quantizer (no importance matrix, as a plain llama-quantize run), the way
`moetier pack` makes a store's low copies.

    python bench/requant.py M.gguf M-q2k.gguf --type q2_K

--type takes a list too, as `moetier pack --low-type` does: each tensor gets the first type whose
block divides its rows (q3_K,q4_0: experts of 224 neurons have down rows of 224 values, which no
K-quant's 256-value block divides).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from moetier import _core
from moetier.tools.moefy import _kv_copy, _tensor_f32

EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")


def ggml_type(name: str) -> gguf.GGMLQuantizationType:
    qt = next((t for t in gguf.GGMLQuantizationType if t.name.lower() == name.lower()), None)
    if qt is None:
        msg = f"--type {name}: not a ggml type"
        raise SystemExit(msg)
    return qt


def requant(src: Path, dst: Path, type_name: str) -> int:
    """Writes dst; returns the bytes of expert tensors written. type_name: a type, or a list
    (comma-separated) tried in order for each tensor."""
    types = {ggml_type(x): x for x in type_name.split(",")}  # the type and its name as ggml spells it
    r = gguf.GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(tmp, arch)
    _kv_copy(r, w, arch, arch)
    expert_bytes = 0
    try:
        for t in tqdm(r.tensors, desc=f"requant {src.name} -> {type_name}", unit="tensor"):
            data: Any = np.asarray(t.data)
            raw_dtype = t.tensor_type
            if EXPERT.search(t.name):
                a = _tensor_f32(t)
                rows = np.ascontiguousarray(a.reshape(-1, a.shape[-1]), dtype=np.float32)
                qt = next((x for x in types if rows.shape[1] % gguf.GGML_QUANT_SIZES[x][0] == 0), None)
                if qt is None:
                    msg = f"{src}: {t.name}: rows of {rows.shape[1]} values fit none of --type {type_name}'s blocks"
                    raise SystemExit(msg)
                data = _core.quantize(rows, types[qt], None).reshape(*a.shape[:-1], -1)
                raw_dtype = qt
                expert_bytes += data.nbytes
            w.add_tensor(t.name, data, raw_dtype=raw_dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file left beside the output
        raise
    tmp.replace(dst)
    return expert_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="MoE GGUF")
    p.add_argument("dst", help="output GGUF")
    p.add_argument(
        "--type",
        required=True,
        help="ggml type of the experts (q2_K, q3_K, q4_K, q4_0, ...), or a list tried in order per tensor (q3_K,q4_0)",
    )
    a = p.parse_args()
    n = requant(Path(a.src), Path(a.dst), a.type)
    print(f"{a.dst}: experts {n / 2**20:.0f} MiB in {a.type}, {Path(a.dst).stat().st_size / 2**20:.0f} MiB in all")


if __name__ == "__main__":
    main()
