"""Evaluation pulls: held-out batches grouped so the rows they share are pulled once (swarm/evaluation.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm import evaluation
from swarm.evaluation import group_batches, rows_for, union_ids

from .conftest import start_peers
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
