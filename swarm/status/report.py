"""What a peer reports of itself: the progress line, the summary a finished peer prints, and the
/api/status document (docs/protocol.md). Functions of the peer that only read it (the status
layer never writes peer or gossip state)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..versions import versions

if TYPE_CHECKING:
    from ..node import Peer

__all__ = ["progress_line", "summary", "task_info", "status"]


def progress_line(peer: "Peer") -> str:
    p = peer.progress
    elapsed = max(1e-9, time.monotonic() - p.started_at)
    loss = peer.recent_loss()
    ratio = p.dense_equiv / p.wire_bytes if p.wire_bytes else 0.0
    rate = (f"tok/s {p.tokens / elapsed:.0f}" if peer.replica.task.tokens_per_sample
            else f"samples/s {p.samples / elapsed:.1f}")
    evals = f" eval_time {p.eval_seconds:.2f}s" if peer.cfg.eval_every else ""  # evaluations so far
    return (f"step {peer.position()} loss {loss:.3f} {rate} "
            f"peers {len(peer.members.alive_ids())} sent {sum(peer.counts.sent.values()) / 1e6:.2f}MB "
            f"recv {sum(peer.counts.received.values()) / 1e6:.2f}MB compression x{ratio:.0f}{evals}")


def bytes_per_sample(peer: "Peer") -> float | None:
    """Every byte this peer sent (all kinds) per sample it trained (None before the first)."""
    p = peer.progress
    return round(sum(peer.counts.sent.values()) / p.samples, 1) if p.samples else None


def early_steps(peer: "Peer") -> int:
    """Inner steps taken while the last window's end travelled (--early-step; 0 per step)."""
    return peer.local_steps.early_steps if peer.local_steps is not None else 0


def summary(peer: "Peer", sketch: list[float]) -> dict:
    p = peer.progress
    tail = p.losses[-10:]
    grads_sent = peer.counts.sent.get("grads", 0)
    return {
        "peer_id": peer.id,
        "name": peer.cfg.name,
        "versions": versions(),  # swarm's, the wire protocol's, Python's, torch's (swarm/versions.py)
        "steps": peer.position(),  # optimizer steps (with local steps: inner steps)
        "rounds": peer.book.step,
        "sync_every": peer.window,  # inner steps per window (1: every step is a round)
        "window_steps": peer.window_steps,  # inner steps our last window took (< sync_every: we are slow)
        "push_lead": peer.push_lead,  # inner steps before our last window's end that its row pushes went
        # windows' first inner steps taken while the last window's end travelled (--early-step)
        "early_steps": early_steps(peer),
        "bytes_per_sample": bytes_per_sample(peer),
        "steps_contributed": p.contributed,
        "first_loss": p.losses[0] if p.losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "val_loss": p.val_loss,
        "bytes_sent": grads_sent,
        "bytes_received": peer.counts.received.get("grads", 0),
        "control_bytes_sent": peer.counts.sent.get("control", 0),
        "state_bytes_received": peer.counts.received.get("state", 0),
        "dense_bytes": peer.dense_bytes,
        "compression_ratio": (p.dense_equiv / p.wire_bytes) if p.wire_bytes else None,
        "skipped_steps": p.skipped_steps,
        "rounds_timed_out": peer.book.stats.timed_out_rounds,
        "pacing": peer.pacing.status(),  # which rounds it sent for, free-running (swarm/pacing.py)
        "late_payloads": peer.book.stats.late,
        "tokens": p.tokens,
        "samples": p.samples,
        "nonfinite_losses": peer.replica.nonfinite if peer.replica else 0,
        "lr": peer.replica.lr() if peer.replica else None,
        "task": task_info(peer),
        "seconds": round(time.monotonic() - p.started_at, 2) if p.started_at else 0.0,
        "row_bytes_sent": peer.counts.sent.get("rows", 0) + peer.counts.sent.get("replica", 0),
        "row_bytes_received": peer.counts.received.get("rows", 0) + peer.counts.received.get("replica", 0),
        "sent_by_kind": dict(peer.counts.sent),  # request bodies this peer sent, by kind
        "received_by_kind": dict(peer.counts.received),  # reply bodies it received (rows served to it)
        # all bodies as they crossed the wire and before zstd (swarm/encoding.py, --wire-compression)
        "wire_encoding": peer.counts.wire(),
        "rows": peer.table_client.status() if peer.table_client else None,
        "pull_latency_ms": peer.table_client.stats.percentiles() if peer.table_client else None,
        "step_phases": peer.step_times.report(),
        "table_stats": vars(peer.tables.stats).copy() if peer.tables else None,
        "param_sketch": sketch,
        "val_history": [[s, round(v, 5)] for s, v in p.val_history],
        "eval_seconds": round(p.eval_seconds, 3),  # what those evaluations took, wall seconds
        "lr_history": [[s, lr] for s, lr in p.lr_history],
        "settings": dict(peer.settings),
        "resyncs": dict(peer.resyncs),
        "task_failures": dict(peer.task_failures),
        "failure": peer.failure,
        "group": peer.group.status() if peer.group is not None else None,
    }

