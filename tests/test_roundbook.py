"""Unit tests of the round book: which payloads form a round, and when a round may be taken."""

from dataclasses import dataclass

import pytest
import torch

from swarm import roundbook
from swarm.roundbook import RoundBook, aggregate_into


@dataclass
class C:
    step: int
    sender: str
    value: float = 1.0

    def add_to(self, out, weight: float = 1.0) -> None:
        out += weight * self.value


def test_round_waits_for_every_expected_peer_then_completes():
    book = RoundBook()
    exp = {"a", "b", "c"}
    assert book.offer(C(0, "a")) == roundbook.ACCEPTED
    assert not book.ready(0, exp, now=0.0, timeout=5.0)
    book.offer(C(0, "c"))
    assert book.missing(0, exp) == ["b"]
    book.offer(C(0, "b"))
    assert book.ready(0, exp, now=0.1, timeout=5.0)
    r = book.take(0, exp, now=0.1, timeout=5.0)
    assert r.contributors == ["a", "b", "c"] and not r.timed_out and book.step == 1


def test_deadline_lets_a_round_go_ahead_without_a_silent_peer():
    book = RoundBook()
    exp = {"a", "b"}
    book.offer(C(0, "a"))
    assert not book.ready(0, exp, now=10.0, timeout=2.0)  # first ask starts the clock
    assert not book.ready(0, exp, now=11.9, timeout=2.0)
    assert book.ready(0, exp, now=12.0, timeout=2.0)
    r = book.take(0, exp, now=12.0, timeout=2.0)
    assert r.timed_out and r.missing == ["b"] and book.stats.timed_out_rounds == 1


def test_late_payload_joins_the_next_round_once():
    book = RoundBook()
    book.offer(C(0, "a"))
    book.take(0, {"a"}, now=0, timeout=1)
    assert book.offer(C(0, "b", 2.0)) == roundbook.LATE
    assert book.offer(C(0, "b", 2.0)) == roundbook.DUPLICATE
    book.offer(C(1, "a"))
    book.offer(C(1, "b"))
    r = book.take(1, {"a", "b"}, now=0, timeout=1)
    assert [c.sender for c in r.late] == ["b"]
    out = torch.zeros(1)
    assert aggregate_into(out, r) == 3
    assert out.item() == pytest.approx((1 + 1 + 2) / 2)  # mean over on-time senders, late joins with same weight
    assert book.offer(C(0, "b")) == roundbook.DUPLICATE  # already applied as a late payload
    assert book.offer(C(1, "a")) == roundbook.DUPLICATE  # already applied on time


def test_duplicates_far_future_and_stale_are_refused():
    book = RoundBook(max_ahead=8, max_staleness=2)
    assert book.offer(C(3, "a")) == roundbook.ACCEPTED
    assert book.offer(C(3, "a")) == roundbook.DUPLICATE
    assert book.offer(C(8, "a")) == roundbook.TOO_FAR_AHEAD
    book.reset(10)
    assert book.offer(C(7, "a")) == roundbook.TOO_OLD
    assert book.offer(C(8, "a")) == roundbook.LATE
    assert 3 not in book.pending  # reset drops what is older than the new step


def test_aggregate_order_is_fixed_by_sender():
    """Two peers holding the same payloads, received in different orders, compute identical bits."""
    torch.manual_seed(0)
    vals = {s: torch.randn(1000) for s in "pqrs"}

    @dataclass
    class V:
        step: int
        sender: str

        def add_to(self, out, weight=1.0):
            out.add_(vals[self.sender], alpha=weight)

    outs = []
    for order in ("pqrs", "srqp", "qspr"):
        book = RoundBook()
        for s in order:
            book.offer(V(0, s))
        out = torch.zeros(1000)
        aggregate_into(out, book.take(0, set("pqrs"), now=0, timeout=1))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_take_out_of_order_is_an_error():
    book = RoundBook()
    with pytest.raises(ValueError):
        book.take(1, set(), now=0, timeout=1)


def test_active_senders_window():
    book = RoundBook()
    book.offer(C(0, "a"))
    book.offer(C(1, "b"))  # b starts one round later, and is early with it
    assert book.active_senders(0, window=2) == set()
    book.take(0, {"a"}, now=0, timeout=1)
    assert book.active_senders(1, window=2) == {"a"}  # not b: its payloads are all for round 1 on
    book.offer(C(1, "a"))
    book.take(1, {"a", "b"}, now=0, timeout=1)
    assert book.active_senders(2, window=2) == {"a", "b"}
    book.offer(C(2, "b"))
    book.take(2, {"a", "b"}, now=5, timeout=1)  # a missed round 2: still in the window through round 1
    assert book.active_senders(3, window=2) == {"a", "b"}
    assert book.active_senders(4, window=2) == {"b"}
