"""Memory per peer: one malloc arena for a peer's threads (swarm/allocator.py limit_arenas)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.allocator import limit_arenas

ROOT = Path(__file__).resolve().parent.parent
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

CHILD = r"""
import ctypes, sys, tempfile, threading
sys.path.insert(0, sys.argv[2])
from swarm.allocator import limit_arenas
if sys.argv[1] == "1":
    assert limit_arenas(1)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def work():
    keep = [libc.malloc(1 << 16) for _ in range(64)]   # each new thread's first malloc picks its arena
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    print(open(f.name).read().count("<heap nr="))
"""


def _arenas(limit: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if limit else "0", str(ROOT)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@glibc
def test_threads_share_one_arena_once_limited():
    assert _arenas(limit=False) > 1    # glibc: a new thread gets an arena of its own
    assert _arenas(limit=True) == 1


@glibc
def test_malloc_arena_max_in_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_arenas(1) is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert limit_arenas(8) is True    # (this test process: 8 is glibc's default per core or fewer)


def test_without_mallopt_nothing_is_changed(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert limit_arenas(1, "libdoes-not-exist.so.9") is False
