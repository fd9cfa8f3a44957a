"""moetier.tools.tiny, the generator of the test models: its byte-level vocabulary, its seeded random
weights, and per architecture the GGUF it writes (metadata, tensor names, shapes, types and values,
read back with gguf.GGUFReader), its argument checks, and that every file loads and generates."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from moetier import Model
from moetier.tools import tiny
from moetier.tools.tiny import ARCHS, CHAT_TEMPLATE, tiny_vocab, write_tiny_model

F32 = gguf.GGMLQuantizationType.F32
F16 = gguf.GGMLQuantizationType.F16
Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q4_K = gguf.GGMLQuantizationType.Q4_K
NORMAL = int(gguf.TokenType.NORMAL)
CONTROL = int(gguf.TokenType.CONTROL)

# every size different from the others, so that a tensor given the wrong one shows
DIMS: dict[str, int] = {
    "n_expert": 6,
    "n_expert_used": 3,
    "n_layer": 3,
    "n_embd": 64,
    "n_ff_exp": 96,
    "n_ff_shexp": 160,
    "n_head": 4,
    "n_head_kv": 2,
    "n_vocab": 140,
    "n_ctx_train": 512,
    "seed": 7,
}
ASCII = [9, 10, 13, *range(32, 127)]
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_k": 15}


# ---------------------------------------------------------------------------------------------
# Vocabulary


def test_bytes_to_unicode_is_gpt2s_byte_map() -> None:
    """Printable Latin-1 bytes map to themselves; the others (control, space, 0x7f-0xa0, 0xad) to
    U+0100 upwards in byte order, as GPT-2's byte-level BPE does."""
    b2u = tiny._bytes_to_unicode()
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    assert len(others) == 68
    assert b2u == {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    assert (b2u[0x09], b2u[0x0A], b2u[0x0D], b2u[0x20], b2u[0x7F], b2u[0xAD]) == ("ĉ", "Ċ", "č", "Ġ", "ġ", "Ń")


def test_bigrams_are_common_pairs_then_every_letter_pair_once() -> None:
    """The merge candidates: 39 common English pairs first, then every (space or letter) + letter pair
    in frequency order, none twice."""
    pairs = list(tiny._bigrams())
    common = "Ġt he in er an Ġa re on Ġs en at or Ġw es is Ġo it Ġc nd ed ar Ġb ou Ġf Ġp al Ġm le st io ng Ġi ll ro"
    assert pairs[:41] == [*common.split(), "Ġd", "ic", "as", "ve", "ly", "Ġe", "Ġn"]
    assert len(pairs) == len(set(pairs)) == 27 * 26
    assert pairs[-3:] == ["zx", "zq", "zz"]


def test_tiny_vocab_default_layout() -> None:
    """128 tokens: the 98 ASCII byte tokens (tab, LF, CR, printable), 27 merges of common pairs, then
    <|endoftext|>, <|im_start|>, <|im_end|> as control tokens."""
    tokens, types, merges = tiny_vocab()
    b2u = tiny._bytes_to_unicode()
    pairs = list(tiny._bigrams())[:27]
    assert tokens == [b2u[b] for b in ASCII] + pairs + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert merges == [f"{p[0]} {p[1]}" for p in pairs]
    assert merges[:2] == ["Ġ t", "h e"]
    assert types == [NORMAL] * 125 + [CONTROL] * 3


@pytest.mark.parametrize(
    ("n_vocab", "n_base", "n_merges", "n_extra"),
    [(101, 98, 0, 0), (102, 98, 1, 0), (258, 98, 157, 0), (259, 256, 0, 0), (260, 256, 1, 0), (963, 256, 702, 2)],
)
def test_tiny_vocab_sizes(n_vocab: int, n_base: int, n_merges: int, n_extra: int) -> None:
    """From 259 tokens on every byte is a token; merges fill what is left, and once the pairs run out
    control tokens <|extra_N|> do."""
    tokens, types, merges = tiny_vocab(n_vocab)
    b2u = tiny._bytes_to_unicode()
    base = range(256) if n_base == 256 else ASCII
    extras = [f"<|extra_{i}|>" for i in range(n_extra)]
    assert len(tokens) == len(types) == n_vocab
    assert tokens[:n_base] == [b2u[b] for b in base]
    assert len(merges) == n_merges and tokens[n_base : n_base + n_merges] == list(tiny._bigrams())[:n_merges]
    assert tokens[n_base + n_merges :] == [*extras, "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types == [NORMAL] * (n_base + n_merges) + [CONTROL] * (n_extra + 3)


def test_tiny_vocab_too_small() -> None:
    """A vocabulary without room for the ASCII bytes and the three special tokens is refused."""
    with pytest.raises(ValueError) as e:
        tiny_vocab(100)
    assert str(e.value) == "n_vocab must be >= 101, got 100"


# ---------------------------------------------------------------------------------------------
# Random weights


@pytest.mark.parametrize("seed", [1, 12345, -5])
def test_randn_is_seeded_by_seed_and_name(seed: int) -> None:
    """Weights are float32 normal(0, std) from a generator seeded with seed XOR crc32(name), taken as an
    unsigned 64-bit number (so negative seeds work)."""
    got = tiny._randn(seed, "blk.0.x", (3, 4), 0.5)
    rng = np.random.default_rng((seed ^ zlib.crc32(b"blk.0.x")) % (1 << 64))
    want = rng.standard_normal((3, 4), dtype=np.float32) * np.float32(0.5)
    assert got.dtype == np.float32 and got.shape == (3, 4)
    assert np.array_equal(got, want)
    assert not np.array_equal(got, tiny._randn(seed, "blk.1.x", (3, 4), 0.5))


def test_random_q4_k_blocks() -> None:
    """Random Q4_K blocks: 144 random bytes per 256 values, except d = std / 257 and dmin = 7.5 d
    (float16) at the start of every block."""
    got = tiny._random_q4_k(3, "e", (2, 3, 512), 0.1)
    assert got.dtype == np.uint8 and got.shape == (2, 3, 2 * 144)
    want = np.random.default_rng(3 ^ zlib.crc32(b"e")).integers(0, 256, size=(2, 3, 2, 144), dtype=np.uint8)
    d = np.float16(0.1 / 257)
    want[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    want[..., 2:4] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), np.uint8)
    assert np.array_equal(got.reshape(2, 3, 2, 144), want)
    assert np.array_equal(tiny._random_q4_k(-1, "e", (1, 256), 0.1), tiny._random_q4_k(-1, "e", (1, 256), 0.1))
    assert tiny._random_q4_k(1, "wide", (1, 255 * 256), 0.1).shape == (1, 255 * 144)  # one block per 256 values


# ---------------------------------------------------------------------------------------------
# What each architecture's file holds

Spec = tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, float, float]  # name, shape, type, std, mean


