"""`moetier calibrate`: per-model settings of the expert cache from calibration text.

1. Record a routing trace: for every token and MoE layer, the selected experts and their gate
   weights (the stock model run through llama.cpp, read from its graph). Saved as .npz so that
   later tools can reuse it.
2. Precision thresholds (HOBBIT sec. 3.2): the distribution of the unimportance scores (eq. 2)
   over the trace; t1 and t2 are the score quantiles that put `target_low` of the selections in low
   precision and `target_skip` in skip. A PNG shows the distribution and the split.
3. Policy weights (sec. 3.4) and the pool split: the trace is replayed at the budget through the
   engine's own cache code (C++, no reads) for every weight vector on a grid and the single
   policies, at each share of the budget for low-precision slots (`low_frac`, when the store has low
   copies and the thresholds use them); the lowest miss penalty (bytes that would be read) wins.
   Penalties are reported relative to random replacement.
4. A JSON config file that `CacheConfig.from_file`, `moetier run --cache-config` and `moetier serve
   --cache-config` load.
"""

from __future__ import annotations

import itertools
import json
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _core
from ._files import replacing, write_text
from .config import AUTO, CacheConfig, ContextConfig
from .errors import ConfigError, ModelError
from .model import Model, check_gguf


def read_texts(paths: list[str], flag: str) -> list[str]:
    """The text of each file given to flag (bytes that are not UTF-8 replaced); ConfigError naming the
    flag and the file that cannot be read."""
    out = []
    for f in paths:
        try:
            out.append(Path(f).read_text(errors="replace"))
        except OSError as e:
            msg = f"{flag} {f}: cannot read it ({e.strerror or e}); give text files"
            raise ConfigError(msg) from None
    return out


@dataclass(frozen=True)
class CalibrateConfig:
    """Knobs of `moetier calibrate`."""

    tokens: int = field(default=4096, metadata={"help": "calibration tokens recorded into the trace"})
    seq_len: int = field(
        default=512, metadata={"help": "tokens per sequence (the KV cache and the sequence records reset)"}
    )
    target_low: float = field(
        default=0.3, metadata={"help": "share of expert selections the thresholds put in low precision"}
    )
    target_skip: float = field(default=0.0, metadata={"help": "share of expert selections the thresholds skip"})
    grid: int = field(default=4, metadata={"help": "policy weights are multiples of 1/GRID summing to 1"})

    def __post_init__(self) -> None:
        for name in ("tokens", "seq_len", "grid"):
            if getattr(self, name) < 1:
                msg = f"calibrate.{name}: {getattr(self, name)} must be positive"
                raise ConfigError(msg)
        if self.grid > 32:  # every weighting of the 4 policies on the grid is replayed: 6545 at 32
            msg = f"calibrate.grid: {self.grid} must be at most 32 (each weighting on the grid is one replay)"
            raise ConfigError(msg)
        for name in ("target_low", "target_skip"):
            if not 0 <= getattr(self, name) <= 1:
                msg = f"calibrate.{name}: {getattr(self, name)} must lie in [0, 1]"
                raise ConfigError(msg)
        if self.target_low + self.target_skip > 1:
            msg = f"calibrate.target_skip: {self.target_skip} and target_low {self.target_low} must sum to at most 1"
            raise ConfigError(msg)


