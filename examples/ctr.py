"""Click-through prediction with a sharded embedding table: plain PyTorch, no extra dependency.

Every sample has 8 categorical fields (a user's country, an ad's campaign, ...), each value hashed
into one shared table of ``rows`` embeddings: the table is sharded across the swarm, the MLP on top
is replicated. The data are generated (the same rule on every peer): each field value has a hidden
weight, and a sample is a click with probability sigmoid(sum of its fields' weights).

    python3 peer.py --task examples/ctr.py:task                       # first peer
    python3 peer.py --task examples/ctr.py:task --join HOST:PORT      # the others
    python3 peer.py --task examples/ctr.py:task --task-arg rows=1000000 --task-arg dim=32
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import swarm

FIELDS = 8
VALUES = 500  # distinct values per field


class CTRModel(nn.Module):
    def __init__(self, rows: int, dim: int, hidden: int):
        super().__init__()
        self.features = nn.ModuleDict({"emb": nn.Embedding(rows, dim)})  # sharded: tables={"features.emb": ...}
        self.features.emb.weight.data.mul_(0.05)
        self.mlp = nn.Sequential(nn.Linear(FIELDS * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.features.emb(ids).flatten(1)).squeeze(-1)


def hashed_ids(fields: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, FIELDS] field values -> [B, FIELDS] row ids of the shared table (one hash per field)."""
    salt = torch.arange(FIELDS, dtype=torch.int64) * 1_000_003
    return (fields * 2_654_435_761 + salt) % rows


def make_batch(g: torch.Generator, batch: int, rows: int, truth: torch.Tensor) -> dict[str, torch.Tensor]:
    # Zipf-like popularity: low values are drawn far more often, as in real categorical data
    u = torch.rand(batch, FIELDS, generator=g)
    fields = (VALUES ** u - 1).long().clamp_(max=VALUES - 1)
    logit = truth[torch.arange(FIELDS), fields].sum(-1)
    click = (torch.rand(batch, generator=g) < torch.sigmoid(logit)).float()
    return {"ids": hashed_ids(fields, rows), "click": click}


def task(rows: int = 65536, dim: int = 16, hidden: int = 64, batch_size: int = 128, lr: float = 1e-2,
         table_lr: float = 0.1, eval_size: int = 1024) -> swarm.Task:
    truth = torch.randn(FIELDS, VALUES, generator=torch.Generator().manual_seed(42)) * 1.2

    def batches(shard: swarm.Shard):
        g = torch.Generator().manual_seed(shard.seed * 1000 + shard.epoch)
        while True:
            yield make_batch(g, batch_size, rows, truth)

    def eval_batches():
        g = torch.Generator().manual_seed(7)  # the same held-out samples on every peer
        return [make_batch(g, 256, rows, truth) for _ in range(max(1, eval_size // 256))]

    return swarm.Task(
        name="ctr",
        model=lambda: CTRModel(rows, dim, hidden),
        batches=batches,
        loss=lambda model, b: F.binary_cross_entropy_with_logits(model(b["ids"]), b["click"]),
        eval_batches=eval_batches,
        tables={"features.emb": lambda b: b["ids"]},
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
        table_lr=table_lr,
    )
