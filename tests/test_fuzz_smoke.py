"""The store fuzzer (bench/fuzz_store.py) runs a few hundred inputs per target in CI; its 10-minute
runs per target are a bench script (the figures are in bench/results/reliability-2026-11-24.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("target", ["manifest", "data-head", "gguf"])
def test_fuzz_target_runs_clean(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "fuzz_store.py"),
            target,
            "-runs=300",
            "-seed=1",
            "-timeout=30",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    counts = re.findall(rf"fuzz_store {target}: (\d+) inputs: (.*)", r.stderr)
    n, outcomes = counts[-1]
    assert int(n) >= 256, r.stderr[-2000:]
    assert "Error" in outcomes, outcomes
