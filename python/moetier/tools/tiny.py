"""Tiny, deterministic GGUF models (several MoE architectures and dense qwen2) for tests.

The files load in llama.cpp: a 2-layer transformer with random weights and a
tiny byte-level BPE vocab ("gpt2" model, "qwen2" pre-tokenizer) in which every
printable ASCII character, tab, newline and carriage return is a token, so any
ASCII text tokenizes and detokenizes losslessly.
"""

from __future__ import annotations

import os
import pathlib
import zlib
from collections.abc import Iterator

import gguf
import numpy as np

__all__ = ["ARCHS", "EXPERT_TYPES", "MOE_ARCHS", "tiny_vocab", "write_tiny_model"]

ARCHS = ("qwen2moe", "qwen3moe", "qwen2", "mixtral", "olmoe", "granitemoe", "phimoe", "deepseek", "dbrx", "glm4moe")
MOE_ARCHS = tuple(a for a in ARCHS if a != "qwen2")
# general.architecture where it differs from the name used here
_GGUF_ARCH = {"mixtral": "llama"}
EXPERT_TYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
}
_FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ASCII_BYTES = (0x09, 0x0A, 0x0D, *range(0x20, 0x7F))
_COMMON_BIGRAMS = (
    "Ġt he in er an Ġa re on Ġs en at or Ġw es is Ġo it Ġc nd ed ar "
    "Ġb ou Ġf Ġp al Ġm le st io ng Ġi ll ro Ġd ic as ve ly"
).split()
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode char mapping (as used by llama.cpp BPE)."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _bigrams() -> Iterator[str]:
    seen: set[str] = set()
    for pair in (*_COMMON_BIGRAMS, *(a + b for a in "Ġ" + _LETTERS for b in _LETTERS)):
        if pair not in seen:
            seen.add(pair)
            yield pair


def tiny_vocab(n_vocab: int = 128) -> tuple[list[str], list[int], list[str]]:
    """Return (tokens, token_types, merges) of a byte-level BPE vocab of n_vocab tokens.

    Ids [0, n_base) are single-byte tokens (printable ASCII + tab/LF/CR, or all
    256 bytes when n_vocab is large enough), then 2-char merges, then the special
    tokens <|endoftext|>, <|im_start|>, <|im_end|> as the last three ids.
    """
    b2u = _bytes_to_unicode()
    n_special = len(SPECIAL_TOKENS)
    base = range(256) if n_vocab >= 256 + n_special else _ASCII_BYTES
    if n_vocab < len(base) + n_special:
        msg = f"n_vocab must be >= {len(base) + n_special}, got {n_vocab}"
        raise ValueError(msg)
    tokens = [b2u[b] for b in base]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    merges: list[str] = []
    n_fill = n_vocab - len(tokens) - n_special
    for pair in _bigrams():
        if len(merges) == n_fill:
            break
        merges.append(f"{pair[0]} {pair[1]}")
        tokens.append(pair)
        types.append(int(gguf.TokenType.NORMAL))
    for i in range(n_fill - len(merges)):
        tokens.append(f"<|extra_{i}|>")
        types.append(int(gguf.TokenType.CONTROL))
    tokens.extend(SPECIAL_TOKENS)
    types.extend([int(gguf.TokenType.CONTROL)] * n_special)
    return tokens, types, merges


def _randn(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Normal(0, std) float32 array seeded with seed ^ crc32(name)."""
    rng = np.random.default_rng((seed ^ zlib.crc32(name.encode())) & 0xFFFFFFFFFFFFFFFF)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _random_q4_k(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random Q4_K blocks (uint8, rows of shape[-1] // 256 blocks of 144 bytes) whose values have mean
    about 0 and standard deviation about std: random 4-bit quants and 6-bit scales and mins, with each
    block's d = std / 257 and dmin = 7.5 d (so d * scale * q - dmin * min centres on 0). Quantizing
    a normal array would take minutes per gigabyte; a model at a real MoE's size is tens of them."""
    rng = np.random.default_rng((seed ^ zlib.crc32(name.encode())) & 0xFFFFFFFFFFFFFFFF)
    n_blocks = shape[-1] // 256
    blocks = rng.integers(0, 256, size=(*shape[:-1], n_blocks, 144), dtype=np.uint8)
    d = np.float16(std / 257.0)
    blocks[..., 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], n_blocks * 144)


