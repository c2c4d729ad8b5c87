"""Memory per peer: one malloc arena for a peer's threads (swarm/allocator.py limit_arenas), and no
torch._dynamo in a peer's process (swarm/optim.py)."""
from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from swarm import node
from swarm.allocator import limit_arenas
from swarm.node import Peer

from .conftest import small_cfg

ROOT = Path(__file__).resolve().parent.parent
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

CHILD = r"""
import ctypes, sys, tempfile, threading
sys.path.insert(0, sys.argv[2])
from swarm.allocator import limit_arenas
if sys.argv[1] == "1":
    assert limit_arenas(1)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def work():
    keep = [libc.malloc(1 << 16) for _ in range(64)]   # each new thread's first malloc picks its arena
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    print(open(f.name).read().count("<heap nr="))
"""


def _arenas(limit: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if limit else "0", str(ROOT)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@glibc
def test_threads_share_one_arena_once_limited():
    assert _arenas(limit=False) > 1    # glibc: a new thread gets an arena of its own
    assert _arenas(limit=True) == 1


@glibc
def test_malloc_arena_max_in_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_arenas(1) is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert limit_arenas(8) is True    # (this test process: 8 is glibc's default per core or fewer)


def test_without_mallopt_nothing_is_changed(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert limit_arenas(1, "libdoes-not-exist.so.9") is False


@pytest.mark.timeout(300)
async def test_peers_on_the_default_task_never_import_torch_dynamo(spawn, tmp_path):
    """torch.optim's optimizers import torch._dynamo and sympy (~73 MB a process) the first time one
    is built or stepped; the built-in task's swarm.optim.Adam does not: not when two peers train,
    nor when one writes a checkpoint (the optimizer's state_dict, as a joiner downloads it) and
    resumes from it (load_state_dict, as a joiner loads it)."""
    launcher = [sys.executable, str(ROOT / "tests" / "modules_at_exit.py")]
    ck = str(tmp_path / "ck")
    a = spawn("--steps", "12", "--min-peers", "2", "--checkpoint", ck, "--checkpoint-every", "4", launcher=launcher)
    port = await a.port()
    b = spawn("--steps", "12", "--min-peers", "2", "--join", f"127.0.0.1:{port}", launcher=launcher)
    (code_a, sum_a), (code_b, sum_b) = await asyncio.gather(a.finish(), b.finish())
    assert code_a == 0 and code_b == 0, (a.stderr_tail(), b.stderr_tail())
    assert sum_a["param_sketch"] == sum_b["param_sketch"]
    resumed = spawn("--steps", "15", "--checkpoint", ck, launcher=launcher)
    code_r, sum_r = await resumed.finish()
    assert code_r == 0 and sum_r["steps"] == 15 and sum_r["steps_contributed"] == 3, resumed.stderr_tail()
    for p in (a, b, resumed):
        line = [ln for ln in p.stderr_tail().splitlines() if ln.startswith("modules at exit: ")][-1]
        assert json.loads(line.removeprefix("modules at exit: ")) == {
            "torch._dynamo": False, "torch._inductor": False, "sympy": False}


async def test_a_peer_hands_its_free_heap_back_once_before_its_final_evaluation(monkeypatch):
    """The final evaluation and the sketch allocate where a peer's RSS peaks: the free heap that
    training left goes back to the kernel first (swarm/allocator.py release_free), once, not
    during the steps (they would fault it in again)."""
    seen: list[str] = []
    monkeypatch.setattr(node, "release_free", lambda: seen.append(f"trim after {peer.replica.step}") or True)
    peer = Peer(small_cfg(steps=3, min_peers=1), out=lambda line: None)
    real_eval = peer.evaluate

    async def evaluate(*a, **kw):
        seen.append("evaluate")
        return await real_eval(*a, **kw)

    peer.evaluate = evaluate
    await peer.start()
    try:
        summary = await asyncio.wait_for(peer.run(), 120)
    finally:
        await peer.close()
    assert summary["steps"] == 3
    assert seen[-2:] == ["trim after 3", "evaluate"] and seen.count("trim after 3") == 1, seen
    assert not any(s.startswith("trim") for s in seen[:-2]), seen
