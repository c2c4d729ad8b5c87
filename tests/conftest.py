"""Shared fixtures: small peer configs, in-process peers and `python peer.py` subprocesses.

Every peer uses one torch thread and small tables so several fit on two cores; every process and
task a test starts is stopped when the test ends, pass or fail.

The suite runs on pytest-xdist workers (pyproject's addopts: ``-n auto --dist loadgroup``). The
modules in SWARM_MODULES start swarms of four or more peers, subprocess peers or torchrun groups:
their tests share one xdist group, so they run one at a time on one worker, never two of them
packed onto two cores at once, while the lighter tests fill the other core. ``-n 0`` runs the
suite in one process.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from swarm.config import BUILTIN_ONLY, PeerConfig
from swarm.node import Peer

ROOT = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)

SMALL = dict(table_rows=4096, table_slots=256, batch_size=4, threads=1, progress_interval=0.5, eval_batches=2,
             warmup_steps=0, round_timeout=15.0,
             # peers in one process share its GIL: their compute times say nothing of their speed
             free_run=0)


# the modules whose tests start whole swarms (see the module docstring); measured at 9-110 s per module
SWARM_MODULES = frozenset({
    "test_byzantine", "test_chaos", "test_examples", "test_bench_gpu_examples", "test_group",
    "test_local_steps", "test_pacing", "test_peer_cli",
})


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core, at most 4 (the swarm tests run one at a time anyway)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = getattr(item, "module", None)  # (an item that is not a Python test function has none)
        if module is not None and module.__name__.rsplit(".", 1)[-1] in SWARM_MODULES:
            item.add_marker(pytest.mark.xdist_group("swarms"))


def small_cfg(**kw) -> PeerConfig:
    return PeerConfig(**{**SMALL, **kw})


@pytest.fixture
async def small_peer():
    """One started peer of small_cfg(), in no swarm (its routes are called directly); closed after."""
    p = Peer(small_cfg(), out=lambda line: None)
    await p.start()
    yield p
    await p.close()


def small_replica():
    """A replica of the built-in task at small_cfg(), on the whole corpus (shard 0 of 1)."""
    from swarm.replica import Replica
    from swarm.tasks import default_task

    r = Replica(default_task(small_cfg()), seed=0)
    r.set_shard(0, 1, 0)
    return r


async def start_peers(n: int, **kw) -> list[Peer]:
    """``n`` in-process peers of ``small_cfg(**kw)`` on ephemeral ports, the others joining the first."""
    first = Peer(small_cfg(**kw), out=lambda line: None)
    await first.start()
    peers = [first]
    for _ in range(n - 1):
        p = Peer(small_cfg(join=f"127.0.0.1:{first.port}", **kw), out=lambda line: None)
        await p.start()
        peers.append(p)
    return peers


def watch_shares(peer: Peer, shares: list, entries: list | None = None) -> None:
    """Append to ``shares`` the share every payload of ``peer`` is compressed at from now on
    (Compressor.compress's ``share``: the contributor cap by bytes), and to ``entries`` (when given)
    the entries it carried."""
    real = peer.compressor.compress

    def compress(*args, **kwargs):
        enc = real(*args, **kwargs)
        shares.append(kwargs.get("share", 1))
        if entries is not None:
            entries.append(enc.k)
        return enc

    peer.compressor.compress = compress


def signed(by, to: Peer, method: str, path: str, body: bytes | None = b"") -> dict:
    """The headers of a request from ``by`` (a Peer, or a PeerKey of a made-up member) for the peer
    ``to``: every /v1/* request is signed by its sender for its receiver (swarm/auth.py)."""
    from swarm import auth

    signer = by.transport.signer if isinstance(by, Peer) else auth.Signer(by, None, to.cfg.secret or None)
    return signer.headers(method, path, body, time.time(), to.id)


def pin(p: Peer):
    """The ``ssl=`` of a test client calling ``p`` directly: its certificate pinned under TLS."""
    return _pin(p.key.fingerprint()) if p.tls else True


@functools.lru_cache(maxsize=None)
def _pin(fp: str):  # one object per certificate: aiohttp pools connections by it
    import aiohttp

    return aiohttp.Fingerprint(bytes.fromhex(fp))


def free_port(span: int = 1) -> int:
    """The first of ``span`` consecutive ports free on 127.0.0.1 now, for peers that must listen on
    known ports (a torchrun group's rank r listens on --port + r). Picked below the kernel's
    ephemeral range, so that no outgoing connection of a test running beside this one can be
    handed one of them as its source port before our peer binds it (CI once saw a group's rank 1
    fail with "Address already in use" on --port + 1, which the old bind-to-0 pick never checked)."""
    low, high = _ephemeral_range()
    lo, hi = (10000, low - span) if low - span > 12000 else (high + 1, 65536 - span)  # hi is exclusive
    rng = random.SystemRandom()
    for _ in range(1000):
        base = rng.randrange(lo, hi)
        held = []
        try:
            for port in range(base, base + span):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {span} consecutive free ports in [{lo}, {hi})")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def join_at(port: int) -> tuple[str, ...]:
    """The flags of a `python peer.py` joining the peer that will listen on ``port``: started
    together with it (their start-ups overlap), it retries the join until that peer listens."""
    return ("--join", f"127.0.0.1:{port}", "--join-timeout", "60")


def rel_l2(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).norm() / max(a.norm(), b.norm(), 1e-12))


class PeerProcess:
    """`python peer.py ...` with its stdout collected line by line in the background."""

    def __init__(self, *args: str, env: dict | None = None, launcher: list[str] | None = None, small: bool = True):
        flags = []  # small: the built-in task at a test's size (a user task brings its own)
        for k, v in (SMALL if small else {k: v for k, v in SMALL.items() if k not in BUILTIN_ONLY}).items():
            flags += [f"--{k.replace('_', '-')}", str(v)]
        # a launcher (torchrun) starts several processes: kill() reaches them all
        self.group = bool(launcher)
        self.proc = subprocess.Popen(
            [*(launcher or [sys.executable]), str(ROOT / "peer.py"), *flags, *args], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        self._stderr: str | None = None

    async def read_until(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """Wait for a stdout line matching ``pattern``; returns the match."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        for line in self.lines:
            if m := rx.search(line):
                return m
        while time.monotonic() < deadline:
            line = await asyncio.wait_for(loop.run_in_executor(None, self.proc.stdout.readline),
                                          max(0.1, deadline - time.monotonic()))
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if m := rx.search(line):
                return m
        raise AssertionError(f"no line matching {pattern!r}; got {self.lines[-5:]}, stderr: {self.stderr_tail()}")

    async def port(self) -> int:
        return int((await self.read_until(r"listening on https?://[^:]+:(\d+)")).group(1))

    async def finish(self, timeout: float = 120.0) -> tuple[int, dict | None]:
        """Wait for exit; returns (exit code, the JSON summary on the last stdout line or None)."""
        loop = asyncio.get_running_loop()
        reader = loop.run_in_executor(None, self._communicate)
        try:
            out, _ = await asyncio.wait_for(asyncio.shield(reader), timeout)
        except asyncio.TimeoutError:
            self.kill()  # the reader thread sees EOF and ends; the event loop can then close
            out, _ = await asyncio.wait_for(reader, 30)
            self.lines += out.splitlines()
            raise AssertionError(f"still running after {timeout} s; last lines {self.lines[-5:]}") from None
        self.lines += out.splitlines()
        last = self.lines[-1] if self.lines else ""
        try:
            summary = json.loads(last)
        except ValueError:
            summary = None
        return self.proc.returncode, summary

    def _communicate(self):
        out = self.proc.stdout.read()
        self.proc.wait()
        return out, None

    def stderr_tail(self) -> str:
        """The end of stderr; a launcher's tail is its own traceback, so each rank's one-line
        "peer.py: error: ..." (which may sit far above it) comes first."""
        if self.proc.poll() is None:
            return "(running)"
        if self._stderr is None:  # read once: the pipe is empty after
            self._stderr = self.proc.stderr.read()
        text = self._stderr
        errors = [line for line in text.splitlines() if "peer.py: error:" in line] if self.group else []
        return "\n".join([*errors, text[-2000:]])

    def summaries(self) -> list[dict]:
        """Every JSON summary line printed (a launcher's ranks print one each)."""
        return json_summaries(self.lines)

    def kill(self, sig=signal.SIGKILL) -> None:
        """Signal the process; for a launcher, every process it started too (torchrun starts each
        rank in a session of its own, so a process-group kill would miss them)."""
        if not self.group:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
            return
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def json_summaries(lines: list[str]) -> list[dict]:
    """The JSON objects among stdout lines, torchrun's "[default<rank>]:" prefix (--tee) removed."""
    out = []
    for line in lines:
        if line.startswith("[") and "]:" in line:
            line = line.split("]:", 1)[1]
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.fixture
def spawn():
    """Start `python peer.py` subprocesses; all are killed at teardown."""
    procs: list[PeerProcess] = []

    def start(*args: str, env: dict | None = None, launcher: list[str] | None = None, small: bool = True) -> PeerProcess:
        p = PeerProcess(*args, env=env, launcher=launcher, small=small)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        try:
            p.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for s in (p.proc.stdout, p.proc.stderr):
            s.close()
