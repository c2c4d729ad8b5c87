"""A user task as a test would write one: a sharded nn.Embedding under a nested path, BatchNorm
(buffers), a replicated head, an optimizer and a scheduler of its own, generated data.

Each sample is 6 token ids out of ROWS; every id has a hidden class bit, and the label is whether
most of a sample's ids have the bit set: the model must learn the bits into the sharded rows.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import swarm

ROWS, DIM, WIDTH = 600, 16, 6


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleDict({"tok": nn.Embedding(ROWS, DIM)})  # sharded: "encoder.tok"
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder["tok"](ids).mean(1)))


BITS = torch.randint(0, 2, (ROWS,), generator=torch.Generator().manual_seed(5))


def make_batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, ROWS, (n, WIDTH), generator=g)
    return ids, (BITS[ids].sum(1) * 2 > WIDTH).long()


def batches(shard: swarm.Shard, size: int = 32):
    g = torch.Generator().manual_seed(shard.seed + 1000 * shard.epoch)
    for _ in range(50):  # finite: the replica starts the next epoch
        yield make_batch(g, size)


def eval_batches():
    g = torch.Generator().manual_seed(99)
    return [make_batch(g, 128) for _ in range(2)]


def loss(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(ids), labels)


def make_task(**overrides) -> swarm.Task:
    fields = dict(name="test-classifier", model=Classifier, batches=batches, loss=loss, eval_batches=eval_batches,
                  tables={"encoder.tok": lambda b: b[0]},
                  optimizer=lambda params: torch.optim.AdamW(params, lr=3e-2),
                  scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9),
                  table_lr=0.1)
    return swarm.Task(**{**fields, **overrides})


task = make_task()


def sized(version: str = "1", lr: float = 3e-2, norm: bool = True) -> swarm.Task:
    """For --task-arg tests: a callable task whose args are converted to these types."""
    assert isinstance(lr, float) and isinstance(norm, bool)
    return make_task(version=version, optimizer=lambda params: torch.optim.AdamW(params, lr=lr))


class TwoTables(Classifier):
    """Two sharded tables of different widths (a host group moves both in one exchange)."""

    def __init__(self):
        super().__init__()
        self.side = nn.Embedding(300, 8)
        self.norm = nn.BatchNorm1d(DIM + 8)
        self.head = nn.Linear(DIM + 8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.encoder["tok"](ids).mean(1), self.side(ids % 300).mean(1)], dim=1)
        return self.head(self.norm(h))


def two_tables() -> swarm.Task:
    return make_task(name="test-two-tables", model=TwoTables,
                     tables={"encoder.tok": lambda b: b[0], "side": lambda b: b[0] % 300})
