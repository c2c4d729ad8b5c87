#!/usr/bin/env python3
"""One peer of the Hivemind baseline for bench/wan.py: the swarm's model, data and optimizer settings,
trained with `hivemind.Optimizer` (the `hivemind` package, optional: `pip install -e '.[hivemind]'`).

The model is the one of `bench/ddp_baseline.py --tables dense`: SwarmLM with local tables, every
parameter dense (8.4M fp32 table entries at --table-rows 32768). Same per-peer batch --batch-size,
BatchSampler shard (index, peers) seeded like a swarm peer with the stand-in id "p<index>", Adam(betas=(0.9, 0.95),
eps=1e-8) at --lr with the peer's warm-up + cosine schedule for the dense parameters, Adam at --table-lr
with the default betas for the tables, final val_loss over val_batches(corpus, batch, 128, 8).

Hivemind in its standard synchronous form: gradients accumulate locally until the peers together
have --target-batch-size samples (default: --batch-size x --peers, the global batch of one DDP step:
ideally one collaborative epoch per step of every peer), then they are averaged by all-reduce in a
group found through the DHT, and every peer runs the same optimizer step (offloaded optimizer);
parameters are also averaged every --average-state-every epochs (hivemind's default 1). The learning
rate follows hivemind's epoch (schedule position = epoch, as hivemind requires). Hivemind's progress
tracker sees the other peers' samples with a delay, so in practice an epoch takes a few local steps
of each peer (on the 10 MB/s links of bench/wan.py about 3): the summary reports the final epoch.

A step here = one local batch (forward, backward, `opt.step()`), so the sample budget is the same as
the other methods'. Prints, on stdout:
  `hivemind listening on MADDR [MADDR ...]`   once the DHT is up (peers join with --initial-peer MADDR)
  `hivemind ready N peers`                     once the N peers see each other; the timed loop starts
  one JSON line per step {"step", "t", "loss", "epoch", "compute_s", "comm_s"}: t = time.time() at the
      end of the step, epoch = hivemind's local epoch after it, compute_s = forward + backward,
      comm_s = time inside `opt.step()` (waiting for the group and the all-reduce, plus the optimizer
      update at an epoch's end)
  a JSON summary line (the last one; printed before the shutdown) with val_loss, the final epoch and how many gradient rounds were
  averaged with other peers (`collaborative_epochs`) or fell back to local gradients (`local_epochs`).
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from ddp_baseline import add_model_args, add_run_args, lr_at, model_config, peer_seed  # noqa: E402
from swarm.allocator import keep_freed_memory  # noqa: E402
from swarm.tasks.bytelm.corpus import BatchSampler, load_corpus, val_batches  # noqa: E402
from swarm.tasks.bytelm.model import TABLES, SwarmLM  # noqa: E402

_AVERAGED = re.compile(r"Averaged gradients with (\d+) peers")
_LOCAL = ("Proceeding with local gradients", "Skipped averaging", "Averaging gradients failed")


class RoundCounter(logging.Handler):
    """Counts hivemind.Optimizer's own reports of each gradient round (logged when verbose=True)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.group_sizes: list[int] = []  # one per round averaged with a group (size includes us)
        self.local = 0  # rounds that ended with local gradients only
        self.failed = 0  # of which: averaging started but failed
        self.out_of_sync = 0  # times this peer found itself behind and downloaded the state from a peer

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        m = _AVERAGED.search(msg)
        if m:
            self.group_sizes.append(int(m.group(1)))
        elif msg.startswith(_LOCAL[0]):
            self.local += 1
        elif msg.startswith(_LOCAL[2]):
            self.failed += 1
        elif msg.startswith("Peer is out of sync"):
            self.out_of_sync += 1


