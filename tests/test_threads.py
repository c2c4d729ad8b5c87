"""swarm/threads.py: worker pools named for the OS, and bench/cpu_split.py's per-role CPU reading."""
from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from swarm import threads

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="native thread names: Linux only")


def _cpu_split():
    path = Path(__file__).resolve().parent.parent / "bench" / "cpu_split.py"
    spec = importlib.util.spec_from_file_location("cpu_split", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@linux
def test_pool_workers_carry_their_role_as_native_name():
    pool = threads.pool(threads.TABLES, 1, "abcdef")
    try:
        name, comm = pool.submit(lambda: (threading.current_thread().name,
                                          Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())).result()
    finally:
        pool.shutdown()
    assert name.startswith("swarm-tables-abcdef")  # Python's name keeps the peer tag for logs
    assert comm == "swarm-tables"


@linux
def test_name_native_truncates_to_fifteen_bytes():
    def run():
        assert threads.name_native("a-name-much-longer-than-fifteen")
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    out = []
    t = threading.Thread(target=lambda: out.append(run()))
    t.start()
    t.join()
    assert out == ["a-name-much-lon"]


@linux
def test_cpu_split_reads_cpu_per_role():
    mod = _cpu_split()
    pool = threads.pool(threads.TRAIN, 1)

    def spin():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
    try:
        before = mod.thread_cpu([os.getpid()])
        pool.submit(spin).result()
        after = mod.thread_cpu([os.getpid()])
    finally:
        pool.shutdown()
    assert after.get("train", 0.0) - before.get("train", 0.0) >= 0.2
    assert "loop" in after  # the main thread
