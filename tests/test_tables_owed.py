"""OwedRows (sans-I/O): what a primary owes the replicas its replays did not reach, and when it
stops owing it."""

from __future__ import annotations

import numpy as np

from swarm.tables import TableSpec
from swarm.tables.owed import OwedRows
from swarm.tables.ownership import OwnershipMap

SPECS = [TableSpec("ngram", 256, 8), TableSpec("value", 256, 8)]
PEERS = ("p-a", "p-b", "p-c")


def rows_of(omap: OwnershipMap, table: str, primary: str, replica: str) -> np.ndarray:
    """The rows of ``table`` whose slot has ``primary`` first and ``replica`` among the rest."""
    ids = np.arange(omap.spec(table).rows)
    om = omap.owner_matrix(table)[omap.slot_of(table, ids)]
    return ids[(om[:, 0] == omap.index[primary]) & (om[:, 1:] == omap.index[replica]).any(axis=1)]


def test_owed_rows_merge_and_are_due_while_the_map_still_says_so():
    m = OwnershipMap(SPECS, PEERS, replicas=2, slots=32)
    mine = rows_of(m, "ngram", "p-a", "p-b")
    assert len(mine) >= 4
    owed = OwedRows()
    owed.add("p-b", "ngram", mine[:3])
    owed.add("p-b", "ngram", mine[1:4])  # overlapping: each row is owed once
    assert len(owed) == 4 and owed.by_peer() == {"p-b": 4}
    (debt,) = owed.due(m, "p-a")
    assert (debt.peer, debt.table, debt.ids.tolist()) == ("p-b", "ngram", sorted(mine[:4].tolist()))
    # p-c asks: it is not these rows' primary, so nothing is due and the record is forgotten
    other = OwedRows()
    other.add("p-b", "ngram", mine[:3])
    assert other.due(m, "p-c") == [] and len(other) == 0 and other.dropped == 3


def test_rows_whose_replica_or_primary_changed_are_no_longer_owed():
    m = OwnershipMap(SPECS, PEERS, replicas=2, slots=32)
    mine = rows_of(m, "value", "p-a", "p-b")
    owed = OwedRows()
    owed.add("p-b", "value", mine)
    gone = OwnershipMap(SPECS, ("p-a", "p-c"), replicas=2, slots=32)  # p-b left: its debt with it
    assert owed.due(gone, "p-a") == [] and len(owed) == 0 and owed.dropped == len(mine)
    owed.add("p-b", "value", mine)
    assert owed.due(None, "p-a") == [] and len(owed) == 0  # no map yet: nothing can be owed


def test_a_catch_up_settles_only_what_was_owed_when_it_read_the_rows():
    m = OwnershipMap(SPECS, PEERS, replicas=2, slots=32)
    mine = rows_of(m, "ngram", "p-a", "p-b")
    owed = OwedRows()
    owed.add("p-b", "ngram", mine[:4])
    (debt,) = owed.due(m, "p-a")
    owed.add("p-b", "ngram", mine[2:6])  # a later replay failed while the catch-up was on its way
    assert owed.settle("p-b", "ngram", debt.ids, debt.gen) == 2  # rows 0 and 1: rows 2, 3 owed again
    assert owed.by_peer() == {"p-b": 4}
    (again,) = owed.due(m, "p-a")
    assert again.ids.tolist() == sorted(mine[2:6].tolist()) and again.gen > debt.gen
    assert owed.settle("p-b", "ngram", again.ids, again.gen) == 4
    assert len(owed) == 0 and owed.due(m, "p-a") == [] and owed.settle("p-b", "ngram", again.ids, again.gen) == 0


def test_debts_are_kept_apart_by_replica_and_table():
    m = OwnershipMap(SPECS, PEERS, replicas=3, slots=32)
    a_b = rows_of(m, "ngram", "p-a", "p-b")
    a_c = rows_of(m, "value", "p-a", "p-c")
    owed = OwedRows()
    owed.add("p-b", "ngram", a_b[:5])
    owed.add("p-c", "value", a_c[:7])
    owed.add("p-c", "value", np.zeros(0, dtype=np.int64))  # nothing: no record
    debts = {(d.peer, d.table): d for d in owed.due(m, "p-a")}
    assert set(debts) == {("p-b", "ngram"), ("p-c", "value")} and owed.by_peer() == {"p-b": 5, "p-c": 7}
    owed.settle("p-b", "ngram", debts[("p-b", "ngram")].ids, debts[("p-b", "ngram")].gen)
    assert owed.by_peer() == {"p-c": 7}