def expected_tensors(arch: str, kw: dict[str, int], exp_t: gguf.GGMLQuantizationType) -> list[Spec]:
    """The tensors write_tiny_model writes, in file order (numpy shapes), with the std and mean of their values."""
    e, f, s, x, v = kw["n_embd"], kw["n_ff_exp"], kw["n_ff_shexp"], kw["n_expert"], kw["n_vocab"]
    hd = e // kw["n_head"]
    kv = e if arch == "olmoe" else hd * kw["n_head_kv"]
    s_in = 1.0 / np.sqrt(e)
    phi = arch == "phimoe"
    out: list[Spec] = [("token_embd.weight", (v, e), F16, 1.0, 0.0), ("output_norm.weight", (e,), F32, 0.1, 1.0)]
    out += [("output_norm.bias", (e,), F32, 0.1, 0.0)] if phi else []
    out += [("output.weight", (v, e), F16, 2.0 * s_in, 0.0)]
    out += [("output.bias", (v,), F32, 0.1, 0.0)] if phi else []
    for i in range(kw["n_layer"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,), F32, 0.1, 1.0)]
        out += [(b + "attn_norm.bias", (e,), F32, 0.1, 0.0)] if phi else []
        if arch == "dbrx":
            out += [(b + "attn_qkv.weight", (e + 2 * kv, e), F16, s_in, 0.0)]
        else:
            out += [(b + f"attn_{t}.weight", (n, e), F16, s_in, 0.0) for t, n in (("q", e), ("k", kv), ("v", kv))]
        if arch in ("qwen2", "qwen2moe"):
            out += [(b + f"attn_{t}.bias", (n,), F32, 0.1, 0.0) for t, n in (("q", e), ("k", kv), ("v", kv))]
        if arch in ("qwen3moe", "olmoe"):
            n = hd if arch == "qwen3moe" else e
            out += [(b + "attn_q_norm.weight", (n,), F32, 0.1, 1.0), (b + "attn_k_norm.weight", (n,), F32, 0.1, 1.0)]
        out += [(b + "attn_output.weight", (e, e), F16, s_in, 0.0)]
        out += [(b + "attn_output.bias", (e,), F32, 0.1, 0.0)] if phi else []
        norm = {"dbrx": "attn_output_norm", "glm4moe": "post_attention_norm"}.get(arch, "ffn_norm")
        out += [(b + norm + ".weight", (e,), F32, 0.1, 1.0)]
        out += [(b + "ffn_norm.bias", (e,), F32, 0.1, 0.0)] if phi else []
        dense_ffn = [
            (b + "ffn_gate.weight", (f, e), F16, s_in, 0.0),
            (b + "ffn_up.weight", (f, e), F16, s_in, 0.0),
            (b + "ffn_down.weight", (e, f), F16, 1.0 / np.sqrt(f), 0.0),
        ]
        if arch == "qwen2" or (arch in ("deepseek", "glm4moe") and i == 0):
            out += dense_ffn
            continue
        out += [(b + "ffn_gate_inp.weight", (x, e), F32, 3.0 * s_in, 0.0)]
        out += [(b + "exp_probs_b.bias", (x,), F32, 0.0, 0.0)] if arch == "glm4moe" else []
        out += [
            (b + "ffn_gate_exps.weight", (x, f, e), exp_t, s_in, 0.0),
            (b + "ffn_up_exps.weight", (x, f, e), exp_t, s_in, 0.0),
            (b + "ffn_down_exps.weight", (x, e, f), exp_t, 1.0 / np.sqrt(f), 0.0),
        ]
        if arch == "qwen2moe":
            out += [
                (b + "ffn_gate_inp_shexp.weight", (e,), F32, s_in, 0.0),
                (b + "ffn_gate_shexp.weight", (s, e), F16, s_in, 0.0),
                (b + "ffn_up_shexp.weight", (s, e), F16, s_in, 0.0),
                (b + "ffn_down_shexp.weight", (e, s), F16, 1.0 / np.sqrt(s), 0.0),
            ]
        if arch in ("deepseek", "glm4moe"):
            out += [(n.replace(".weight", "_shexp.weight"), *rest) for n, *rest in dense_ffn]
    return out


