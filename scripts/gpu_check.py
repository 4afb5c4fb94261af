"""`make gpu-check`: proves on any CUDA host what only runs on NVIDIA GPUs, in one command.

1. the tests marked `cuda` (tests/test_cuda.py): bf16 inside DataParallel's replicas, channels_last
   and portable checkpoints, the CUDA-event phase clock, per-device peak memory, commcheck on NCCL
   over every GPU, DDP and DataParallel over every GPU against single;
2. the default pipeline (`dvc repro` with params.yaml as it is) on all of MNIST, in a copy of the
   project, with each mode's training time and test accuracy against the 99% target, each mode's
   step breakdown (CUDA events, NCCL's all-reduce through the comm hook, DataParallel's parts) with
   the scaling model's prediction against it, and what `train.deterministic` costs (single trained
   again with it off).
It ends with one summary table. Without a CUDA device it says so and what it skipped, and proves
nothing (exit 0: there was nothing it could check). MNIST comes from MNIST_SOURCE (default
../shared/data/mnist).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import gpus  # noqa: E402
from pipeline.errors import PipelineError  # noqa: E402
from tests.conftest import make_project, project_env, subprocess_env  # noqa: E402

TARGET_ACCURACY = 0.99
MODES = ("single", "dp", "ddp")
HOOK_COST = "comm timer's cost (benchmarks/comm_hook_cost.py)"
# Every mechanism that runs only on NVIDIA GPUs, and the check here that proves it (a test of
# tests/test_cuda.py, or a row of the pipeline run). What the CPU can model of each is in the suite.
MECHANISMS = [
    ("NCCL's in-order P2P: commcheck's batched isend/irecv, every primitive", "test_nccl_commcheck_over_every_gpu"),
    ("bf16 autocast inside each DataParallel replica's thread", "test_bf16_inside_every_dataparallel_replica"),
    ("bf16 only where the GPU computes it natively", "test_bf16_only_where_native"),
    ("channels_last training, checkpoints that load anywhere", "test_single_on_the_gpu_trains_channels_last_and_saves_portable_files"),
    ("the CUDA-event phase clock: events only on the steps read", "test_phase_clock_reads_cuda_events_only_where_read"),
    ("peak memory per device", "test_peak_memory_per_device"),
    ("an empty DDP share under bf16 and channels_last", "test_an_empty_share_trains_nothing_on_the_gpu"),
    ("DDP over NCCL, uneven shares, float32 without TF32", "test_ddp_on_every_gpu_agrees_with_single"),
    ("fsdp over NCCL: ddp's weights, 1/W of its state, the allocator peak per rank",
     "test_fsdp_on_every_gpu_agrees_with_ddp_and_reports_the_allocator_peak"),
    ("train.compile: Triton's kernels; compiled ddp over NCCL agrees with compiled single",
     "test_compiled_ddp_on_every_gpu_agrees_with_compiled_single"),
    ("DataParallel's scatter, replicas and gather over every GPU", "test_dataparallel_over_every_gpu_agrees_with_single"),
    ("the timeline: a lane for each GPU's kernels", "test_dataparallel_over_every_gpu_agrees_with_single"),
    ("a dropout stream per DataParallel replica (each GPU's generator)", "test_dataparallel_replicas_draw_dropout_masks_of_their_own"),
    ("bf16 keeps float32's accuracy", "test_bf16_keeps_float32_accuracy"),
    ("fp16 with a loss scaler: it learns, a resume carries the scale", "test_fp16_with_a_loss_scaler_learns_and_resumes_bit_for_bit_on_the_gpus"),
    ("train.loader: dataloader: pinned asynchronous copies, the in-memory weights",
     "test_a_training_read_by_dataloaders_is_the_in_memory_one_bit_for_bit_on_the_gpus"),
    ("deterministic cuDNN/cuBLAS: identical reruns, bit-identical resume", "test_a_resume_on_the_gpu_ends_with_the_uninterrupted_weights_bit_for_bit"),
    ("a run re-made from its MLflow record, bit for bit on the GPUs", "test_a_run_on_the_gpus_is_reproduced_bit_for_bit_from_its_record"),
    ("steady-state throughput after the warm-up steps", "dvc repro (default params, all of MNIST)"),
    ("the warm server serves every stage where the driver is loaded", "warm server (every stage after prepare)"),
    ("what train.deterministic costs", "train.deterministic cost (single, all of MNIST)"),
    ("the driver floor (CUDA 13.0 wheels: driver 580 or newer)", "the first lines: an older driver fails here"),
    ("GPUs these wheels have kernels for (compute capability)", "the first lines: sm_70 and older fail here"),
    ("the driver version read from /proc/driver/nvidia/version", "test_the_driver_version_is_recorded_as_the_driver_says"),
    ("train.sync_batchnorm: SyncBatchNorm over NCCL (two GPUs at least)",
     "test_sync_batchnorm_makes_a_batchnorm_model_on_every_gpu_agree_with_single"),
    ("DDP's comm timer on NCCL: its cost a step, kept out of the step times", HOOK_COST),
]


def describe_host() -> list[str]:
    driver = gpus.driver_gpus()
    if not torch.cuda.is_available():
        return [f"torch {torch.__version__}: no CUDA device on this host"]
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
             + (f", NVIDIA driver {driver[1]}" if isinstance(driver, tuple) else "")]
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
    # One stream, so each stage's own lines follow DVC's "Running stage" line (warm_row).
    result = subprocess.run(["dvc", "repro"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=subprocess_env(**project_env(project, MNIST_SOURCE=str(mnist), MNIST_PIPELINE_DEBUG="1")))
    wall = time.perf_counter() - started
    if result.returncode != 0:
        print(result.stdout[-8000:])
        return [("dvc repro (default params, all of MNIST)", "FAILED", f"exit code {result.returncode}")]
    rows = [("dvc repro (default params, all of MNIST)", "passed", f"{wall:.0f} s wall time"),
            warm_row(result.stdout)]
    for mode in MODES:
        train = json.loads((project / "results/train" / f"{mode}.json").read_text())
        accuracy = json.loads((project / "results/eval" / f"{mode}.json").read_text())["accuracy"]
        outcome = "passed" if accuracy >= TARGET_ACCURACY else "FAILED"
        rows.append((f"{mode}: {train['world_size']} x {train['device_name']}", outcome,
                     f"{accuracy:.2%} test accuracy after {train['train_time_s']:.1f} s of training, "
                     f"{train['samples_per_s']:,.0f} samples/s, {steady(train)} after the warm-up"))
    rows += breakdown_rows(project)
    rows.append(deterministic_cost(project, mnist))
    return rows


def warm_row(output: str) -> tuple[str, str, str]:
    """Whether each stage ran as a fork of the warm server (MNIST_PIPELINE_DEBUG=1 has each client
    say where its command ran): on a GPU host every stage after prepare must, since `import
    torch` loads the driver without initialising it (pipeline/runtime/driver.py)."""
    where, stage = {}, None
    for line in output.splitlines():
        started = re.match(r"Running stage '([^']+)'", line)
        if started:
            stage = started.group(1)
        elif stage and "a fork of the warm server" in line:
            where[stage] = "warm"
        elif stage and "mnist-pipeline: running in this process: " in line:
            where[stage] = "own process: " + line.split("running in this process: ", 1)[1]
    cold = {name: how for name, how in where.items() if how != "warm" and name != "prepare"}
    detail = "; ".join(f"{name}: {how}" for name, how in where.items())
    return ("warm server (every stage after prepare)", "FAILED" if cold or not where else "passed", detail or "no stage said")


def breakdown_rows(project: Path) -> list[tuple[str, str, str]]:
    """Where each mode's step went on these GPUs, and the scaling model's prediction for it
    (reports/scaling.json, from the breakdown's CUDA events and the NCCL comm hook)."""
    scaling = json.loads((project / "reports/scaling.json").read_text())
    rows = []
    for mode in MODES:
        breakdown = json.loads((project / "results/breakdown" / f"{mode}.json").read_text())
        ranks = breakdown.get("ranks") or []
        if not ranks:
            rows.append((f"{mode}: step breakdown", "FAILED", "no step measured (results/breakdown)"))
            continue
        m = max(ranks, key=lambda r: r["median_s"]["step"])["median_s"]
        parts = ", ".join(f"{key} {m[key] * 1000:.2f}" for key in
                          ("data", "forward", "backward_compute", "comm_exposed", "optimizer"))
        prediction = scaling["predictions"].get(mode)
        error = prediction and prediction.get("prediction_error")
        # Within 25%, as on the shaped links (tests/test_shaped_links.py).
        outcome = "passed" if error is not None and abs(error) <= 0.25 else "FAILED"
        rows.append((f"{mode}: step breakdown and prediction", outcome,
                     f"step {m['step'] * 1000:.2f} ms = {parts} ms; predicted "
                     + (f"{prediction['predicted_step_s'] * 1000:.2f} ms ({error:+.1%})" if error is not None
                        else "n/a")))
    return rows


def steady(train: dict) -> str:
    value = train.get("steady_samples_per_s")
    return f"{value:,.0f}" if value else "n/a"


def deterministic_cost(project: Path, mnist: Path) -> tuple[str, str, str]:
    """What `train.deterministic` costs: single trained again on all of MNIST with it off, against
    the pipeline's own single run with it on (both warm: data and kernels cached by then)."""
    on = json.loads((project / "results/train/single.json").read_text())["steady_samples_per_s"]
    params = project / "params-nondeterministic.yaml"
    params.write_text((project / "params.yaml").read_text().replace("deterministic: true", "deterministic: false"))
    result = subprocess.run(["mnist-pipeline", "train", "--mode", "single", "--params", str(params)], cwd=project,
                            capture_output=True, text=True, env=subprocess_env(**project_env(project)))
    name = "train.deterministic cost (single, all of MNIST)"
    if result.returncode != 0:
        print(result.stderr[-4000:])
        return (name, "FAILED", f"exit code {result.returncode}")
    off = json.loads((project / "results/train/single.json").read_text())["steady_samples_per_s"]
    return (name, "passed", f"{on:,.0f} samples/s on, {off:,.0f} off (after the warm-up): {off / on:.2f}x "
                            "the time per sample with it on")


def hook_cost(work: Path) -> tuple[str, str, str]:
    """What DDP's comm timer (a Python hook on each bucket) costs a step over NCCL against DDP's
    built-in all-reduce: the cost the breakdown keeps out of DDP's step times and steady
    throughput by hooking only its last window."""
    out = work / "hook-cost.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks/comm_hook_cost.py"), "--device", "cuda",
                             "--repeats", "3", "--json", str(out)], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr[-4000:])
        return (HOOK_COST, "FAILED", f"exit code {result.returncode}")
    figures = json.loads(out.read_text())
    arms = figures["arms"]
    base = arms["built-in all-reduce"]["median_step_s"]
    return (HOOK_COST, "passed", f"{figures['ranks']} ranks: built-in {base * 1000:.3f} ms a step; hook idle "
            f"{arms['timer hook, idle']['ratio']:.3f}x, recording {arms['timer hook, recording']['ratio']:.3f}x")


