"""Chaos: four `python peer.py` processes; one at a time is stopped and resumed, SIGKILLed, or
SIGKILLed and restarted from its checkpoint. Training goes on, no table slot is lost, loss falls."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import aiohttp
import pytest

from .conftest import free_port, join_at
from .test_peer_cli import until_settled

pytestmark = pytest.mark.timeout(300)


async def status(port: int) -> dict | None:
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/api/status", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


async def until_step(port: int, step: int, timeout: float = 90.0) -> int:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = await status(port)
        if st and st["step"] >= step:
            return st["step"]
        await asyncio.sleep(0.2)
    raise AssertionError(f"peer on port {port} did not reach step {step}")


async def until_dead(port: int, peer_id: str, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = await status(port)
        if st and any(m["peer_id"] == peer_id and m["state"] == "dead" for m in st["members"]):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"peer {peer_id} was not declared dead")


async def test_chaos_one_peer_at_a_time(spawn, tmp_path):
    rng = random.Random(7)
    common = ["--replicas", "2", "--min-peers", "4", "--round-timeout", "5"]
    ports = {0: free_port()}  # all four start at once: the joiners retry until the first one listens
    procs = {0: spawn(*common, "--port", str(ports[0]))}
    for i in (1, 2, 3):
        procs[i] = spawn(*common, *join_at(ports[0]), "--checkpoint", str(tmp_path / f"ck{i}"),
                         "--checkpoint-every", "2")
    for i in (1, 2, 3):
        ports[i] = await procs[i].port()
    await until_step(ports[0], 5)
    await until_settled(list(ports.values()))
    events = ["stop", "kill-restart", "kill"]
    rng.shuffle(events)
    alive = {0, 1, 2, 3}
    for event in events:
        victim = rng.choice(sorted(alive - {0}))
        step = (await status(ports[0]))["step"]
        if event == "stop":
            victim_id = (await procs[victim].read_until(r"as peer ([0-9a-f]{32})")).group(1)
            procs[victim].kill(signal.SIGSTOP)
            try:  # until it is suspected and declared dead
                await until_dead(ports[0], victim_id)
            finally:
                procs[victim].kill(signal.SIGCONT)
        else:
            procs[victim].kill(signal.SIGKILL)
            procs[victim].proc.wait(10)
            alive.discard(victim)
            if event == "kill-restart":
                procs[victim] = spawn(*common[:2], "--join", f"127.0.0.1:{ports[0]}",
                                      "--checkpoint", str(tmp_path / f"ck{victim}"))
                ports[victim] = await procs[victim].port()
                alive.add(victim)
        await until_step(ports[0], step + 5, timeout=120)  # training goes on
        await until_settled([ports[i] for i in alive], timeout=90)
    for i in alive:
        procs[i].kill(signal.SIGTERM)
    results = await asyncio.gather(*(procs[i].finish(120) for i in sorted(alive)))
    for code, summary in results:
        assert code == 0, summary
        assert summary["table_stats"]["slots_lost"] == 0
    first = results[0][1]
    assert first["val_loss"] < first["first_loss"] - 0.5  # the swarm kept learning through it all
