"""Where a new owner gets the slots it awaits (sans-I/O): the hand-off source policy of one chunk
of moves (one table, up to SLOTS_PER_REQUEST slots), as a state machine the HTTP shell carries out
(TableClient._fetch_chunk in swarm/tables/http.py).

No sockets, no asyncio, no clock of its own: the shell passes the time (``now``), what it knows of
the peers (the map's members, who is reachable) and of the service (whether a move is still
awaited), and gets back a decision:

- Round: ask these sources for these slots (POST /v1/rows/slots), then install the offers that
  count (Round.offers, TableService.import_best) and report back (HandoffPlan.after_install);
- Sleep: wait this long, then ask again;
- Done: stop; give up these moves (TableService.give_up: the copy held, else zero rows).

The rules (docs/tables.md, "Hand-off"):
- A slot's old owners (Move.sources, members of the map or not) are asked first, each for the
  slots it owned. A source may have no current copy yet (it is fetching the slot itself), so they
  are asked again, with backoff, until the deadline.
- After ``widen_after`` attempts without a copy, every member of the map is asked for every slot
  too: a slot that moved on again before its previous new owner fetched it (two joins within
  seconds) is held only by an earlier owner, for release, which is in no map this peer saw.
- An old owner's offer always counts; another member's only in a round that every member answered,
  so that the newest copy wins (TableService.import_best keeps the most updated one) and "nobody
  ever updated it" (FRESH) is what all of them said.
- A move the service no longer awaits (installed, or superseded by a newer view) is dropped, also
  from the moves given up at the deadline: giving up a superseded move would throw away the slot
  that a newer view's fetch is getting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from .ownership import Move

__all__ = ["HandoffPlan", "Round", "Sleep", "Done", "WIDEN_AFTER", "DEADLINE_S", "Offer"]

WIDEN_AFTER = 3  # attempts asking only a slot's old owners before asking every member
DEADLINE_S = 30.0  # seconds of asking before a slot is given up (a falsely dead owner has refuted by then)
Offer = bytes | int  # an encoded slot (encode_slot) or FRESH


@dataclass(frozen=True)
class Round:
    """Ask each source of ``asked`` for its slots, at once; ``moves`` are the moves still awaited.
    ``everyone`` is the members asked for every slot (None before the round is widened)."""
    moves: tuple[Move, ...]
    asked: dict[str, list[int]]
    everyone: tuple[str, ...] | None = None

    def offers(self, replies: Mapping[str, Sequence[Offer | None] | None]) -> dict[int, list[Offer]]:
        """The offers that count, by slot, given each asked source's reply (one copy or None per
        slot asked, in order; None or absent for a source that did not answer)."""
        answered = {src for src, blobs in replies.items() if blobs is not None}
        complete = self.everyone is not None and answered.issuperset(self.everyone)
        sources_of = {m.slot: m.sources for m in self.moves}
        out: dict[int, list[Offer]] = {}
        for src, slots in self.asked.items():
            for slot, blob in zip(slots, replies.get(src) or ()):
                if blob is not None and (complete or src in sources_of[slot]):
                    out.setdefault(slot, []).append(blob)
        return out


@dataclass(frozen=True)
class Sleep:
    """Wait ``seconds`` before the next next_round."""
    seconds: float


@dataclass(frozen=True)
class Done:
    """Nothing more to ask: give up ``give_up`` (empty when every move was installed or dropped)."""
    give_up: tuple[Move, ...] = ()


@dataclass
class HandoffPlan:
    """The fetch of one chunk of moves (one table), from ``started`` (the shell's clock) on."""
    moves: Sequence[Move]
    started: float
    deadline_s: float = DEADLINE_S
    widen_after: int = WIDEN_AFTER
    attempt: int = 0  # rounds that got no copy of some slot, and waits with nobody to ask
    pending: list[Move] = field(init=False)

    def __post_init__(self) -> None:
        self.pending = list(self.moves)
        if len({m.table for m in self.pending}) > 1 or len({m.slot for m in self.pending}) != len(self.pending):
            raise ValueError("a hand-off chunk is distinct slots of one table")

    def next_round(self, now: float, members: Iterable[str] | None, reachable: Callable[[str], bool],
                   still_pending: Callable[[Move], bool]) -> Round | Sleep | Done:
        """What to do now. ``members``: the current map's members (None: no map yet; this peer is
        left out of them); ``reachable(peer)``: whether it has an address to ask;
        ``still_pending(move)``: whether the service still awaits that very move."""
        self.pending = [m for m in self.pending if still_pending(m)]
        if not self.pending or now - self.started >= self.deadline_s:
            return Done(tuple(self.pending))
        sources = sorted({src for m in self.pending for src in m.sources if reachable(src)})
        asked = {src: [m.slot for m in self.pending if src in m.sources] for src in sources}
        everyone = None
        if self.attempt >= self.widen_after and members is not None:
            # the old owners (members or not) as before, and every member for every slot
            me = self.pending[0].to
            everyone = tuple(p for p in members if p != me)
            asked.update({p: [m.slot for m in self.pending] for p in everyone if reachable(p)})
        if not asked:  # no old owner is reachable now; one may come back (refuting) before the deadline
            self.attempt += 1
            return Sleep(min(0.2 * self.attempt, 2.0))
        return Round(tuple(self.pending), asked, everyone)

    def after_install(self, installed: Mapping[Move, bool], still_pending: Callable[[Move], bool]) -> Sleep | None:
        """Record a round's outcome: ``installed[move]`` is True when its copy was installed. The
        moves left are those not installed that the service still awaits; returns the wait before
        asking them again (None when none is left)."""
        self.pending = [m for m in self.pending if not installed.get(m, False) and still_pending(m)]
        if not self.pending:
            return None
        self.attempt += 1
        return Sleep(min(0.1 * self.attempt, 1.0))
