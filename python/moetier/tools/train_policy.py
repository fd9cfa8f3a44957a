"""`moetier train-policy`: FlashMoE's learned eviction policy (paper 003, sec. 3) for one model.

1. Decisions. Training traces (from `moetier trace` on text apart from the evaluation text) are
   replayed through the engine's cache code at each budget; every eviction decision is logged with,
   per candidate slot, the policy's inputs ([1/recency, frequency / max frequency], as the paper
   normalises them, and the layer distance; the C++ code computes them for the recorder and the
   policy alike) and the distance to its expert's next use. The label of a candidate is 1 where
   Belady would evict it among the candidates offered (its next use is the farthest), else 0.
2. Training. A feed-forward network (3 layers, SiLU, hidden 128, MSE, AdamW at 1e-3 with weight
   decay 1e-2: the paper's Table 1) in numpy. Round 1 logs the decisions of LRU's cache states;
   each further round replays with the network just trained and adds its own states (the states a
   learned policy meets are not LRU's).
3. The network is written as the little-endian file policies/flashmoe.h describes; a model runs it
   as policy `flashmoe:PATH`, replay too.
4. Evaluation. Held-out traces replayed with the network, LRU, multi and Belady: bytes per token,
   hit rate, the share of the LRU-to-Belady gap closed, and the time per eviction decision.

    moetier train-policy -m MODEL.gguf --train calib.npz --eval held-out.npz -o MODEL.flashmoe.bin
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _core
from .._files import replacing, write_text
from ..calibrate import Trace, concat_traces
from ..errors import ConfigError
from .mlp import F32, MLP, FitConfig, fit
from .replay import geometry, geometry_of, parse_sequences, probe, replay_one, select_sequences

MAGIC = b"MOETFMN1"
N_RECORDED = 3  # inputs the recorder logs (policies/flashmoe.h); a network takes the first 2 or 3


@dataclass(frozen=True)
class TrainPolicyConfig:
    """Knobs of `moetier train-policy` (defaults: FlashMoE's Table 1 where it gives one)."""

    hidden: int = field(default=128, metadata={"help": "hidden units of each of the two hidden layers"})
    epochs: int = field(default=8, metadata={"help": "passes over the decisions per round"})
    lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=1e-2, metadata={"help": "AdamW decoupled weight decay"})
    batch: int = field(default=512, metadata={"help": "candidates per gradient step"})
    rounds: int = field(default=2, metadata={"help": "1: LRU's decisions only; more: add the trained policy's own"})
    max_rows: int = field(
        default=400_000, metadata={"help": "candidates kept per round (a random subset of decisions)"}
    )
    seed: int = field(default=0, metadata={"help": "initialisation and sampling seed"})
    layer_distance: bool = field(
        default=False,
        metadata={
            "help": "add the layer distance as a third input and evict across layers (the paper's caches are per "
            "layer; so is this cache's partition without it)"
        },
    )

    def __post_init__(self) -> None:
        if min(self.hidden, self.epochs, self.batch, self.rounds, self.max_rows) < 1 or self.hidden > 1024:
            msg = "train-policy: hidden (1-1024), epochs, batch, rounds and max_rows must be positive"
            raise ConfigError(msg)
        if not (0 < self.lr < math.inf and 0 <= self.weight_decay < math.inf):
            msg = "train-policy: lr must be positive and weight_decay not negative (finite numbers both)"
            raise ConfigError(msg)
        if not 0 <= self.seed <= 2**63 - 1:
            msg = f"train-policy: seed {self.seed} must be in [0, 2^63 - 1]"
            raise ConfigError(msg)


def new_net(hidden: int, rng: np.random.Generator, n_in: int = 2) -> MLP:
    """FlashMoE's scorer: [1/r, f/max f] (+ layer distance) -> hidden -> hidden -> eviction score."""
    return MLP.init([n_in, hidden, hidden, 1], rng)


def save_net(net: MLP, path: str | Path) -> None:
    """The file policies/flashmoe.h reads."""
    w1, w2, w3 = net.weights
    b1, b2, b3 = net.biases
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<II", w1.shape[1], w1.shape[0]))
        for a in (w1, b1, w2, b2, w3.reshape(-1), b3):
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())


def scores(net: MLP, x: F32) -> F32:
    return net(x)[:, 0]


