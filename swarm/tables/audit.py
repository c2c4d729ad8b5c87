"""Replica audit (sans-I/O): which replica slots to compare with their primary's copy, and what
a comparison says.

A replica's rows only change by replaying its primary's optimizer steps, so within one view a
replica at the same update count as its primary holds the same bits. The replay checks (the
pre-step counters of TableService.apply_replays) catch an update that was missed or applied twice;
they do not catch rows that changed with their counters intact (a bit flip, a bug in a replay, a
copy installed from a bad checkpoint). The audit does: each peer, now and then, asks the primary
of every slot it replicates for the slot's digest (update count and checksum of rows, optimizer
state and counters) and compares it with its own.

Verdict per slot, primary authoritative (it is the one writer: its copy is what later updates
build on):
- same update count, same checksum: in step;
- same update count, another checksum: diverged -> repair;
- more updates here than on the primary: diverged (nobody else writes a replica) -> repair;
- fewer updates here: a replay may be in flight, so not judged now; when the next audit finds
  the primary's count unchanged and ours still lower, no replay is coming -> repair.
A repair installs the primary's copy of the slot (TableService.repair).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Digest", "ReplicaAudit", "MAX_DIGESTS"]

MAX_DIGESTS = 4096  # slots in one digest request (a digest is ~45 bytes on the wire)


@dataclass(frozen=True)
class Digest:
    """A held slot's update count (sum of its rows' step counters) and checksum."""
    version: int
    checksum: str


class ReplicaAudit:
    """Compares this peer's replica slots with their primaries' digests (one per peer)."""

    def __init__(self) -> None:
        # (table, slot) -> the primary's update count when ours was found lower
        self.lagging: dict[tuple[str, int], int] = {}
        self.view = ""
        self.compared = 0  # slots compared, in all audits
        self.repaired = 0  # slots found diverged (their repair was asked for)

    def judge(self, view: str, table: str, slots: list[int], ours: list[Digest | None],
              theirs: list[Digest | None]) -> list[int]:
        """The slots (of ``slots``) to repair, given our digests and the primary's, in the same
        order; ``view`` is the map both were taken under (a new view forgets the lagging slots)."""
        if len(ours) != len(slots) or len(theirs) != len(slots):
            raise ValueError("one digest (or None) per slot, ours and the primary's")
        if view != self.view:
            self.view, self.lagging = view, {}
        repair = []
        for slot, mine, prim in zip(slots, ours, theirs):
            key = (table, slot)
            if mine is None or prim is None:  # one of us does not hold it (yet): nothing to compare
                self.lagging.pop(key, None)
                continue
            self.compared += 1
            if mine.version < prim.version:
                if self.lagging.get(key) == prim.version:  # a whole audit period and no replay came
                    del self.lagging[key]
                    repair.append(slot)
                else:
                    self.lagging[key] = prim.version
                continue
            self.lagging.pop(key, None)
            if mine.version > prim.version or mine.checksum != prim.checksum:
                repair.append(slot)
        self.repaired += len(repair)
        return repair
