"""What a peer says of itself in its membership metadata, parsed once and validated.

Metadata arrives by gossip from any peer: every value may be of any type. ``PeerMeta.parse``
keeps what is well formed and takes the default for the rest, so no decision downstream reads a
string key or a value of the wrong type. ``PeerMeta.fields`` is the other direction: the dict a
peer publishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["PeerMeta", "MAX_STEP"]

MAX_STEP = 1 << 62  # steps and round numbers beyond this are not believed


def _int(v: Any, default: int | None, lo: int = 0) -> int | None:
    return v if type(v) is int and lo <= v <= MAX_STEP else default


def _flag(v: Any) -> bool:
    return (type(v) is int or type(v) is bool) and bool(v)


@dataclass(frozen=True)
class PeerMeta:
    """A member's self-description (docs/protocol.md, "Member metadata")."""
    step: int = 0  # the next round it will take
    active: bool = False  # contributing gradients
    active_from: int = 0  # the first round it contributes to
    active_until: int | None = None  # its last round before it stopped contributing (a re-sync), if it said
    run: bool = False  # it has begun training (a peer waiting for --min-peers joins it)
    done: bool = False  # it has finished its steps and evaluated
    group: str | None = None  # the id of its host group's leader, for a rank of a host group
    grank: int | None = None  # its rank in that group
    loss: float | None = None  # its recent mean train loss
    tps: int = 0  # its training throughput (tokens or samples per second)
    next_round: int | None = None  # the next round it contributes to (core/cadence.py)
    declared_at: int | None = None  # ... as declared by its payload of this round (-1: before any)
    compute_ms: int = 0  # its median compute time per step, ms (0: unknown)

    @property
    def follower(self) -> bool:
        """A rank of a host group other than its leader: it steps on its leader's aggregate and
        sends no payload of its own."""
        return self.grank is not None and self.grank > 0

    @property
    def contributor(self) -> bool:
        """Counted as a contributor (the status page's count, --min-peers): a host group is one."""
        return self.active and not self.follower

    @classmethod
    def parse(cls, meta: Mapping[str, Any] | None) -> "PeerMeta":
        m = meta if isinstance(meta, Mapping) else {}
        loss = m.get("loss")
        group = m.get("group")
        return cls(
            step=_int(m.get("step"), 0),
            active=_flag(m.get("active")),
            active_from=_int(m.get("active_from"), 0),
            active_until=_int(m.get("active_until"), None, lo=-1),  # -1: before its first round
            run=_flag(m.get("run")),
            done=_flag(m.get("done")),
            group=group if isinstance(group, str) and len(group) <= 200 else None,
            grank=_int(m.get("grank"), None),
            loss=float(loss) if type(loss) in (int, float) and loss == loss and abs(loss) != float("inf") else None,
            tps=_int(m.get("tps"), 0),
            next_round=_int(m.get("nx"), None),
            declared_at=_int(m.get("cs"), None, lo=-1),
            compute_ms=_int(m.get("ms"), 0),
        )
