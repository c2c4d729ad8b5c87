"""Evaluation pulls: held-out batches grouped so the rows they share are pulled once (swarm/evaluation.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from swarm import evaluation
from swarm.evaluation import group_batches, initial_rows, rows_for, union_ids
from swarm.node import Peer
from swarm.tables.ownership import slot_bounds

from .conftest import small_cfg, start_peers
from .test_tables_swarm import push_random, settled, until

pytestmark = pytest.mark.timeout(180)


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, np.int64)


def test_union_is_sorted_unique_per_table():
    u = union_ids([{"a": ids(1, 5), "b": ids(2)}, {"a": ids(0, 5, 9)}])
    assert np.array_equal(u["a"], ids(0, 1, 5, 9)) and np.array_equal(u["b"], ids(2))
    assert union_ids([]) == {}


def test_groups_are_consecutive_and_stay_under_the_cap():
    wants = [{"a": ids(0, 1, 2)}, {"a": ids(1, 2, 3)}, {"a": ids(10, 11)}, {"a": ids(3)}, {"a": ids(20, 21, 22, 23, 24)}]
    assert group_batches(wants, cap=100) == [[0, 1, 2, 3, 4]]
    # 0+1: 4 distinct rows; +2 would make 6
    assert group_batches(wants, cap=5) == [[0, 1], [2, 3], [4]]
    # a batch over the cap alone is still evaluated: a group of its own
    assert group_batches(wants, cap=2) == [[0], [1], [2], [3], [4]]
    assert group_batches([], cap=5) == []
    # rows of different tables count together
    assert group_batches([{"a": ids(0), "b": ids(0)}, {"a": ids(0), "b": ids(1)}], cap=2) == [[0], [1]]
    with pytest.raises(ValueError):
        group_batches(wants, cap=0)


def test_a_batch_reads_its_rows_out_of_the_group_pull():
    union = {"a": ids(0, 3, 7, 9), "b": ids(4)}
    rows = {"a": torch.arange(4.0).unsqueeze(1).repeat(1, 2), "b": torch.full((1, 2), 8.0)}
    got = rows_for({"a": ids(3, 9), "b": ids(4)}, union, rows)
    assert torch.equal(got["a"], torch.tensor([[1.0, 1.0], [3.0, 3.0]]))
    assert torch.equal(got["b"], torch.full((1, 2), 8.0))
    assert rows_for({"a": ids()}, union, rows)["a"].shape == (0, 2)
    for missing in (ids(3, 4), ids(10)):  # not in the union: refused, never a wrong row
        with pytest.raises(ValueError):
            rows_for({"a": missing}, union, rows)


async def test_grouped_evaluation_equals_pulling_each_batch_alone(monkeypatch):
    peers = await start_peers(2, eval_batches=4)
    try:
        await until(lambda: settled(peers), what="a shared view")
        rng = np.random.default_rng(3)
        for i, p in enumerate(peers):  # rows that differ from their init, at both owners
            await push_random(p, rng, key=f"{p.id}:{i}", n=2000)
        await peers[0].table_client.batcher.settled()
        await peers[1].table_client.batcher.settled()
        a = peers[0]
        dtype = a.cfg.eval_pull_dtype()

        def moved() -> int:
            return a.table_client.stats.rows_pulled_remote + a.table_client.stats.rows_read_local

        start, alone = moved(), []
        for batch in a.replica.val:
            want = a.replica.rows_of(batch)
            rows, missing = await a.table_client.pull(want, dtype=dtype)
            assert not any(len(v) for v in missing.values())
            alone.append(a.replica.eval_loss(batch, want, rows))
        per_batch = moved() - start
        grouped = await a.evaluate()
        assert grouped == pytest.approx(sum(alone) / len(alone), abs=1e-6)
        # the held-out batches share rows: one pull for all of them moves fewer rows
        assert 0 < moved() - start - per_batch < per_batch
        # a cap below the batches' distinct rows splits the pulls; the loss is the same
        monkeypatch.setattr(evaluation, "EVAL_PULL_ROWS", 1)
        assert await a.evaluate() == pytest.approx(grouped, abs=1e-6)
    finally:
        for p in peers:
            await p.close()


def drawn(p, union: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """``union``'s initial rows, drawn as the peer's step-0 evaluation draws them."""
    specs = {s.name: s for s in p.replica.table_specs}
    return initial_rows(union, {t: slot_bounds(specs[t].rows, p.cfg.table_slots) for t in union},
                        {t: specs[t].dim for t in union}, p.replica.table_inits)


def test_initial_rows_are_drawn_per_slot_and_checked():
    calls = []

    def init(lo: int, hi: int) -> torch.Tensor:
        calls.append((lo, hi))
        return torch.arange(lo, hi, dtype=torch.float32).unsqueeze(1).repeat(1, 3)

    b = slot_bounds(10, 4)
    assert b.tolist() == [0, 2, 5, 7, 10] and slot_bounds(3, 8).tolist() == [0, 1, 2, 3]
    union = {"t": ids(1, 3, 4, 9), "z": ids(0, 7)}
    rows = initial_rows(union, {"t": b, "z": b}, {"t": 3, "z": 2}, {"t": init, "z": None})
    assert rows["t"][:, 0].tolist() == [1, 3, 4, 9] and rows["t"].shape == (4, 3)
    assert sorted(calls) == [(0, 2), (2, 5), (7, 10)]  # each touched slot drawn once, whole
    assert not rows["z"].any() and rows["z"].shape == (2, 2)  # no init: zeros, as a fresh shard's
    with pytest.raises(ValueError, match="outside"):
        initial_rows({"t": ids(10)}, {"t": b}, {"t": 3}, {"t": init})
    with pytest.raises(ValueError, match="shape"):
        initial_rows({"t": ids(1)}, {"t": b}, {"t": 2}, {"t": init})
    with pytest.raises(ValueError):
        slot_bounds(0, 4)


async def test_the_evaluation_before_round_0_draws_the_initial_rows_and_pulls_nothing():
    peers = await start_peers(2, eval_batches=4)
    try:
        await until(lambda: settled(peers), what="a shared view")
        a = peers[0]
        union = union_ids([a.replica.rows_of(batch) for batch in a.replica.val])
        pulled, missing = await a.table_client.pull(union, dtype="fp32")
        assert not any(len(v) for v in missing.values())
        mine = drawn(a, union)
        for t in union:  # what the owners hold before any push, bit for bit
            assert torch.equal(mine[t], pulled[t]), t

        def moved() -> int:
            return a.table_client.stats.rows_pulled_remote + a.table_client.stats.rows_read_local

        start = moved()
        first = await a.evaluate(initial=True)
        assert moved() == start  # nothing pulled
        assert first == pytest.approx(await a.evaluate(), abs=2e-3)  # pulled: int8 from remote owners
        rng = np.random.default_rng(5)
        for i, p in enumerate(peers):
            await push_random(p, rng, key=f"{p.id}:{i}", n=2000)
        for p in peers:
            await p.table_client.batcher.settled()
        assert await a.evaluate(initial=True) == first  # the owners' rows moved, the initial model did not
        assert abs(await a.evaluate() - first) > 1e-4
    finally:
        for p in peers:
            await p.close()


async def test_every_peer_starts_its_val_curve_at_the_same_point_though_one_evaluates_late(monkeypatch):
    # a peer whose step-0 evaluation comes after the others' first row pushes landed read rows they
    # had stepped, while it pulled them: the peers' first val points differed
    cfg = dict(steps=4, min_peers=2, eval_every=2, eval_batches=2)
    a = Peer(small_cfg(**cfg), out=lambda line: None)
    await a.start()
    b = Peer(small_cfg(join=f"127.0.0.1:{a.port}", **cfg), out=lambda line: None)
    await b.start()
    first_b = b.evaluate_first

    async def late() -> None:
        await asyncio.sleep(1.5)  # a has computed step 0 and its row pushes were applied
        await first_b()

    monkeypatch.setattr(b, "evaluate_first", late)
    try:
        ra, rb = await asyncio.wait_for(asyncio.gather(a.run(), b.run()), 120)
    finally:
        await a.close()
        await b.close()
    assert ra["rows"]["pushes_sent"] > 0
    assert ra["val_history"][0][0] == rb["val_history"][0][0] == 0
    assert ra["val_history"][0][1] == rb["val_history"][0][1]  # bit for bit: the same initial model
    assert ra["val_history"][-1][1] < ra["val_history"][0][1]


async def test_a_peer_says_how_long_its_evaluations_took():
    """With --eval-every the progress lines end `eval_time Xs` (the evaluations so far) and the
    summary has `eval_seconds`: a benchmark takes them off the training's time (bench/wan.py)."""
    lines: list[str] = []
    p = Peer(small_cfg(steps=4, min_peers=1, eval_every=2, eval_batches=2, progress_interval=0), out=lines.append)
    await p.start()
    try:
        summary = await asyncio.wait_for(p.run(), 120)
    finally:
        await p.close()
    progress = [line for line in lines if line.startswith("step ")]
    times = [float(line.rsplit(" eval_time ", 1)[1].rstrip("s")) for line in progress]
    assert progress and len(times) == len(progress)
    assert times == sorted(times) and times[-1] > 0  # the first evaluation came before step 1
    assert len(summary["val_history"]) == 3 and summary["eval_seconds"] >= times[-1]
