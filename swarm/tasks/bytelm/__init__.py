"""The built-in default task: a byte-level transformer LM with two hashed, sharded tables.

``task(**args)`` is what ``peer.py`` trains without ``--task``; its size is its task args
(``--task-arg d_model=512``), and the built-in flags (``--batch-size``, ``--lr``, ``--data``,
``--table-rows``, ``--eval-batches``) map onto the others. docs/model.md lists the sizes.
"""
from __future__ import annotations

import math

import torch

from ... import optim
from ...task import Shard, Task
from .corpus import BatchSampler, load_corpus, val_batches
from .model import TABLES, ModelConfig, SwarmLM, table_ids

__all__ = ["task", "ModelConfig", "SwarmLM", "TABLES", "dense_params", "lr_at"]

WARMUP = 20  # steps of linear learning-rate warm-up


def lr_at(step: int, lr: float, steps: int) -> float:
    """Linear warm-up over 20 steps, then cosine to 10% at ``steps`` (constant when unbounded)."""
    if step < WARMUP:
        return lr * (step + 1) / WARMUP
    if steps <= WARMUP:
        return lr
    t = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def dense_params(d_model: int = 128, layers: int = 2, context: int = 128, vocab: int = 256) -> int:
    """Dense (replicated) parameters of the model at this size: what a swarm's gradients cover."""
    per_layer = 2 * 2 * d_model + 3 * d_model * d_model + d_model * d_model + 2 * 4 * d_model * d_model
    return vocab * d_model + context * d_model + layers * per_layer + 2 * d_model + d_model * vocab


def task(d_model: int = 128, layers: int = 2, heads: int = 4, context: int = 128, table_rows: int = 65536,
         batch_size: int = 16, lr: float = 3e-3, data: str = "", steps: int = 0, eval_batches: int = 8) -> Task:
    """The byte LM at this size. ``batch_size`` sequences of ``context`` bytes per step, Adam
    (betas 0.9, 0.95) at peak ``lr`` with warm-up and a cosine to 10% at ``steps`` (0: constant
    after warm-up), ``eval_batches`` held-out batches; ``data``: text files instead of the stdlib."""
    for what, v, lo in (("d_model", d_model, 8), ("layers", layers, 1), ("heads", heads, 1), ("context", context, 8),
                        ("table_rows", table_rows, 1024), ("batch_size", batch_size, 1), ("eval_batches", eval_batches, 1)):
        if v < lo:
            raise ValueError(f"built-in task: {what} must be >= {lo}, got {v}")
    if d_model % heads:
        raise ValueError(f"built-in task: d_model={d_model} is not divisible by heads={heads}")
    if not 0 < lr < 1:
        raise ValueError(f"built-in task: lr must be in (0, 1), got {lr}")
    corpus = load_corpus(data or None)
    cfg = ModelConfig(d_model=d_model, n_layers=layers, n_heads=heads, context=context, ngram_rows=table_rows,
                      value_rows=table_rows, local_tables=False)

    def model() -> SwarmLM:
        # called under the swarm seed (swarm/replica.py): the init draws from it, as SwarmLM's own
        # generator, so every peer builds the same replica
        return SwarmLM(ModelConfig(**{**vars(cfg), "seed": torch.initial_seed()}))

    def batches(shard: Shard) -> BatchSampler:
        return BatchSampler(corpus, batch_size, context, seed=shard.seed, shard=(shard.index, shard.count),
                            prefix=cfg.prefix)

    def ids(name: str):
        return lambda batch: table_ids(cfg, batch[:, :-1])[name]

    return Task(
        name="bytelm",
        version="1",
        model=model,
        batches=batches,
        loss=lambda m, batch: m.loss(batch),
        eval_batches=lambda: val_batches(corpus, batch_size, context, max_batches=eval_batches, prefix=cfg.prefix),
        tables={name: ids(name) for name in TABLES},
        optimizer=lambda params: optim.Adam(params, lr=lr, betas=(0.9, 0.95), eps=1e-8),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, lr, steps) / lr),
        table_lr=3e-2,
        # 4 sequences per forward/backward: a step's activations are a quarter of the batch's (at
        # batch 16, ~25 MB less peak memory per peer, measured with bench/memory.py) for no time
        micro_batch=4,
        data_id=f"{corpus.name}:{corpus.hash}",
        tokens_per_sample=context,
    )