@dataclass(frozen=True)
class Trace:
    """Routing of a model on some text, as `moetier trace` and `moetier calibrate` write it: a NumPy
    .npz archive holding

    - ids: int32 [n_tokens, n_layers, n_used], the experts each token selected at each MoE layer,
      in the router's order (top-1 first);
    - weights: float32 of the same shape, their gate weights (after the model's normalisation);
    - layers: int32 [n_layers], the model layer index of each MoE layer;
    - n_expert: int32, experts per layer;
    - seq_starts: int64, the tokens where a sequence starts (an empty KV cache);
    - ubatch_starts: int64, the tokens where a ubatch starts (the tokens one forward pass
      computed together; a trace written before this field reads as one ubatch per sequence).

    load() also reads the shared format of real routing recorded by other tools (ids uint8 [T, L, K],
    seq_offsets [S + 1], n_experts, top_k, layers, optional weights): each token is one step, and
    without weights each selected expert weighs 1/K (has_weights False).
    """

    ids: npt.NDArray[np.int32]
    weights: npt.NDArray[np.float32]
    layers: tuple[int, ...]
    n_expert: int
    seq_starts: tuple[int, ...]
    ubatch_starts: tuple[int, ...] = ()
    has_weights: bool = True  # False: a real trace without gate weights (each selected expert weighs 1/K)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Writes the trace as PATH(.npz): to a temporary file renamed over it, so that a failed write
        never leaves a damaged trace where a good one was."""
        p = Path(path)
        out = p if p.suffix == ".npz" else p.with_name(p.name + ".npz")
        with replacing(out) as tmp:
            self._write(tmp)
        return out

    def _write(self, p: Path) -> None:
        np.savez_compressed(
            p,
            ids=self.ids,
            weights=self.weights,
            layers=np.asarray(self.layers, dtype=np.int32),
            n_expert=np.int32(self.n_expert),
            seq_starts=np.asarray(self.seq_starts, dtype=np.int64),
            ubatch_starts=np.asarray(self.ubatch_starts or self.seq_starts, dtype=np.int64),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        try:
            # a routing trace is an .npz archive (a zip file); anything else np.load would unpickle
            with open(path, "rb") as f:
                is_zip = zipfile.is_zipfile(f)
        except OSError as e:
            msg = f"{path}: cannot read the routing trace ({e.strerror or e})"
            raise ConfigError(msg) from None
        if not is_zip:
            msg = f"{path}: not a moetier routing trace (not an .npz archive); record one with `moetier trace`"
            raise ConfigError(msg)
        try:
            with np.load(path) as z:
                if "seq_offsets" in z.files and "seq_starts" not in z.files:
                    tr = _shared_trace(z, path)
                else:
                    seq = _int_list(z["seq_starts"], "seq_starts", path)
                    tr = cls(
                        ids=_ids(z["ids"], path),
                        weights=np.asarray(z["weights"]).astype(np.float32),
                        layers=tuple(_int_list(z["layers"], "layers", path)),
                        n_expert=_count(z["n_expert"], "n_expert", path),
                        seq_starts=tuple(seq),
                        ubatch_starts=tuple(_int_list(z["ubatch_starts"], "ubatch_starts", path))
                        if "ubatch_starts" in z
                        else tuple(seq),
                    )
        except OSError as e:
            msg = f"{path}: cannot read the routing trace ({e.strerror or e})"
            raise ConfigError(msg) from None
        except ConfigError:
            raise  # the checks below, which name the file already
        except (KeyError, ValueError, TypeError, AttributeError, EOFError, zipfile.BadZipFile) as e:
            # a missing or damaged member, one of the wrong kind: what np.load or the casts say
            msg = f"{path}: not a moetier routing trace ({type(e).__name__}: {e}); record one with `moetier trace`"
            raise ConfigError(msg) from None
        n_layers = len(tr.layers)
        if tr.ids.ndim != 3 or tr.weights.shape != tr.ids.shape or tr.ids.shape[1] != n_layers or not n_layers:
            msg = (
                f"{path}: ids {tr.ids.shape} and weights {tr.weights.shape} must both be [n_tokens, {n_layers}, n_used]"
            )
            raise ConfigError(msg)
        n = tr.ids.shape[0]
        if tr.ids.size and (tr.ids.min() < 0 or tr.ids.max() >= tr.n_expert):
            msg = f"{path}: expert ids must lie in [0, {tr.n_expert})"
            raise ConfigError(msg)
        for name, starts in (("seq_starts", tr.seq_starts), ("ubatch_starts", tr.ubatch_starts)):
            if list(starts) != sorted(set(starts)) or (starts and (starts[0] != 0 or starts[-1] >= n)):
                msg = f"{path}: {name} must rise strictly from 0 and stay below {n} tokens"
                raise ConfigError(msg)
        k = tr.ids.shape[2]
        if not n or not 1 <= k <= tr.n_expert:
            msg = f"{path}: {n} tokens of top-{k} of {tr.n_expert} experts; a trace needs tokens, 1 <= top-k <= experts"
            raise ConfigError(msg)
        if k > 1 and (np.diff(np.sort(tr.ids, axis=2), axis=2) == 0).any():
            msg = f"{path}: a token selects the same expert twice in one layer"
            raise ConfigError(msg)
        if not np.isfinite(tr.weights).all() or (tr.weights < 0).any():
            msg = f"{path}: gate weights must be finite and 0 or more"
            raise ConfigError(msg)
        return tr


MAX_EXPERTS = 1 << 16  # experts per layer a trace may name (the largest MoEs have 512)


def _ids(a: Any, path: str | os.PathLike[str]) -> npt.NDArray[np.int32]:
    """A trace's expert ids as int32, checked before the cast (which would wrap or truncate)."""
    a = np.asarray(a)
    if a.dtype.kind not in "iu":
        msg = f"{path}: ids are {a.dtype}; expert ids are integers"
        raise ConfigError(msg)
    if a.size and (a.min() < 0 or a.max() >= MAX_EXPERTS):
        msg = f"{path}: expert ids must lie in [0, n_expert)"
        raise ConfigError(msg)
    return np.asarray(a.astype(np.int32), dtype=np.int32)


