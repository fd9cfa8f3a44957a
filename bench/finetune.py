"""Fine-tunes a dense qwen2 GGUF on one text corpus, on the CPU with torch, and writes the variant GGUF.

The variants of one base that the multi-MoE serving is measured on (bench/multimoe.py): no set of
fine-tunes of one small base can be downloaded here, so they are made. The whole model runs in float32
(the GGUF's weights dequantized); the FFN weights (gate, up, down: what moefy turns into experts) of
every layer are trained, the rest stays the base's, so the variants differ where experts live and share
attention, norms and embeddings. The trained FFN weights are written as q8_0 (a step small enough to
keep the fine-tune's changes), every other tensor as the base's bytes.

The record beside the GGUF (.json) holds the held-out perplexity before and after, computed by this
forward pass (for the base it agrees with llama-perplexity's: bench/results/multimoe-quality-*.md).

    python bench/finetune.py --base qwen2.5-coder-0.5b.gguf --train fortunes.calib.txt \\
        --eval fortunes.eval.txt --steps 300 -o variant-fortunes.gguf

Needs torch (CPU); not a dependency of the package.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from moetier.tools.moefy import _kv_copy, _tensor_f32

FFN = ("ffn_gate", "ffn_up", "ffn_down")


class Qwen2:
    """The qwen2 forward pass in torch (float32), from a GGUF: RMSNorm, NEOX rope, grouped-query
    attention with q/k/v biases, SwiGLU FFN; the FFN weights are the trainable parameters."""

    def __init__(self, path: Path) -> None:
        r = gguf.GGUFReader(path)
        f = r.fields

        def num(key: str) -> float:
            return float(f[key].parts[-1][0])

        self.n_layer = int(num("qwen2.block_count"))
        self.n_head = int(num("qwen2.attention.head_count"))
        self.n_head_kv = int(num("qwen2.attention.head_count_kv"))
        self.eps = num("qwen2.attention.layer_norm_rms_epsilon")
        self.rope_base = num("qwen2.rope.freq_base")
        tensors = {t.name: t for t in r.tensors}
        self.w: dict[str, torch.Tensor] = {}
        for name, t in tqdm(tensors.items(), desc="dequantize", disable=not sys.stderr.isatty()):
            self.w[name] = torch.from_numpy(_tensor_f32(t).copy())
        if "output.weight" not in self.w:  # tied embeddings
            self.w["output.weight"] = self.w["token_embd.weight"]
        self.n_embd = self.w["token_embd.weight"].shape[1]
        self.head_dim = self.n_embd // self.n_head
        self.params = [self.w[f"blk.{il}.{p}.weight"] for il in range(self.n_layer) for p in FFN]
        for p in self.params:
            p.requires_grad_(True)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.head_dim // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, n_vocab]."""
        w = self.w
        b, t = tokens.shape
        x = w["token_embd.weight"][tokens]
        pos = torch.arange(t, dtype=torch.float32)
        inv = self.rope_base ** (-torch.arange(0, self.head_dim // 2, dtype=torch.float32) * 2 / self.head_dim)
        ang = pos[:, None] * inv[None, :]
        cos, sin = ang.cos()[None, None], ang.sin()[None, None]
        for il in range(self.n_layer):
            p = f"blk.{il}."
            h = self._norm(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T + w[p + "attn_q.bias"]).view(b, t, self.n_head, self.head_dim)
            k = (h @ w[p + "attn_k.weight"].T + w[p + "attn_k.bias"]).view(b, t, self.n_head_kv, self.head_dim)
            v = (h @ w[p + "attn_v.weight"].T + w[p + "attn_v.bias"]).view(b, t, self.n_head_kv, self.head_dim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            rep = self.n_head // self.n_head_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + a.transpose(1, 2).reshape(b, t, self.n_embd) @ w[p + "attn_output.weight"].T
            h = self._norm(x, w[p + "ffn_norm.weight"])
            ff = F.silu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)
            x = x + ff @ w[p + "ffn_down.weight"].T
        return self._norm(x, w["output_norm.weight"]) @ w["output.weight"].T


def windows(tokens: list[int], n_ctx: int) -> torch.Tensor:
    n = len(tokens) // n_ctx
    return torch.tensor(tokens[: n * n_ctx], dtype=torch.long).view(n, n_ctx)


def perplexity(model: Qwen2, wins: torch.Tensor) -> float:
    """llama-perplexity's rule: each window scored on its second half."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in wins:
            lg = model.logits(row[None])[0]
            half = row.shape[0] // 2
            nll += float(F.cross_entropy(lg[half - 1 : -1], row[half:], reduction="sum"))
            count += row.shape[0] - half
    return math.exp(nll / count)


def write_variant(base: Path, model: Qwen2, out: Path) -> None:
    """The base's GGUF with the trained FFN weights as q8_0."""
    from moetier import _core

    r = gguf.GGUFReader(base)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "qwen2")
    _kv_copy(r, writer, "qwen2", "qwen2")
    for t in r.tensors:
        if t.name.split(".")[-2] in FFN:
            a = model.w[t.name].detach().numpy().astype(np.float32)
            q = _core.quantize(np.ascontiguousarray(a), "q8_0", None)
            writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            data = np.asarray(t.data)
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, type=Path, help="dense qwen2 GGUF")
    p.add_argument("--train", required=True, type=Path, help="training text")
    p.add_argument("--eval", required=True, type=Path, help="held-out text of the same domain")
    p.add_argument("-o", "--out", required=True, type=Path, help="variant GGUF to write")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--ctx", type=int, default=256, help="tokens per training window (default: 256)")
    p.add_argument("--batch", type=int, default=2, help="windows per step (default: 2)")
    p.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate (default: 3e-5)")
    p.add_argument(
        "--train-chars",
        type=int,
        default=4_000_000,
        help="characters of the training text the windows are drawn from (default: 4,000,000)",
    )
    p.add_argument("--eval-windows", type=int, default=8, help="evaluation windows of 512 tokens (default: 8)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the window order (default: 0)")
    p.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=True, help="bfloat16 matmuls in training (default: on)"
    )
    p.add_argument("--time-steps", type=int, default=0, help="run this many steps, print their time, write nothing")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from moetier import Model

    tok = Model(str(args.base), n_ctx=512, n_threads=args.threads)
    n_train_tokens = args.steps * args.batch * args.ctx
    # windows drawn from a wide slice of the text: a short run over a small slice memorises it
    train = tok.tokenize(args.train.read_text(errors="replace")[: args.train_chars], add_special=False)
    eval_tokens = tok.tokenize(args.eval.read_text(errors="replace")[: args.eval_windows * 512 * 6], add_special=False)
    eval_wins = windows(eval_tokens, 512)[: args.eval_windows]
    del tok
    t0 = time.monotonic()
    model = Qwen2(args.base)
    t_load = time.monotonic() - t0

    wins = windows(train, args.ctx)

    if len(wins) < args.batch:
        sys.exit(f"{args.train}: {len(train)} tokens, too few for one batch of {args.batch} x {args.ctx}")
    opt = torch.optim.AdamW(model.params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    n_steps = args.time_steps or args.steps
    ppl_before = perplexity(model, eval_wins) if not args.time_steps else float("nan")
    t0 = time.monotonic()
    losses: list[float] = []
    bar = tqdm(range(n_steps), desc=f"fine-tune {args.out.stem}", disable=not sys.stderr.isatty())
    for step in bar:
        idx = torch.randint(len(wins), (args.batch,), generator=g)
        batch = wins[idx]
        lr = args.lr * min(1.0, (step + 1) / 10) * (0.5 * (1 + math.cos(math.pi * step / n_steps)))
        for grp in opt.param_groups:
            grp["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            lg = model.logits(batch)
        loss = F.cross_entropy(lg[:, :-1].float().reshape(-1, lg.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix_str(f"loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
    t_train = time.monotonic() - t0
    if args.time_steps:
        print(f"{n_steps} steps of {args.batch} x {args.ctx} tokens: {t_train:.1f} s ({t_train / n_steps:.2f} s/step)")
        return
    ppl_after = perplexity(model, eval_wins)
    write_variant(args.base, model, args.out)
    rec = {
        "base": str(args.base),
        "train": str(args.train),
        "eval": str(args.eval),
        "steps": args.steps,
        "batch": args.batch,
        "ctx": args.ctx,
        "lr": args.lr,
        "train_tokens": n_train_tokens,
        "train_pool_tokens": len(train),
        "load_s": t_load,
        "train_s": t_train,
        "ppl_before": ppl_before,
        "ppl_after": ppl_after,
        "loss_first10": sum(losses[:10]) / min(10, len(losses)),
        "loss_last10": sum(losses[-10:]) / min(10, len(losses)),
    }
    args.out.with_suffix(".json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
