"""What this build is, for a bug report, the JSON summary and /api/status: swarm's version, its
wire protocol's, Python's and torch's. Read from the installed packages' metadata, so that
``peer.py --version`` answers without importing torch."""
from __future__ import annotations

import functools
import sys
from importlib.metadata import PackageNotFoundError, version

from .bodies import PROTOCOL_VERSION

__all__ = ["versions", "line"]


def _of(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=1)
def versions() -> dict:
    """{"swarm", "protocol", "python", "torch"}: the distribution swarm-trainer's version (``not
    installed`` when run from a checkout that pip never installed), the wire protocol's number
    (swarm/bodies.py), Python's and torch's."""
    return {"swarm": _of("swarm-trainer"), "protocol": PROTOCOL_VERSION, "python": sys.version.split()[0],
            "torch": _of("torch")}


def line() -> str:
    v = versions()
    return f"swarm-trainer {v['swarm']} (protocol {v['protocol']}; Python {v['python']}; torch {v['torch']})"
