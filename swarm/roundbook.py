"""Gradient rounds: which payloads make up step t's aggregate, and when step t may be taken.

Sans-I/O: the node feeds validated payloads and the current time in, and asks whether a round is
complete. No sockets, no clocks of its own.

Consistency model (see docs/design.md): synchronous rounds keyed by step, with a deadline.
A peer applies round t once it holds a step-t payload from every *expected* peer (alive, and
contributing), or once ``round_timeout`` has passed since it first asked. A payload that arrives
after its round was taken is not dropped: it joins the next aggregate ("late"), unless it is more
than ``max_staleness`` steps old. Contributions are summed in sender-id order, so peers that hold
the same set of payloads compute the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

from . import robust


class Contribution(Protocol):
    """What the round book needs of a decoded payload (swarm.codec.Decoded fits)."""

    step: int
    sender: str

    def add_to(self, out, weight: float = 1.0) -> None: ...


ACCEPTED, LATE, DUPLICATE, TOO_OLD, TOO_FAR_AHEAD = "accepted", "late", "duplicate", "too-old", "too-far-ahead"


@dataclass
class RoundResult:
    """One round's inputs, in the order they are summed."""

    step: int
    on_time: list[Contribution]
    late: list[Contribution]
    missing: list[str]  # expected peers whose payload did not arrive
    timed_out: bool
    completed_at: float | None = None  # when its last on-time payload arrived (None: not recorded)

    @property
    def contributors(self) -> list[str]:
        return [c.sender for c in self.on_time]

    @property
    def contributions(self) -> list[Contribution]:
        """Every payload of the round in sum order: on-time by sender, then late by (sender, step)."""
        return self.on_time + self.late

    def divisor(self) -> int:
        return max(1, len(self.on_time))


@dataclass
class RoundStats:
    accepted: int = 0
    late: int = 0
    duplicate: int = 0
    too_old: int = 0
    too_far_ahead: int = 0
    timed_out_rounds: int = 0


