"""deploy/jetson/install.sh against fake Jetson trees (/proc, /sys, /etc as JetPack writes them) for an
Orin Nano 8 GB, an Orin NX 16 GB and an AGX Orin 64 GB, and against machines it must refuse. Every run
is --dry-run: it prints what it would do and changes nothing. The systemd unit's command line is run
through sh, as systemd would run it, with a stand-in for moetier that prints its arguments."""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "jetson" / "install.sh"


@dataclass
class Board:
    model: str
    release: str  # /etc/nv_tegra_release's first line
    cuda: str
    mem_total_kib: int
    mem_avail_kib: int
    swaps: list[str]


NANO = Board(
    "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super",
    "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025",
    "12.6.68",
    7_802_356,
    5_421_000,
    ["/dev/zram0                              partition\t635188\t0\t5"],
)
NX = Board(
    "NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
    "# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic, EABI: aarch64, DATE: Fri Jul 19 23:24:25 UTC 2024",
    "12.4.131",
    15_655_000,
    13_100_000,
    ["/dev/mmcblk0p11                         partition\t2097148\t0\t-2"],
)
AGX = Board(
    "Jetson AGX Orin Developer Kit",
    "# R36 (release), REVISION: 2.0, GCID: 35084178, BOARD: generic, EABI: aarch64, DATE: Tue Dec 19 05:55:03 UTC 2023",
    "12.2.140",
    64_335_000,
    60_100_000,
    [],
)


def fake_root(tmp: Path, b: Board, mmc_type: str = "MMC") -> Path:
    root = tmp / "root"
    (root / "proc" / "device-tree").mkdir(parents=True)
    (root / "proc" / "device-tree" / "model").write_bytes(b.model.encode() + b"\0")
    (root / "etc").mkdir()
    (root / "etc" / "nv_tegra_release").write_text(b.release + "\n# KERNEL_VARIANT: oot\n")
    (root / "usr" / "local" / "cuda").mkdir(parents=True)
    # as the toolkit writes it: an object per component, over several lines
    (root / "usr" / "local" / "cuda" / "version.json").write_text(
        '{\n   "cuda" : {\n      "name" : "CUDA SDK",\n      "version" : "' + b.cuda + '"\n   },\n'
        '   "cuda_cccl" : {\n      "version" : "' + b.cuda + '"\n   }\n}\n'
    )
    (root / "proc" / "meminfo").write_text(
        f"MemTotal:       {b.mem_total_kib} kB\nMemFree:         1000000 kB\nMemAvailable:   {b.mem_avail_kib} kB\n"
    )
    swaps = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n" + "".join(s + "\n" for s in b.swaps)
    (root / "proc" / "swaps").write_text(swaps)
    for disk in ("mmcblk0", "mmcblk1"):
        (root / "sys" / "block" / disk / "device").mkdir(parents=True)
    (root / "sys" / "block" / "mmcblk0" / "device" / "type").write_text(mmc_type + "\n")
    (root / "sys" / "block" / "mmcblk1" / "device" / "type").write_text("SD\n")
    return root


@pytest.fixture
def model_files(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(4096))
    store = tmp_path / "m.experts"
    store.mkdir()
    (store / "manifest.json").write_text("{}")
    (store / "experts.bin").write_bytes(bytes(4096))
    return model, store


