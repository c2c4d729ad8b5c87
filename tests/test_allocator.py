"""swarm/allocator.py: glibc keeps freed memory mapped, so a peer's steps stop faulting pages in."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.allocator import keep_freed_memory, release_free

ROOT = Path(__file__).resolve().parent.parent
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


@glibc
def test_thresholds_are_set_and_setting_them_again_is_harmless():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True


def test_without_mallopt_nothing_is_changed():
    assert keep_freed_memory("libdoes-not-exist.so.9") is False


@glibc
def test_training_steps_stop_faulting_pages_in():
    """The bench's child process (bench/allocator.py), tuned: after warm-up steps, a training step
    and a row Adam step map (almost) no new pages (glibc's defaults fault thousands per training
    step in again)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import allocator as bench
    finally:
        sys.path.pop(0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", bench.CHILD, "1", "2300", "32768", "30"], env=env,
                         capture_output=True, text=True, timeout=180, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["train"]["faults"] < 400 and res["adam"]["faults"] < 20, res


TRIM_CHILD = r"""
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from swarm.allocator import keep_freed_memory, release_free
assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
blocks = [libc.malloc(1 << 16) for _ in range(3200)]   # 200 MiB of heap, each block written
for b in blocks:
    ctypes.memset(b, 1, 1 << 16)
for b in blocks[:-1]:   # all freed but the last: the heap's top stays in use, the rest is free inside it
    libc.free(b)
before = rss_mb()
released = release_free()
print(before, rss_mb(), released)
"""


@glibc
def test_free_heap_pages_go_back_to_the_kernel_once_released():
    """With the thresholds pinned, freed memory stays resident (the point of them); release_free
    hands the free pages back, those inside the heap too (a block in use at its top keeps it)."""
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD, str(ROOT)], capture_output=True, text=True,
                         timeout=60, check=True)
    before, after, released = out.stdout.split()
    assert float(before) - float(after) > 150, out.stdout
    assert released == "True"


def test_without_malloc_trim_nothing_is_released():
    assert release_free("libdoes-not-exist.so.9") is False
