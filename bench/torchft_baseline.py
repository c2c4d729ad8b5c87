#!/usr/bin/env python3
"""One replica of the torchft DiLoCo baseline for bench/wan.py (method `torchft-diloco`): the model,
data, seed, batch and budget of bench/ddp_baseline.py --tables dense, trained with DiLoCo as torchft
ships it (`torchft.local_sgd.DiLoCo`) instead of DDP.

Each peer is its own torchft replica group of one rank: its own TCPStore (at --host) and
`torchft.Manager` (ManagerServer advertised at --host), all in one quorum through one lighthouse
(`torchft.coordination.LighthouseServer`, which `--serve-lighthouse` runs; bench/wan.py starts it in
peer 0's namespace). The replicas' pseudo-gradients are all-reduced over torchft's reconfigurable
`ProcessGroupGloo` every --sync-every inner steps; the quorum needs every replica
(min_replicas = min_replica_size = --world), so like DDP it is synchronous at each sync.

  inner optimizer  one Adam with the DDP baseline's two settings as two parameter groups: the dense
                   parameters at --lr (betas 0.9, 0.95, the peer's warm-up + cosine schedule,
                   bytelm.lr_at) and the two tables (dense parameters here) at --table-lr (betas
                   0.9, 0.999); torchft's DiLoCo hooks one optimizer, so both are one
  outer optimizer  SGD(lr --outer-lr 0.7, momentum --outer-momentum 0.9, Nesterov): the DiLoCo
                   paper's recipe, on every parameter (tables included: their pseudo-gradient is
                   all-reduced dense, like ddp-dense's gradient)

Output: the DDP baseline's (bench/wan.py's collect_baseline parses both): one JSON line per inner
step ({"step", "t", "loss", "compute_s", "comm_s", "sync"}; ``comm_s`` is, on a step that ends a
sync window, the optimizer step's time beyond the last plain inner step's: the quorum, the
all-reduce and the outer step), and as the LAST line a JSON summary with "val_loss" (evaluated
after the last sync, so every replica evaluates the same global model).

torchft is an optional dependency (`[torchft]` extra of pyproject.toml). Install it WITHOUT its
pinned dependencies, so that the installed torch stays, then its pure-Python ones:

    pip install --no-deps torchft==0.2.0
    pip install opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http

Lighthouse:  python3 bench/torchft_baseline.py --serve-lighthouse --bind 0.0.0.0:29510 --world 4
Replica i:   GLOO_SOCKET_IFNAME=wan0 python3 bench/torchft_baseline.py --rank i --world 4 \\
                 --host 10.77.0.(i+1) --lighthouse http://10.77.0.1:29510 --steps 224 --sync-every 32
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from ddp_baseline import add_model_args, add_run_args, lr_at, model_config, peer_seed  # noqa: E402
from swarm.allocator import keep_freed_memory  # noqa: E402
from swarm.tasks.bytelm.corpus import BatchSampler, load_corpus, val_batches  # noqa: E402
from swarm.tasks.bytelm.model import TABLES, SwarmLM  # noqa: E402


def serve_lighthouse(args) -> None:
    """Run a torchft lighthouse until SIGTERM/SIGINT; prints `lighthouse listening on ADDR` once up."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=args.bind, min_replicas=args.world, join_timeout_ms=args.join_timeout_ms,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    print(f"lighthouse listening on {server.address()}", flush=True)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.2)
    server.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description="one replica of the torchft DiLoCo baseline of bench/wan.py")
    ap.add_argument("--serve-lighthouse", action="store_true", help="run the lighthouse instead of a replica")
    ap.add_argument("--bind", default="0.0.0.0:29510", help="lighthouse: address to listen on")
    ap.add_argument("--join-timeout-ms", type=int, default=60000,
                    help="lighthouse: wait this long for heartbeating stragglers before a quorum")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=30000,
                    help="lighthouse: a replica silent this long is dead (4 peers share 2 cores here)")
    ap.add_argument("--rank", type=int, default=0, help="this replica's index (data shard), 0..world-1")
    ap.add_argument("--world", type=int, required=True, help="number of replicas (all of them form each quorum)")
    ap.add_argument("--host", default="127.0.0.1", help="this replica's address (its TCPStore and manager)")
    ap.add_argument("--lighthouse", default="http://127.0.0.1:29510")
    ap.add_argument("--store-port", type=int, default=29700)
    ap.add_argument("--manager-port", type=int, default=29800)
    ap.add_argument("--steps", type=int, default=96, help="inner steps (a multiple of --sync-every)")
    ap.add_argument("--sync-every", type=int, default=32, help="H: inner steps per outer step")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--no-nesterov", action="store_true")
    add_run_args(ap)
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds torchft may take for one quorum or one all-reduce (a dense sync at 1 MB/s "
                         "takes about a minute)")
    add_model_args(ap)
    args = ap.parse_args()
    if args.serve_lighthouse:
        serve_lighthouse(args)
        return
    if args.steps % args.sync_every:
        ap.error(f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every}")

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    corpus = load_corpus()
    cfg = model_config(args)
    model = SwarmLM(cfg)  # tables as dense parameters, as ddp_baseline.py --tables dense
    sampler = BatchSampler(corpus, args.batch_size, cfg.context,
                           seed=peer_seed(args.seed, args.peer_id or f"p{args.rank}"),
                           shard=(args.rank, args.world), prefix=cfg.prefix)
    val = val_batches(corpus, args.batch_size, cfg.context, max_batches=args.eval_batches, prefix=cfg.prefix)
    table_params = [getattr(model, n).weight for n in TABLES]
    table_ids = {id(p) for p in table_params}
    dense_params = [p for p in model.parameters() if id(p) not in table_ids]
    inner = torch.optim.Adam([{"params": dense_params, "lr": args.lr, "betas": (0.9, 0.95)},
                              {"params": table_params, "lr": args.table_lr, "betas": (0.9, 0.999)}], eps=1e-8)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=not args.no_nesterov and args.outer_momentum > 0)

    timeout = timedelta(seconds=args.timeout)
    store = TCPStore(host_name=args.host, port=args.store_port, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        min_replica_size=args.world,
        use_async_quorum=False,  # DiLoCo requires it
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timedelta(seconds=120),
        rank=0, world_size=1,  # each peer is a replica group of one rank
        store_addr=args.host, store_port=args.store_port,
        lighthouse_addr=args.lighthouse, replica_id=f"p{args.rank}",  # torchft reads the trailing digits
        port=args.manager_port, hostname=args.host,
        init_sync=False,  # every replica builds the same model under the seed
    )

    # the first quorum (and the replicas' process group) before step 1, as DDP forms its group before
    # its first step; the first sync window then costs what every later one does
    manager.start_quorum()
    t_start = time.time()
    compute_total = comm_total = 0.0
    plain_opt = None  # the last plain (no-sync) inner optimizer step's seconds
    syncs = 0
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every, backup_device=torch.device("cpu"),
                pin_memory=False):
        for step in range(args.steps):
            batch = sampler.next()
            t0 = time.perf_counter()
            loss = model.loss(batch)
            inner.zero_grad(set_to_none=True)
            loss.backward()
            inner.param_groups[0]["lr"] = lr_at(step, args.lr, args.steps)
            t1 = time.perf_counter()
            inner.step()  # DiLoCo's post-hook: every --sync-every steps, quorum + all-reduce + outer step
            t2 = time.perf_counter()
            sync = (step + 1) % args.sync_every == 0
            if sync:
                syncs += 1
                comm = max(0.0, (t2 - t1) - (plain_opt or 0.0))
            else:
                plain_opt, comm = t2 - t1, 0.0
            compute = (t2 - t0) - comm
            compute_total += compute
            comm_total += comm
            print(json.dumps({"step": step + 1, "t": time.time(), "loss": float(loss.detach()),
                              "compute_s": round(compute, 4), "comm_s": round(comm, 4), "sync": sync}), flush=True)
    train_seconds = time.time() - t_start

    model.eval()
    with torch.no_grad():
        losses = [float(model.loss(b)) for b in val]
    val_loss = sum(losses) / len(losses)
    committed = manager.current_step()
    manager.shutdown(wait=False)
    del store
    print(json.dumps({"rank": args.rank, "method": "torchft-diloco", "steps": args.steps,
                      "sync_every": args.sync_every, "syncs": syncs, "outer_steps_committed": committed,
                      "val_loss": val_loss, "train_seconds": round(train_seconds, 3),
                      "compute_s": round(compute_total, 3), "comm_s": round(comm_total, 3),
                      "dense_params": sum(p.numel() for p in dense_params),
                      "table_params": sum(p.numel() for p in table_params)}), flush=True)


if __name__ == "__main__":
    main()
