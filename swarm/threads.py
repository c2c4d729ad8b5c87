"""Named worker threads: one role per pool, its name visible to the OS.

A peer's CPU goes to a few roles: the event loop (the main thread), the training thread, the table
thread and the event loop's helper threads (``asyncio.to_thread``: encoding pushes and replays,
decoding large payloads). Python 3.11 names threads for Python only; giving each worker its role as
its native name (Linux ``prctl(PR_SET_NAME)``, at most 15 bytes) lets ``top -H``, ``ps -L`` and
``bench/cpu_split.py`` (which reads ``/proc/PID/task/TID/comm``) tell the roles apart. Elsewhere the
names are Python's only.

It also says how many torch threads a peer takes by default (``default_threads``): the CPUs the
process may use, shared out among the ranks of a torchrun host, so that one peer per machine uses
the machine and a host group does not oversubscribe it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

TRAIN, TABLES, HELPER = "swarm-train", "swarm-tables", "swarm-helper"
PR_SET_NAME = 15
_prctl = None


def name_native(name: str) -> bool:
    """Set the calling thread's OS-visible name (truncated to 15 bytes); True if it was set."""
    global _prctl
    if not sys.platform.startswith("linux"):
        return False
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    if not _prctl:
        return False
    return _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0


def pool(role: str, workers: int, tag: str = "") -> ThreadPoolExecutor:
    """A thread pool whose workers carry ``role`` as their native name (``tag``: added to the
    Python name, e.g. the peer id, for logs and py-spy)."""
    return ThreadPoolExecutor(workers, thread_name_prefix=f"{role}-{tag}" if tag else role,
                              initializer=name_native, initargs=(role,))


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on: its affinity mask (os.sched_getaffinity, else os.cpu_count()),
    capped by a cgroup CPU quota where one is readable (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``; a container limited to 1.5 CPUs gets 2). At least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def _cgroup_quota(root: Path) -> float | None:
    """The cgroup's CPU quota in CPUs, or None when there is none or it cannot be read."""
    def read(path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
    for v2 in (root / "cpu.max", root / "unified" / "cpu.max"):
        text = read(v2)
        if text is not None:
            parts = text.split()
            try:
                return None if parts[0] == "max" else int(parts[0]) / int(parts[1])
            except (IndexError, ValueError, ZeroDivisionError):
                return None
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        quota, period = read(v1 / "cpu.cfs_quota_us"), read(v1 / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            try:
                q, p = int(quota), int(period)
            except ValueError:
                return None
            return q / p if q > 0 and p > 0 else None
    return None


def default_threads(environ: Mapping[str, str] | None = None, cpus: int | None = None) -> int:
    """The --threads default: the CPUs this process may use (available_cpus), shared out among
    the ranks torchrun starts on this host (LOCAL_WORLD_SIZE), at least 1 and at most 256 (the
    flag's range). Several peers on one machine without torchrun should each be given --threads."""
    environ = os.environ if environ is None else environ
    cpus = available_cpus() if cpus is None else cpus
    try:
        ranks = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, min(256, cpus // ranks))