def install(
    root: Path | None, *args: str, storage: str = "nvme0n1p1", prefix: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_JETSON")}
    if root is not None:
        env["MOETIER_JETSON_ROOT"] = str(root)
    env["MOETIER_JETSON_STORAGE"] = storage
    cmd = ["bash", str(SCRIPT), "--dry-run", *args]
    if prefix is not None:
        cmd += ["--prefix", str(prefix)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def unit_command(out: str) -> str:
    """The ExecStart of the unit the dry run prints, as systemd hands it to /bin/sh -c."""
    line = next(x.strip() for x in out.splitlines() if x.strip().startswith("ExecStart="))
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[:2] == ["/bin/sh", "-c"]
    return argv[2].replace("$$", "$")


def env_file(out: str) -> dict[str, str]:
    lines = out.split("would write /etc/moetier/moetier.env:\n", 1)[1].splitlines()
    env = {}
    for x in lines:
        if not x.startswith("    "):
            break
        k, eq, v = x.strip().partition("=")
        if eq and not k.startswith("#"):
            env[k] = v
    return env


@pytest.mark.parametrize(
    ("board", "label"),
    [
        (NANO, "Orin Nano, L4T R36.4.3, CUDA 12.6"),
        (NX, "Orin NX, L4T R36.3.0, CUDA 12.4"),
        (AGX, "AGX Orin, L4T R36.2.0, CUDA 12.2"),
    ],
)
def test_dry_run_on_each_orin(tmp_path: Path, model_files: tuple[Path, Path], board: Board, label: str) -> None:
    model, store = model_files
    root = fake_root(tmp_path, board)
    prefix = tmp_path / "opt"
    r = install(root, "--model", str(model), "--store", str(store), "--extra", "-ngl 99 -c 8192", prefix=prefix)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    name, l4t, cuda = label.split(", ")
    assert name in out and f"L4T {l4t.split()[1]} (JetPack 6)" in out and cuda in out and "sm_87" in out
    total_gib = f"{board.mem_total_kib / 1048576:.1f} GiB"
    assert f"unified memory: {total_gib}" in out
    assert f"{model}: on nvme0n1p1 (NVMe)" in out
    assert f"would measure the O_DIRECT read rate of {store}/experts.bin" in out
    # the build: the Orin's arch and the flags that work there, with the board's nvcc
    build = next(x for x in out.splitlines() if "pip install" in x and "MOETIER_CUDA" in x)
    for flag in ("MOETIER_CUDA=ON", "CMAKE_CUDA_ARCHITECTURES=87", "GGML_CUDA_NO_VMM=ON", "GGML_CUDA_FORCE_MMQ=ON"):
        assert f"-C cmake.define.{flag}" in build
    assert "CUDACXX=/usr/local/cuda/bin/nvcc" in build and str(ROOT) in build
    assert f"would run: python3 -m venv {prefix}/venv" in out
    # the service: settings in one env file, restart on failure, locked memory allowed
    assert env_file(out) == {
        "MOETIER_MODEL": str(model),
        "MOETIER_STORE": str(store),
        "MOETIER_CACHE": "auto",
        "MOETIER_HOST": "127.0.0.1",
        "MOETIER_PORT": "8080",
        "MOETIER_EXTRA": "-ngl 99 -c 8192",
    }
    assert "would write /etc/systemd/system/moetier.service:" in out
    for line in ("Restart=on-failure", "LimitMEMLOCK=infinity", "EnvironmentFile=/etc/moetier/moetier.env"):
        assert f"    {line}\n" in out
    assert "would run: systemctl enable --now moetier" in out
    assert "nvpmodel -m 0" in out and "jetson_clocks" in out and "nothing here was changed" in out
    assert not prefix.exists()  # a dry run creates nothing


@pytest.mark.parametrize("store_set", [True, False])
def test_the_units_command_line_runs_moetier_serve(
    tmp_path: Path, model_files: tuple[Path, Path], store_set: bool
) -> None:
    """The unit's ExecStart through sh, with the env file's values, runs `moetier serve` with them."""
    model, store = model_files
    root = fake_root(tmp_path, NANO)
    prefix = tmp_path / "opt"
    args = ["--model", str(model), "--cache", "6G", "--port", "9000", "--extra", "-ngl 99 -c 8192"]
    r = install(root, *args, *(["--store", str(store)] if store_set else []), prefix=prefix)
    assert r.returncode == 0, r.stderr
    cmd, env = unit_command(r.stdout), env_file(r.stdout)
    fake = prefix / "venv" / "bin" / "moetier"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    got = subprocess.run(
        ["/bin/sh", "-c", cmd], env={**env, "PATH": os.environ["PATH"]}, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
    want = ["serve", "-m", str(model)] + (["--store", str(store)] if store_set else [])
    want += ["--cache", "6G", "--host", "127.0.0.1", "--port", "9000", "-ngl", "99", "-c", "8192"]
    assert got.stdout.split("\n")[:-1] == want


def test_swap_on_emmc_and_models_on_slow_storage_are_warned(tmp_path: Path, model_files: tuple[Path, Path]) -> None:
    model, _ = model_files
    root = fake_root(tmp_path, NX)
    r = install(root, "--model", str(model), storage="mmcblk0p1")
    assert r.returncode == 0, r.stderr
    assert "swap on /dev/mmcblk0p11 (eMMC or SD card)" in r.stderr and "swapoff" in r.stderr
    assert f"{model} is on mmcblk0p1, the eMMC" in r.stderr
    r = install(root, "--model", str(model), storage="mmcblk1p1")
    assert f"{model} is on mmcblk1p1, an SD card" in r.stderr
    r = install(fake_root(tmp_path / "nano", NANO), "--model", str(model))
    assert "swap" not in r.stderr and "warning" not in r.stderr  # zram swap and an NVMe: nothing to say


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"release": "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref"},
            "L4T R35.4.1 is JetPack 5 (CUDA 11.4): not supported",
        ),
        ({"release": "# R32 (release), REVISION: 7.4"}, "L4T R32.7.4: not supported"),
        ({"release": "R36 garbage"}, "nv_tegra_release: no '# R<major> (release), REVISION: <rev>' line"),
        (
            {"model": "NVIDIA Jetson AGX Xavier Developer Kit"},
            "NVIDIA Jetson AGX Xavier Developer Kit: not an Orin module",
        ),
        ({"model": "Raspberry Pi 5 Model B Rev 1.0"}, "Raspberry Pi 5 Model B Rev 1.0: not a Jetson"),
        ({"cuda": "12.8.93"}, "CUDA 12.8"),
    ],
)
def test_unsupported_boards_are_refused(
    tmp_path: Path, model_files: tuple[Path, Path], change: dict[str, str], message: str
) -> None:
    model, _ = model_files
    board = Board(**{**NANO.__dict__, **change})
    r = install(fake_root(tmp_path, board), "--model", str(model))
    assert r.returncode == 1
    assert message in r.stderr, r.stderr
    assert "==> build" not in r.stdout


