"""Host groups (swarm/group): torchrun ranks on one host, rows and dense gradients moved through
torch.distributed (gloo on CPU here, NCCL on GPUs), joined with plain HTTP peers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from swarm.group.comm import GroupEnv, GroupError, pick_backend, pick_device
from swarm.group.rows import KEY_BITS, Exchange, GroupRows, pack_keys, unpack_keys
from swarm.tables import OwnershipMap, TableSpec

from .conftest import ROOT, free_port, join_at, json_summaries, rel_l2
from .test_peer_cli import run_clis

pytestmark = pytest.mark.timeout(300)

# bench/gpu_check.sh runs these on NCCL and GPUs; CI runs them on gloo and CPUs
BACKEND = os.environ.get("GROUP_TEST_BACKEND", "gloo")
DEVICE = os.environ.get("GROUP_TEST_DEVICE", "cpu")


def same_model(a: dict, b: dict) -> bool:
    """Two peers' summaries hold the same model: bit for bit on the same device type; between a GPU
    and a CPU peer their float arithmetic differs legitimately (docs/design.md, "Replicas compared
    while training"), so within float rounding (an H200 against a CPU: 4e-9 to 3e-8 relative after
    20-50 steps; the divergence check itself tolerates 1e-3)."""
    kinds = {s["task"]["device"].split(":")[0] for s in (a, b)}
    if len(kinds) == 1:
        return a["param_sketch"] == b["param_sketch"]
    return rel_l2(a["param_sketch"], b["param_sketch"]) <= 1e-5


def failed(plain, group) -> str:
    """Why the plain peer failed, with the group's own output (killed first if it still runs)."""
    group.kill()
    try:
        group.proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    return f"plain peer: {plain.stderr_tail()}\ngroup: {group.stderr_tail()}"


