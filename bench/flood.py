#!/usr/bin/env python3
"""Flood benchmark (issue 20, "Per-client limits"): a training swarm's step rate without and with a
flood from another loopback address against one of its peers.

Starts --peers `peer.py` processes on 127.0.0.1 (1 torch thread each, the built-in LM, --batch-size 2,
--table-rows 32768, --min-peers N, one --join address; --secret S on every peer with --secret), waits
--warmup seconds, then measures alternating windows of --window seconds: quiet, flood, quiet, flood.
A flood window starts a flooder process (this file with --flooder) bound to 127.0.0.2 against peer 0
--ramp seconds before the window and stops it after. Steps are the peers' `step N` progress lines
(--progress-interval 0: one per step) summed over peers; the step-rate ratio is flood / quiet.

The flooder is one asyncio process: --connections connections (of which --streams hold an
/api/events stream open) attempted at once and re-attempted a second after a refusal, and
--rate requests/s spread over the connected ones, a mix of POST /v1/grads and /v1/ping with no or
forged signatures, GET /v1/swarm, /api/status and /metrics. It counts every reply by how it was
refused (HTTP 429 from the middleware, the fixed 429 of a refused connection, other statuses,
connection errors) and reports its own CPU seconds per wall second (it shares the cores).

    python3 bench/flood.py                 # 3 peers, 20 s windows, about 3 minutes
    python3 bench/flood.py --secret        # the same with a swarm secret (forged signatures -> 401)

The LAST stdout line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import resource
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_split import free_port, steps_done, stop  # noqa: E402  (bench/cpu_split.py)

ROOT = Path(__file__).resolve().parent.parent
SECRET = "flood benchmark secret 0123456789abcdef"
TICK = os.sysconf("SC_CLK_TCK")


# -- the flooder ---------------------------------------------------------------------------------
class Flood:
    def __init__(self, a):
        self.a = a
        self.host, port = a.target.rsplit(":", 1)
        self.port = int(port)
        self.counts: dict[str, int] = {}
        self.sent = 0
        self.skipped = 0  # request slots with no connected worker free (all refused or busy)
        self.tokens = asyncio.Semaphore(0)
        self.unclaimed = 0  # tokens released that no worker took yet
        self.stop = False
        body = os.urandom(1024)
        forged = ("X-Swarm-Timestamp: %d\r\nX-Swarm-Nonce: %s\r\nX-Swarm-Signature: %s\r\n")
        self.requests = []
        for i in range(16):
            fake = forged % (int(time.time()), "n" * 16 + f"{i:08d}", "0" * 64)
            hdr = f"Host: {a.target}\r\n"
            self.requests += [
                f"POST /v1/grads HTTP/1.1\r\n{hdr}X-Compression: topk-int8\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body,
                f"POST /v1/ping HTTP/1.1\r\n{hdr}{fake}Content-Length: {len(body)}\r\n\r\n".encode() + body,
                f"GET /v1/swarm HTTP/1.1\r\n{hdr}{fake}\r\n".encode(),
                f"GET /api/status HTTP/1.1\r\n{hdr}\r\n".encode(),
                f"GET /metrics HTTP/1.1\r\n{hdr}\r\n".encode(),
            ]

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    async def connect(self):
        return await asyncio.wait_for(asyncio.open_connection(self.host, self.port, local_addr=(self.a.source, 0),
                                                              ssl=unverified() if self.a.tls else None), 5)

    async def reply(self, reader: asyncio.StreamReader) -> tuple[str, bool]:
        """(outcome, the server keeps the connection) of one reply."""
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        status = head[9:12].decode()
        lower = head.lower()
        length = 0
        i = lower.find(b"content-length:")
        if i >= 0:
            length = int(lower[i + 15:lower.find(b"\r\n", i)])
        body = await asyncio.wait_for(reader.readexactly(length), 10) if length else b""
        closing = b"connection: close" in lower
        if status == "429":
            return ("429-connection" if b"from this address; retry" in body else "429-request"), not closing
        return status, not closing

    async def worker(self, k: int) -> None:
        reader = writer = None
        while not self.stop:
            await self.tokens.acquire()
            self.unclaimed -= 1
            if self.stop:
                break
            try:
                if writer is None:
                    reader, writer = await self.connect()
                    self.count("connections-opened")
                writer.write(self.requests[k % len(self.requests)])
                k += 1
                self.sent += 1
                outcome, keep = await self.reply(reader)
                self.count(outcome)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, asyncio.LimitOverrunError) as e:
                self.count("error-" + type(e).__name__)
                keep = False
            if not keep and writer is not None:
                writer.close()  # and the next token opens a new one: a flood does not wait for Retry-After
                reader = writer = None

    async def stream(self) -> None:
        while not self.stop:
            writer = None
            try:
                reader, writer = await self.connect()
                writer.write(f"GET /api/events HTTP/1.1\r\nHost: {self.a.target}\r\n\r\n".encode())
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                status = head[9:12].decode()
                if status == "200":
                    self.count("stream-200")
                    while not self.stop and await reader.read(1 << 16):
                        pass
                else:
                    self.count(f"stream-{status}")
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError) as e:
                self.count("stream-error-" + type(e).__name__)
            if writer is not None:
                writer.close()
            await asyncio.sleep(self.a.retry)

    async def run(self) -> dict:
        workers = self.a.connections - self.a.streams
        tasks = [asyncio.create_task(self.worker(random.randrange(1000))) for _ in range(workers)]
        tasks += [asyncio.create_task(self.stream()) for _ in range(self.a.streams)]
        t0 = time.monotonic()
        cpu0 = time.process_time()
        step = 0.01
        owed = 0.0
        # the first connections open at once: every worker gets a token
        for _ in range(workers):
            self.tokens.release()
        self.unclaimed += workers
        last = t0
        while time.monotonic() - t0 < self.a.duration:
            await asyncio.sleep(step)
            now = time.monotonic()
            owed += self.a.rate * (now - last)  # by the clock: a busy loop sleeps longer than asked
            last = now
            n = int(owed)
            owed -= n
            if self.unclaimed > self.a.rate * 0.05:  # every worker busy or sleeping
                self.skipped += n
                continue
            for _ in range(n):
                self.tokens.release()
            self.unclaimed += n
        wall = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        self.stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "cpu_per_wall": round(cpu / wall, 3),
                "requests_sent": self.sent, "requests_per_s": round(self.sent / wall, 1),
                "request_slots_skipped": self.skipped, "outcomes": dict(sorted(self.counts.items()))}


def flooder(a) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * a.connections + 64)), hard))
    out = asyncio.run(Flood(a).run())
    print(json.dumps(out), flush=True)
    return 0


# -- the swarm (ports, step counts and shutdown as bench/cpu_split.py's) ---------------------------
def cpu_of(pid: int) -> float:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


@functools.lru_cache(maxsize=1)
def unverified() -> ssl.SSLContext:
    """TLS without checking the peer's certificate: the flooder does not care whom it floods, and
    this benchmark reads its own peers' status on loopback."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def status_of(port: int, tls: bool) -> dict:
    import urllib.request
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/api/status"
    with urllib.request.urlopen(url, timeout=10, context=unverified() if tls else None) as r:
        return json.loads(r.read())