def test_a_machine_that_is_not_a_jetson_is_refused(tmp_path: Path, model_files: tuple[Path, Path]) -> None:
    model, _ = model_files
    empty = tmp_path / "pc"
    empty.mkdir()
    r = install(empty, "--model", str(model))
    assert r.returncode == 1
    assert "not a Jetson" in r.stderr and "pip install" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--model is required"),
        (["--model", "/nonexistent.gguf"], "--model /nonexistent.gguf: no such file"),
        (["--model", "{model}", "--store", "{tmp}"], "not an expert store (no manifest.json"),
        (["--model", "{model}", "--port", "70000"], "--port 70000: not a port number"),
        (["--model", "{model}", "--cache", "lots"], "--cache lots: expected a size such as 6G, or auto"),
        (["--model", "{model}", "--frobnicate"], "unknown option '--frobnicate'"),
        (["--model", "{model}", "--source", "{tmp}"], "not a moetier checkout"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, model_files: tuple[Path, Path], args: list[str], message: str) -> None:
    model, _ = model_files
    root = fake_root(tmp_path, NANO)
    args = [a.format(model=model, tmp=tmp_path) for a in args]
    r = install(root, *args)
    assert r.returncode == 1
    assert message in r.stderr, r.stderr


def test_public_host_is_warned(tmp_path: Path, model_files: tuple[Path, Path]) -> None:
    model, _ = model_files
    r = install(fake_root(tmp_path, AGX), "--model", str(model), "--host", "0.0.0.0")
    assert r.returncode == 0, r.stderr
    assert "no authentication" in r.stderr


def test_no_service_writes_no_unit(tmp_path: Path, model_files: tuple[Path, Path]) -> None:
    model, _ = model_files
    r = install(fake_root(tmp_path, AGX), "--model", str(model), "--no-service")
    assert r.returncode == 0, r.stderr
    assert "would write" not in r.stdout and "would run: systemctl" not in r.stdout
    assert "-C cmake.define.CMAKE_CUDA_ARCHITECTURES=87" in r.stdout
