"""Mutation testing of the Python layer (mutmut 3), outside CI: does a test fail when the code is wrong?

mutmut changes one thing at a time in the package's Python source (an operator, a constant, a
condition, an argument) and runs the tests that reach the changed function; a mutant no test notices
"survived". Our package needs three things mutmut does not do on its own, so they are done in a
scratch git worktree (WORK), never in the checkout:

- mutmut names modules by their path under ./, src/ or source/: the worktree's `python/` becomes `src/`;
- the native core (`_core`, libllama, the tools in bin/) is copied from the installed package beside the
  source, so the mutated copy imports (build and install the package first); mutmut puts that copy
  ahead of the installed package on the tests' path;
- many tests run the CLI or the server in a subprocess, which mutmut does not see: the mutated copy is
  put on PYTHONPATH so those subprocesses run the mutant under test too (mutmut names it in the
  environment they inherit), and during mutmut's first pass, where it records which test reaches which
  function, a sitecustomize in each subprocess writes the functions it reached to a file that a pytest
  plugin hands to mutmut at the end of the test. Without this, a function reached only through the
  CLI would count as reached by no test.

The run is resumable (mutmut keeps its state in WORK/mutants: run the same command again to go on).
After tests are added for the survivors (and committed), `--recheck` brings HEAD's tests (with HEAD's
other modules and the installed native core, which they may need) into the same WORK and runs only
the mutants that survived, against every selected test (mutmut maps the new tests
first); the mutated modules must not have changed since WORK was made, and --mutate and --tests must
be the ones of the run it rechecks (mutmut forgets every result when its configuration changes).
Then OUT.json and OUT.md get the counts per file: killed, survived, timed out, not reached by any
selected test; the score is killed / (killed + survived) over the mutants a test reaches, with
timeouts counted apart.

    python bench/mutation.py --mutate 'config.py,errors.py' --tests tests/test_params.py,tests/test_errors.py \\
        --work /tmp/moetier-mutation --out bench/results/mutation-config-2026-11-27
"""

from __future__ import annotations

