"""Whether the fast tier (`make test-fast`, the tests marked `fast`) exercises every module of
`pipeline/` and `stages/`: it runs that tier under coverage, in every process the tests start (the
CLI, DVC's stages, the warm server and its forks, DDP's workers), and names each module none of
whose functions ran. A module with no functions (an entry point, a preload list) counts when any
of its lines ran.

    .venv/bin/python scripts/fast_tier_coverage.py        # exit 1 naming what the tier misses

The tests run copies of the project (tests/conftest.py: make_project): their files are mapped back
onto this checkout's. Run from a checkout in which `make install` ran (coverage is in
requirements-dev.txt).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "stages")
# As `make test-fast` runs the tier: on 2 workers, a file at a time (each worker a process coverage
# measures, as it does every process the tests start).
XDIST = ("-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")


def config(data_file: Path) -> str:
    """Coverage's settings: every Python process the tests start measures itself (its .pth file is in
    the venv), forks and os._exit included; a copy's files count as the checkout's."""
    copies = "\n".join(f"{package} =\n    {ROOT / package}\n    /**/{package}" for package in PACKAGES)
    return (f"[run]\nparallel = true\npatch = subprocess, fork, _exit, execv\nsource_pkgs = {', '.join(PACKAGES)}\n"
            f"data_file = {data_file}\n\n[paths]\n{copies}\n")


def body_lines(path: Path) -> set[int] | None:
    """The lines inside the module's function bodies; None for a module without functions."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0]
            # A docstring alone is no sign the function ran: it is not a statement coverage sees.
            start = node.body[1].lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and len(node.body) > 1 else first.lineno
            lines.update(range(start, node.end_lineno + 1))
    return lines or None


def modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                  if "__pycache__" not in path.parts)


def unexercised(coverage_module, rcfile: Path) -> list[str]:
    cov = coverage_module.Coverage(config_file=str(rcfile))
    cov.load()
    missing = []
    for path in modules():
        statements = cov.analysis2(str(path))[1]
        if not statements:
            continue  # a package marker: nothing to run
        executed = set(cov.get_data().lines(str(path)) or ())
        wanted = body_lines(path)
        if not (executed & wanted if wanted is not None else executed):
            missing.append(str(path.relative_to(ROOT)))
    return missing


def main() -> int:
    import coverage

    with tempfile.TemporaryDirectory(prefix="fast-tier-coverage-") as tmp:
        rcfile = Path(tmp) / "coveragerc"
        rcfile.write_text(config(Path(tmp) / ".coverage"))
        env = {**os.environ, "COVERAGE_PROCESS_START": str(rcfile), "COVERAGE_RCFILE": str(rcfile)}
        done = subprocess.run([sys.executable, "-m", "coverage", "run", "-m", "pytest", "-m", "fast", "-q",
                               "-p", "no:cacheprovider", *XDIST], cwd=ROOT, env=env)
        subprocess.run([sys.executable, "-m", "coverage", "combine", "-q"], cwd=tmp, env=env, check=True)
        missing = unexercised(coverage, rcfile)
    total = len(modules())
    if missing:
        print(f"fast tier: {len(missing)} of {total} modules never ran a function: {', '.join(missing)}; mark a test "
              "that exercises each `fast`")
    else:
        print(f"fast tier: every one of the {total} modules of {' and '.join(PACKAGES)} ran")
    if done.returncode != 0:
        print(f"fast tier: the tests failed (exit code {done.returncode})")
    return 1 if missing or done.returncode != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
