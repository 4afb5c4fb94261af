"""The C allocator's settings for a process that trains or evaluates on the CPU.

glibc's malloc serves each block above its mmap threshold with fresh pages from the kernel, and
hands the pages back when the block is freed. It also gives back free memory at the top of its
heap. A training step allocates and frees its activations and gradients, megabytes each, so every
step faults the same memory in again: on the MNIST model, over a million page faults and seconds of
system time per epoch (benchmarks/step_times.py). The threshold also moves with what the process
freed before (glibc raises it to the size of a freed mapped block), so how fast an epoch runs
depended on what ran before it: one epoch of a run slower than the next by 10-20%, in either order.
Fixed thresholds end both. The process keeps the memory its largest step needed, which it needs
again on the next step.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Larger than any block a step of this project allocates: MNIST's biggest activations, at the
# largest batch sizes people set, are some hundreds of megabytes. mallopt takes a C int.
KEEP_BELOW_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve blocks under 1 GiB from its heap and keep freed memory for reuse,
    instead of mapping and unmapping them. False where the C library is not glibc (macOS, musl):
    they have other allocators, and nothing changes."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # Both, or the freed top of the heap still goes back to the kernel. Setting either turns off
    # glibc's moving thresholds.
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BELOW_BYTES) and mallopt(M_TRIM_THRESHOLD, KEEP_BELOW_BYTES))
