"""swarm/allocator.py: glibc keeps freed memory mapped, so a peer's steps stop faulting pages in."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.allocator import keep_freed_memory

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
