"""Named worker threads: one role per pool, its name visible to the OS.

A peer's CPU goes to a few roles: the event loop (the main thread), the training thread, the table
thread and the event loop's helper threads (``asyncio.to_thread``: encoding pushes and replays,
decoding large payloads). Python 3.11 names threads for Python only; giving each worker its role as
its native name (Linux ``prctl(PR_SET_NAME)``, at most 15 bytes) lets ``top -H``, ``ps -L`` and
``bench/cpu_split.py`` (which reads ``/proc/PID/task/TID/comm``) tell the roles apart. Elsewhere the
names are Python's only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from concurrent.futures import ThreadPoolExecutor

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
