"""`python peer.py` as a user runs it: several processes on localhost, joins, kills, signals, bad flags."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from swarm.bodies import PROTOCOL_VERSION

from .conftest import ROOT, free_port, join_at, rel_l2

pytestmark = pytest.mark.timeout(240)


async def test_three_processes_join_train_and_agree(spawn):
    port = free_port()  # all three start at once: the joiners retry until the first one listens
    a = spawn("--steps", "25", "--min-peers", "3", "--port", str(port))
    b = spawn("--steps", "25", "--min-peers", "3", *join_at(port))
    c = spawn("--steps", "25", "--min-peers", "3", *join_at(port))
    results = await asyncio.gather(a.finish(), b.finish(), c.finish())
    for code, summary in results:
        assert code == 0, summary
        assert summary is not None and summary["steps"] == 25
        for key in ("peer_id", "first_loss", "final_loss", "val_loss", "bytes_sent", "bytes_received",
                    "dense_bytes", "param_sketch"):
            assert key in summary
        assert summary["versions"]["protocol"] == PROTOCOL_VERSION and summary["versions"]["torch"] == torch_version()
        assert len(summary["param_sketch"]) == 16
        assert summary["bytes_sent"] <= 0.03 * summary["dense_bytes"]
        phases = summary["step_phases"]  # where the step time went, every step of the run
        assert phases["steps"] == 25 and phases["compute"]["mean_ms"] > 0 and 0 <= phases["wait_share"] < 1
    sketches = [s["param_sketch"] for _, s in results]
    assert rel_l2(sketches[0], sketches[1]) <= 1e-3 and rel_l2(sketches[0], sketches[2]) <= 1e-3
    assert any(line.startswith("step ") and "peers 3" in line for line in a.lines)  # progress lines


async def test_sigkill_of_one_peer_mid_run_the_others_finish(spawn):
    steps = 40  # killed past step 10: 30 or so rounds without it
    port = free_port()
    a = spawn("--steps", str(steps), "--min-peers", "3", "--port", str(port))
    b = spawn("--steps", str(steps), "--min-peers", "3", *join_at(port))
    victim = spawn("--steps", str(steps), "--min-peers", "3", *join_at(port))
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
    port = free_port()
    a = spawn(*common, "--port", str(port))
    others = [spawn(*common, *join_at(port)) for _ in range(3)]
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


def run_clis(*runs: tuple[tuple[str, ...], dict | None], timeout: float = 60) -> list[subprocess.CompletedProcess]:
    """``run_cli(*args, env=env, timeout=timeout)`` for each (args, env), two at a time (the CPUs a
    test may use): each is its own `python peer.py`, so the results are those of running them one by one."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda run: run_cli(*run[0], env=run[1], timeout=timeout), runs))


BAD_FLAGS = [
    (["--ratio", "2"], "--ratio"),
    (["--batch-size", "0"], "--batch-size"),
    (["--compression", "zip"], "--compression"),
    (["--port", "70000"], "--port"),
    (["--join", "nohostport"], "--join"),
    (["--steps", "many"], "--steps"),
    (["--no-such-flag"], "unrecognized"),
    (["--data", "/no/such/path"], "--data"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every refused command line of this module, run once (two at a time), by name: each test
    below checks its own."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    blob = tmp_path_factory.mktemp("blob")
    (blob / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    runs = {**{" ".join(args): (tuple(args), None) for args, _ in BAD_FLAGS},
            "env": ((), {"SWARM_BATCH_SIZE": "lots"}),
            "unreachable": (("--table-rows", "4096", "--join", f"127.0.0.1:{port}", "--join-timeout", "1"), None),
            "no-text": (("--data", str(blob), "--table-rows", "4096"), None)}
    return dict(zip(runs, run_clis(*runs.values())))


@pytest.mark.parametrize("args, needle", BAD_FLAGS)
def test_bad_flags_give_one_line_and_exit_2(refused, args, needle):
    r = refused[" ".join(args)]
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_flags_are_checked_and_help_printed_without_importing_torch():
    """`import swarm` and the command line's checks load neither torch nor aiohttp (a refused flag
    answers before the ~2 s torch import); the public names that need torch load when asked for."""
    code = ("import sys, swarm, swarm.cli\n"
            "assert swarm.cli.main(['--ratio', '2']) == 2\n"
            "loaded = sorted(m for m in ('torch', 'aiohttp', 'numpy') if m in sys.modules)\n"
            "assert not loaded, loaded\n"
            "assert isinstance(swarm.Task, type) and swarm.optim.Adam and 'torch' in sys.modules\n"
            "from swarm.task import TaskError\n"
            "assert swarm.TaskError is TaskError\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "peer.py: error: --ratio must be in (0, 1], got 2.0"
    h = subprocess.run([sys.executable, "-c", "import sys, swarm.cli\n"
                        "try:\n    swarm.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
                        "assert 'torch' not in sys.modules"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "--sync-every" in h.stdout, h.stderr


def torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def test_version_names_the_package_protocol_python_and_torch():
    import re

    want = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    r = subprocess.run([sys.executable, str(ROOT / "peer.py"), "--version"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith(f"swarm-trainer {want} (protocol {PROTOCOL_VERSION}; Python {sys.version.split()[0]}; "
                               "torch "), r.stdout
    assert "not installed" not in r.stdout


def test_bad_environment_variable_is_a_clear_error(refused):
    r = refused["env"]
    assert r.returncode == 2 and "SWARM_BATCH_SIZE" in r.stderr and "Traceback" not in r.stderr


def test_unreachable_join_gives_one_line_and_exit_2(refused):
    r = refused["unreachable"]
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


def test_data_without_usable_text_is_a_clear_error(refused):
    r = refused["no-text"]
    assert r.returncode == 2 and "no usable text" in r.stderr and "Traceback" not in r.stderr
