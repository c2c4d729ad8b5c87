"""Replays a replica has been told are coming (sans-I/O): read-your-writes for replica-held rows.

A pull reads the rows of slots this peer holds, as primary or replica, from its own copy. With
``--push-ack applied`` (local steps) a primary answers a push once its flush is applied and
replicates the flush after, so our own copy of a replica slot can be a flush behind when the next
window's first pulls read it: those rows would train a window without the last one's updates,
which the window barrier exists to prevent (docs/design.md, "When a primary answers a push").

So a push's answer names the flush's replay when we are one of the replicas it goes to
(``"replay"``: the primary's replay key of that flush); the client notes it here, the replay route
notes each replay that lands, and a pull that would read a replica slot of a primary whose named
replay has not landed waits for it first, bounded (TableClient.pull). One key per primary is
enough: a primary replicates its flushes in order, each before it applies the next, so once a
later flush's replay has landed every earlier one has landed or failed for good (and is then
owed a catch-up, swarm/tables/owed.py)."""

from __future__ import annotations

import collections

MAX_KEY = 256  # a replay key's length: "<primary id>.<nonce>/flush:<n>"


class ReplaysDue:
    """Per primary, the replay key its last push answer said is coming to us, until it lands."""

    def __init__(self, keep_landed: int = 1024):
        self._due: dict[str, str] = {}  # primary -> replay key not landed yet
        # replay keys that landed here, most recent last: a replay can overtake the push answer
        # that names it (another connection), and must then not be waited for
        self._landed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._keep = keep_landed
        self.given_up = 0  # keys whose wait ran out (the primary died, or its replay failed)

    def expect(self, primary: str, key: object) -> None:
        """A push answer from ``primary`` named ``key`` as the replay of its flush to us. A key that
        does not name that primary (a replay key starts "<primary id>."), or is not a short string,
        is ignored: only that primary's own replays could ever satisfy it."""
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or not key.startswith(primary + "."):
            return
        if key in self._landed or _older(key, self._due.get(primary)):
            return  # landed already, or an answer that came after a later flush's: that one is waited for
        self._due[primary] = key

    def __len__(self) -> int:
        """Primaries with a replay to us still on its way."""
        return len(self._due)

    def landed(self, key: str) -> None:
        """A replay message keyed ``key`` was applied here (or was a repeat of one that was). It
        also settles an earlier flush of the same primary run that is still due: replays come in
        flush order, so that one landed or failed for good (and is owed a catch-up)."""
        self._landed[key] = None
        self._landed.move_to_end(key)
        while len(self._landed) > self._keep:
            self._landed.popitem(last=False)
        for primary, due in list(self._due.items()):
            if due == key or _older(due, key):
                del self._due[primary]

    def due(self, primaries: set[str]) -> set[str]:
        """Which of ``primaries`` have a replay to us still on its way."""
        return {p for p in primaries if p in self._due}

    def give_up(self, primaries: set[str]) -> None:
        """Stop waiting for these primaries' replays (the wait ran out): reads go on from our copy,
        and the rows stay behind until a replay, catch-up or audit brings them up."""
        for p in primaries:
            if self._due.pop(p, None) is not None:
                self.given_up += 1


def _older(key: str, than: str | None) -> bool:
    """``key`` names an earlier flush of the same primary run than ``than`` ("<primary>.<nonce>/flush:<n>")."""
    if than is None:
        return False
    run, _, n = key.rpartition("/flush:")
    run2, _, n2 = than.rpartition("/flush:")
    return run == run2 and n.isdigit() and n2.isdigit() and int(n) < int(n2)