def _int_list(a: Any, name: str, path: str | os.PathLike[str]) -> list[int]:
    """A 1-d integer member of a trace as a list."""
    a = np.asarray(a)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        msg = f"{path}: {name} must be a 1-d array of integers, not {a.dtype} of shape {a.shape}"
        raise ConfigError(msg)
    return [int(x) for x in a]


def _count(a: Any, name: str, path: str | os.PathLike[str]) -> int:
    """A trace's expert count: one integer in [1, MAX_EXPERTS]."""
    a = np.asarray(a)
    if a.size != 1 or a.dtype.kind not in "iu" or not 1 <= int(a.reshape(())) <= MAX_EXPERTS:
        msg = f"{path}: {name} must be one integer in [1, {MAX_EXPERTS}], not {a.tolist()!r}"
        raise ConfigError(msg)
    return int(a.reshape(()))


def _shared_trace(z: Any, path: str | os.PathLike[str]) -> Trace:
    """A trace in the shared format of real routing recorded elsewhere (ids uint8 [T, L, K], seq_offsets
    [S + 1], n_experts, top_k, layers; weights optional): every token is its own step, as a decode
    replays it. Without gate weights every selected expert weighs 1/K: the order of ids is the rank."""
    ids = _ids(z["ids"], path)
    n_expert = _count(z["n_experts"], "n_experts", path)
    offs = _int_list(z["seq_offsets"], "seq_offsets", path)
    if ids.ndim != 3:
        msg = f"{path}: ids of shape {ids.shape}, need [tokens, layers, top_k]"
        raise ConfigError(msg)
    n = ids.shape[0]
    if offs[:1] != [0] or offs[-1] != n or any(b <= a for a, b in itertools.pairwise(offs)):
        msg = f"{path}: seq_offsets must rise strictly from 0 to the {n} tokens"
        raise ConfigError(msg)
    if "weights" in z.files:
        weights = np.asarray(z["weights"], dtype=np.float32)
        if weights.shape != ids.shape:
            msg = f"{path}: weights {weights.shape} and ids {ids.shape} differ in shape"
            raise ConfigError(msg)
    else:
        weights = np.full(ids.shape, 1.0 / ids.shape[2], dtype=np.float32)
    layers = tuple(_int_list(z["layers"], "layers", path)) if "layers" in z.files else tuple(range(ids.shape[1]))
    return Trace(ids, weights, layers, n_expert, tuple(offs[:-1]), tuple(range(n)), "weights" in z.files)