def main() -> int:
    try:  # GPUs the driver shows but CUDA cannot use (a driver too old for these wheels, GPUs they
        # have no kernels for): say so, fail
        gpus.check_capabilities("gpu-check", range(gpus.cuda_device_count()))
    except PipelineError as exc:
        print(f"gpu-check: {exc}")
        return 1
    if gpus.no_gpu_reason:  # hidden GPUs: the CPU's part runs, and the line says why no more
        print(f"gpu-check: no usable GPU: {gpus.no_gpu_reason}")
    print("\n".join(describe_host()), flush=True)
    mnist = Path(os.environ.get("MNIST_SOURCE", ROOT.parent / "shared" / "data" / "mnist")).resolve()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        rows = run_cuda_tests(Path(tmp) / "cuda-tests.xml")
        if torch.cuda.is_available():
            rows += run_default_pipeline(Path(tmp), mnist)
            rows.append(hook_cost(Path(tmp)))
        else:
            rows += [(name, "skipped", "no CUDA device on this host")
                     for name in ("dvc repro (default params, all of MNIST)",
                                  "train.deterministic cost (single, all of MNIST)", HOOK_COST)]
    print("\nCUDA-only mechanisms and the checks that prove them:")
    for mechanism, check in MECHANISMS:
        print(f"  {mechanism:<70} {check}")
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
