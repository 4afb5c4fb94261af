"""The C allocator keeps freed memory in every `mnist-pipeline` process, so a training step reuses
the pages of the step before instead of faulting fresh ones in (pipeline/malloc.py)."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# 64 MB tensors, made and freed again and again as a training step's activations are: above the
# largest mmap threshold glibc picks by itself (32 MB), so by default every one is fresh pages.
REUSE = """
import resource, sys
import torch

if sys.argv[1] == "cli":
    from stages.cli import main
    main(["prepare", "--help"], standalone_mode=False)  # the command group's setup, then only the help
for _ in range(2):  # the process's first big blocks fault in, whatever the allocator
    torch.ones(1 << 24)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(int(sys.argv[2])):
    torch.ones(1 << 24)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_PER_TENSOR = (1 << 24) * 4 // 4096
REPEATS = 10


def page_faults(setup: str) -> int:
    done = subprocess.run([sys.executable, "-c", REUSE, setup, str(REPEATS)], capture_output=True, text=True, check=True)
    return int(done.stdout.splitlines()[-1])


def test_freed_memory_is_reused_under_the_cli():
    kept = page_faults("cli")
    default = page_faults("none")
    # Default: every 64 MB tensor faults its pages in again. Kept: the pages of the first ones
    # serve the rest; now and then the heap grows once or twice more, as blocks fall on it.
    assert default >= (REPEATS - 1) * PAGES_PER_TENSOR, default
    assert kept <= 3 * PAGES_PER_TENSOR, kept