def labels(decision: npt.NDArray[np.int64], next_use: npt.NDArray[np.float64]) -> F32:
    """1 for the candidates whose next use is the farthest of those their decision offered (Belady's
    choice among them; all of them where several never come back), else 0."""
    far = np.full(int(decision.max()) + 1 if len(decision) else 0, -1.0)
    np.maximum.at(far, decision, next_use)
    return np.asarray(next_use == far[decision], dtype=np.float32)


@dataclass
class Decisions:
    """Eviction decisions as the recorder logs them, a row per candidate: inputs x, decision id d,
    ticks to the next use n (inf: never), whether the policy chose it."""

    x: F32
    d: npt.NDArray[np.int64]
    n: npt.NDArray[np.float64]
    chosen: npt.NDArray[np.bool_]

    def rows(self, k: npt.NDArray[np.int64] | npt.NDArray[np.bool_]) -> Decisions:
        return Decisions(self.x[k], self.d[k], self.n[k], self.chosen[k])

    @property
    def n_decisions(self) -> int:
        return len(np.unique(self.d))


def agreement(net: MLP, x: F32, y: F32, decision: npt.NDArray[np.int64]) -> float:
    """Share of decisions where the network's top score (numpy's ties: the first row) is a candidate
    with the farthest next use among those offered."""
    if len(decision) == 0:
        return 0.0
    score = scores(net, x)
    order = np.lexsort((-score, decision))  # by decision, highest score first
    first = order[np.r_[True, decision[order][1:] != decision[order][:-1]]]
    return float(y[first].mean())


def chosen_agreement(dec: Decisions) -> float:
    """Share of decisions where the candidate the policy actually evicted has the farthest next use
    among those offered."""
    if len(dec.d) == 0:
        return 0.0
    return float(labels(dec.d, dec.n)[dec.chosen].mean())


def collect(
    traces: Sequence[Trace],
    geos: Sequence[dict[str, int]],
    policy: str,
    max_rows: int,
    rng: np.random.Generator,
    per_layer: bool = False,
) -> Decisions:
    """The eviction decisions of policy replayed over each trace at each geometry, whole decisions
    sampled to about max_rows candidates in all (decision ids made unique across runs); per_layer:
    only the candidates a three-input policy scores (oldest_per_layer), before sampling."""
    per_run = max(1, max_rows // max(1, len(traces) * len(geos)))
    parts = []
    base = 0
    for tr in traces:
        for g in geos:
            _, rows = _core.replay_decisions(
                tr.ids, tr.weights, tr.n_expert, g["bytes_high"], 0, g["n_slots"], 0, policy,
                [0.25] * 4, 1.0, 1.0, list(tr.seq_starts),
            )  # fmt: skip
            if len(rows["decision"]):
                dec = Decisions(rows["x"], rows["decision"], rows["next_use"], rows["chosen"])
                if per_layer:
                    dec = dec.rows(oldest_per_layer(dec.x, dec.d))
                dec = subsample(dec, per_run, rng)
                parts.append(Decisions(dec.x, dec.d + base, dec.n, dec.chosen))
                base += int(rows["decision"].max()) + 1
    if not parts:
        z = np.zeros(0)
        return Decisions(np.zeros((0, N_RECORDED), np.float32), z.astype(np.int64), z, z.astype(bool))
    return Decisions(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("x", "d", "n", "chosen")))