def torchrun(n: int) -> list[str]:
    """The torchrun command line; --tee 1 makes each rank's stdout whole lines prefixed "[defaultR]:"."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "--tee=1"]


# -- set-up from torchrun's environment ------------------------------------------------------------

def test_group_env_detects_torchrun_and_refuses_what_it_cannot_run():
    assert GroupEnv.detect({}) is None  # plain `python peer.py`
    assert GroupEnv.detect({"WORLD_SIZE": "1", "RANK": "0"}) is None
    env = {"WORLD_SIZE": "3", "RANK": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}
    assert GroupEnv.detect(env) == GroupEnv(rank=2, world=3, local_rank=2)
    with pytest.raises(GroupError, match="one host"):
        GroupEnv.detect({**env, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(GroupError, match="integers"):
        GroupEnv.detect({**env, "RANK": "x"})
    with pytest.raises(GroupError, match="MASTER_PORT"):
        GroupEnv.detect({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(GroupError, match="RANK 3"):
        GroupEnv.detect({**env, "RANK": "3"})


def test_backend_and_device_choice():
    assert pick_device("cpu", 0) == "cpu"
    assert pick_backend("auto", "cpu") == "gloo"
    assert pick_backend("gloo", "cpu") == "gloo"
    with pytest.raises(GroupError, match="nccl needs GPU"):
        pick_backend("nccl", "cpu")
    # ranks that outnumber the GPUs share them: NCCL refuses two ranks on one GPU, so auto takes gloo
    assert pick_backend("auto", "cuda:0", world=3, gpus=1) == "gloo"
    assert pick_backend("gloo", "cuda:0", world=3, gpus=1) == "gloo"
    with pytest.raises(GroupError, match="3 ranks share 1 GPU"):
        pick_backend("nccl", "cuda:0", world=3, gpus=1)
    if torch.distributed.is_nccl_available():
        assert pick_backend("auto", "cuda:1", world=2, gpus=2) == "nccl"
    if not torch.cuda.is_available():
        assert pick_device("auto", 0) == "cpu"
        with pytest.raises(GroupError, match="no CUDA"):
            pick_device("cuda", 0)


def test_bad_group_flags_are_one_line_errors():
    cases = ((["--backend", "mpi"], {}, "--backend must be"),
             (["--device", "tpu"], {}, "--device must be"),
             ([], {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "0",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "one host"))
    for (flags, env, needle), r in zip(cases, run_clis(*((flags, env) for flags, env, _ in cases))):
        assert r.returncode == 2, r.stderr
        assert needle in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


async def test_a_rank_whose_port_is_taken_says_which_port_in_one_line(spawn):
    """Rank r of a group listens on --port + r; when that port is taken, the rank's error names the
    address and why, without a traceback of its own (the launcher adds its own report after it)."""
    import socket

    port = free_port(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        group = spawn("--steps", "5", "--port", str(port), "--backend", BACKEND, "--device", DEVICE,
                      launcher=torchrun(2), env={"OMP_NUM_THREADS": "1"})
        code, _ = await group.finish(120)
    assert code != 0
    stderr = group.stderr_tail()
    errors = [line for line in stderr.splitlines() if "peer.py: error:" in line]
    assert any(f"cannot listen on 127.0.0.1:{port + 1} (rank 1 of this host's group listens on --port + 1): "
               in line for line in errors), errors
    # rank 0, left alone in the group's first collective, says so in one line too (no traceback of a rank)
    assert any("another rank of this host's group stopped while the group formed" in line for line in errors), errors
    assert "[rank0]: Traceback" not in stderr and "[rank1]: Traceback" not in stderr, stderr


# -- routing: the one cut both transports share -----------------------------------------------------

class _FakeComm:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world


def _rows(rank: int = 0, ranks: tuple[str, ...] = ("a", "b")) -> tuple[GroupRows, OwnershipMap]:
    specs = [TableSpec("ngram", 4096, 8), TableSpec("value", 4096, 8)]
    omap = OwnershipMap(specs, [*ranks, "http-peer"], replicas=1, slots=64)
    return GroupRows(_FakeComm(rank, len(ranks)), list(ranks), specs), omap


def test_split_pull_and_push_follow_the_ownership_map():
    rows, omap = _rows()
    rng = np.random.default_rng(0)
    want = {t: np.unique(rng.integers(0, 4096, 900)) for t in ("ngram", "value")}
    per_rank, rest = rows.split_pull(omap, want)
    assert set(per_rank) == {1}  # the other rank; never ourselves
    for t, ids in want.items():
        plan = omap.plan(t, ids)
        assert np.array_equal(per_rank[1][t], plan["b"])
        assert np.array_equal(rest[t], np.sort(np.concatenate([plan.get("a", ids[:0]), plan["http-peer"]])))
    grads = {t: (ids, torch.arange(len(ids), dtype=torch.float32)[:, None].expand(-1, 8)) for t, ids in want.items()}
    per_rank_g, rest_g = rows.split_push(omap, grads)
    for t, ids in want.items():
        sub, g = per_rank_g[1][t]
        assert np.array_equal(sub, omap.plan(t, ids)["b"])
        assert torch.equal(g[:, 0], torch.from_numpy(np.searchsorted(ids, sub)).float())  # each id keeps its row
        assert len(sub) + len(rest_g[t][0]) == len(ids)


def test_split_pull_skips_a_suspect_owner_like_the_http_client():
    rows, _ = _rows()
    specs = rows.specs
    omap = OwnershipMap(specs, ["a", "b", "http-peer"], replicas=2, slots=64)
    want = {"ngram": np.arange(0, 4096, 3)}
    per_rank, rest = rows.split_pull(omap, want, down={"b"})
    assert 1 not in per_rank  # b is down: its slots go to their other owner, over HTTP or locally
    assert np.array_equal(rest["ngram"], want["ngram"])


def test_keys_round_trip_and_hostile_keys_are_refused():
    rows, _ = _rows()
    keys, counts, sent = pack_keys({1: {"value": np.array([5, 9]), "ngram": np.array([1, 4095])}},
                                   rows.table_index, rows.comm.world)
    assert counts == [0, 4] and [t for _, t, _ in sent] == ["ngram", "value"]
    runs = unpack_keys(keys.numpy(), rows.specs)
    assert [(t, ids.tolist()) for t, ids in runs] == [("ngram", [1, 4095]), ("value", [5, 9])]
    hostile = [np.array([3, 2], dtype=np.int64),  # not sorted
               np.array([7 << KEY_BITS], dtype=np.int64),  # no such table
               np.array([4096], dtype=np.int64),  # beyond the table
               np.array([-1], dtype=np.int64)]
    for keys in hostile:
        assert unpack_keys(keys, rows.specs) is None
    # an owner refuses such a part before it touches its tables (service None: it is never reached)
    for keys in hostile:
        ex = Exchange(sent=[], send_counts=[0, 0], recv_counts=[0, len(keys)], views=["v", "v"], asked=keys,
                      grads=torch.zeros(len(keys), rows.dim))
        assert rows.apply(None, ex, step=1) == ([1, 0], {})
        assert not rows.serve(None, ex)[:, rows.dim].any()  # nothing served


# -- real ranks ---------------------------------------------------------------------------------

def test_rows_through_the_group_equal_http_and_gradients_land_exactly_once(tmp_path):
    """Three gloo ranks, each a full peer: rows pulled through all_to_all are bitwise the rows the
    same owners serve over HTTP, and every pushed gradient row is applied once on its primary and
    replayed once on its replica (update counters count exactly the ranks that pushed the row)."""
    r = subprocess.run([*torchrun(3), str(ROOT / "tests" / "group_worker.py"), str(tmp_path), "--backend", BACKEND,
                        "--device", DEVICE], cwd=ROOT,
                       capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(3)]
    for rep in reports:
        assert rep["settled"] and rep["warm_pushed"]
        assert rep["rows_equal_http"] and rep["rows_compared"] > 300 and rep["missing"] == 0
        assert rep["group_rows"]["rows_pulled"] == rep["rows_compared"] and rep["group_rows"]["rows_missed"] == 0
        after = rep["group_rows_after"]
        assert after["grads_sent"] > 300 and after["grads_applied"] > 300 and after["parts_refused"] == 0
        assert rep["push_failures"] == 0
        for t, u in rep["updates"].items():
            assert u["exact"], (rep["rank"], t, u)
    assert sum(r["group_rows"]["rows_served"] for r in reports) == sum(r["rows_compared"] for r in reports)


async def test_a_two_rank_group_and_a_plain_peer_train_together(spawn):
    """`torchrun --nproc-per-node 2 peer.py` plus one `peer.py --join` (through rank 1): everyone finishes, the
    held-out loss falls, the group sends one gradient payload per step (its leader's), and its two
    replicas stay bit-identical."""
    steps = "30"
    common = ("--steps", steps, "--eval-every", "10", "--min-peers", "2", "--linger", "30")
    port = free_port(2)  # rank r listens on port + r
    group = spawn(*common, "--port", str(port), "--backend", BACKEND, "--device", DEVICE, launcher=torchrun(2),
                  env={"OMP_NUM_THREADS": "1"})
    # through rank 1, which is not the group's gossiping rank: any member is a way in (started with
    # the group, it retries until rank 1 listens)
    plain = spawn(*common, "--device", "cpu", *join_at(port + 1))
    cp, sp = await plain.finish(240)
    assert cp == 0, failed(plain, group)
    cg, _ = await group.finish(120)
    assert cg == 0, group.stderr_tail()
    ranks = sorted(group.summaries(), key=lambda s: s["group"]["rank"])
    assert [s["group"]["rank"] for s in ranks] == [0, 1]
    for s in (*ranks, sp):
        assert s["steps"] == int(steps)
        hist = [v for _, v in s["val_history"]]
        assert [k for k, _ in s["val_history"]][-3:] == [10, 20, 30] and hist[-1] < hist[0], s["val_history"]
    leader, follower = ranks
    assert leader["bytes_sent"] > 0 and follower["bytes_sent"] == 0  # one payload per group on the wire
    assert leader["param_sketch"] == follower["param_sketch"]  # the same aggregate, the same bits
    assert leader["group"]["rows"]["grads_sent"] + follower["group"]["rows"]["grads_sent"] > 0
    assert leader["group"]["rows"]["rows_pulled"] + follower["group"]["rows"]["rows_pulled"] > 0
    assert leader["group"]["error"] is None and follower["group"]["error"] is None


async def step_of(port: int) -> int:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/api/status", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return (await r.json())["step"]


async def test_a_group_that_lost_rounds_resyncs_every_rank_and_ends_equal(spawn):
    """The whole group is stopped (SIGSTOP) while a plain peer, which started the swarm, trains on
    without it; once the group runs again its replicas differ from the plain peer's (the plain peer
    took rounds without the group's payload) or lag behind, so its leader re-syncs its state from
    the plain peer and hands it to its other rank, which drops its prefetched rows as the leader
    does: every replica ends bit-identical."""
    steps = "50"
    common = ("--steps", steps, "--min-peers", "2", "--linger", "30", "--round-timeout", "2", "--sketch-every", "5")
    plain_port = free_port()
    plain = spawn(*common, "--device", "cpu", "--port", str(plain_port))
    group = spawn(*common, "--backend", BACKEND, "--device", DEVICE, *join_at(plain_port),
                  launcher=torchrun(2), env={"OMP_NUM_THREADS": "1"})
    await plain.read_until(r"^step (1[0-9]|[2-9][0-9]) ", timeout=180)
    group.kill(signal.SIGSTOP)
    try:  # until the plain peer, alone, is more than RESYNC_LAG rounds ahead of the stopped group
        at = await step_of(plain_port)
        while await step_of(plain_port) < at + 12:
            await asyncio.sleep(0.2)
    finally:
        group.kill(signal.SIGCONT)
    cp, sp = await plain.finish(240)
    assert cp == 0, failed(plain, group)
    cg, _ = await group.finish(120)
    assert cg == 0, group.stderr_tail()
    leader, follower = sorted(group.summaries(), key=lambda s: s["group"]["rank"])
    assert sum(leader["resyncs"].values()) >= 1 and sp["resyncs"] == {}, (leader["resyncs"], sp["resyncs"])
    assert all(s["steps"] == int(steps) for s in (leader, follower, sp))
    assert leader["param_sketch"] == follower["param_sketch"] and same_model(leader, sp)
    assert leader["group"]["error"] is None and follower["group"]["error"] is None


def test_a_group_restarts_from_its_checkpoints(tmp_path):
    """Each rank checkpoints to DIR/rank<r> (the host's key is DIR/peer.key); started again on DIR, the
    group keeps its ids, resumes the leader's step and every rank gets its table slots back (the two
    hand each other their copies)."""
    def run(steps: int) -> list[dict]:
        r = subprocess.run([*torchrun(2), str(ROOT / "peer.py"), "--steps", str(steps), "--checkpoint", str(tmp_path),
                            "--table-rows", "4096", "--table-slots", "256", "--batch-size", "4", "--linger", "1",
                            "--threads", "1", "--backend", BACKEND, "--device", DEVICE],
                           cwd=ROOT, capture_output=True, text=True, timeout=200, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        return json_summaries(r.stdout.splitlines())

    first = run(4)
    # the host's key (shared by its ranks: their ids are "<its id>~<rank>") and a directory per rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer.key", "rank0", "rank1"]
    again = run(7)
    assert len(first) == len(again) == 2
    host = first[0]["peer_id"].split("~")[0]
    assert sorted(s["peer_id"] for s in first) == sorted(s["peer_id"] for s in again) == [f"{host}~0", f"{host}~1"]
    for s in again:
        assert s["steps"] == 7 and s["steps_contributed"] == 3  # resumed at step 4
        assert s["table_stats"]["slots_lost"] == 0, s["table_stats"]
    # whichever rank saw the other in its first map fetched the other's copies (rank 0 may have
    # started alone, on its own checkpoint's slots)
    assert sum(s["table_stats"]["slots_fetched"] for s in again) > 0
    assert again[0]["param_sketch"] == again[1]["param_sketch"]


async def test_killing_a_whole_host_group_loses_no_slot(spawn):
    """A host group is one failure domain, so its ranks never hold both copies of a slot while other
    hosts are members: SIGKILL the whole group mid-run and the two plain peers lose no slot.
    The kill can land while the group's payload of a round has reached one plain peer and not the
    other, which then differ (docs/design.md, "How the contributor set is agreed": the sketches
    repair it); they compare every 5 steps here, so they end equal (with the default 100 they
    compared only at step 10, and a full-suite run here once ended with their sketches apart)."""
    steps = "40"
    common = ("--steps", steps, "--min-peers", "2", "--linger", "5", "--sketch-every", "5")
    port = free_port()
    a = spawn(*common, "--port", str(port))
    group = spawn(*common, *join_at(port), "--backend", BACKEND, "--device", DEVICE,
                  launcher=torchrun(2), env={"OMP_NUM_THREADS": "1"})
    b = spawn(*common, *join_at(port))
    await a.read_until(r"^step (1[2-9]|[2-9]\d)\b", timeout=180)
    group.kill(signal.SIGKILL)  # torchrun and both ranks: the host is gone
    (ca, sa), (cb, sb) = await asyncio.gather(a.finish(180), b.finish(180))
    assert ca == 0 and cb == 0, (a.stderr_tail(), b.stderr_tail())
    for s in (sa, sb):
        assert s["steps"] == int(steps)
        # no slot lost all its owners: none restarted from zeros, none went on from a stale copy
        assert s["table_stats"]["slots_lost"] == 0 and s["table_stats"]["slots_kept"] == 0, s["table_stats"]
    assert sa["param_sketch"] == sb["param_sketch"]


async def test_a_group_trains_a_user_task_with_tables_of_two_widths(spawn):
    """A user task (tests/user_task.py: two sharded tables, 16 and 8 wide, and BatchNorm buffers) on a
    2-rank group plus one plain peer: one swarm, every replica bit-identical, the loss falls."""
    common = ("--task", "tests/user_task.py:two_tables", "--steps", "20", "--eval-every", "10", "--min-peers", "2",
              "--linger", "30", "--table-slots", "16")
    port = free_port(2)  # rank r listens on port + r
    group = spawn(*common, "--port", str(port), "--backend", BACKEND, "--device", DEVICE, launcher=torchrun(2),
                  env={"OMP_NUM_THREADS": "1"}, small=False)
    plain = spawn(*common, "--device", "cpu", *join_at(port), small=False)
    cp, sp = await plain.finish(240)
    assert cp == 0, failed(plain, group)
    cg, _ = await group.finish(120)
    assert cg == 0, group.stderr_tail()
    ranks = sorted(group.summaries(), key=lambda s: s["group"]["rank"])
    assert len(ranks) == 2
    for s in (*ranks, sp):
        assert s["steps"] == 20 and s["val_history"][-1][1] < s["val_history"][0][1], s["val_history"]
        assert same_model(s, sp)
    assert ranks[0]["param_sketch"] == ranks[1]["param_sketch"]  # the group's ranks: one device type
    assert sum(s["group"]["rows"]["rows_pulled"] for s in ranks) > 0
    assert sum(s["group"]["rows"]["grads_sent"] for s in ranks) > 0


async def test_a_group_waiting_for_min_peers_joins_the_plain_peer_that_trains_instead_of_splitting(spawn):
    """Issue 16's split: a 2-rank group started with --min-peers 3 (a group counts as one contributor)
    and a plain peer that joins it without the flag and starts training: the group joins that
    training instead of waiting, and all three end with one model."""
    port = free_port(2)  # rank r listens on port + r
    group = spawn("--steps", "20", "--min-peers", "3", "--linger", "30", "--port", str(port), "--backend", BACKEND,
                  "--device", DEVICE, launcher=torchrun(2), env={"OMP_NUM_THREADS": "1"})
    plain = spawn("--steps", "20", "--linger", "30", "--device", "cpu", *join_at(port))
    cp, sp = await plain.finish(240)
    assert cp == 0, failed(plain, group)
    cg, _ = await group.finish(120)
    assert cg == 0, group.stderr_tail()
    ranks = group.summaries()
    assert len(ranks) == 2
    for s in ranks:
        assert s["steps"] == 20 and same_model(s, sp)
    assert ranks[0]["param_sketch"] == ranks[1]["param_sketch"]
