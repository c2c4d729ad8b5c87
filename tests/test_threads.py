"""swarm/threads.py: worker pools named for the OS, the --threads default, and bench/cpu_split.py's per-role CPU reading."""
from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from swarm import threads

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="native thread names: Linux only")


def _cpu_split():
    path = Path(__file__).resolve().parent.parent / "bench" / "cpu_split.py"
    spec = importlib.util.spec_from_file_location("cpu_split", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@linux
def test_pool_workers_carry_their_role_as_native_name():
    pool = threads.pool(threads.TABLES, 1, "abcdef")
    try:
        name, comm = pool.submit(lambda: (threading.current_thread().name,
                                          Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())).result()
    finally:
        pool.shutdown()
    assert name.startswith("swarm-tables-abcdef")  # Python's name keeps the peer tag for logs
    assert comm == "swarm-tables"


@linux
def test_name_native_truncates_to_fifteen_bytes():
    def run():
        assert threads.name_native("a-name-much-longer-than-fifteen")
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    out = []
    t = threading.Thread(target=lambda: out.append(run()))
    t.start()
    t.join()
    assert out == ["a-name-much-lon"]


@linux
def test_cpu_split_reads_cpu_per_role():
    mod = _cpu_split()
    pool = threads.pool(threads.TRAIN, 1)

    def spin():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
    try:
        before = mod.thread_cpu([os.getpid()])
        pool.submit(spin).result()
        after = mod.thread_cpu([os.getpid()])
    finally:
        pool.shutdown()
    assert after.get("train", 0.0) - before.get("train", 0.0) >= 0.2
    assert "loop" in after  # the main thread


def test_cpu_split_gives_every_peer_the_peer_args_and_refuses_bad_quoting(capsys, monkeypatch):
    from types import SimpleNamespace
    mod = _cpu_split()
    a = SimpleNamespace(steps=416, table_rows=32768, peers=4, peer_args=["--sync-every", "32"])
    for mode, first in (("alone", None), ("together", 5000), ("tls", 5000)):
        argv = mod.peer_argv(a, mode, 1, 6000, first)
        assert argv[argv.index("--sync-every") + 1] == "32" and argv[argv.index("--port") + 1] == "6000"
        assert ("--join" in argv) is (mode != "alone")
    monkeypatch.setattr(sys, "argv", ["cpu_split.py", "--peer-args", '"--sync-every 32'])
    assert mod.main() == 2
    assert "--peer-args" in capsys.readouterr().err


def _cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_available_cpus_is_capped_by_a_cgroup_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert threads.available_cpus(_cgroup(tmp_path / "none", {})) == 8                      # no quota files
    assert threads.available_cpus(_cgroup(tmp_path / "v2max", {"cpu.max": "max 100000\n"})) == 8
    assert threads.available_cpus(_cgroup(tmp_path / "v2", {"cpu.max": "150000 100000\n"})) == 2  # 1.5 CPUs
    assert threads.available_cpus(_cgroup(tmp_path / "v2big", {"cpu.max": "3200000 100000"})) == 8  # affinity caps
    assert threads.available_cpus(_cgroup(tmp_path / "v2tiny", {"cpu.max": "1000 100000"})) == 1
    v1 = {"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert threads.available_cpus(_cgroup(tmp_path / "v1", v1)) == 3
    unlimited = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert threads.available_cpus(_cgroup(tmp_path / "v1inf", unlimited)) == 8
    assert threads.available_cpus(_cgroup(tmp_path / "junk", {"cpu.max": "lots\n"})) == 8


def test_default_threads_shares_the_cpus_among_a_hosts_ranks():
    assert threads.default_threads({}, cpus=16) == 16
    assert threads.default_threads({"LOCAL_WORLD_SIZE": "4"}, cpus=16) == 4
    assert threads.default_threads({"LOCAL_WORLD_SIZE": "3"}, cpus=16) == 5
    assert threads.default_threads({"LOCAL_WORLD_SIZE": "8"}, cpus=2) == 1        # at least 1
    assert threads.default_threads({"LOCAL_WORLD_SIZE": "x"}, cpus=6) == 6        # unreadable: one rank
    assert threads.default_threads({}, cpus=1000) == 256                          # the flag's range
    assert 1 <= threads.default_threads() <= max(1, os.cpu_count() or 1)


def test_peer_config_defaults_to_the_machines_threads(monkeypatch):
    from swarm.config import PeerConfig

    monkeypatch.setattr(threads, "available_cpus", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert PeerConfig().threads == 3
    assert PeerConfig(threads=1).threads == 1