def write_tiny_model(
    path: str | os.PathLike[str],
    arch: str = "qwen2moe",
    *,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_layer: int = 2,
    n_embd: int = 64,
    n_ff_exp: int = 64,
    n_ff_shexp: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_vocab: int = 128,
    expert_type: str = "f16",
    seed: int = 1,
    n_ctx_train: int = 4096,
) -> pathlib.Path:
    """Write a tiny random-weight GGUF model and return its path.

    arch is one of ARCHS:

    - "qwen2moe" (with a gated shared expert of n_ff_shexp), "qwen3moe";
    - "mixtral" (GGUF arch "llama" with experts), "olmoe" (its q/k norms span
      all heads, so n_head_kv is ignored and equals n_head), "granitemoe" (with
      logit/residual/embedding/attention scales), "phimoe" (norm and output
      biases, NeoX rope), "deepseek" (DeepSeek-V1: layer 0 is a dense FFN, the
      others have experts plus one always-on shared expert of n_ff_exp;
      needs n_layer >= 2), "dbrx" (fused QKV, LayerNorm, clamped QKV), "glm4moe"
      (GLM-4.5: DeepSeek-V1's layout, with sigmoid probabilities and a per-expert
      selection bias, blk.N.exp_probs_b.bias, of zeros: DeepSeek-V3's routing);
    - "qwen2" (dense; its FFN size is n_ff_exp and the expert arguments are ignored).

    Every dense FFN is n_ff_exp wide. expert_type ("f32", "f16", "q8_0",
    "q4_k") applies to the three ffn_*_exps tensors only; q4_k experts are
    random blocks (not a quantized normal array), for models at a real MoE's
    size (tensors are written one at a time: memory stays at one tensor).
    Output is byte-identical for identical arguments.
    """
    if arch not in ARCHS:
        msg = f"arch must be one of {ARCHS}, got {arch!r}"
        raise ValueError(msg)
    if expert_type not in EXPERT_TYPES:
        msg = f"expert_type must be one of {tuple(EXPERT_TYPES)}, got {expert_type!r}"
        raise ValueError(msg)
    if arch == "olmoe":
        n_head_kv = n_head  # its k norm weight is n_embd wide: the argument is ignored, not checked
    if n_head < 1 or n_head_kv < 1 or n_embd % n_head or n_head % n_head_kv or (n_embd // n_head) % 2:
        msg = "need n_head, n_head_kv >= 1, n_embd % n_head == 0, n_head % n_head_kv == 0 and an even head size"
        raise ValueError(msg)
    moe = arch != "qwen2"
    if moe and not 0 < n_expert_used <= n_expert:
        msg = "need 0 < n_expert_used <= n_expert"
        raise ValueError(msg)
    if moe and expert_type == "q8_0" and (n_embd % 32 or n_ff_exp % 32):
        msg = "q8_0 experts need n_embd and n_ff_exp to be multiples of 32"
        raise ValueError(msg)
    if moe and expert_type == "q4_k" and (n_embd % 256 or n_ff_exp % 256):
        msg = "q4_k experts need n_embd and n_ff_exp to be multiples of 256"
        raise ValueError(msg)
    if arch in ("deepseek", "glm4moe") and n_layer < 2:
        msg = f"{arch} needs n_layer >= 2 (layer 0 is dense)"
        raise ValueError(msg)

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, types, merges = tiny_vocab(n_vocab)
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    n_ff = n_ff_exp

    w = gguf.GGUFWriter(path, _GGUF_ARCH.get(arch, arch))
    w.add_name(f"moetier-tiny-{arch}")
    w.add_file_type(int(_FILE_TYPES[expert_type] if moe else gguf.LlamaFileType.MOSTLY_F16))
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    if moe:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(n_ff_shexp)
    if arch == "granitemoe":
        w.add_logit_scale(0.5)
        w.add_residual_scale(0.5)
        w.add_embedding_scale(2.0)
        w.add_attention_scale(1.0 / head_dim)
    elif arch in ("deepseek", "glm4moe"):
        if arch == "glm4moe":
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_leading_dense_block_count(1)
        w.add_expert_shared_count(1)
        w.add_expert_weights_scale(1.0)
    elif arch == "dbrx":
        w.add_layer_norm_eps(1e-5)
        w.add_clamp_kqv(8.0)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eot = tokens.index("<|endoftext|>")
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_pad_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    # (name, numpy shape, std, type, mean) in file order: the infos go first, the data one tensor at a time
    specs: list[tuple[str, tuple[int, ...], float, gguf.GGMLQuantizationType, float]] = []

    def add(
        name: str,
        shape: tuple[int, ...],
        std: float,
        qtype: gguf.GGMLQuantizationType,
        mean: float = 0.0,
    ) -> None:
        # shape is numpy order, i.e. reversed ggml ne
        specs.append((name, shape, std, qtype, mean))

    def make(
        name: str, shape: tuple[int, ...], std: float, qtype: gguf.GGMLQuantizationType, mean: float
    ) -> np.ndarray:
        if qtype == gguf.GGMLQuantizationType.Q4_K:
            return _random_q4_k(seed, name, shape, std)
        data = _randn(seed, name, shape, std) if std else np.zeros(shape, np.float32)
        if mean:
            data += np.float32(mean)
        if name in ("output.weight", "output.bias"):
            # zero logits for special/extra tokens so that greedy decoding never stops early
            data[types.index(int(gguf.TokenType.CONTROL)) :] = 0.0
        if qtype == gguf.GGMLQuantizationType.F32:
            return data
        if qtype == gguf.GGMLQuantizationType.F16:
            return data.astype(np.float16)
        return gguf.quants.quantize(data, qtype)

    f32 = gguf.GGMLQuantizationType.F32
    f16 = gguf.GGMLQuantizationType.F16
    exp_t = EXPERT_TYPES[expert_type]
    s_in = 1.0 / np.sqrt(n_embd)

    add("token_embd.weight", (n_vocab, n_embd), 1.0, f16)
    add("output_norm.weight", (n_embd,), 0.1, f32, mean=1.0)
    if arch == "phimoe":
        add("output_norm.bias", (n_embd,), 0.1, f32)
    add("output.weight", (n_vocab, n_embd), 2.0 * s_in, f16)
    if arch == "phimoe":
        add("output.bias", (n_vocab,), 0.1, f32)
    for i in range(n_layer):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (n_embd,), 0.1, f32, mean=1.0)
        if arch == "phimoe":
            add(b + "attn_norm.bias", (n_embd,), 0.1, f32)
        if arch == "dbrx":
            add(b + "attn_qkv.weight", (n_embd + 2 * n_embd_kv, n_embd), s_in, f16)
        else:
            add(b + "attn_q.weight", (n_embd, n_embd), s_in, f16)
            add(b + "attn_k.weight", (n_embd_kv, n_embd), s_in, f16)
            add(b + "attn_v.weight", (n_embd_kv, n_embd), s_in, f16)
        if arch in ("qwen2", "qwen2moe"):
            add(b + "attn_q.bias", (n_embd,), 0.1, f32)
            add(b + "attn_k.bias", (n_embd_kv,), 0.1, f32)
            add(b + "attn_v.bias", (n_embd_kv,), 0.1, f32)
        elif arch in ("qwen3moe", "olmoe"):
            n_qk_norm = head_dim if arch == "qwen3moe" else n_embd
            add(b + "attn_q_norm.weight", (n_qk_norm,), 0.1, f32, mean=1.0)
            add(b + "attn_k_norm.weight", (n_qk_norm,), 0.1, f32, mean=1.0)
        add(b + "attn_output.weight", (n_embd, n_embd), s_in, f16)
        if arch == "phimoe":
            add(b + "attn_output.bias", (n_embd,), 0.1, f32)
        # dbrx normalizes the FFN input with attn_output_norm and has no ffn_norm
        ffn_norm = {"dbrx": "attn_output_norm", "glm4moe": "post_attention_norm"}.get(arch, "ffn_norm")
        add(b + ffn_norm + ".weight", (n_embd,), 0.1, f32, mean=1.0)
        if arch == "phimoe":
            add(b + "ffn_norm.bias", (n_embd,), 0.1, f32)
        if not moe or (arch in ("deepseek", "glm4moe") and i == 0):
            add(b + "ffn_gate.weight", (n_ff, n_embd), s_in, f16)
            add(b + "ffn_up.weight", (n_ff, n_embd), s_in, f16)
            add(b + "ffn_down.weight", (n_embd, n_ff), 1.0 / np.sqrt(n_ff), f16)
            continue
        # router: logits with std ~3 so that routing is decisive and varies per token/layer
        add(b + "ffn_gate_inp.weight", (n_expert, n_embd), 3.0 * s_in, f32)
        if arch == "glm4moe":
            add(b + "exp_probs_b.bias", (n_expert,), 0.0, f32)
        add(b + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), s_in, exp_t)
        add(b + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), s_in, exp_t)
        add(
            b + "ffn_down_exps.weight",
            (n_expert, n_embd, n_ff_exp),
            1.0 / np.sqrt(n_ff_exp),
            exp_t,
        )
        if arch == "qwen2moe":
            add(b + "ffn_gate_inp_shexp.weight", (n_embd,), s_in, f32)
            add(b + "ffn_gate_shexp.weight", (n_ff_shexp, n_embd), s_in, f16)
            add(b + "ffn_up_shexp.weight", (n_ff_shexp, n_embd), s_in, f16)
            add(
                b + "ffn_down_shexp.weight",
                (n_embd, n_ff_shexp),
                1.0 / np.sqrt(n_ff_shexp),
                f16,
            )
        elif arch in ("deepseek", "glm4moe"):
            add(b + "ffn_gate_shexp.weight", (n_ff_exp, n_embd), s_in, f16)
            add(b + "ffn_up_shexp.weight", (n_ff_exp, n_embd), s_in, f16)
            add(b + "ffn_down_shexp.weight", (n_embd, n_ff_exp), 1.0 / np.sqrt(n_ff_exp), f16)

    for name, shape, _, qtype, _ in specs:
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.dtype(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16)
            w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for spec in specs:
        w.write_tensor_data(make(*spec))
    w.close()
    return path