def concat_traces(traces: list[Trace], names: list[str]) -> Trace:
    """One trace of several recorded on the same model, one after the other (each keeps its own
    sequence and ubatch starts)."""
    first = traces[0]
    for t, name in zip(traces, names, strict=True):
        if t.layers != first.layers or t.n_expert != first.n_expert or t.ids.shape[2] != first.ids.shape[2]:
            msg = f"{name}: recorded on another model than {names[0]} (MoE layers, experts or top-k differ)"
            raise ConfigError(msg)
    offs = np.cumsum([0] + [t.ids.shape[0] for t in traces])
    # each trace starts a sequence of its own
    seqs = {int(o) + s for t, o in zip(traces, offs, strict=False) for s in t.seq_starts} | {*map(int, offs[:-1])}
    return Trace(
        np.concatenate([t.ids for t in traces]),
        np.concatenate([t.weights for t in traces]),
        first.layers,
        first.n_expert,
        tuple(sorted(seqs)),
        tuple(int(o) + s for t, o in zip(traces, offs, strict=False) for s in t.ubatch_starts),
        all(t.has_weights for t in traces),
    )


def moe_layers(
    model_path: str | os.PathLike[str],
    needs: str = "calibration needs a MoE model",
    none: str = "no MoE layers (blk.N.ffn_gate_inp.weight)",
) -> tuple[list[int], int]:
    """Indices of the MoE layers of a GGUF (those with a router, blk.N.ffn_gate_inp.weight) and the
    expert count; a ModelError naming the file if it is no GGUF or has none (none: its words, needs: why
    the caller needs them)."""
    from gguf import GGUFReader

    path = check_gguf(model_path)
    try:
        tensors = GGUFReader(str(path)).tensors
    except (ValueError, OSError, IndexError, KeyError) as e:  # a header gguf cannot read: cut short, damaged
        msg = f"{path}: gguf cannot read its header ({type(e).__name__}: {e})"
        raise ModelError(msg) from None
    layers, n_expert = [], 0
    for t in tensors:
        parts = t.name.split(".")
        # the router's weight only: some architectures give it a bias too (gpt-oss), which is no second layer
        if len(parts) == 4 and parts[0] == "blk" and parts[2] == "ffn_gate_inp" and parts[3] == "weight":
            layers.append(int(parts[1]))
            n_expert = int(t.shape[-1]) if len(t.shape) > 1 else int(t.shape[0])
    if not layers:
        msg = f"{model_path}: {none}: {needs}"
        raise ModelError(msg)
    return sorted(layers), n_expert


def record_trace(
    model_path: str | os.PathLike[str], text: str | list[int], cfg: CalibrateConfig, n_threads: int | None = None
) -> Trace:
    """Runs the stock model over the first cfg.tokens tokens of text (or token ids) and records its
    routing; every cfg.seq_len tokens a new sequence starts from an empty context."""
    layers, n_expert = moe_layers(model_path)
    seq = min(cfg.seq_len, cfg.tokens)  # no context longer than the tokens it will hold
    ctx = ContextConfig(n_ctx=seq, n_batch=seq, n_ubatch=min(seq, 512))
    m = Model(model_path, context=ctx, n_threads=n_threads)
    try:
        tokens = (m.tokenize(text) if isinstance(text, str) else list(text))[: cfg.tokens]
        if len(tokens) < 2:
            msg = "calibration text is empty (under 2 tokens); give a file of real text"
            raise ConfigError(msg)
        names = [f"ffn_moe_topk-{il}" for il in layers] + [f"ffn_moe_weights-{il}" for il in layers]
        rows = _core.trace.collect(m._m, tokens, names, cfg.seq_len)
    finally:
        m.close()  # the model's memory goes back now, not when the collector comes by
    n = len(tokens)
    ids = np.stack([rows[f"ffn_moe_topk-{il}"].reshape(n, -1) for il in layers], axis=1).astype(np.int32)
    weights = np.stack([rows[f"ffn_moe_weights-{il}"].reshape(n, -1) for il in layers], axis=1).astype(np.float32)
    n_ubatch = ctx.n_ubatch
    seqs = tuple(range(0, n, cfg.seq_len))
    ubatches = tuple(u for s in seqs for u in range(s, min(s + cfg.seq_len, n), n_ubatch))
    return Trace(ids, weights, tuple(layers), n_expert, seqs, ubatches)


