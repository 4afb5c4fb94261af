"""`train.deterministic` and `train.bf16: false`, in the process that trains."""

import os
import subprocess
import sys

from tests.conftest import ROOT


def in_fresh_process(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_deterministic_mode_refuses_an_op_without_a_deterministic_form():
    """Not a flag read back: torch itself refuses an op it cannot run deterministically
    (Tensor.put_ without accumulate has no deterministic form on any device)."""
    out = in_fresh_process(
        "import os, torch\n"
        "from pipeline.determinism import use_deterministic_algorithms\n"
        "use_deterministic_algorithms(True)\n"
        "try:\n"
        "    torch.zeros(3).put_(torch.tensor([0]), torch.ones(1))\n"
        "    print('ran')\n"
        "except RuntimeError as exc:\n"
        "    print('refused', 'put_' in str(exc), os.environ['CUBLAS_WORKSPACE_CONFIG'],\n"
        "          torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)\n")
    assert out == "refused True :4096:8 True False"
    out = in_fresh_process(
        "import torch\n"
        "from pipeline.determinism import use_deterministic_algorithms\n"
        "use_deterministic_algorithms(False)\n"
        "torch.zeros(3).put_(torch.tensor([0]), torch.ones(1))\n"
        "print('ran', torch.backends.cudnn.deterministic)\n")
    assert out == "ran False"


def test_the_loop_trains_under_deterministic_algorithms(tmp_path):
    """Every op of a training step (and DDP's settling backward) has a deterministic form."""
    out = in_fresh_process(
        "import torch\n"
        "from pipeline.determinism import use_deterministic_algorithms\n"
        "from pipeline.config import TrainConfig\n"
        "from pipeline.loop import Training, train\n"
        "from pipeline.parallel import Rank\n"
        "from tests.ddp_harness import learnable_data\n"
        "use_deterministic_algorithms(True)\n"
        f"run = Training(TrainConfig(batch_size=16), 'single', Rank(), torch.device('cpu'), __import__('pathlib').Path({str(tmp_path)!r}))\n"
        "model, history = train(run, learnable_data(40), learnable_data(9, seed=1))\n"
        "print(len(history))\n")
    assert out == "1"


def test_float32_means_float32_turns_tf32_off_for_convolutions_and_matmuls():
    out = in_fresh_process(
        "import torch\n"
        "from pipeline.precision import float32_means_float32\n"
        "before = torch.backends.cudnn.conv.fp32_precision\n"
        "float32_means_float32()\n"
        "print(before, torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision)\n")
    assert out == "tf32 ieee ieee"  # cuDNN's convolutions use TF32 unless told otherwise
