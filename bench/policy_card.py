"""The eviction policy report card for one model: routing traces of the calibration splits (to
train on) and of the evaluation splits (held out), every policy replayed over the held-out traces at
each budget beside Belady's bound, and FlashMoE's learned policy trained on the calibration traces
and judged on the held-out ones.

Traces are recorded once per model and text (`moetier trace`, kept under --work); the replay and the
training run the engine's own cache code (moetier.tools.replay / train_policy).

    python bench/policy_card.py --model M.gguf --corpora fortunes linux-doc py-library \
        --tokens 2048 --budgets 10,25,50 --out bench/results/policies-1.5b
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from corpora import default_cache
from moetier.tools import replay as rp
from moetier.tools import train_policy as tp


def trace_of(model: Path, text: Path, tokens: int, work: Path) -> Path:
    out = work / f"{model.stem}.{text.name.removesuffix('.txt')}.{tokens}.npz"
    if not out.exists():
        rp.trace_main([str(model), "--text", str(text), "--tokens", str(tokens), "-o", str(out)])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="MoE GGUF")
    p.add_argument("--corpora", nargs="+", default=["fortunes", "linux-doc", "py-library"], help="corpus names")
    p.add_argument("--tokens", type=int, default=2048, help="tokens traced per corpus and split")
    p.add_argument("--budgets", default="10,25,50", help="budgets in %% of the experts' bytes")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache/moetier/traces", help="where traces are kept")
    p.add_argument("--out", required=True, help="OUT.json/.md/.png (replay); OUT-flashmoe.bin, .json, .md (learned)")
    p.add_argument("--epochs", type=int, default=8, help="train-policy epochs per round")
    p.add_argument("--policies", default=None, help="policies to replay, comma-separated (default: moetier replay's)")
    p.add_argument("--no-learned", action="store_true", help="replay only: do not train FlashMoE's learned policy")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    texts = default_cache() / "corpora"  # bench/corpora.py fetch NAME writes NAME.calib.txt, NAME.eval.txt
    held = [trace_of(a.model, texts / f"{c}.eval.txt", a.tokens, a.work) for c in a.corpora]
    policies = ["--policies", a.policies] if a.policies else []
    rp.replay_main(
        [*map(str, held), "-m", str(a.model), "--budgets", a.budgets, *policies, "-o", a.out + ".json", "-q"]
    )
    if a.no_learned:
        return 0
    train = [trace_of(a.model, texts / f"{c}.calib.txt", a.tokens, a.work) for c in a.corpora]
    net = a.out + "-flashmoe.bin"
    args = ["-m", str(a.model), "--train", *map(str, train), "--eval", *map(str, held), "--budgets", a.budgets]
    tp.main([*args, "-o", net, "--epochs", str(a.epochs)])
    rep = json.loads(Path(tp.report_base(net) + ".json").read_text())
    sys.stdout.write(f"flashmoe: held-out agreement with Belady {100 * rep['eval_agreement']:.1f}%\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