def scores_of(trace: Trace) -> npt.NDArray[np.float32]:
    """HOBBIT eq. 2 scores of every selection, [n_tokens, n_layers, n_used] (the engine's code)."""
    t, lay, k = trace.weights.shape
    return _core.precision_scores(trace.weights.reshape(t * lay, k)).reshape(t, lay, k)


def choose_thresholds(scores: npt.NDArray[np.float32], target_low: float, target_skip: float) -> tuple[float, float]:
    """t1, t2 as score quantiles: about target_skip of all selections score above t2, target_low
    between t1 and t2 (top-1 selections score 0 and stay high)."""
    flat = np.sort(scores.ravel())
    n = len(flat)

    def upper(share: float) -> float:
        if share <= 0:
            return 1.0
        i = int(np.clip(round(n * (1 - share)) - 1, 0, n - 1))
        return float(flat[i])

    t2 = upper(target_skip)
    t1 = upper(target_skip + target_low) if target_low > 0 else t2
    return round(min(t1, t2), 4), round(t2, 4)


def split_of(scores: npt.NDArray[np.float32], t1: float, t2: float) -> dict[str, float]:
    """Share of selections the rule puts in high, low and skip."""
    n = scores.size
    high = float(np.count_nonzero(scores <= t1)) / n
    low = float(np.count_nonzero((scores > t1) & (scores <= t2))) / n
    return {"high": high, "low": low, "skip": max(0.0, 1.0 - high - low)}


def policy_candidates(grid: int) -> list[tuple[str, tuple[float, float, float, float]]]:
    """random, lru, lfu, lhu, fld, reuse, reuse-rank, and multi at every weight vector on the simplex grid."""
    out: list[tuple[str, tuple[float, float, float, float]]] = [
        (name, (0.25, 0.25, 0.25, 0.25)) for name in ("random", "lru", "lfu", "lhu", "fld", "reuse", "reuse-rank")
    ]
    for c in itertools.product(range(grid + 1), repeat=4):
        if sum(c) == grid and max(c) < grid:  # one-hot vectors are the single policies
            out.append(("multi", tuple(x / grid for x in c)))  # type: ignore[arg-type]
    return out


