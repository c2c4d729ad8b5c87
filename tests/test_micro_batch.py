"""Micro-batches (Task.micro_batch, --micro-batch): a batch taken in pieces gives the same gradient,
for the dense parameters and the pulled table rows, and a batch that cannot be cut says why."""

from __future__ import annotations

import collections

import pytest
import torch

from swarm.config import ConfigError, PeerConfig
from swarm.replica import Replica, split_batch
from swarm.task import TaskError, TaskTypeError
from swarm.tasks import default_task

from . import user_task
from .conftest import small_cfg

Pair = collections.namedtuple("Pair", "x y")


def test_a_batch_is_cut_along_its_tensors_first_dimension():
    x, y = torch.arange(20).reshape(10, 2), torch.arange(10)
    pieces = split_batch((x, y), 4)
    assert [n for _, n in pieces] == [4, 4, 2]
    assert torch.equal(torch.cat([p[0] for p, _ in pieces]), x) and torch.equal(torch.cat([p[1] for p, _ in pieces]), y)
    d = split_batch({"x": x, "scale": torch.tensor(2.0), "name": "b"}, 5)
    assert [n for _, n in d] == [5, 5] and all(p["name"] == "b" and p["scale"].item() == 2.0 for p, _ in d)
    nt = split_batch(Pair(x, y), 3)
    assert isinstance(nt[0][0], Pair) and [n for _, n in nt] == [3, 3, 3, 1]
    whole = (x, y)
    assert split_batch(whole, 10)[0][0] is whole and split_batch(whole, 64) == [(whole, 10)]
    with pytest.raises(TaskError, match=r"first dimensions \[3, 10\]"):
        split_batch((x, torch.zeros(3, 4)), 4)


def _grads(r: Replica, batch, want):
    rows = {t: torch.randn(len(ids), r.modules[t].embedding_dim, generator=torch.Generator().manual_seed(1)) * 0.1
            for t, ids in want.items()}
    stats, flat, row_grads = r.compute(batch, want, rows)
    return stats, flat, row_grads


@pytest.mark.parametrize("make", ["builtin", "user"])
def test_micro_batches_give_the_whole_batchs_gradient(make):
    if make == "builtin":
        task = default_task(small_cfg(batch_size=8))
    else:
        task = user_task.make_task()  # BatchNorm: in train mode each piece has its own batch statistics
    whole, cut = Replica(task, seed=0, micro_batch=0), Replica(task, seed=0, micro_batch=3)
    for r in (whole, cut):
        r.set_shard(0, 1, 0)
    batch, want = whole.sample()
    s1, g1, rows1 = _grads(whole, batch, want)
    s2, g2, rows2 = _grads(cut, batch, want)
    assert s1.samples == s2.samples == (8 if make == "builtin" else 32)
    if make == "builtin":  # a mean loss over samples: the same gradient up to rounding
        assert abs(s1.loss - s2.loss) < 1e-5
        assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-4) and not torch.equal(g1, torch.zeros_like(g1))
        for t in rows1:
            assert torch.allclose(rows1[t][1], rows2[t][1], atol=1e-7, rtol=1e-4)
    else:  # BatchNorm normalises each piece by its own statistics: close, not equal
        assert torch.isfinite(g2).all() and g2.norm() > 0
        assert torch.nn.functional.cosine_similarity(g1, g2, dim=0) > 0.9


def test_the_setting_and_the_task_field():
    assert default_task(small_cfg()).micro_batch == 4
    r = Replica(default_task(small_cfg()), seed=0)
    assert r.micro_batch == 4 and Replica(default_task(small_cfg()), seed=0, micro_batch=0).micro_batch == 0
    with pytest.raises(TaskTypeError, match="micro_batch"):
        user_task.make_task(micro_batch=-2)
    with pytest.raises(TaskTypeError, match="micro_batch"):
        user_task.make_task(micro_batch=True)
    with pytest.raises(ConfigError, match="--micro-batch"):
        PeerConfig(micro_batch=-5).validate()
    # a batch whose tensors do not share their first dimension: refused when the task is checked
    odd = user_task.make_task(loss=lambda m, b: user_task.loss(m, b[:2]),
                              batches=lambda shard: iter([(*user_task.make_batch(torch.Generator(), 8), torch.zeros(3))]),
                              micro_batch=4)
    with pytest.raises(TaskError, match="first dimensions"):
        Replica(odd).check()
    Replica(odd, micro_batch=0).check()  # whole batches: fine