def expected_values(spec: Spec, seed: int, n_vocab: int) -> np.ndarray:
    name, shape, qtype, std, mean = spec
    if qtype == Q4_K:
        return tiny._random_q4_k(seed, name, shape, std)
    data = tiny._randn(seed, name, shape, std) if std else np.zeros(shape, np.float32)
    data = data + np.float32(mean)
    if name in ("output.weight", "output.bias"):
        data[n_vocab - 3 :] = 0.0  # the special tokens' logits are 0
    if qtype == F32:
        return data
    if qtype == F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def expected_kv(arch: str, kw: dict[str, int], expert_type: str) -> dict[str, Any]:
    g = "llama" if arch == "mixtral" else arch
    moe = arch != "qwen2"
    tokens, types, merges = tiny_vocab(kw["n_vocab"])
    eot = kw["n_vocab"] - 3
    kv: dict[str, Any] = {
        "general.architecture": g,
        "general.name": f"moetier-tiny-{arch}",
        "general.file_type": FILE_TYPES[expert_type] if moe else 1,
        f"{g}.context_length": kw["n_ctx_train"],
        f"{g}.embedding_length": kw["n_embd"],
        f"{g}.block_count": kw["n_layer"],
        f"{g}.feed_forward_length": kw["n_ff_exp"],
        f"{g}.attention.head_count": kw["n_head"],
        f"{g}.attention.head_count_kv": kw["n_head"] if arch == "olmoe" else kw["n_head_kv"],
        f"{g}.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
        f"{g}.rope.freq_base": 1e6,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": eot,
        "tokenizer.ggml.eos_token_id": eot,
        "tokenizer.ggml.padding_token_id": eot,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    if moe:
        kv[f"{g}.expert_count"] = kw["n_expert"]
        kv[f"{g}.expert_used_count"] = kw["n_expert_used"]
        kv[f"{g}.expert_feed_forward_length"] = kw["n_ff_exp"]
    if arch == "qwen2moe":
        kv[f"{g}.expert_shared_feed_forward_length"] = kw["n_ff_shexp"]
    if arch == "granitemoe":
        head_dim = kw["n_embd"] // kw["n_head"]
        kv |= {f"{g}.logit_scale": 0.5, f"{g}.residual_scale": 0.5, f"{g}.embedding_scale": 2.0}
        kv[f"{g}.attention.scale"] = 1.0 / head_dim
    if arch in ("deepseek", "glm4moe"):
        kv |= {f"{g}.leading_dense_block_count": 1, f"{g}.expert_shared_count": 1, f"{g}.expert_weights_scale": 1.0}
    if arch == "glm4moe":
        kv[f"{g}.expert_gating_func"] = int(gguf.ExpertGatingFuncType.SIGMOID)
    if arch == "dbrx":
        kv[f"{g}.attention.layer_norm_epsilon"] = float(np.float32(1e-5))
        kv[f"{g}.attention.clamp_kqv"] = 8.0
    return kv


def check_file(path: Path, arch: str, kw: dict[str, int], expert_type: str) -> None:
    """Compares the file's metadata, tensor list and every tensor's values with what they should be."""
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert kv == expected_kv(arch, kw, expert_type)
    want = expected_tensors(arch, kw, tiny.EXPERT_TYPES[expert_type] if arch != "qwen2" else F16)
    got = [(t.name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type) for t in r.tensors]
    assert got == [(name, shape, qtype) for name, shape, qtype, _, _ in want]
    for t, spec in zip(r.tensors, want, strict=True):
        values = expected_values(spec, kw["seed"], kw["n_vocab"])
        assert np.array_equal(np.asarray(t.data).reshape(values.shape), values), t.name


@pytest.mark.parametrize("arch", ARCHS)
def test_written_file_per_architecture(tmp_path: Path, arch: str) -> None:
    """Each architecture's file has its metadata, its tensors (names, order, shapes, types) and the
    seeded values (norms around 1, the selection bias zero, the special tokens' output rows zero)."""
    kw = dict(DIMS)
    if arch == "olmoe":
        kw["n_head_kv"] = 2  # ignored: olmoe's q/k norms span all heads
    path = write_tiny_model(tmp_path / "m.gguf", arch, **kw)  # type: ignore[arg-type]
    assert path == tmp_path / "m.gguf"
    check_file(path, arch, kw, "f16")


@pytest.mark.parametrize(
    ("arch", "expert_type", "dims"),
    [
        ("qwen2moe", "f32", {}),
        ("deepseek", "q8_0", {}),
        ("glm4moe", "f32", {"n_layer": 2}),
        ("qwen2", "q8_0", {"n_ff_exp": 48}),  # dense: the expert type and its multiples do not apply
        ("qwen3moe", "q4_k", {"n_embd": 256, "n_ff_exp": 512, "n_expert": 2, "n_expert_used": 1, "n_layer": 1}),
    ],
)
def test_written_file_per_expert_type(tmp_path: Path, arch: str, expert_type: str, dims: dict[str, int]) -> None:
    """expert_type sets the file type and the type of the three expert tensors only."""
    kw = {**DIMS, **dims}
    path = write_tiny_model(tmp_path / "m.gguf", arch, expert_type=expert_type, **kw)  # type: ignore[arg-type]
    check_file(path, arch, kw, expert_type)


def test_defaults(tmp_path: Path) -> None:
    """Without arguments: a qwen2moe of 2 layers, 8 experts (2 used), 64 wide, 4 heads (2 kv), 128 tokens,
    f16 experts, seed 1, trained context 4096; a str path and missing folders are fine."""
    path = write_tiny_model(str(tmp_path / "a" / "b" / "m.gguf"))
    assert path == tmp_path / "a" / "b" / "m.gguf"
    kw = {
        "n_expert": 8,
        "n_expert_used": 2,
        "n_layer": 2,
        "n_embd": 64,
        "n_ff_exp": 64,
        "n_ff_shexp": 64,
        "n_head": 4,
        "n_head_kv": 2,
        "n_vocab": 128,
        "n_ctx_train": 4096,
        "seed": 1,
    }
    check_file(path, "qwen2moe", kw, "f16")


def test_output_is_byte_identical_for_identical_arguments(tmp_path: Path) -> None:
    """The same arguments give the same bytes; another seed other weights (same layout); an existing
    folder is written into."""
    a = write_tiny_model(tmp_path / "a.gguf", "mixtral", n_layer=1).read_bytes()
    assert write_tiny_model(tmp_path / "b.gguf", "mixtral", n_layer=1).read_bytes() == a
    c = write_tiny_model(tmp_path / "c.gguf", "mixtral", n_layer=1, seed=2).read_bytes()
    assert len(c) == len(a) and c != a


HEADS = "need n_head, n_head_kv >= 1, n_embd % n_head == 0, n_head % n_head_kv == 0 and an even head size"


@pytest.mark.parametrize(
    ("arch", "kw", "error"),
    [
        ("llama", {}, f"arch must be one of {ARCHS}, got 'llama'"),
        ("qwen2moe", {"expert_type": "q4_0"}, "expert_type must be one of ('f32', 'f16', 'q8_0', 'q4_k'), got 'q4_0'"),
        ("qwen2moe", {"n_embd": 66}, HEADS),
        ("qwen2moe", {"n_head_kv": 3}, HEADS),
        ("qwen2moe", {"n_embd": 60}, HEADS),
        ("qwen2", {"n_embd": 60}, HEADS),
        ("qwen2moe", {"n_head": 0}, HEADS),
        ("qwen2moe", {"n_head_kv": 0}, HEADS),
        ("qwen2moe", {"n_expert_used": 0}, "need 0 < n_expert_used <= n_expert"),
        ("olmoe", {"n_expert_used": 9}, "need 0 < n_expert_used <= n_expert"),
        (
            "qwen2moe",
            {"expert_type": "q8_0", "n_embd": 48},
            "q8_0 experts need n_embd and n_ff_exp to be multiples of 32",
        ),
        (
            "dbrx",
            {"expert_type": "q8_0", "n_ff_exp": 48},
            "q8_0 experts need n_embd and n_ff_exp to be multiples of 32",
        ),
        (
            "qwen3moe",
            {"expert_type": "q4_k", "n_ff_exp": 256},
            "q4_k experts need n_embd and n_ff_exp to be multiples of 256",
        ),
        (
            "qwen3moe",
            {"expert_type": "q4_k", "n_embd": 256, "n_ff_exp": 128},
            "q4_k experts need n_embd and n_ff_exp to be multiples of 256",
        ),
        ("deepseek", {"n_layer": 1}, "deepseek needs n_layer >= 2 (layer 0 is dense)"),
        ("glm4moe", {"n_layer": 1}, "glm4moe needs n_layer >= 2 (layer 0 is dense)"),
    ],
)
def test_bad_arguments_are_refused_before_writing(tmp_path: Path, arch: str, kw: dict[str, Any], error: str) -> None:
    """Arguments no model can have are refused with what is needed, and nothing is written."""
    with pytest.raises(ValueError) as e:
        write_tiny_model(tmp_path / "d" / "m.gguf", arch, **kw)
    assert str(e.value) == error
    assert list(tmp_path.iterdir()) == []


def test_edge_arguments_are_accepted(tmp_path: Path) -> None:
    """The limits themselves are fine: every expert used, one expert, two layers for the leading-dense
    architectures, one attention head, and a dense model ignores the expert arguments."""
    cases: list[tuple[str, dict[str, Any]]] = [
        ("qwen2moe", {"n_expert": 4, "n_expert_used": 4}),
        ("mixtral", {"n_expert": 1, "n_expert_used": 1}),
        ("deepseek", {"n_layer": 2}),
        ("glm4moe", {"n_layer": 2}),
        ("qwen2", {"n_expert_used": 0, "expert_type": "q4_k"}),
        ("qwen2moe", {"expert_type": "q8_0", "n_embd": 32, "n_ff_exp": 32, "n_head": 2, "n_head_kv": 1}),
        ("qwen2", {"n_head": 1, "n_head_kv": 1}),
    ]
    for i, (arch, kw) in enumerate(cases):
        path = write_tiny_model(tmp_path / f"{i}.gguf", arch, **kw)
        assert gguf.GGUFReader(path).fields["general.architecture"].contents() in (arch, "llama")


# ---------------------------------------------------------------------------------------------
# The files work in llama.cpp


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_loads_tokenizes_and_generates(tmp_path: Path, arch: str) -> None:
    """Each file loads in llama.cpp with uneven sizes, tokenizes any ASCII text losslessly (single bytes
    are the first ids), renders the ChatML template and decodes greedily without stopping early."""
    path = write_tiny_model(tmp_path / "m.gguf", arch, **DIMS)  # type: ignore[arg-type]
    m = Model(path, cache=None, n_ctx=256)
    assert m.n_vocab == 140
    text = "\tHello, World!\r\n~ {x} 0123456789"
    assert m.detokenize(m.tokenize(text, add_special=False)) == text
    assert [m.tokenize(c, add_special=False) for c in "\t\n\r ~"] == [[0], [1], [2], [3], [97]]
    assert m.chat_prompt([("user", "hi")]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert len(m.generate("The quick brown fox", max_tokens=8).tokens) == 8


def test_olmoe_ignores_n_head_kv(tmp_path: Path) -> None:
    """olmoe's q/k norms span all heads, so n_head_kv is ignored, whatever it is, not refused."""
    path = write_tiny_model(tmp_path / "o.gguf", "olmoe", n_head_kv=3)
    f = gguf.GGUFReader(str(path)).fields["olmoe.attention.head_count_kv"]
    assert int(f.parts[f.data[0]][0]) == 4  # n_head
