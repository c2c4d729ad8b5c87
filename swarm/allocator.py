"""Keep freed memory in the process instead of handing it back to the kernel after every step.

glibc's malloc serves blocks above M_MMAP_THRESHOLD (128 KiB, growing up to 32 MiB as it sees
large frees) with a fresh mmap, and returns heap tops above M_TRIM_THRESHOLD to the kernel. A
peer allocates and frees the same few-MiB tensors many times a step (activations and gradients of
the forward/backward, the rows of a pull, a flush's Adam temporaries), so each step maps new pages
and faults every one of them in again: measured by `bench/allocator.py`, a forward/backward of the
default model faulted 2000-4500 pages in per step, 20-80 with these thresholds, and took 3-12% less
time (a minor fault costs microseconds on a VM). Pinning both thresholds keeps those pages mapped;
the price is that the process's resident size stays near its peak instead of shrinking between
steps.

Only glibc has mallopt; elsewhere (musl, macOS, Windows) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory(libc_name: str | None = None) -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if both were set. Idempotent;
    a no-op (False) without glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(libc_name or ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
