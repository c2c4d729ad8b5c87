"""Which peers a round waits for, how far behind the swarm a peer is, and whom it syncs from.

Inputs are the members' parsed metadata (core/meta.py) and the round book's counters; nothing
here touches a socket, a clock or the membership object. The step loop (swarm/node.py) calls these
with what it sees now and acts on the answer.
"""

from __future__ import annotations

from typing import Callable, Collection, Mapping

from .meta import PeerMeta

__all__ = ["RESYNC_LAG", "expected", "declared_next", "behind", "lost_in_catch_up", "must_resync", "pick_donor", "traffic_reaches_us"]

RESYNC_LAG = 8  # steps behind the furthest contributor after which a peer re-syncs its state


def expected(step: int, live: Mapping[str, PeerMeta], recent_senders: Collection[str], banned: Collection[str],
             self_id: str, self_active: bool,
             declared: Callable[[str, int], int | None] | None = None) -> set[str]:
    """The peers whose payload round ``step`` waits for.

    ``live``: the other live members' metadata (alive or suspect); ``recent_senders``: peers whose
    payloads reached us for the last rounds (RoundBook.active_senders) -- a peer whose 'active'
    has not reached us by gossip yet is still waited for when its payloads have. A peer that said
    its last round (a re-sync) is not waited for after it; one that (re)joined not before its
    first round. Banned peers are never waited for. ``declared(peer, step)``: the round that peer's
    latest payload before ``step`` said it contributes to next (RoundBook.declared_for; None:
    none), combined with its metadata (declared_next); a peer that declared a later round is not
    waited for in this one (core/cadence.py). ``self_active``: we contribute to this round ourselves."""
    exp: set[str] = set()
    for pid, m in live.items():
        if m.active and m.active_from <= step:
            exp.add(pid)
    for pid in set(recent_senders) & live.keys():
        m = live[pid]
        if not m.active and m.active_until is not None and step > m.active_until:
            continue  # it stopped contributing after round `active_until`: nothing more is coming
        if m.active and m.active_from > step:
            continue  # it (re)joined: it contributes from round `active_from` on, not before
        exp.add(pid)
    if declared is not None:
        exp = {p for p in exp if not _skips(declared_next(step, declared(p, step), live[p]), step)}
    exp -= set(banned)
    if self_active:
        exp.add(self_id)
    return exp


def _skips(nxt: int | None, step: int) -> bool:
    """A peer that declared ``nxt`` as its next round sends nothing for ``step`` < ``nxt``."""
    return nxt is not None and nxt > step


def declared_next(step: int, from_payloads: int | None, meta: PeerMeta) -> int | None:
    """The round a peer contributes to next, as of round ``step``: what its latest payload before
    ``step`` said, or its metadata when that is newer (gossip can carry a declaration whose payload
    was lost or is late). None: it said nothing we hold."""
    best = from_payloads
    if meta.next_round is not None and meta.declared_at is not None and meta.declared_at < step:
        if best is None or meta.next_round > best:
            best = meta.next_round
    return best


def behind(step: int, alive: Mapping[str, PeerMeta]) -> int:
    """How many steps the furthest contributing peer is ahead of ``step`` (0 if none is)."""
    return max([m.step - step for m in alive.values() if m.active] + [0])


def must_resync(step: int, alive: Mapping[str, PeerMeta], diverged: bool) -> bool:
    """Fallen more than RESYNC_LAG steps behind the swarm, or our replica differs from the majority's."""
    return diverged or behind(step, alive) > RESYNC_LAG


def pick_donor(alive: Mapping[str, PeerMeta], prefer: str | None = None) -> str | None:
    """The peer to download state from: ``prefer`` (a peer of the majority, after a divergence)
    when it is alive and contributing, else the contributor furthest ahead (the lowest id among
    equals); None when no peer contributes."""
    if prefer is not None and prefer in alive and alive[prefer].active:
        return prefer
    best: str | None = None
    for pid in sorted(alive):
        if alive[pid].active and (best is None or alive[pid].step > alive[best].step):
            best = pid
    return best


def snapshot_gap(step: int, alive: Mapping[str, PeerMeta], has: Callable[[str], bool],
                 last_step_from: Mapping[str, int]) -> list[str]:
    """After a state sync at ``step``: the contributors whose round-``step`` payload is lost to us.
    A peer sends its payloads in step order, so one that already sent us a payload of round
    ``step`` or later but not round ``step``'s itself sent that one before it knew us (with
    --overlap a peer sends round s+1's payload before it applies round s, so a snapshot can be one
    round older than the first payload that reached us). The snapshot is then too old to replay
    from: download a newer one."""
    return sorted(p for p, m in alive.items() if m.active and not has(p) and last_step_from.get(p, -1) >= step)


def lost_in_catch_up(step: int, expected: Collection[str], has: Callable[[str], bool],
                     last_step_from: Mapping[str, int]) -> list[str]:
    """While a joiner replays the rounds between its snapshot and its first own one: the expected
    senders whose round-``step`` payload is lost to it. A peer sends its payloads in step order,
    so one whose later round reached us but not this one sent it before it knew us (with --overlap
    it may send round s + 1 before a snapshot of step s is taken). Waiting for it would only end at
    the round's deadline, with a round applied without it (a replica off the swarm's) and the
    joiner's own first payload that late for everyone: the joiner downloads a newer snapshot."""
    return sorted(p for p in expected if not has(p) and last_step_from.get(p, -1) > step)


def traffic_reaches_us(alive: Mapping[str, PeerMeta], last_step_from: Mapping[str, int]) -> bool:
    """Before a state sync: every contributor's current payloads reach us (its last payload here is
    within 2 steps of its step), so no round after the snapshot is lost to us."""
    contributors = {pid: m.step for pid, m in alive.items() if m.active}
    return bool(contributors) and all(last_step_from.get(p, -1) >= s - 2 for p, s in contributors.items())
