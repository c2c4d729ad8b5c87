#!/usr/bin/env python3
"""One rank of the torch DDP (gloo) baseline for bench/wan.py: the swarm's model, data and optimizer
settings, trained with synchronous data parallelism instead of gossip.

  --tables dense   SwarmLM with local tables; DDP all-reduces every gradient, tables included
                   (8.4M fp32 table entries at --table-rows 32768); Adam on everything.
  --tables sparse  the same model with the two tables as nn.Embedding(sparse=True): DDP all-gathers
                   sparse row gradients (gloo); SparseAdam for the tables, Adam for the rest.

Same as a swarm peer on the built-in task (swarm/tasks/bytelm): per-rank batch --batch-size, BatchSampler shard
(rank, world) seeded the way a peer seeds its shard from its id (here the stand-in "p<rank>"; a swarm
peer's id comes from its key, so its shards are other, equally random ones), Adam(betas=(0.9, 0.95),
eps=1e-8) at --lr with the peer's warm-up + cosine schedule (bytelm.lr_at), table lr --table-lr with Adam's default betas (the
swarm's row-wise Adam), final val_loss over val_batches(corpus, batch, 128, 8) on every rank.

Prints one JSON line per step ({"step", "t", "loss", "compute_s", "comm_s"}; step = steps done,
loss = this rank's training loss of that step, t = time.time() at the end of the step) and, as its
LAST line, a JSON summary. ``comm_s`` is the time spent waiting on the network: the time of
forward + backward (DDP overlaps its bucketed all-reduce with backward and waits for the last one at
the end of backward) beyond the same on 3 calibration batches run under ``ddp.no_sync()`` (no
communication) before the timed loop.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from swarm.allocator import keep_freed_memory  # noqa: E402
from swarm.config import PeerConfig  # noqa: E402
from swarm.tasks.bytelm import lr_at  # noqa: E402  (the built-in task's schedule, re-exported for the Hivemind baseline)
from swarm.tasks.bytelm.corpus import BatchSampler, load_corpus, val_batches  # noqa: E402
from swarm.tasks.bytelm.model import TABLES, ModelConfig, SwarmLM  # noqa: E402


class SparseTableLM(SwarmLM):
    """SwarmLM whose local tables are nn.Embedding(sparse=True) and are looked up through the module,
    so their gradients are sparse COO tensors (rows touched by the batch only)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        for name in TABLES:
            old = getattr(self, name)
            new = nn.Embedding(old.num_embeddings, old.embedding_dim, sparse=True)
            with torch.no_grad():
                new.weight.zero_()  # SwarmLM tables start at zero
            setattr(self, name, new)


# the table learning rate of a swarm peer on the built-in task: --table-lr, whose default 0 means the
# task's own (swarm/tasks/bytelm: table_lr=3e-2); the baselines need the number itself
TABLE_LR = PeerConfig.table_lr or 3e-2


def peer_seed(seed: int, peer_id: str) -> int:
    """The data seed a swarm peer with this id uses (swarm.node.Peer._shard)."""
    return (seed * 7919 + int.from_bytes(peer_id.encode()[:8], "little")) % (1 << 32)


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The flags every baseline shares with a swarm peer, with the peer's defaults: batch, table
    rows, learning rates, seed, peer id (its data seed), held-out batches, threads."""
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--table-rows", type=int, default=32768)
    ap.add_argument("--lr", type=float, default=PeerConfig.lr)
    ap.add_argument("--table-lr", type=float, default=TABLE_LR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-id", default="")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model size flags (the built-in task's --task-arg d_model/layers/heads/context of peer.py)."""
    ap.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    ap.add_argument("--layers", type=int, default=ModelConfig.n_layers)
    ap.add_argument("--heads", type=int, default=ModelConfig.n_heads)
    ap.add_argument("--context", type=int, default=ModelConfig.context)


def model_config(args) -> ModelConfig:
    """The model a swarm peer of the same size builds, with its tables local (dense parameters)."""
    return ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, context=args.context,
                       ngram_rows=args.table_rows, value_rows=args.table_rows, seed=args.seed, local_tables=True)


