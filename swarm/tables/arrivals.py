"""When each member's row push of a window reached this primary: a peer's own view of when the
others' windows ended.

With local steps a peer sends its window's payload only once its row pushes are answered, and a
primary may hold those answers until every contributor's push of the window is in
(--window-push-wait, tables/http.py PushBatcher). A slow peer then cannot read the others' window
ends from their payloads, which wait for its own push; their pushes to its primary tell it instead
(swarm/local_steps.py LocalSteps.others_done_at). Sans-I/O: times are inputs.
"""

from __future__ import annotations

__all__ = ["PushArrivals"]


class PushArrivals:
    """The first time a push keyed ``"sender:step"`` arrived, for the last ``keep`` steps seen."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._at: dict[int, dict[str, float]] = {}

    def note(self, key: str, at: float) -> None:
        """A push with ``key`` was accepted (or repeated) at ``at``; keys without a step are ignored."""
        sender, _, step = key.rpartition(":")
        if not sender or not step.isdigit():
            return
        s = int(step)
        if s not in self._at and self._at and s < min(self._at) and len(self._at) >= self.keep:
            return  # older than every step kept: nobody asks about it any more
        self._at.setdefault(s, {}).setdefault(sender, at)
        while len(self._at) > self.keep:
            del self._at[min(self._at)]

    def all_in(self, step: int, senders: set[str]) -> float | None:
        """When the last of ``senders`` had pushed for ``step`` (None: one has not, or none named)."""
        got = self._at.get(step, {})
        if not senders or not senders <= got.keys():
            return None
        return max(got[s] for s in senders)
