"""Mutation testing of one part of entrenar with the tests of that part (mutmut 3).

    python tools/mutation.py optim                 # entrenar/optim/* vs tests/optim
    python tools/mutation.py nn/losses.py tests/nn/test_nn_losses.py
    python tools/mutation.py quant/int4.py,quant/nf4.py tests/quant
    python tools/mutation.py autograd --sample 37   # mutants numbered *3 and *7: ~1/5
    python tools/mutation.py lora --only survivors.txt   # names or fnmatch patterns

mutmut changes one operator, constant or call at a time ("mutants") and runs the
tests that reach the changed function; a mutant no test notices *survived*. The
score is killed / (killed + survived) (timeouts count as killed, as mutmut does).
Each run works in a scratch copy (``.mutation/<name>``): entrenar/, the chosen tests
and a pyproject.toml whose ``[tool.mutmut]`` names them, so the repository is never
touched and the parts run one at a time on a small machine. ``make mutation
PART=optim`` calls this; the scores are recorded in QUALITY.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRELOAD = ["numpy", "jax", "jax.numpy", "hypothesis", "optax", "chex", "yaml", "torch"]


def _scratch(part: str, tests: list[str]) -> Path:
    name = re.sub(r"[^A-Za-z0-9]+", "-", part).strip("-")
    work = ROOT / ".mutation" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # the package, and the folders some tests use: they run the examples or import the
    # benchmark scripts (the jit test's HLO histogram)
    skip = shutil.ignore_patterns("__pycache__", "results", "runs")
    for folder in ("entrenar", "benchmarks", "examples"):
        shutil.copytree(ROOT / folder, work / folder, ignore=skip)
    (work / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", work / "tests" / "conftest.py")
    for t in tests:
        src = ROOT / t
        dst = work / t
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True, ignore=skip)
        else:
            shutil.copy(src, dst)
            for helper in src.parent.glob("*.py"):  # a folder's shared helpers
                if not helper.name.startswith("test_"):
                    shutil.copy(helper, dst.parent / helper.name)
    (work / "preload.txt").write_text("\n".join(PRELOAD) + "\n")
    targets = [
        f"entrenar/{p}" if p.endswith(".py") else f"entrenar/{p.rstrip('/')}/*"
        for p in part.split(",")
    ]
    # the suite's markers block as it stands (tomllib is Python 3.11+)
    pyproject = (ROOT / "pyproject.toml").read_text()
    markers = re.search(r"^markers = \[.*?\]$", pyproject, re.S | re.M)
    assert markers, "pyproject.toml: [tool.pytest.ini_options] markers not found"
    (work / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        'source_paths = ["entrenar"]\n'
        'also_copy = ["benchmarks", "examples"]\n'
        f"only_mutate = {json.dumps(targets)}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "not slow"]\n'
        # JAX starts thread pools: fork from a clean server, not from the process
        # that ran the suite (a fork of a multithreaded process can deadlock). The
        # server imports the heavy libraries once (importing starts no JAX backend,
        # so no threads), which saves each mutant ~2 s of imports.
        'process_isolation = "forkserver"\n'
        'forkserver_warmup = "import"\n'
        'preload_modules_file = "preload.txt"\n'
        "use_git_change_detection = false\n"
        "\n[tool.pytest.ini_options]\n"
        'addopts = "-q --strict-markers"\n'
        f"{markers.group(0)}\n"
    )
    return work


def _score(work: Path) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=work, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return dict(
        collections.Counter(
            line.rsplit(":", 1)[1].strip()
            for line in out.stdout.splitlines()
            if ":" in line
        )
    )


def main() -> None:
    """Run mutmut on one part and print its counts and score."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "part",
        help="a package (optim) or module (nn/losses.py), or several with commas",
    )
    parser.add_argument("tests", nargs="*", help="test paths (default tests/<package>)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    pick = parser.add_mutually_exclusive_group()  # mutmut would run their union
    pick.add_argument(
        "--sample",
        metavar="DIGITS",
        help="run only the mutants whose number ends in one of these digits (a "
        "systematic sample: '37' runs about a fifth of every function's mutants)",
    )
    pick.add_argument(
        "--only",
        metavar="FILE",
        help="run only these mutants: a file with one name or fnmatch pattern a line "
        "(e.g. the survivors of an earlier run, against the tests added since)",
    )
    args = parser.parse_args()
    if args.sample and not args.sample.isdigit():
        parser.error(f"--sample takes digits, like 37; got {args.sample!r}")
    names = [f"*__mutmut_*[{args.sample}]"] if args.sample else []
    if args.only:
        names = Path(args.only).read_text().split()
    tests = args.tests or [f"tests/{args.part.split('/')[0]}"]
    work = _scratch(args.part, tests)
    # Every mutant runs in a fresh process; JAX's persistent compilation cache lets it
    # reuse the programs an earlier mutant compiled (keyed by the program itself, so a
    # mutant that changes a traced computation compiles anew): ~4x faster here.
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(work / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    run = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs)]
    subprocess.run([*run, *names], cwd=work, env=env, check=False)
    counts = _score(work)
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    survived = counts.get("survived", 0)
    total = killed + survived
    print(json.dumps({"part": args.part, "tests": tests, **counts}))
    if total:
        name = f"{args.part} (sample {args.sample})" if args.sample else args.part
        print(f"mutation score {name}: {killed}/{total} = {killed / total:.1%}")
    print(f"survivors: cd {work} && python -m mutmut results; mutmut show <name>")


if __name__ == "__main__":
    main()
