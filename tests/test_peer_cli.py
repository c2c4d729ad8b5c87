"""`python peer.py` as a user runs it: several processes on localhost, joins, kills, signals, bad flags."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from .conftest import ROOT, rel_l2

pytestmark = pytest.mark.timeout(240)


async def test_three_processes_join_train_and_agree(spawn):
    a = spawn("--steps", "25", "--min-peers", "3")
    port = await a.port()
    b = spawn("--steps", "25", "--min-peers", "3", "--join", f"127.0.0.1:{port}")
    c = spawn("--steps", "25", "--min-peers", "3", "--join", f"127.0.0.1:{port}")
    results = await asyncio.gather(a.finish(), b.finish(), c.finish())
    for code, summary in results:
        assert code == 0, summary
        assert summary is not None and summary["steps"] == 25
        for key in ("peer_id", "first_loss", "final_loss", "val_loss", "bytes_sent", "bytes_received",
                    "dense_bytes", "param_sketch"):
            assert key in summary
        assert len(summary["param_sketch"]) == 16
        assert summary["bytes_sent"] <= 0.03 * summary["dense_bytes"]
        phases = summary["step_phases"]  # where the step time went, every step of the run
        assert phases["steps"] == 25 and phases["compute"]["mean_ms"] > 0 and 0 <= phases["wait_share"] < 1
    sketches = [s["param_sketch"] for _, s in results]
    assert rel_l2(sketches[0], sketches[1]) <= 1e-3 and rel_l2(sketches[0], sketches[2]) <= 1e-3
    assert any(line.startswith("step ") and "peers 3" in line for line in a.lines)  # progress lines


async def test_sigkill_of_one_peer_mid_run_the_others_finish(spawn):
    steps = 60
    a = spawn("--steps", str(steps), "--min-peers", "3")
    port = await a.port()
    b = spawn("--steps", str(steps), "--min-peers", "3", "--join", f"127.0.0.1:{port}")
    victim = spawn("--steps", str(steps), "--min-peers", "3", "--join", f"127.0.0.1:{port}")
    await victim.read_until(r"^step (1\d|[2-9]\d)\b", timeout=120)  # killed somewhere past step 10
    victim.kill(signal.SIGKILL)
    (ca, sa), (cb, sb) = await asyncio.gather(a.finish(180), b.finish(180))
    assert ca == 0 and cb == 0
    for s in (sa, sb):
        # every round (a peer the busy machine made look slow runs free and computes a few more)
        assert s["steps"] == steps and s["steps_contributed"] >= steps, s["pacing"]
        assert s["val_loss"] < s["first_loss"]
    # the survivors applied the same rounds after the kill: their replicas still agree closely
    assert rel_l2(sa["param_sketch"], sb["param_sketch"]) <= 1e-2


async def until_settled(ports: list[int], timeout: float = 60.0) -> None:
    """Until every peer reports the same ownership view and no pending hand-off."""
    import time

    import aiohttp

    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - t0 < timeout:
            views, pending = set(), 0
            for p in ports:
                async with s.get(f"http://127.0.0.1:{p}/api/status") as r:
                    t = (await r.json())["tables"]
                views.add(t["view"])
                pending += t["handoffs_pending"]
            if len(views) == 1 and pending == 0:
                return
            await asyncio.sleep(0.2)
    raise AssertionError("peers did not settle")


async def test_four_peers_two_replicas_sigkill_loses_no_table_rows(spawn):
    """Issue 4's must-show: with R=2 a SIGKILLed peer's slots all have a live owner that hands them
    over (no slot restarts from zeros), and training goes on."""
    steps = 40
    common = ["--steps", str(steps), "--min-peers", "4", "--replicas", "2"]
    a = spawn(*common)
    port = await a.port()
    others = [spawn(*common, "--join", f"127.0.0.1:{port}") for _ in range(3)]
    victim = others[-1]
    await victim.read_until(r"^step (1\d|[2-9]\d)\b", timeout=150)
    ports = [port] + [await p.port() for p in others]
    await until_settled(ports)  # "any one peer" at steady state: every hand-off of the joins is done
    victim.kill(signal.SIGKILL)
    results = await asyncio.gather(*(p.finish(180) for p in [a, *others[:2]]))
    for code, s in results:
        assert code == 0 and s["steps"] == steps
        assert s["table_stats"]["slots_lost"] == 0
        assert s["val_loss"] < s["first_loss"]
    assert sum(s["table_stats"]["slots_fetched"] for _, s in results) > 0  # the victim's slots moved


async def test_sigterm_leaves_gracefully_and_exits_zero(spawn):
    a = spawn("--min-peers", "1")
    await a.port()
    await a.read_until(r"^step \d+", timeout=60)
    a.kill(signal.SIGTERM)
    code, summary = await a.finish(60)
    assert code == 0
    assert summary is not None and summary["steps"] > 0


def run_cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, str(ROOT / "peer.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, needle", [
    (["--ratio", "2"], "--ratio"),
    (["--batch-size", "0"], "--batch-size"),
    (["--compression", "zip"], "--compression"),
    (["--port", "70000"], "--port"),
    (["--join", "nohostport"], "--join"),
    (["--steps", "many"], "--steps"),
    (["--no-such-flag"], "unrecognized"),
    (["--data", "/no/such/path"], "--data"),
])
def test_bad_flags_give_one_line_and_exit_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bad_environment_variable_is_a_clear_error():
    r = run_cli(env={"SWARM_BATCH_SIZE": "lots"})
    assert r.returncode == 2 and "SWARM_BATCH_SIZE" in r.stderr and "Traceback" not in r.stderr


def test_unreachable_join_gives_one_line_and_exit_2():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_cli("--table-rows", "4096", "--join", f"127.0.0.1:{port}", "--join-timeout", "1")
    assert r.returncode == 2
    err = [line for line in r.stderr.strip().splitlines() if line and not line.startswith("warning: no --secret")]
    assert len(err) == 1 and "cannot reach" in err[0] and "Traceback" not in r.stderr


def test_own_data_too_small_for_a_held_out_batch_still_finishes(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, this is a tiny corpus. " * 20)
    r = run_cli("--data", str(tmp_path), "--steps", "3", "--table-rows", "4096", "--table-slots", "256",
                "--batch-size", "2", timeout=120)
    assert r.returncode == 0, r.stderr
    summary = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["val_loss"] is None  # nothing held out to evaluate on


def test_data_without_usable_text_is_a_clear_error(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    r = run_cli("--data", str(tmp_path), "--table-rows", "4096")
    assert r.returncode == 2 and "no usable text" in r.stderr and "Traceback" not in r.stderr