def search_policy(
    trace: Trace,
    info: dict[str, Any],
    t1: float,
    t2: float,
    grid: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Replays the trace for each candidate policy at the cache geometry of info (Model.cache_info());
    rows sorted by miss penalty (bytes that would be read), with the penalty relative to random."""
    if int(info["n_groups"]) != 1:
        msg = "calibration replays one pool group; this model's layers form several"
        raise ModelError(msg)
    n_experts = int(info["n_layers"]) * int(info["n_expert"])
    bytes_high = int(info["expert_bytes"]) // n_experts
    bytes_low = int(info.get("expert_bytes_low", 0)) // n_experts
    cands = policy_candidates(grid)
    rows: list[dict[str, Any]] = []
    for i, (name, w) in enumerate(cands):
        counters = _core.replay(
            trace.ids,
            trace.weights,
            trace.n_expert,
            bytes_high,
            bytes_low,
            int(info["n_slots"]),
            int(info.get("n_slots_low", 0)),
            name,
            list(w),
            t1,
            t2,
            list(trace.seq_starts),
        )
        rows.append({"policy": name, "weights": list(w), **counters._asdict()})
        if progress:
            progress(i + 1, len(cands))
    base = next(r["n_bytes_read"] for r in rows if r["policy"] == "random") or 1
    for r in rows:
        r["penalty_vs_random"] = r["n_bytes_read"] / base
    rows.sort(key=lambda r: (r["n_bytes_read"], r["policy"] != "multi"))
    return rows


# low_frac candidates: low copies serve the less important selections, which come back less often
# than the important ones, so small low pools tend to win; past ~0.4 the high pool starves
LOW_FRACS = (0.05, 0.1, 0.15, 0.25, 0.4)


def plot_scores(scores: npt.NDArray[np.float32], t1: float, t2: float, out: Path) -> bool:
    """Histogram of the non-top-1 scores with the thresholds; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s = split_of(scores, t1, t2)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(scores[scores > 0].ravel(), bins=60, color="#4c72b0")
    for x, name in ((t1, "T1"), (t2, "T2")):
        ax.axvline(x, color="k", ls="--")
        ax.text(x, ax.get_ylim()[1] * 0.95, f" {name}={x:.2f}", va="top")
    ax.set(
        xlabel="unimportance score s (HOBBIT eq. 2), top-1 selections (s = 0) left out",
        ylabel="expert selections",
        title=f"high {100 * s['high']:.0f}% / low {100 * s['low']:.0f}% / skip {100 * s['skip']:.0f}%",
    )
    fig.tight_layout()
    with replacing(out) as tmp:
        fig.savefig(tmp, dpi=100)
    return True


def calibrate(
    model_path: str | os.PathLike[str],
    text: str,
    budget: int | str,
    out: str | os.PathLike[str],
    cfg: CalibrateConfig | None = None,
    store: str | os.PathLike[str] | None = None,
    low_frac: float | None = None,
    n_threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The whole calibration; writes OUT (JSON config), OUT.trace.npz, OUT.scores.png and
    OUT.report.json (thresholds, split, the policy table), and returns that report."""
    cfg = cfg or CalibrateConfig()
    outp = Path(out)
    CacheConfig(budget=budget)  # a bad budget is an error before the minutes of tracing, not after
    trace = record_trace(model_path, text, cfg, n_threads)
    trace_path = trace.save(outp.with_name(outp.stem + ".trace.npz"))
    scores = scores_of(trace)
    t1, t2 = choose_thresholds(scores, cfg.target_low, cfg.target_skip)
    # the split of the budget is searched only where low copies are read at all
    uses_low = store is not None and t1 < min(t2, 1.0)
    fracs = [CacheConfig(budget=budget).low_frac] if not uses_low else list(LOW_FRACS)
    if low_frac is not None:
        fracs = [low_frac]
    splits: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    lf = fracs[0]
    for i, f in enumerate(fracs):
        cache = CacheConfig(budget=budget, t1=t1, t2=t2, low_frac=f, warm=False)  # a probe: no sidecar
        probe = Model(model_path, store=store, cache=cache, n_threads=n_threads)
        try:
            info = probe.cache_info()
        finally:
            probe.close()  # its cache is freed now, not when the collector comes by
        step = (lambda done, total, i=i: progress(i * total + done, len(fracs) * total)) if progress else None
        r = search_policy(trace, info, t1, t2, cfg.grid, step)
        splits.append(
            {
                "low_frac": f,
                "n_slots": int(info["n_slots"]),
                "n_slots_low": int(info.get("n_slots_low", 0)),
                "policy": r[0]["policy"],
                "weights": r[0]["weights"],
                "n_bytes_read": r[0]["n_bytes_read"],
            }
        )
        if not rows or r[0]["n_bytes_read"] < rows[0]["n_bytes_read"]:
            rows, lf = r, f
    best = rows[0]
    w = dict(zip(("w_lru", "w_lfu", "w_lhu", "w_fld"), best["weights"], strict=True))
    # an automatic budget stays "auto": it is sized again on the machine that loads the config
    budget_field: int | str = "auto" if cache.budget_bytes == AUTO else cache.budget_bytes
    config = {"budget": budget_field, "policy": best["policy"], "t1": t1, "t2": t2, "low_frac": lf, **w}
    write_text(outp, json.dumps(config, indent=1) + "\n")
    plot = outp.with_name(outp.stem + ".scores.png")
    report = {
        "config": config,
        "config_path": str(outp),
        "trace_path": str(trace_path),
        "plot_path": str(plot) if plot_scores(scores, t1, t2, plot) else None,
        "split": split_of(scores, t1, t2),
        "tokens": int(trace.ids.shape[0]),
        "low_frac_search": splits,
        "policies": rows,
    }
    write_text(outp.with_name(outp.stem + ".report.json"), json.dumps(report, indent=1) + "\n")
    return report
