"""The one-way delay of bench/wan.py's links, in user space: this kernel has no netem.

bench/delayline.c (built here with gcc into a temporary directory) creates two TAP devices per
link, one in the peer's namespace (its `wan0`) and one in the hub namespace (a bridge port), and
copies frames between them: toward the peer after holding them `delay_ms`, toward the hub at once.
A packet between two peers thus crosses one delay (the receiver's link): RTT = 2 x delay_ms.

Everything but the process handling is pure and tested (tests/test_bench_wan.py): the command
line, the parsing of its output, of /proc/PID/stat and of bench/delayline_ping.py's output."""
from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("delayline.c")
PING = Path(__file__).resolve().with_name("delayline_ping.py")
MTU = 64000  # of every TAP and the bridge: few, large frames (tbf's 64kb burst still holds one)
QUEUE_BYTES = 32 << 20  # the most bytes held per link toward its peer; more are dropped
IFNAMSIZ = 16


@dataclass(frozen=True)
class Link:
    """One peer's link: TAP `peer_if` in namespace `peer_ns`, TAP `hub_if` in namespace `hub_ns`."""
    peer_ns: str
    peer_if: str
    hub_ns: str
    hub_if: str

    def arg(self) -> str:
        """The link as delayline.c's NETNS_PATH:PEER_IF:NETNS_PATH:HUB_IF argument."""
        for name in (self.peer_ns, self.hub_ns):
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(f"bad namespace name {name!r}")
        for name in (self.peer_if, self.hub_if):
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or len(name) >= IFNAMSIZ:
                raise ValueError(f"bad interface name {name!r} (at most {IFNAMSIZ - 1} of [A-Za-z0-9_.-])")
        return f"/run/netns/{self.peer_ns}:{self.peer_if}:/run/netns/{self.hub_ns}:{self.hub_if}"


def argv(binary: str, delay_ms: float, links: list[Link], queue_bytes: int = QUEUE_BYTES) -> list[str]:
    """delayline.c's command line: DELAY_US QUEUE_BYTES LINK..."""
    if delay_ms < 0 or not links:
        raise ValueError("the delay must be >= 0 ms and there must be at least one link")
    return [binary, str(int(round(delay_ms * 1000))), str(int(queue_bytes)), *(lk.arg() for lk in links)]


def parse_ready(line: str) -> str | None:
    """`ready sched=fifo` -> the scheduling policy it got ("fifo" or "other"); None if not that line."""
    m = re.fullmatch(r"ready sched=(\w+)\s*", line)
    return m.group(1) if m else None


def parse_counters(text: str) -> dict[str, int] | None:
    """Its exit line `frames_up N frames_down N ... dropped N write_errors N` (names and counts in
    pairs) -> a dict."""
    for line in reversed(text.splitlines()):
        f = line.split()
        if f and f[0] == "frames_up" and len(f) % 2 == 0 and all(x.isdigit() for x in f[1::2]):
            return {k: int(v) for k, v in zip(f[0::2], f[1::2])}
    return None


def cpu_seconds(stat: str, ticks: int) -> float | None:
    """User + system CPU seconds of a process from its /proc/PID/stat text (fields 14 and 15,
    counted after the LAST ')': the command name may hold spaces)."""
    _, paren, rest = stat.rpartition(")")
    f = rest.split()
    if not paren or len(f) < 13:
        return None
    try:
        return (int(f[11]) + int(f[12])) / ticks
    except ValueError:
        return None


_PING_RE = re.compile(r"rtt min/avg/median/max = ([0-9.]+)/([0-9.]+)/([0-9.]+)/([0-9.]+) ms, (\d+)/(\d+) replies")


def parse_ping(text: str) -> dict | None:
    """bench/delayline_ping.py's last line -> {min_ms, avg_ms, median_ms, max_ms, replies, sent}."""
    for line in reversed(text.splitlines()):
        m = _PING_RE.search(line)
        if m:
            mn, avg, med, mx = (float(x) for x in m.groups()[:4])
            return {"min_ms": mn, "avg_ms": avg, "median_ms": med, "max_ms": mx,
                    "replies": int(m.group(5)), "sent": int(m.group(6))}
    return None


def build(workdir: Path) -> Path:
    """Compile delayline.c into `workdir`; RuntimeError (one line) without gcc or on a failure."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("the delay line needs a C compiler (gcc) to build bench/delayline.c")
    out = workdir / "delayline"
    r = subprocess.run([gcc, "-O2", "-Wall", "-o", str(out), str(SOURCE)], capture_output=True, text=True)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        raise RuntimeError(f"building bench/delayline.c failed: {last}")
    return out


class DelayLine:
    """The running delay line of a set of links (one process for all of them)."""

    def __init__(self, delay_ms: float, links: list[Link], queue_bytes: int = QUEUE_BYTES):
        self.delay_ms, self.links, self.queue_bytes = delay_ms, links, queue_bytes
        self.p: subprocess.Popen | None = None
        self.sched: str | None = None
        self.counters: dict[str, int] | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self, timeout: float = 10.0) -> None:
        """Build, start, and wait until every TAP device exists (its `ready` line)."""
        self._dir = tempfile.TemporaryDirectory(prefix="swarm-delayline-")
        binary = build(Path(self._dir.name))
        self.p = subprocess.Popen(argv(str(binary), self.delay_ms, self.links, self.queue_bytes),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = ""
        if select.select([self.p.stdout], [], [], timeout)[0]:
            line = self.p.stdout.readline()
        self.sched = parse_ready(line)
        if self.sched is None:
            self.stop()
            err = (self.p.stderr.read().strip().splitlines() or ["no ready line"])[-1]
            raise RuntimeError(f"the delay line did not start: {err}")

    def cpu_s(self) -> float | None:
        """Its user + system CPU seconds so far."""
        if self.p is None:
            return None
        try:
            return cpu_seconds(Path(f"/proc/{self.p.pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))
        except OSError:
            return None

    def stop(self) -> dict[str, int] | None:
        """SIGTERM it and read its counters (frames, bytes, drops); its TAP devices go with it."""
        if self.p is None:
            return None
        if self.p.poll() is None:
            self.p.terminate()
            deadline = time.time() + 5
            while self.p.poll() is None and time.time() < deadline:
                time.sleep(0.05)
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
        try:
            self.counters = parse_counters(self.p.stdout.read())
        except (OSError, ValueError):
            self.counters = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        return self.counters
