"""The prefetch gate (csrc/moetier-gate.cpp): prefetch measures whether it pays where it runs. Its
schedule is driven with step times from a small C++ driver compiled against the engine's own source;
a real model then shows that both arms decode exactly and that every decode step is counted."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import LONG_PROMPT, StoredModel
from moetier import CacheConfig, Model

ROOT = Path(__file__).resolve().parents[1]
WINDOW, ROUNDS, KEEP, MAX_BLOCKS = 2, 16, 256, 3  # the gate's defaults
PROBE = 2 * ROUNDS * WINDOW  # one block of a probe


def block() -> list[int]:
    """The arms of one block's steps: windows reading, standing back, standing back, reading, ..."""
    return [int(k % 4 in (0, 3)) for k in range(2 * ROUNDS) for _ in range(WINDOW)]


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("gate") / "gate"
    cmd = [cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}"]
    cmd += [str(ROOT / "tests" / "gate_driver.cpp"), str(ROOT / "csrc" / "moetier-gate.cpp"), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return exe


def drive(exe: Path, steps: list[tuple[int, int, int]], enabled: bool = True) -> tuple[list[int], list[int]]:
    """(pass, decode, now_us) per pass -> whether each pass's prefetch read, and n_on n_off us_on us_off."""
    text = "".join(f"{p} {d} {t}\n" for p, d, t in steps)
    out = subprocess.run([str(exe), "1" if enabled else "0"], input=text, capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    return [int(x) for x in lines[: len(steps)]], [int(x) for x in lines[len(steps)].split()]


Times = int | list[int]  # one step time, or a cycle of them (the k-th step of that arm takes the k-th)


def decode_run(n: int, on_us: Times, off_us: Times, reads: list[int] | None = None) -> list[tuple[int, int, int]]:
    """n consecutive decode steps whose time depends on the arm the gate gave them; the gate's answer
    for a step is only known after it ran, so the times follow a first pass with the driver."""
    cycles = [off_us if isinstance(off_us, list) else [off_us], on_us if isinstance(on_us, list) else [on_us]]
    steps, t, seen = [], 0, [0, 0]
    for i in range(n):
        steps.append((i + 1, 1, t))
        arm = 1 if reads is None else reads[i]
        t += cycles[arm][seen[arm] % len(cycles[arm])]
        seen[arm] += 1
    return steps


def settle(exe: Path, n: int, on_us: Times, off_us: Times) -> tuple[list[int], list[int]]:
    """Iterate until the arms and the step times agree (the schedule does not depend on the times
    until a block ends, so two passes per block suffice)."""
    reads: list[int] | None = None
    for _ in range(2 * (n // PROBE) + 3):
        got, counters = drive(exe, decode_run(n, on_us, off_us, reads))
        if got == reads:
            return got, counters
        reads = got
    assert reads is not None
    return reads, counters


def test_probe_alternates_windows_abba(driver: Path) -> None:
    reads, (n_on, n_off, _, _) = drive(driver, decode_run(PROBE, 100, 100))
    assert reads == block()
    assert reads[: 4 * WINDOW] == [1] * WINDOW + [0] * 2 * WINDOW + [1] * WINDOW
    assert (n_on, n_off) == (PROBE // 2, PROBE // 2)


@pytest.mark.parametrize(("on_us", "off_us", "winner"), [(100, 130, 1), (130, 100, 0), (1000, 1001, 1)])
def test_the_faster_arm_runs_until_the_next_probe(driver: Path, on_us: int, off_us: int, winner: int) -> None:
    n = PROBE + KEEP + PROBE
    reads, (n_on, n_off, us_on, us_off) = settle(driver, n, on_us, off_us)
    assert reads[PROBE : PROBE + KEEP] == [winner] * KEEP
    # then both are measured again, the same way
    assert reads[PROBE + KEEP :] == block()
    assert (us_on, us_off) == (on_us, off_us)
    assert n_on + n_off == n


def test_a_few_slow_steps_count(driver: Path) -> None:
    """Prefetch faster on most steps but paying for its wasted reads in every fifth: the median
    would keep it, the mean (the time the steps take in all) stands back."""
    on = [100, 100, 100, 100, 1100]  # mean 300
    reads, (_, _, us_on, us_off) = settle(driver, PROBE + KEEP, on, 200)
    assert us_off == 200 and us_on > 250
    assert reads[PROBE:] == [0] * KEEP


def test_prefetch_no_faster_stands_back_after_one_block(driver: Path) -> None:
    """Prefetch has to show that it pays: slower after the first block, by however little and
    however noisy the steps, it stands back at once."""
    reads, _ = settle(driver, PROBE + KEEP, [100, 500, 300], 290)
    assert reads[PROBE:] == [0] * KEEP


def test_prefetch_faster_but_not_told_apart_probe_on_then_keep_longer(driver: Path) -> None:
    """Prefetch faster, but the steps so noisy that the means differ by less than two standard
    errors: the probe takes another block, up to MAX_BLOCKS, and the arm then chosen keeps going for
    that many times KEEP (probing stays a small share of the steps)."""
    n = MAX_BLOCKS * PROBE + MAX_BLOCKS * KEEP + PROBE
    reads, (n_on, n_off, us_on, us_off) = settle(driver, n, [100, 500, 300], 330)
    assert reads[: MAX_BLOCKS * PROBE] == block() * MAX_BLOCKS
    probe_end = MAX_BLOCKS * PROBE
    assert reads[probe_end : probe_end + MAX_BLOCKS * KEEP] == [1] * (MAX_BLOCKS * KEEP)  # about 300 < 330
    assert reads[probe_end + MAX_BLOCKS * KEEP :] == block()
    assert us_on < us_off
    assert n_on + n_off == n


def test_arms_told_apart_in_one_block(driver: Path) -> None:
    """The same noise with a wide gap: one block decides."""
    reads, _ = settle(driver, PROBE + KEEP, [100, 500, 300], 600)
    assert reads[PROBE:] == [1] * KEEP


def test_prompts_and_gaps_are_not_timed(driver: Path) -> None:
    """A prompt pass always prefetches and does not advance the schedule; a decode step followed by
    a prompt (a request's end), or by a pass that is not the next one, is not timed."""
    steps, t, p = [], 0, 0
    for i in range(PROBE):
        if i % 5 == 0:  # a new request: its prompt, then its decode steps
            p += 1
            steps.append((p, 0, t))
            t += 10_000_000
        p += 1
        steps.append((p, 1, t))
        t += 100
    reads, (n_on, n_off, us_on, us_off) = drive(driver, [*steps, (p + 1, 1, t)])
    decode_reads = [r for (_, d, _), r in zip(steps, reads, strict=False) if d]
    assert decode_reads == block()
    assert all(r == 1 for (_, d, _), r in zip(steps, reads, strict=False) if not d)
    # no sample holds a prompt's 10 s: the means are a decode step's time; on a tie prefetch
    # stands back (its reads cost disk time and slots for nothing)
    assert (us_on, us_off) == (100, 100)
    assert reads[-1] == 0 and (n_on, n_off) == (PROBE // 2, PROBE // 2 + 1)


def test_too_few_timed_steps_leave_prefetch_reading(driver: Path) -> None:
    """Requests of one or two tokens leave an arm with too few timed steps: no decision, and
    prefetch reads (as without the gate) until the next probe, rather than probing on and on."""
    steps, t, p = [], 0, 0
    for _ in range(PROBE):
        p += 2  # every step follows a prompt: none is timed
        steps.append((p - 1, 0, t))
        steps.append((p, 1, t + 50))
        t += 1000
    after = [(p + 1 + i, 1, t + 100 * i) for i in range(KEEP + WINDOW)]
    reads, (_, _, us_on, us_off) = drive(driver, [*steps, *after])
    assert (us_on, us_off) == (0, 0)
    decode_reads = [r for (_, d, _), r in zip(steps, reads, strict=False) if d]
    assert decode_reads == block()
    tail = reads[len(steps) :]
    assert tail[:KEEP] == [1] * KEEP  # reading, not measuring
    assert tail[KEEP:] == [1] * WINDOW  # then the next probe, which begins with its reading window


def test_disabled_always_reads(driver: Path) -> None:
    reads, (n_on, n_off, _, _) = drive(driver, decode_run(PROBE + 10, 100, 50), enabled=False)
    assert reads == [1] * (PROBE + 10)
    assert (n_on, n_off) == (0, 0)


@pytest.mark.parametrize("gate", [True, False])
def test_gated_prefetch_is_exact_and_counts_every_decode_step(stored_tiny: StoredModel, gate: bool) -> None:
    path, store, lo = stored_tiny
    want = Model(path).generate(LONG_PROMPT, max_tokens=PROBE + 4).tokens
    m = Model(path, store=store, cache=CacheConfig.exact(budget=lo + lo // 2, prefetch=2, prefetch_gate=gate))
    m.reset_stats()
    got = m.generate(LONG_PROMPT, max_tokens=PROBE + 4)
    assert got.tokens == want
    pf = m.prefetch_stats()
    decode_steps = len(got.tokens) - 1  # the first token comes from the prompt's pass
    if gate:
        assert pf.n_steps_on + pf.n_steps_off == decode_steps
        assert pf.n_steps_off >= PROBE // 2  # the probe stood back for half of its steps
        assert pf.step_us_on > 0 and pf.step_us_off > 0  # the probe ended and timed both arms
    else:
        assert (pf.n_steps_on, pf.n_steps_off, pf.step_us_on, pf.step_us_off) == (0, 0, 0, 0)
    assert pf.n_issued > 0