@dataclass
class RoundBook:
    """Payloads by step and sender, for rounds this peer has not taken yet."""

    step: int = 0  # the next round to take
    max_ahead: int = 64  # refuse payloads this far in the future (bounds memory)
    max_staleness: int = 16
    pending: dict[int, dict[str, Contribution]] = field(default_factory=dict)
    late: dict[tuple[int, str], Contribution] = field(default_factory=dict)
    last_step_from: dict[str, int] = field(default_factory=dict)
    round_started: dict[int, float] = field(default_factory=dict)
    # rounds already taken remember who was in them, so a replayed payload is a duplicate, not late
    taken: dict[int, frozenset[str]] = field(default_factory=dict)
    stats: RoundStats = field(default_factory=RoundStats)
    # per sender, the next round each of its payloads declared: {sender: {round: next}}
    declared: dict[str, dict[int, int]] = field(default_factory=dict)
    arrived: dict[int, float] = field(default_factory=dict)  # per pending round, its latest arrival

    def offer(self, c: Contribution, now: float | None = None) -> str:
        """File a validated payload (arrived at ``now``, if given); returns ACCEPTED, LATE,
        DUPLICATE, TOO_OLD or TOO_FAR_AHEAD."""
        if c.step >= self.step + self.max_ahead:
            self.stats.too_far_ahead += 1
            return TOO_FAR_AHEAD
        if c.step < self.step - self.max_staleness:
            self.stats.too_old += 1
            return TOO_OLD
        if c.step < self.step:
            key = (c.step, c.sender)
            if key in self.late or self.was_taken(c.sender, c.step):
                self.stats.duplicate += 1
                return DUPLICATE
            self.late[key] = c
            self._seen(c)
            self.stats.late += 1
            return LATE
        slot = self.pending.setdefault(c.step, {})
        if c.sender in slot:
            self.stats.duplicate += 1
            return DUPLICATE
        slot[c.sender] = c
        self._seen(c)
        if now is not None:
            self.arrived[c.step] = max(now, self.arrived.get(c.step, now))
        self.stats.accepted += 1
        return ACCEPTED

    def _seen(self, c: Contribution) -> None:
        self.last_step_from[c.sender] = max(c.step, self.last_step_from.get(c.sender, -1))
        nxt = getattr(c, "next", None)
        if nxt is not None:
            self.declared.setdefault(c.sender, {})[c.step] = nxt

    def declared_for(self, sender: str, step: int) -> int | None:
        """The next round ``sender``'s latest payload of a round before ``step`` declared (None:
        we hold none that declared one)."""
        rounds = [s for s in self.declared.get(sender, ()) if s < step]
        return self.declared[sender][max(rounds)] if rounds else None

    def was_taken(self, sender: str, step: int) -> bool:
        return sender in self.taken.get(step, ())

    def has(self, step: int, sender: str) -> bool:
        return sender in self.pending.get(step, {})

    def senders(self, step: int) -> list[str]:
        return sorted(self.pending.get(step, {}))

    def missing(self, step: int, expected: Iterable[str]) -> list[str]:
        have = self.pending.get(step, {})
        return sorted(p for p in set(expected) if p not in have)

    def ready(self, step: int, expected: Iterable[str], now: float, timeout: float) -> bool:
        """True once every expected peer's step payload is here, or the round's deadline passed."""
        started = self.round_started.setdefault(step, now)
        return not self.missing(step, expected) or now - started >= timeout

    def deadline(self, step: int, now: float, timeout: float) -> float:
        return self.round_started.setdefault(step, now) + timeout

    def take(self, step: int, expected: Iterable[str], now: float, timeout: float) -> RoundResult:
        """Remove and return round ``step``: its payloads plus every late one, in sender order."""
        if step != self.step:
            raise ValueError(f"round {step} taken out of order (next is {self.step})")
        missing = self.missing(step, expected)
        started = self.round_started.pop(step, now)
        timed_out = bool(missing) and now - started >= timeout
        if timed_out:
            self.stats.timed_out_rounds += 1
        on_time = [c for _, c in sorted(self.pending.pop(step, {}).items())]
        late = [self.late[k] for k in sorted(self.late, key=lambda k: (k[1], k[0]))]
        self.late.clear()
        self.taken[step] = frozenset(c.sender for c in on_time)
        for c in late:
            self.taken[c.step] = self.taken.get(c.step, frozenset()) | {c.sender}
        for s in [s for s in self.taken if s < step - self.max_staleness]:
            del self.taken[s]
        self._prune_declared(step)
        arrived = self.arrived.pop(step, None)
        self.step = step + 1
        return RoundResult(step=step, on_time=on_time, late=late, missing=missing, timed_out=timed_out,
                           completed_at=now if timed_out or arrived is None else arrived)

    def _prune_declared(self, step: int) -> None:
        """Keep each sender's latest declaration and those of the rounds a late payload may still join."""
        for d in self.declared.values():
            newest = max(d)
            for s in [s for s in d if s < step - self.max_staleness and s != newest]:
                del d[s]

    def reset(self, step: int) -> None:
        """Jump to ``step`` (after a state sync): drop what is older, keep what is newer."""
        for s in [s for s in self.pending if s < step]:
            del self.pending[s]
        self.late.clear()
        self.taken.clear()
        self.round_started.clear()
        self.arrived = {s: t for s, t in self.arrived.items() if s >= step}
        self.step = step

    def active_senders(self, step: int, window: int) -> set[str]:
        """Peers in at least one of the ``window`` rounds taken before ``step`` (on time or late):
        they are contributing. A peer whose payloads are all for ``step`` or later is not, yet: a
        joiner that starts at step s and computes fast can send its step-s payload while we still
        take round s-1, and must not make us wait for a round-(s-1) payload it will never send."""
        out: set[str] = set()
        for s in range(step - window, step):
            out |= self.taken.get(s, frozenset())
        return out

    def forget(self, peer_id: str) -> None:
        self.last_step_from.pop(peer_id, None)
        self.declared.pop(peer_id, None)


def aggregate_into(out, result: RoundResult, cfg: robust.RobustConfig | None = None) -> int:
    """out (zeroed fp32 [n]) <- the round's aggregate; returns the number of contributions used.

    ``cfg`` None is the plain mean (late payloads join with the same weight); otherwise the rule of
    swarm/robust.py, where late payloads are contributors of the round like on-time ones.
    Fixed order: on-time by sender, then late by sender.
    """
    return aggregate_report(out, result, cfg).count


def aggregate_report(out, result: RoundResult, cfg: robust.RobustConfig | None = None) -> robust.Report:
    """As aggregate_into, returning what the aggregation saw (norms, clipped, outliers) for scoring."""
    return robust.aggregate(out, result.contributions, cfg or robust.MEAN, divisor=result.divisor())