def main() -> None:
    ap = argparse.ArgumentParser(description="one rank of the DDP-gloo baseline of bench/wan.py")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="host:port of rank 0's rendezvous store")
    ap.add_argument("--tables", choices=["dense", "sparse"], default="dense")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--compute-speed", type=float, default=1.0,
                    help="compute at this fraction of this rank's speed, as peer.py's flag: after each step's "
                         "forward/backward, repeat it outside DDP (no communication, gradients discarded) for "
                         "(1/F - 1) x the calibrated forward/backward time (bench/wan.py --slow-peer)")
    add_run_args(ap)
    add_model_args(ap)
    args = ap.parse_args()
    if not 0 < args.compute_speed <= 1:
        ap.error(f"--compute-speed must be in (0, 1], got {args.compute_speed}")
    keep_freed_memory()  # as peer.py does: the same allocator behaviour on both sides of the comparison
    torch.set_num_threads(args.threads)

    corpus = load_corpus()
    cfg = model_config(args)
    model = SparseTableLM(cfg) if args.tables == "sparse" else SwarmLM(cfg)
    sampler = BatchSampler(corpus, args.batch_size, cfg.context,
                           seed=peer_seed(args.seed, args.peer_id or f"p{args.rank}"),
                           shard=(args.rank, args.world), prefix=cfg.prefix)
    val = val_batches(corpus, args.batch_size, cfg.context, max_batches=args.eval_batches, prefix=cfg.prefix)

    host, port = args.master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=600))
    # bucket_cap_mb default (25): DDP overlaps each bucket's all-reduce with the rest of backward
    ddp = DDP(model)
    table_params = [getattr(model, n).weight for n in TABLES]
    table_ids = {id(p) for p in table_params}
    dense_params = [p for p in model.parameters() if id(p) not in table_ids]
    opt = torch.optim.Adam(dense_params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if args.tables == "sparse":
        topt = torch.optim.SparseAdam(table_params, lr=args.table_lr, betas=(0.9, 0.999), eps=1e-8)
    else:
        topt = torch.optim.Adam(table_params, lr=args.table_lr, betas=(0.9, 0.999), eps=1e-8)

    # Local compute of forward + backward, with DDP's communication off (no_sync), on a few batches
    # that are then thrown away: the network wait of a real step is its fwd+bwd time beyond this.
    calib, calib_sampler = [], BatchSampler(corpus, args.batch_size, cfg.context, seed=987654321,
                                            shard=(args.rank, args.world), prefix=cfg.prefix)
    for _ in range(3):
        b = calib_sampler.next()
        t0 = time.perf_counter()
        with ddp.no_sync():
            _ddp_loss(ddp, b).backward()
        calib.append(time.perf_counter() - t0)
    opt.zero_grad(set_to_none=True)
    topt.zero_grad(set_to_none=True)
    local_fwd_bwd = sorted(calib)[1]
    dist.barrier()
    sent0 = time.time()
    compute_total = comm_total = 0.0
    for step in range(args.steps):
        batch = sampler.next()
        t0 = time.perf_counter()
        loss = _ddp_loss(ddp, batch)
        loss.backward()  # DDP's hooks all-reduce bucket by bucket during backward and wait at its end
        t1 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.lr, args.steps)
        opt.step()
        topt.step()
        opt.zero_grad(set_to_none=True)
        topt.zero_grad(set_to_none=True)
        if args.compute_speed < 1:
            _rehearse(model, batch, time.perf_counter() + local_fwd_bwd * (1 / args.compute_speed - 1))
        t2 = time.perf_counter()
        comm = max(0.0, (t1 - t0) - local_fwd_bwd)
        compute = (t2 - t0) - comm
        compute_total += compute
        comm_total += comm
        print(json.dumps({"step": step + 1, "t": time.time(), "loss": float(loss.detach()),
                          "compute_s": round(compute, 4), "comm_s": round(comm, 4)}), flush=True)
    train_seconds = time.time() - sent0

    model.eval()
    with torch.no_grad():
        losses = [float(model.loss(b)) for b in val]
    val_loss = sum(losses) / len(losses)
    dist.barrier()
    dist.destroy_process_group()
    n_dense = sum(p.numel() for p in dense_params)
    n_table = sum(p.numel() for p in table_params)
    print(json.dumps({"rank": args.rank, "tables": args.tables, "steps": args.steps, "val_loss": val_loss,
                      "train_seconds": round(train_seconds, 3), "compute_s": round(compute_total, 3), "local_fwd_bwd_s": round(local_fwd_bwd, 4),
                      "comm_s": round(comm_total, 3), "dense_params": n_dense, "table_params": n_table}), flush=True)


def _rehearse(model: nn.Module, batch: torch.Tensor, until: float) -> None:
    """--compute-speed: forward/backward of `batch` through the bare module (not DDP: no hooks, no
    communication) until about `until`, the gradients returned and dropped (nothing accumulates).
    A pass starts only while more than half a pass is left (a plain `while now < until` overshoots
    by up to a whole pass: F = 0.5 then took ~2.8x, not 2x, the step's time)."""
    params = [p for p in model.parameters() if p.requires_grad]
    t, last = time.perf_counter(), 0.0
    while t + last / 2 < until:
        torch.autograd.grad(model.loss(batch), params, allow_unused=True)
        t, last = time.perf_counter(), time.perf_counter() - t


def _ddp_loss(ddp: DDP, batch: torch.Tensor) -> torch.Tensor:
    """SwarmLM.loss through DDP's forward (so that DDP prepares its reducer for this iteration)."""
    P = ddp.module.cfg.prefix
    ctx, x, y = batch[:, :P], batch[:, P:-1], batch[:, P + 1:]
    logits = ddp(x, ctx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


if __name__ == "__main__":
    main()
