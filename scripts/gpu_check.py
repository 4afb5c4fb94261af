"""`make gpu-check`: proves on any CUDA host what only runs on NVIDIA GPUs, in one command.

1. the tests marked `cuda` (tests/test_cuda.py): bf16 inside DataParallel's replicas, channels_last
   and portable checkpoints, the CUDA-event phase clock, per-device peak memory, commcheck on NCCL
   over every GPU, DDP and DataParallel over every GPU against single;
2. the default pipeline (`dvc repro` with params.yaml as it is) on all of MNIST, in a copy of the
   project, with each mode's training time and test accuracy against the 99% target.
It ends with one summary table. Without a CUDA device it says so and what it skipped, and proves
nothing (exit 0: there was nothing it could check). MNIST comes from MNIST_SOURCE (default
../shared/data/mnist).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import make_project, project_env, subprocess_env  # noqa: E402

TARGET_ACCURACY = 0.99
MODES = ("single", "dp", "ddp")


def describe_host() -> list[str]:
    if not torch.cuda.is_available():
        return [f"torch {torch.__version__}: no CUDA device on this host"]
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"]
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(f"cuda:{index} {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                     f"compute capability {props.major}.{props.minor}")
    lines.append(f"native bf16: {torch.cuda.is_bf16_supported(including_emulation=False)}")
    return lines


def run_cuda_tests(report: Path) -> list[tuple[str, str, str]]:
    """(test, outcome, detail) for every test marked cuda."""
    subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-s", "tests/test_cuda.py",
                    f"--junitxml={report}"], cwd=ROOT, env=subprocess_env())
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                detail = (found.get("message") or "").splitlines()[0][:90] if found.get("message") else ""
        rows.append((case.get("name"), outcome, detail))
    return rows


def run_default_pipeline(work: Path, mnist: Path) -> list[tuple[str, str, str]]:
    """`dvc repro` with the default params on all of MNIST; one row per mode."""
    project = make_project(work / "pipeline")
    started = time.perf_counter()
    result = subprocess.run(["dvc", "repro"], cwd=project, capture_output=True, text=True,
                            env=subprocess_env(**project_env(project, MNIST_SOURCE=str(mnist))))
    wall = time.perf_counter() - started
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-4000:], sep="\n")
        return [("dvc repro (default params, all of MNIST)", "FAILED", f"exit code {result.returncode}")]
    rows = [("dvc repro (default params, all of MNIST)", "passed", f"{wall:.0f} s wall time")]
    for mode in MODES:
        train = json.loads((project / "metrics/train" / f"{mode}.json").read_text())
        accuracy = json.loads((project / "metrics/eval" / f"{mode}.json").read_text())["accuracy"]
        outcome = "passed" if accuracy >= TARGET_ACCURACY else "FAILED"
        rows.append((f"{mode}: {train['world_size']} x {train['device_name']}", outcome,
                     f"{accuracy:.2%} test accuracy after {train['train_time_s']:.1f} s of training, "
                     f"{train['samples_per_s']:,.0f} samples/s"))
    return rows


def main() -> int:
    print("\n".join(describe_host()), flush=True)
    mnist = Path(os.environ.get("MNIST_SOURCE", ROOT.parent / "shared" / "data" / "mnist")).resolve()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        rows = run_cuda_tests(Path(tmp) / "cuda-tests.xml")
        if torch.cuda.is_available():
            rows += run_default_pipeline(Path(tmp), mnist)
        else:
            rows.append(("dvc repro (default params, all of MNIST)", "skipped", "no CUDA device on this host"))
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'check':<{width}}  {'outcome':<8} detail")
    for name, outcome, detail in rows:
        print(f"{name:<{width}}  {outcome:<8} {detail}")
    failed = [name for name, outcome, _ in rows if outcome in ("FAILED", "ERROR")]
    skipped = [name for name, outcome, _ in rows if outcome == "skipped"]
    if not torch.cuda.is_available():
        print(f"\ngpu-check: no CUDA device on this host; nothing proven, {len(skipped)} checks skipped. "
              "Run `make gpu-check` on a host with an NVIDIA GPU.")
        return 0
    print(f"\ngpu-check: {len(rows) - len(failed) - len(skipped)} passed, {len(failed)} failed"
          + (f", {len(skipped)} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