def wait_for_peers(dht, opt, key: str, index: int, n: int, timeout: float, lead: float = 2.0) -> int:
    """A start barrier through the DHT, so that hivemind's first epochs are collaborative:

    1. announce this peer under `key` and wait until `n` peers have;
    2. prime hivemind's progress tracker: a peer publishes its progress only once it has accumulated
       samples, and a tracker that sees no peers estimates the next epoch as due at once, so each peer's
       first steps would each end an epoch alone ("Proceeding with local gradients"), putting it
       epochs ahead; the others then find themselves out of sync and download the whole state from
       it. So every peer reports 1 sample (not counted towards the epoch) until its tracker sees all
       `n`, then 0 again;
    3. peer 0 publishes a start time `lead` s ahead and every peer sleeps until it: all start together.
    Returns how many peers the tracker saw."""
    from hivemind.utils import get_dht_time

    deadline, seen, stored = time.time() + timeout, 0, 0.0
    while True:
        if time.time() - stored > 5:
            dht.store(key, subkey=index, value=True, expiration_time=get_dht_time() + timeout + 60)
            stored = time.time()
        found = dht.get(key, latest=True)
        seen = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if seen >= n or time.time() > deadline:
            break
        time.sleep(0.2)
    opt.tracker.report_local_progress(opt.local_epoch, 1, update_global_samples=False)
    while opt.tracker.global_progress.num_peers < n and time.time() < deadline:
        time.sleep(0.1)
    seen = opt.tracker.global_progress.num_peers
    opt.tracker.report_local_progress(opt.local_epoch, 0, update_global_samples=False)
    if index == 0:
        dht.store(f"{key}_start", value=get_dht_time() + lead, expiration_time=get_dht_time() + timeout + 60)
    while time.time() < deadline + lead:
        found = dht.get(f"{key}_start", latest=True)
        if found is not None:
            time.sleep(max(0.0, found.value - get_dht_time()))
            break
        time.sleep(0.1)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description="one peer of the Hivemind baseline of bench/wan.py")
    ap.add_argument("--index", type=int, required=True, help="this peer's index (data shard), 0..peers-1")
    ap.add_argument("--peers", type=int, required=True, help="number of peers (target batch, data shards)")
    ap.add_argument("--host", default="127.0.0.1", help="IPv4 address the DHT listens on")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--initial-peer", action="append", default=[], help="multiaddr of a running peer (repeatable)")
    ap.add_argument("--run-id", default="swarm_wan_hivemind")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--target-batch-size", type=int, default=None, help="default: batch size x peers")
    add_run_args(ap)
    ap.add_argument("--matchmaking-time", type=float, default=3.0,
                    help="seconds to gather a group (hivemind: 3-5 s for small local runs, 10-15 s over the "
                         "internet); a round not pre-scheduled starts its all-reduce only this long after "
                         "the epoch is due, so it adds to the step time")
    ap.add_argument("--target-group-size", type=int, default=None,
                    help="close the group once this many peers joined (default: --peers; 0 = hivemind's "
                         "default, no limit)")
    ap.add_argument("--averaging-timeout", type=float, default=60.0,
                    help="give up an averaging round after this long (hivemind: ~2x the all-reduce time)")
    ap.add_argument("--average-state-every", type=int, default=1, help="average parameters every this many epochs")
    ap.add_argument("--compression", choices=["none", "fp16"], default="none",
                    help="wire format of averaged gradients and parameters (none = fp32, like DDP)")
    ap.add_argument("--join-timeout", type=float, default=120.0, help="seconds to wait for all peers to appear")
    add_model_args(ap)
    args = ap.parse_args()
    keep_freed_memory()  # as peer.py does: the same allocator behaviour on both sides of the comparison
    torch.set_num_threads(args.threads)

    import hivemind  # noqa: E402  (optional dependency: imported only here)
    from hivemind.compression import Float16Compression, NoCompression

    counter = RoundCounter()
    logging.getLogger("hivemind.optim.optimizer").addHandler(counter)

    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
                       initial_peers=args.initial_peer or None)
    print("hivemind listening on " + " ".join(str(a) for a in dht.get_visible_maddrs()), flush=True)

    corpus = load_corpus()
    cfg = model_config(args)
    model = SwarmLM(cfg)
    sampler = BatchSampler(corpus, args.batch_size, cfg.context,
                           seed=peer_seed(args.seed, args.peer_id or f"p{args.index}"),
                           shard=(args.index, args.peers), prefix=cfg.prefix)
    val = val_batches(corpus, args.batch_size, cfg.context, max_batches=args.eval_batches, prefix=cfg.prefix)

    table_params = [getattr(model, n).weight for n in TABLES]
    table_ids = {id(p) for p in table_params}
    dense_params = [p for p in model.parameters() if id(p) not in table_ids]
    groups = [{"params": dense_params, "lr": args.lr, "betas": (0.9, 0.95)},
              {"params": table_params, "lr": args.table_lr, "betas": (0.9, 0.999)}]
    lr, steps = args.lr, args.steps
    group = args.peers if args.target_group_size is None else args.target_group_size
    comp = Float16Compression() if args.compression == "fp16" else NoCompression()
    opt = hivemind.Optimizer(
        dht=dht, run_id=args.run_id,
        target_batch_size=args.target_batch_size or args.batch_size * args.peers,
        batch_size_per_step=args.batch_size,
        params=groups, optimizer=lambda p: torch.optim.Adam(p, eps=1e-8),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, [lambda epoch: lr_at(epoch, lr, steps) / lr, lambda epoch: 1.0]),
        matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        average_state_every=args.average_state_every,
        averager_opts={"target_group_size": group or None},
        grad_compression=comp, state_averaging_compression=comp,
        verbose=True,  # INFO logs (to stderr) of every round, counted by RoundCounter
    )

    # like DDP's process group and the swarm's --min-peers: start once every peer is there
    seen = wait_for_peers(dht, opt, f"{args.run_id}_ready", args.index, args.peers, args.join_timeout)
    print(f"hivemind ready {seen} peers", flush=True)

    compute_total = comm_total = 0.0
    t_start = time.time()
    for step in range(args.steps):
        batch = sampler.next()
        t0 = time.perf_counter()
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        compute_total += t1 - t0
        comm_total += t2 - t1
        print(json.dumps({"step": step + 1, "t": time.time(), "loss": float(loss.detach()),
                          "epoch": opt.local_epoch, "compute_s": round(t1 - t0, 4),
                          "comm_s": round(t2 - t1, 4)}), flush=True)
    train_seconds = time.time() - t_start

    model.eval()
    with torch.no_grad():
        losses = [float(model.loss(b)) for b in val]
    val_loss = sum(losses) / len(losses)
    sizes = counter.group_sizes
    summary = {"index": args.index, "steps": args.steps, "val_loss": val_loss, "epoch": opt.local_epoch,
               "collaborative_epochs": sum(1 for s in sizes if s > 1), "local_epochs": counter.local,
               "failed_rounds": counter.failed, "out_of_sync": counter.out_of_sync, "mean_group_size": round(sum(sizes) / len(sizes), 2) if sizes else None,
               "train_seconds": round(train_seconds, 3), "compute_s": round(compute_total, 3),
               "comm_s": round(comm_total, 3), "dense_params": sum(p.numel() for p in dense_params),
               "table_params": sum(p.numel() for p in table_params),
               "hivemind": hivemind.__version__}
    print(json.dumps(summary), flush=True)  # before the shutdown, which can be slow
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
