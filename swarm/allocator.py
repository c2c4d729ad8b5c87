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

One malloc arena (``limit_arenas``): glibc gives each thread that allocates while another holds
the arena lock an arena of its own (up to 8 per core), and memory freed in one arena serves only
that arena. A peer's threads (the event loop, the training thread, the table thread, the helpers)
each allocate and free tensors of every size, so each arena grows to its own peak: measured by
`bench/memory.py` on 4 peers of the default task, one arena cut the median peak RSS per peer by
60-100 MB (docs/benchmarks.md, "Memory per peer"). MALLOC_ARENA_MAX in the environment wins.

Freed memory handed back once training is over (``release_free``): the price of the thresholds is
heap kept resident that the steps left free in pieces (40-90 MB of a peer's heap, mallinfo2). A
peer's RSS peaks at the end of its run, where the final evaluation and the replica's sketch
allocate on top of it; glibc's malloc_trim(0) first returns every free heap page (inside the heap
too, not only its top). In 4-peer runs of 600 steps that took the largest peer's peak from
448.8-461.0 MB to 438.3-438.7 (docs/benchmarks.md, "Memory per peer"). Not during training: the
next steps would fault those pages in again.

Only glibc has mallopt and malloc_trim; elsewhere (musl, macOS, Windows) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
ARENA_MAX = 1
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20


def _libc_fn(name: str, argtypes: list, libc_name: str | None = None):
    """glibc's function ``name`` (returning int), or None where there is none (not Linux, not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(libc_name or ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def _mallopt(libc_name: str | None = None):
    """glibc's mallopt(int, int), or None where there is none."""
    return _libc_fn("mallopt", [ctypes.c_int, ctypes.c_int], libc_name)


def keep_freed_memory(libc_name: str | None = None) -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if both were set. Idempotent;
    a no-op (False) without glibc."""
    mallopt = _mallopt(libc_name)
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def limit_arenas(n: int = ARENA_MAX, libc_name: str | None = None) -> bool:
    """Let this process's threads share ``n`` malloc arenas (call it before the threads start);
    True if set. Left alone (False) when MALLOC_ARENA_MAX is set or without glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = _mallopt(libc_name)
    return mallopt is not None and bool(mallopt(M_ARENA_MAX, int(n)))


def release_free(libc_name: str | None = None) -> bool:
    """Return the heap's free pages to the kernel (glibc's malloc_trim(0)); True if any were. A
    no-op (False) without glibc. It takes the arenas' locks for a few milliseconds: call it off
    the event loop, where no step is running."""
    trim = _libc_fn("malloc_trim", [ctypes.c_size_t], libc_name)
    return trim is not None and bool(trim(0))