def task_info(peer: "Peer") -> dict | None:
    """What the swarm trains: the task's name and version, its dense size and its tables."""
    r = peer.replica
    if r is None:
        return None
    return {"name": r.task.name, "version": r.task.version, "fingerprint": r.fingerprint,
            "device": str(r.device), "tokens_per_sample": r.task.tokens_per_sample,
            "params": sum(p.numel() for p in r.params), "buffers": sum(b.numel() for b in r.buffers.values()),
            "dense_values": r.manifest.numel, "lr": r.lr(), "nonfinite_losses": r.nonfinite,
            "tables": [{"name": t.name, "path": r.paths[t.name], "rows": t.rows, "dim": t.dim}
                       for t in r.table_specs]}

def status(peer: "Peer") -> dict:
    """The /api/status document (see docs/protocol.md)."""
    p = peer.progress
    peer.timeline.poll(peer)
    members = peer.timeline.members(peer)  # peer_id, addr, state, ... plus the page's per-peer columns
    recent = p.losses[-10:]
    elapsed = time.monotonic() - p.started_at if p.started_at else 0.0
    return {
        "peer_id": peer.id,
        "name": peer.cfg.name,
        "versions": versions(),
        "addr": peer.addr,
        "step": peer.book.step,  # rounds (with local steps: windows)
        "inner_step": peer.position(),
        "sync_every": peer.window,
        "window_steps": peer.window_steps,
        "push_lead": peer.push_lead,
        "early_steps": early_steps(peer),
        "overlap": peer.overlap,  # a host group's ranks do not overlap
        "bytes_per_sample": bytes_per_sample(peer),
        "active": peer.active,
        "state": peer.lifecycle.state.value,  # core/lifecycle.py State
        "loss": sum(recent) / len(recent) if recent else None,
        "val_loss": p.val_loss,
        "tokens_per_s": p.tokens / elapsed if elapsed > 0 else 0.0,
        "samples_per_s": p.samples / elapsed if elapsed > 0 else 0.0,
        "task": task_info(peer),
        "members": members,
        "bytes_sent": dict(peer.counts.sent),
        "bytes_received": dict(peer.counts.received),
        "wire_encoding": {**peer.counts.wire(), "compress": peer.cfg.wire_compression},
        "dense_bytes": peer.dense_bytes,
        "compression_ratio": (p.dense_equiv / p.wire_bytes) if p.wire_bytes else None,
        "rounds": vars(peer.book.stats).copy(),
        "pacing": peer.pacing.status(),
        "rejected": dict(peer.rejected),
        # what vouches for this peer (docs/security.md): its key, its certificate, the requests it refused
        "security": {"tls": peer.tls, "fingerprint": peer.key.fingerprint() if peer.tls else None,
                     "secret": bool(peer.cfg.secret), "key": peer.key_origin or "its host's key (host group rank)",
                     "requests_accepted": peer.verifier.accepted, "requests_refused": peer.verifier.refused},
        "robust": {"aggregation": peer.cfg.aggregation, "msg_clip": peer.cfg.msg_clip,
                   "ban_seconds": peer.cfg.ban_seconds, "refused_banned": peer.rejected.get("banned", 0),
                   "peers": peer.robust.status(time.monotonic(), time.time() - time.monotonic())},
        "dropped_sends": peer.dropped_sends,
        "events": list(peer.events)[-50:],
        "param_sketch": peer.last_sketch,
        "sketch_step": peer.sketch_note.step if peer.sketch_note is not None else None,
        "settings": dict(peer.settings),
        "resyncs": dict(peer.resyncs),
        "task_failures": dict(peer.task_failures),
        "tables": peer.tables.status() if peer.tables is not None else None,
        "rows": peer.table_client.status() if peer.table_client is not None else None,
        "pull_latency_ms": peer.table_client.stats.percentiles() if peer.table_client is not None else None,
        "step_phases": peer.step_times.report(),
        "group": peer.group.status() if peer.group is not None else None,
        "limits": peer.guard.status() if getattr(peer, "guard", None) is not None else None,  # swarm/limits.py
        # for the status page (docs/protocol.md, "GET /api/status")
        "now": time.time(),
        "compression": peer.cfg.compression,
        "swarm": peer.timeline.swarm(peer),
        "series": peer.timeline.series(),
        "log": peer.timeline.log(peer),
    }
