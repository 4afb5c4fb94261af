"""The C allocator keeps freed memory in every `mnist-pipeline` process, so a training step reuses
the pages of the step before instead of faulting fresh ones in (pipeline/malloc.py)."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# 64 MB tensors, made and freed again and again as a training step's activations are: above the
# largest mmap threshold glibc picks by itself (32 MB), so by default every one is fresh pages.
# Prints the page faults of the process's first such tensor, which every allocator faults in (the
# unit: a fault a page, or fewer where transparent huge pages map 2 MB at once), then those of the
# next ones.
REUSE = """
import resource, sys
import torch

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

if sys.argv[1] == "cli":
    from stages.cli import main
    main(["prepare", "--help"], standalone_mode=False)  # the command group's setup, then only the help
before = faults()
torch.ones(1 << 24)
first = faults() - before
torch.ones(1 << 24)  # where the heap settles: the first blocks may not fall where later ones do
before = faults()
for _ in range(int(sys.argv[2])):
    torch.ones(1 << 24)
print(first, faults() - before)
"""
REPEATS = 20


def page_faults(setup: str) -> tuple[int, int]:
    """(faults of the first 64 MB tensor, faults of the REPEATS after the second)."""
    done = subprocess.run([sys.executable, "-c", REUSE, setup, str(REPEATS)], capture_output=True, text=True,
                          check=True)
    first, later = map(int, done.stdout.splitlines()[-1].split())
    return first, later


def test_freed_memory_is_reused_under_the_cli():
    kept_first, kept = page_faults("cli")
    default_first, default = page_faults("none")
    assert kept_first > 0 and default_first > 0
    # Default: every 64 MB tensor faults its pages in again. Kept: the pages of the first ones
    # serve the rest; now and then the heap grows again as blocks fall on it (0 to 5 times in 20
    # on a busy 2-core machine, however many tensors follow), so most must fault nothing.
    assert default >= (REPEATS - 1) * default_first, (default, default_first)
    assert kept <= REPEATS // 2 * kept_first, (kept, kept_first)
