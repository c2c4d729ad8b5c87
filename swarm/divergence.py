"""Replicas that drifted apart: who is out of line, and whom it re-syncs from (sans-I/O).

Every ``--sketch-every`` steps each peer computes the param_sketch of its replica (parameters and
buffers) and publishes a note of it in its membership metadata: the step, a digest of the sketch's
exact bits, its first components rounded, and the device type. Peers compare notes of the same
step. Among peers on the same device type replicas must agree bit for bit (equal digests); between
a CPU and a GPU peer the float arithmetic differs legitimately, so two sketches agree when their
relative L2 distance is at most ``TOLERANCE`` (on the published components).

A peer whose note disagrees with a strict majority of the notes (its own included) re-syncs its
state from the most senior peer of the largest agreeing group. In a tie (two peers, or two groups
of equal size) the group holding the most senior peer keeps its state and the others re-sync
from it: seniority is contributing longest (the lowest ``active_from``), then the lowest id.
Every peer decides for itself from the same notes, so exactly the peers outside that group move.
"""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

TOLERANCE = 1e-3  # relative L2 between sketches of peers on different device types
COMPONENTS = 8  # sketch components published (rounded) for cross-device comparison


@dataclass(frozen=True)
class Note:
    peer: str
    step: int
    digest: str
    values: tuple[float, ...]
    device: str
    since: int  # the step it has contributed from (active_from): lower is more senior


def digest(sketch: Sequence[float]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(sketch)}d", *sketch)).hexdigest()[:16]


def meta_of(step: int, sketch: Sequence[float], device: str) -> dict[str, Any]:
    """What a peer publishes in its membership metadata (strings of at most 128 characters)."""
    return {"sk_step": int(step), "sk": digest(sketch), "sk_v": ",".join(f"{v:.6g}" for v in sketch[:COMPONENTS]),
            "dev": device[:16]}


def note_of(peer: str, meta: Mapping[str, Any]) -> Note | None:
    """A peer's note from its (untrusted) metadata; None when it has none or it is malformed."""
    step, dig, vals, dev = meta.get("sk_step"), meta.get("sk"), meta.get("sk_v"), meta.get("dev")
    since = meta.get("active_from", 0)
    if type(step) is not int or not isinstance(dig, str) or len(dig) != 16 or not isinstance(vals, str) \
            or not isinstance(dev, str) or type(since) is not int:
        return None
    try:
        values = tuple(float(v) for v in vals.split(","))
    except ValueError:
        return None
    if len(values) > COMPONENTS or not all(math.isfinite(v) for v in values):
        return None
    return Note(peer, step, dig, values, dev, since)


def agree(a: Note, b: Note) -> bool:
    if a.device == b.device:
        return a.digest == b.digest
    if len(a.values) != len(b.values) or not a.values:
        return False
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a.values, b.values)))
    scale = max(math.sqrt(sum(x * x for x in a.values)), math.sqrt(sum(y * y for y in b.values)), 1e-12)
    return diff / scale <= TOLERANCE


def _senior(notes: Sequence[Note]) -> Note:
    return min(notes, key=lambda n: (n.since, n.peer))


def verdict(me: Note, others: Sequence[Note]) -> str | None:
    """The peer ``me`` must re-sync from, or None when its replica stands (see the module docstring).
    Only notes of ``me.step`` count."""
    notes = [me, *(o for o in others if o.step == me.step and o.peer != me.peer)]
    if len(notes) < 2:
        return None
    groups: list[list[Note]] = []
    for n in sorted(notes, key=lambda n: (n.since, n.peer)):  # seniors first: each group's head is its senior
        for g in groups:
            if agree(g[0], n):
                g.append(n)
                break
        else:
            groups.append([n])
    if len(groups) == 1:
        return None
    best = max(len(g) for g in groups)
    top = [g for g in groups if len(g) == best]
    keep = top[0] if len(top) == 1 else min(top, key=lambda g: (g[0].since, g[0].peer))
    if any(n.peer == me.peer for n in keep):
        return None
    return _senior(keep).peer