def window(a, procs, logs, flood_port: int | None) -> dict:
    fl = None
    if flood_port is not None:
        fl = subprocess.Popen([sys.executable, __file__, "--flooder", "--target", f"127.0.0.1:{flood_port}",
                               "--source", a.source, "--connections", str(a.connections), "--streams",
                               str(a.streams), "--rate", str(a.rate), "--duration", str(a.ramp + a.window),
                               *(["--tls"] if a.secret else [])],
                              stdout=subprocess.PIPE, text=True)
        time.sleep(a.ramp)
    s0, w0 = steps_done(logs), time.monotonic()
    c0 = [cpu_of(p.pid) for p in procs]
    time.sleep(a.window)
    s1, w1 = steps_done(logs), time.monotonic()
    c1 = [cpu_of(p.pid) for p in procs]
    if any(p.poll() is not None for p in procs):
        raise RuntimeError("a peer ended inside the window (raise --steps)")
    out = {"peer_steps": sum(s1) - sum(s0), "seconds": round(w1 - w0, 2),
           "steps_per_s": round((sum(s1) - sum(s0)) / (w1 - w0), 3),
           "peer_cpu_per_wall": [round((b - x) / (w1 - w0), 3) for x, b in zip(c0, c1)]}
    if fl is not None:
        stdout, _ = fl.communicate(timeout=60)
        out["flooder"] = json.loads(stdout.strip().splitlines()[-1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds of training before the first window")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured per window")
    ap.add_argument("--ramp", type=float, default=3.0, help="seconds a flood runs before its window")
    ap.add_argument("--pairs", type=int, default=2, help="(quiet, flood) window pairs")
    ap.add_argument("--secret", action="store_true", help="every peer gets --secret (the flood's signatures are forged)")
    ap.add_argument("--peer-args", default="", help="more flags for every peer, e.g. \"--client-limits 0\"")
    ap.add_argument("--connections", type=int, default=500)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--source", default="127.0.0.2", help="the flooder's address (any 127.x.y.z is loopback)")
    # the flooder's own flags
    ap.add_argument("--flooder", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)  # the flooder speaks TLS (a --secret swarm)
    ap.add_argument("--duration", type=float, default=20.0, help=argparse.SUPPRESS)
    ap.add_argument("--retry", type=float, default=1.0, help=argparse.SUPPRESS)  # an event stream's retry
    a = ap.parse_args()
    if a.flooder:
        return flooder(a)
    if a.peers < 2 or a.pairs < 1 or a.window <= 0 or a.streams > a.connections:
        print("--peers must be >= 2, --pairs >= 1, --window > 0, --streams <= --connections", file=sys.stderr)
        return 2
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ports = [free_port() for _ in range(a.peers)]
    windows = []
    with tempfile.TemporaryDirectory(prefix="swarm-flood-") as tmp:
        try:
            for i, port in enumerate(ports):
                argv = [sys.executable, str(ROOT / "peer.py"), "--port", str(port), "--steps", "100000",
                        "--batch-size", "2", "--table-rows", "32768", "--threads", "1", "--name", f"p{i}",
                        "--progress-interval", "0", "--min-peers", str(a.peers), *a.peer_args.split()]
                if a.secret:
                    argv += ["--secret", SECRET]
                if i:
                    argv += ["--join", f"127.0.0.1:{ports[0]}"]
                log = Path(tmp) / f"p{i}.out"
                logs.append(log)
                with log.open("w") as out:
                    procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, env=env, cwd=ROOT,
                                                  start_new_session=True))
                if i == 0:
                    time.sleep(3.0)
            deadline = time.monotonic() + 180
            while min(steps_done(logs)) < 1:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("the swarm did not start training")
                time.sleep(1.0)
            time.sleep(a.warmup)
            for k in range(a.pairs):
                quiet = window(a, procs, logs, None)
                flood = window(a, procs, logs, ports[0])
                windows.append({"quiet": quiet, "flood": flood})
                fl = flood["flooder"]
                print(f"pair {k + 1}: quiet {quiet['steps_per_s']} peer-steps/s, flood {flood['steps_per_s']} "
                      f"(x{flood['steps_per_s'] / max(quiet['steps_per_s'], 1e-9):.2f}); flooder sent "
                      f"{fl['requests_per_s']} req/s, cpu {fl['cpu_per_wall']}, {fl['outcomes']}", flush=True)
            limits = status_of(ports[0], a.secret).get("limits")
        except RuntimeError as e:
            print(f"bench/flood.py: {e}", file=sys.stderr)
            return 2
        finally:
            stop(procs)
    quiet = sum(w["quiet"]["peer_steps"] for w in windows) / sum(w["quiet"]["seconds"] for w in windows)
    flood = sum(w["flood"]["peer_steps"] for w in windows) / sum(w["flood"]["seconds"] for w in windows)
    ratio = round(flood / quiet, 3) if quiet else None
    result = {"peers": a.peers, "secret": a.secret, "peer_args": a.peer_args, "window_s": a.window,
              "flood": {"connections": a.connections, "streams": a.streams, "rate": a.rate, "source": a.source},
              "quiet_steps_per_s": round(quiet, 3), "flood_steps_per_s": round(flood, 3), "ratio": ratio,
              "target_met": ratio is not None and ratio >= 0.8, "attacked_peer_limits": limits, "windows": windows}
    print(f"step rate under flood: x{ratio} (target >= 0.8)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