import argparse
import configparser
import fnmatch
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def installed_package() -> Path:
    out = subprocess.run(
        [sys.executable, "-c", "import moetier, os; print(os.path.dirname(moetier.__file__))"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return Path(out.stdout.strip())


# written into WORK/path/ (on PYTHONPATH): a test's subprocess reports, during mutmut's pass that maps
# tests to functions, each function it reaches to HITS/PID as it first reaches it (a server killed at
# the end of its test has no exit handler to run)
SITECUSTOMIZE = """\
import os

if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("MOETIER_MUTATION_HITS"):
    import mutmut.mutation.trampoline as _trampoline

    _seen = set()
    _path = os.path.join(os.environ["MOETIER_MUTATION_HITS"], str(os.getpid()))

    def _record(name, caller=None):
        if name not in _seen:
            _seen.add(name)
            with open(_path, "a") as f:
                f.write(name + "\\n")

    _trampoline.record_trampoline_hit = _record

if os.environ.get("MUTANT_UNDER_TEST"):
    # `python -m moetier.cli` runs the file as __main__, whose functions mutmut would name
    # __main__.x_...: neither the mutant under test nor the hits would match moetier.cli's. The
    # package's own module is imported and its entry point run instead.
    import runpy as _runpy

    _ENTRY = {"moetier.cli": "main", "moetier.lcpp": "install"}
    _run_as_main = _runpy._run_module_as_main

    def _as_main(mod_name, alter_argv=True):
        if mod_name not in _ENTRY:
            return _run_as_main(mod_name, alter_argv)
        import importlib
        import sys

        mod = importlib.import_module(mod_name)
        sys.argv[0] = mod.__file__
        sys.exit(getattr(mod, _ENTRY[mod_name])())

    _runpy._run_module_as_main = _as_main
"""

# the pytest side (pytest -p moetier_mutation_hits): before mutmut's own teardown hook files the
# functions the test reached, the subprocesses' ones join them
PLUGIN = """\
import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    hits = os.environ.get("MOETIER_MUTATION_HITS")
    if not hits or not os.path.isdir(hits):
        return
    from mutmut.state import state

    for name in os.listdir(hits):
        path = os.path.join(hits, name)
        with open(path) as f:
            state()._stats.update(line.strip() for line in f if line.strip())
        os.remove(path)
"""


def setup_cfg(mutate: list[str], tests: list[str]) -> str:
    """mutmut's configuration for the modules to mutate and the tests that may kill them."""
    # setup.cfg lists: one item per line
    only = "".join(f"\n    src/moetier/{m}" for m in mutate)
    selection = "".join(f"\n    {t}" for t in tests)
    return (
        "[mutmut]\n"
        "source_paths=src/moetier\n"
        f"only_mutate={only}\n"
        f"pytest_add_cli_args_test_selection={selection}\n"
        # plain fork deadlocks in the native library's threads
        "process_isolation=forkserver\n"
        "pytest_add_cli_args=\n    -p\n    moetier_mutation_hits\n"
        # tests import the bench harness (its cgroup and disk helpers) and compare docs/cli.md with
        # what scripts/cli-reference.py makes of the parsers; the README's examples run
        "also_copy=\n    bench\n    scripts\n    docs\n    README.md\n"
    )


def selection(cfg: str) -> tuple[str, str]:
    """What mutmut's results depend on in a configuration: the modules mutated and the tests selected
    (files it copies beside them, also_copy, are not part of it)."""
    parser = configparser.ConfigParser()
    parser.read_string(cfg)
    section = parser["mutmut"]
    return section.get("only_mutate", ""), section.get("pytest_add_cli_args_test_selection", "")


def copy_native(dst: Path) -> None:
    """The installed package's native core (_core, libllama, libggml-*, the tools in bin/) into dst."""
    pkg = installed_package()
    for f in [*pkg.glob("*.so"), *pkg.glob("*.so.*")]:
        shutil.copy2(f, dst / f.name)
    if (pkg / "bin").is_dir():
        shutil.copytree(pkg / "bin", dst / "bin", symlinks=True, dirs_exist_ok=True)


def prepare(work: Path, mutate: list[str], tests: list[str]) -> None:
    """The scratch worktree at HEAD, made once; its mutmut configuration written every time."""
    if not work.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(work), "HEAD"], check=True)
        (work / "python").rename(work / "src")
        copy_native(work / "src" / "moetier")
    (work / "setup.cfg").write_text(setup_cfg(mutate, tests))
    (work / "path").mkdir(exist_ok=True)
    (work / "path" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (work / "path" / "moetier_mutation_hits.py").write_text(PLUGIN)
    (work / "hits").mkdir(exist_ok=True)
    # on the path before mutmut fills it: a directory missing when the interpreter starts is cached as
    # holding nothing, and mutmut's own pass would then import the installed package
    (work / "mutants" / "src").mkdir(parents=True, exist_ok=True)


def recheck(work: Path, mutate: list[str]) -> list[str]:
    """HEAD's tests and bench scripts in WORK (made earlier at another commit with the same source of
    the mutated modules); the names of the mutants that survived there."""
    if not (work / "mutants").is_dir():
        msg = f"--recheck: {work} has no mutmut run to recheck; run without --recheck first"
        raise SystemExit(msg)
    base = subprocess.run(["git", "-C", str(work), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    changed = subprocess.run(
        ["git", "-C", str(ROOT), "diff", "--quiet", base.stdout.strip(), head.stdout.strip(), "--"]
        + [f"python/moetier/{m}" for m in mutate],
        check=False,
    )
    if changed.returncode != 0:
        msg = f"--recheck: a mutated module changed since {work} was made; its mutants are stale: start a new WORK"
        raise SystemExit(msg)
    # with what the tests read (the docs they compare, the scripts they run, the README's examples)
    subprocess.run(
        [
            "git",
            "-C",
            str(work),
            "checkout",
            head.stdout.strip(),
            "--",
            "tests",
            "bench",
            "scripts",
            "docs",
            "README.md",
        ],
        check=True,
    )
    # HEAD's tests run against HEAD's package: its other modules (the mutated ones are the same) and the
    # installed native core (build and install HEAD first), in the source and in mutmut's copy of it
    src = ROOT / "python"  # the checkout, at HEAD (the tests' commit: commit first)
    for f in sorted(src.rglob("*.py")):
        rel = f.relative_to(src).as_posix()
        if not any(fnmatch.fnmatch(rel, f"moetier/{m}") for m in mutate):  # --mutate takes globs
            for dst in (work / "src", work / "mutants" / "src"):
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dst / rel)
    for dst in (work / "src" / "moetier", work / "mutants" / "src" / "moetier"):
        copy_native(dst)
    results = subprocess.run(["mutmut", "results"], cwd=work, capture_output=True, text=True, check=True).stdout
    names = [line.strip().rpartition(": ")[0] for line in results.splitlines() if line.strip().endswith(": survived")]
    print(f"rechecking {len(names)} survivors against the tests of {head.stdout.strip()[:12]}")
    return names


def mutmut_env(work: Path) -> dict[str, str]:
    """The mutated copy and the hit reporting first on every test subprocess's path."""
    env = dict(os.environ)
    paths = [str(work / "mutants" / "src"), str(work / "path")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["MOETIER_MUTATION_HITS"] = str(work / "hits")
    return env


def tally(results: str) -> dict[str, Counter[str]]:
    """`mutmut results --all true` lines ('    moetier.config.x_f__mutmut_3: killed') -> counts per module."""
    out: dict[str, Counter[str]] = {}
    for line in results.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if not sep or "__mutmut_" not in name:
            continue
        module = name.split(".x")[0] if ".x" in name else name.rsplit(".", 1)[0]
        out.setdefault(module, Counter())[status.strip()] += 1
    return out


def report(counts: dict[str, Counter[str]], command: str) -> tuple[dict[str, object], str]:
    rows = ["| module | mutants | killed | survived | timed out | no test reaches them | score |", "|" + "---|" * 7]
    total: Counter[str] = Counter()
    for module in sorted(counts):
        c = counts[module]
        total.update(c)
        rows.append(row(module, c))
    rows.append(row("**all**", total))
    md = (
        "Mutation testing of the Python layer (mutmut 3). Score: killed / (killed + survived), the "
        f"mutants a selected test reaches; timeouts apart. Made by `{command}`.\n\n" + "\n".join(rows) + "\n"
    )
    return {"modules": {m: dict(c) for m, c in counts.items()}, "total": dict(total), "command": command}, md


def row(name: str, c: Counter[str]) -> str:
    reached = c["killed"] + c["survived"]
    score = f"{100 * c['killed'] / reached:.0f}%" if reached else "-"
    n = sum(c.values())
    return f"| {name} | {n} | {c['killed']} | {c['survived']} | {c['timeout']} | {c['no tests']} | {score} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mutate", required=True, help="modules under python/moetier/ to mutate, comma-separated (globs)")
    p.add_argument("--tests", required=True, help="test files or node ids that may kill them, comma-separated")
    p.add_argument("--work", type=Path, default=Path("/tmp/moetier-mutation"), help="the scratch worktree")
    p.add_argument("--children", type=int, default=1, help="mutants tested at once (mutmut --max-children)")
    p.add_argument("--out", type=Path, required=True, help="output prefix: OUT.json, OUT.md")
    p.add_argument(
        "--recheck",
        action="store_true",
        help="in an existing WORK: take HEAD's tests and run only the mutants that survived",
    )
    a = p.parse_args()
    if shutil.which("mutmut") is None:
        msg = "mutmut is not installed: pip install mutmut==3.8.1"
        raise SystemExit(msg)
    cfg = a.work / "setup.cfg"
    new_cfg = setup_cfg(a.mutate.split(","), a.tests.split(","))
    if a.recheck and cfg.exists() and selection(cfg.read_text()) != selection(new_cfg):
        # mutmut forgets every result when its configuration changes: a recheck keeps the selection
        msg = "--recheck: give the --mutate and --tests of the run it rechecks (mutmut would forget its results)"
        raise SystemExit(msg)
    names = recheck(a.work, a.mutate.split(",")) if a.recheck else []
    prepare(a.work, a.mutate.split(","), a.tests.split(","))
    env = mutmut_env(a.work)
    cmd = ["mutmut", "run", "--max-children", str(a.children), *names]
    run = subprocess.run(cmd, cwd=a.work, env=env, check=False)
    if run.returncode != 0:
        # mutmut exits 0 whatever survives; anything else is a failed run (the selected tests must pass
        # on HEAD first: the worktree holds no uncommitted change), whose counts would all be zero
        msg = f"mutmut run failed (exit {run.returncode}); no results written"
        raise SystemExit(msg)
    results = subprocess.run(
        ["mutmut", "results", "--all", "true"], cwd=a.work, capture_output=True, text=True, check=True
    ).stdout
    data, md = report(tally(results), "python bench/mutation.py " + " ".join(sys.argv[1:]))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    a.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