def oldest_per_layer(x: F32, d: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The rows a three-input policy scores: in each decision, one candidate per layer, its least
    recently used (smallest 1/r; the lowest slot of a tie, as rows come in slot order). The layer
    distance x[:, 2] tells the layers of a decision apart."""
    if len(d) == 0:
        return np.zeros(0, np.int64)
    order = np.lexsort((np.arange(len(d)), x[:, 0], x[:, 2], d))
    keys = np.stack([d[order].astype(np.float64), x[order, 2]], 1)
    first = np.r_[True, np.any(keys[1:] != keys[:-1], axis=1)]
    return np.sort(order[first])


def subsample(dec: Decisions, max_rows: int, rng: np.random.Generator) -> Decisions:
    """Whole decisions, chosen at random, up to about max_rows candidates."""
    if len(dec.d) <= max_rows:
        return dec
    ids = np.unique(dec.d)
    keep = rng.choice(ids, size=max(1, int(len(ids) * max_rows / len(dec.d))), replace=False)
    return dec.rows(np.isin(dec.d, keep))


def decision_cost_us(trace: Trace, geo: dict[str, int], policy: str, repeats: int = 3) -> float:
    """Microseconds one eviction decision of policy adds over LRU's: replay wall times (best of
    repeats) over the number of decisions."""

    def best(p: str) -> float:
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            replay_one(trace, geo, p, 1.0, 1.0, (0.25, 0.25, 0.25, 0.25))
            ts.append(time.perf_counter() - t0)
        return min(ts)

    _, rows = _core.replay_decisions(
        trace.ids, trace.weights, trace.n_expert, geo["bytes_high"], 0, geo["n_slots"], 0, policy,
        [0.25] * 4, 1.0, 1.0, list(trace.seq_starts),
    )  # fmt: skip
    n = len(np.unique(rows["decision"]))
    return 1e6 * max(0.0, best(policy) - best("lru")) / max(1, n)


def _part(t: Trace, seqs: tuple[int, int | None] | None, path: str | Path) -> Trace:
    return t if seqs is None else select_sequences(t, seqs[0], seqs[1], str(path))


def _held_out_label(n: int) -> str:
    return f"held-out ({n} trace{'' if n == 1 else 's'})"


def train_policy(
    model: str | Path | None,
    train: Sequence[str | Path],
    evals: Sequence[str | Path],
    out: str | Path,
    budgets: Sequence[float] = (10, 25, 50),
    cfg: TrainPolicyConfig | None = None,
    train_sequences: tuple[int, int | None] | None = None,
    eval_sequences: tuple[int, int | None] | None = None,
) -> dict[str, Any]:
    """model None: the geometry is the first training trace's (a trace of real routing with no model
    file), each expert counted as one byte. train_sequences: only those sequences of each training trace
    (first, last excluded; None: to the end); eval_sequences: those of the held-out traces joined in
    order; e.g. the prompts of one trace split in two. A file both trained on and held out must have
    its two parts apart. out is written when the training and the evaluation have succeeded."""
    cfg = cfg or TrainPolicyConfig()
    if eval_sequences is not None and not evals:
        msg = "train-policy: eval sequences name part of the held-out traces, and none is given (--eval)"
        raise ConfigError(msg)
    tr_traces = [_part(Trace.load(p), train_sequences, p) for p in train]
    ev_raw = [Trace.load(p) for p in evals]
    _check_apart(train, train_sequences, evals, eval_sequences, [len(t.seq_starts) for t in ev_raw])
    joined = ", ".join(str(p) for p in evals)
    ev_traces = [_part(concat_traces(ev_raw, [str(p) for p in evals]), eval_sequences, joined)] if evals else []
    ev_names = [joined] if evals else []
    with replacing(out) as tmp:
        # the network goes to a temp file beside out, which the flashmoe policy of the later rounds and
        # of the evaluation reads: a failure leaves what was at out untouched
        return _train(
            model, train, ev_names, tr_traces, ev_traces, Path(out), tmp, budgets, cfg, train_sequences, eval_sequences
        )


def _check_apart(
    train: Sequence[str | Path],
    train_sequences: tuple[int, int | None] | None,
    evals: Sequence[str | Path],
    eval_sequences: tuple[int, int | None] | None,
    ev_counts: list[int],
) -> None:
    """Held out means held out: sequences of one file both trained on and evaluated are refused."""
    where = {Path(p).resolve(): i for i, p in enumerate(evals)}
    total = sum(ev_counts)
    c, d = eval_sequences if eval_sequences is not None else (0, None)
    d = total if d is None else d
    for p in train:
        j = where.get(Path(p).resolve())
        if j is None:
            continue
        off, n = sum(ev_counts[:j]), ev_counts[j]
        lo_e, hi_e = max(c - off, 0), min(d - off, n)  # the held-out sequences of this file
        a, b = train_sequences if train_sequences is not None else (0, None)
        b = n if b is None else min(b, n)
        if max(a, lo_e) < min(b, hi_e):
            msg = (
                f"{p}: trained on (sequences {a}:{b}) and held out (sequences {lo_e}:{hi_e} of it); "
                "held-out traces must be others, or other sequences (--train-sequences, --eval-sequences)"
            )
            raise ConfigError(msg)


def _train(
    model: str | Path | None,
    train: Sequence[str | Path],
    evals: list[str],
    tr_traces: list[Trace],
    ev_traces: list[Trace],
    out: Path,
    work: Path,
    budgets: Sequence[float],
    cfg: TrainPolicyConfig,
    train_sequences: tuple[int, int | None] | None,
    eval_sequences: tuple[int, int | None] | None,
) -> dict[str, Any]:
    rng = np.random.default_rng(cfg.seed)
    if model is None:
        geos = [geometry_of(tr_traces[0].ids.shape[1], tr_traces[0].n_expert, b, 1) for b in budgets]
    else:
        facts = probe(model, None)
        geos = [geometry(model, None, facts, b, 1.0, 1.0, 0.25) for b in budgets]
    for p, t in zip([*train, *evals], [*tr_traces, *ev_traces], strict=True):
        if t.ids.shape[1] != geos[0]["n_layers"] or t.n_expert != geos[0]["n_expert"]:
            msg = f"{p}: a trace of another model ({t.ids.shape[1]} MoE layers of {t.n_expert} experts)"
            raise ConfigError(msg)
    n_in = 3 if cfg.layer_distance else 2
    net = new_net(cfg.hidden, rng, n_in)
    fit_cfg = FitConfig(epochs=cfg.epochs, lr=cfg.lr, weight_decay=cfg.weight_decay, batch=cfg.batch)
    xs: list[F32] = []
    ys: list[F32] = []
    rounds = []
    for r in range(cfg.rounds):
        # round 1: a policy that offers the candidates this one will choose among (one layer's, or all)
        driver = ("multi" if cfg.layer_distance else "lru") if r == 0 else f"flashmoe:{work}"
        dec = collect(tr_traces, geos, driver, cfg.max_rows, rng, cfg.layer_distance)
        if dec.n_decisions == 0:
            msg = f"train-policy: no eviction decisions at budgets {list(budgets)}: a budget that holds every expert?"
            raise ConfigError(msg)
        x, d = dec.x[:, :n_in], dec.d
        y = labels(d, dec.n)
        before = agreement(net, x, y, d) if r else None
        xs.append(x)
        ys.append(y)
        losses = fit(net, np.concatenate(xs), np.concatenate(ys)[:, None], "mse", fit_cfg, rng, f"round {r + 1}")
        save_net(net, work)
        rounds.append(
            {
                "driver": driver.split(":")[0],
                "decisions": dec.n_decisions,
                "candidates": len(d),
                "driver_agreement": chosen_agreement(dec),
                "positive_share": float(y.mean()),
                "loss": losses,
                "agreement_before": before,
                "agreement": agreement(net, x, y, d),
            }
        )
    # held-out: the network, LRU, multi and Belady at every budget
    rows = []
    for path, t in zip([str(p) for p in evals], ev_traces, strict=True):
        for g in geos:
            at = {p: replay_one(t, g, p, 1.0, 1.0, (0.25,) * 4) for p in ("lru", "multi", f"flashmoe:{work}", "belady")}
            gap = at["lru"]["n_bytes_read"] - at["belady"]["n_bytes_read"]
            for p, row in at.items():
                row["policy"] = p.split(":")[0]
                row["gap_closed"] = (at["lru"]["n_bytes_read"] - row["n_bytes_read"]) / gap if gap > 0 else None
                rows.append({"trace": str(path), "trace_label": _held_out_label(len(path.split(", "))), **row})
    ev = collect(ev_traces, geos, f"flashmoe:{work}", cfg.max_rows, rng, cfg.layer_distance)
    lru = collect(ev_traces, geos, "lru", cfg.max_rows, rng)
    report = {
        "model": str(model) if model is not None else None,
        "network": str(out),
        "train_sequences": list(train_sequences) if train_sequences is not None else None,
        "eval_sequences": list(eval_sequences) if eval_sequences is not None else None,
        "config": asdict(cfg),
        "budgets": list(budgets),
        "train": [str(p) for p in train],
        "eval": [str(p) for p in evals],
        "rounds": rounds,
        # held-out: how often the evicted candidate is the farthest-used of those offered (the policy's
        # own choices, from the recorder), and the same for LRU
        "eval_agreement": chosen_agreement(ev) if ev_traces else None,  # None: nothing held out
        "eval_agreement_lru": chosen_agreement(lru) if ev_traces else None,
        "decision_us": decision_cost_us(ev_traces[0], geos[len(geos) // 2], f"flashmoe:{work}") if ev_traces else None,
        "rows": rows,
    }
    return report


def table(rep: dict[str, Any]) -> str:
    head = (
        f"FlashMoE policy {rep['network']}: decisions where it evicts the candidate used again last (Belady's "
        f"choice among those offered): train {100 * rep['rounds'][-1]['agreement']:.1f}%"
    )
    out = [
        f"{head}, held-out {100 * rep['eval_agreement']:.1f}% "
        f"(LRU {100 * rep.get('eval_agreement_lru', float('nan')):.1f}%); "
        f"{rep['decision_us']:.1f} us per decision over LRU's"
        if rep["decision_us"] is not None and rep.get("eval_agreement") is not None
        else f"{head}; no held-out traces (--eval)",
        "",
        "| trace | budget | policy | hit rate | MB/token | gap closed |",
        "|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        g = r.get("gap_closed")
        out.append(
            f"| {r.get('trace_label', 'held-out')} | {r['pct']:g}% | {r['policy']} | {100 * r['hit_rate']:.1f}% "
            f"| {r['mb_per_token']:.3f} | {'' if g is None else f'{100 * g:.0f}%'} |"
        )
    return "\n".join(out) + "\n"


def report_base(network: str) -> str:
    """Where the report of a network goes: OUT.flashmoe.bin -> OUT.flashmoe (.json, .md). Not OUT.bin.md: a
    docs site turns that page into a folder named like the network beside it."""
    return network.removesuffix(".bin")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="moetier train-policy",
        description="Train FlashMoE's learned eviction policy on routing traces to imitate Belady's evictions, and "
        "evaluate it on held-out traces; run it with policy flashmoe:OUT.",
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="the MoE GGUF the traces were recorded on (gives the geometry); without one, the traces' layers and "
        "experts (a trace of real routing, shared format)",
    )
    p.add_argument("--train", nargs="+", required=True, help="training traces (moetier trace), not the held-out text")
    p.add_argument("--eval", nargs="*", default=[], help="held-out traces to evaluate on")
    p.add_argument(
        "--train-sequences",
        default=None,
        help="train on sequences A:B of each training trace only (B excluded; A: to the end; default: all)",
    )
    p.add_argument(
        "--eval-sequences",
        default=None,
        help="evaluate on sequences A:B of the held-out traces only (numbered over them joined in order), e.g. "
        "the prompts of the training trace not trained on; a file both trained on and held out must have its "
        "two parts apart (default: all)",
    )
    p.add_argument("--budgets", default="10,25,50", help="budgets in %% of the experts' bytes (default: 10,25,50)")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="network file to write, e.g. MODEL.flashmoe.bin; its report beside it as MODEL.flashmoe.json and .md",
    )
    for f in TrainPolicyConfig.__dataclass_fields__.values():
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            p.add_argument(
                flag, type=type(f.default), default=f.default, help=f"{f.metadata['help']} (default: %(default)s)"
            )
    a = p.parse_args(argv)
    cfg = TrainPolicyConfig(**{k: getattr(a, k) for k in TrainPolicyConfig.__dataclass_fields__})
    try:
        budgets = [float(b) for b in a.budgets.split(",") if b.strip()]
    except ValueError:
        budgets = []
    if not budgets or any(not 0 < b <= 100 for b in budgets):
        msg = f"--budgets: {a.budgets!r}: each budget is a share of the experts in (0, 100]"
        raise ConfigError(msg)
    rep = train_policy(
        a.model,
        a.train,
        a.eval,
        a.output,
        budgets,
        cfg,
        parse_sequences(a.train_sequences, "--train-sequences"),
        parse_sequences(a.eval_sequences, "--eval-sequences"),
    )
    md = table(rep)
    sys.stdout.write(md)
    base = report_base(a.output)
    write_text(base + ".json", json.dumps(rep, indent=1) + "\n")
    write_text(base + ".md", md)
    return 0
