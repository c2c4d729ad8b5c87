"""When a peer contributes: the round it declares next, and whether it holds rounds up (sans-I/O).

Two things keep a growing or uneven swarm from costing each peer more (docs/design.md, "Uneven
peers and large swarms"):

* **A cap on contributors.** With P contributing members and a cap of C, k = ``floor(P / C)``.
  By bytes (the default, and windows of local steps always) every peer sends every round at 1/k of
  its entries (swarm/pacing.py: nothing here but k). By rounds (--cap-by rounds) each peer sends a
  payload every k rounds, in the rounds whose number is its phase (its rank among the members'
  sorted ids) modulo that stride; between two payloads it sums its steps' gradients, so no sample
  is lost; the payload says the samples behind it and weighs by them.
* **Free-running slow peers.** A peer whose compute takes clearly longer than the swarm's median
  stops waiting for each round: it computes step after step, takes the rounds that are complete
  when it looks, and sends what it has summed when its declared round is about to close.

Every payload names the next round its sender contributes to, and so does its member metadata:
a round expects exactly the peers that declared it (core/rounds.py). The contributor set of a round
is thus fixed by its senders ahead of time, and every peer that holds the same payloads computes the
same aggregate. Nothing here reads a clock: times come in as arguments.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Sequence

__all__ = ["cap_stride", "phase", "next_round", "window_steps", "end_window_now", "push_lead", "Pace", "SLOW_FACTOR", "FAST_AGAIN", "MIN_SEEN",
           "MAX_STRIDE", "WINDOW_FIT", "window_over"]

SLOW_FACTOR = 1.5  # compute this x longer than the swarm's median: stop holding rounds up
FAST_AGAIN = 1.2  # ... and hold them again (wait for each round) once under this x
MIN_SEEN = 8  # steps of our own timed before we judge
MAX_STRIDE = 8  # rounds between two payloads of one peer, at most (well under max_staleness)
MARGIN = 1.2  # a free-running peer declares rounds its compute fits into with this much to spare
LEAD_SHARE = 4  # --push-lead auto leads a window's row pushes by at most 1/this of its inner steps
WINDOW_FIT = 1.1  # a whole window is shortened only when it ended over this x later than the others' (or cut with over 1 - 1/this of it left)


def cap_stride(contributors: int, cap: int, limit: int | None = MAX_STRIDE) -> int:
    """Rounds between two payloads of a peer so that at least ``cap`` (and fewer than 2 x ``cap``)
    of ``contributors`` send per round: floor(contributors / cap), at least 1, so a robust rule
    always has ``cap`` payloads to work on; ``cap`` 0 is no cap (every round). At most ``limit``
    (MAX_STRIDE: the sum of a peer's steps between two payloads stays fresher than
    --max-staleness); None: no limit, for the share of a payload when the cap holds by bytes,
    which sums nothing (swarm/pacing.py: every peer sends every round, at 1/k of its entries)."""
    if cap <= 0 or contributors < 2 * cap:
        return 1
    k = contributors // cap
    return k if limit is None else min(limit, k)


def phase(self_id: str, ids: Collection[str], stride: int) -> int:
    """Our rank among the contributing ids (ours included), sorted, modulo ``stride``: peers that
    see the same members spread evenly over the rounds."""
    ranked = sorted(set(ids) | {self_id})
    return ranked.index(self_id) % max(1, stride)


def next_round(after: int, stride: int, cap_k: int, ph: int) -> int:
    """The round to contribute to after round ``after``: at least ``stride`` rounds on, and (with a
    cap stride ``cap_k`` > 1) on our phase, so peers keep their places in the rotation."""
    r = after + max(1, stride)
    if cap_k > 1:
        r += (ph - r) % cap_k
    return r


def window_steps(h: int, ends: Sequence[float], sent: float, others: float) -> int:
    """Inner steps this peer takes in its next window of ``h`` (--sync-every), so that it ends when
    the other contributors' windows do, from the last window measured (seconds from its start):
    ``ends``, when each of its inner steps ended; ``sent``, when its payload went (after the row
    pushes); ``others``, when the other contributors' payloads were all in.

    Late (``sent`` after ``others``): the steps that had ended by ``others`` less the time its
    pushes took after its last step (at least 1): what it computed in the time the others took,
    measured on this machine as it was (a slow peer sharing cores with fast ones computes faster
    once they wait, so a rate would overestimate it). Early or on time: its steps scaled by
    others / sent, up to ``h``, so a window cut short grows back when the peer speeds up. A peer
    at ``h`` keeps ``h`` while it is late by less than WINDOW_FIT or by one step: noise never
    shortens equal peers' windows. Each peer decides for itself: a window's round is still one payload per
    contributor, saying the samples behind it, so its contributor set does not depend on this."""
    last = len(ends)
    if h < 1 or not 1 <= last <= h:
        raise ValueError(f"a window of {h} takes 1..{h} inner steps, got {last}")
    times = [*ends, sent, others]
    if not all(math.isfinite(t) for t in times) or not 0 < ends[-1] <= sent or others <= 0:
        return last
    k = others / sent
    if k >= 1:
        return max(1, min(h, round(last * k)))
    deadline = others - (sent - ends[-1])
    fit = max(1, sum(1 for e in ends if e <= deadline))
    if last == h and (k * WINDOW_FIT >= 1 or fit >= h - 1):
        return h  # a whole window late by noise, or by one step: not worth a step of the window
    return fit


def window_over(ends: Sequence[float], payload_sent: float, pushes_sent: float | None, by_pushes: bool) -> float:
    """When our own window was over, for window_steps' ``sent``, by the mark the others' was taken
    with (every time on one clock; ``ends``: when each inner step ended). Taken from their payloads
    (``by_pushes`` False): when our payload went. From their row pushes all in at our primary:
    when ours went (``pushes_sent``; at least our last step's end, as a push led by --push-lead went
    before it). Not our payload against their pushes: our payload goes once our pushes are answered,
    and a primary answers once it has every contributor's push of the window (--window-push-wait),
    so that mark always trails theirs by the pushes' upload and the flush: on a 1 MB/s link with
    dense payloads it made equal peers plan windows half as long, window after window."""
    if not by_pushes or pushes_sent is None or not ends:
        return payload_sent
    return max(pushes_sent, ends[-1])


def end_window_now(h: int, done: int, others_in: bool) -> bool:
    """End the window after ``done`` of its ``h`` inner steps, because every other contributor's
    payload for it is in (``others_in``): the swarm's window is over and it waits for ours. Only
    with more than WINDOW_FIT's worth of it and at least 2 steps left, so equal peers do not cut a
    step or two on noise."""
    return others_in and 1 <= done < h and (h - done) > max(1.0, (WINDOW_FIT - 1) * h)


def push_lead(h: int, ends: Sequence[float], push_s: float) -> int:
    """Inner steps before the end of a window of ``h`` at which its row pushes go (--push-lead
    auto), from the last window measured: ``ends``, when each of its inner steps ended (seconds
    from its start), whose median step time is the unit; ``push_s``, how long its pushes took from
    sent to answered. As many steps as cover the pushes, so the payload, which waits for them, need
    not (they travel while the last steps compute); none where they take under half a step (not
    worth carrying a single step's row deltas to the next window); at most ``h`` // LEAD_SHARE, as
    those steps' deltas go a window late, which costs loss."""
    step_s = _median(b - a for a, b in zip([0.0, *ends], ends))
    if h < 2 or step_s is None or not (math.isfinite(step_s) and math.isfinite(push_s)) or step_s <= 0 \
            or push_s < step_s / 2:
        return 0
    return min(h // LEAD_SHARE, math.ceil(push_s / step_s))


def pull_group(started: int, most: int, lookahead: int) -> int:
    """Inner steps the next row pull of a window asks for, ``started`` pulls after its first
    (--pull-steps ``most``, --row-lookahead ``lookahead``): 2, 3, ... up to the most. A window's
    first steps bring most of its new rows (later ones mostly recur), so its first pulls are kept
    small, as they are what its first steps wait for on a slow link; its later pulls carry few rows
    each and cost mostly a request at both ends (CPU on cores the inner steps share), so they
    take more steps each (docs/design.md "Tables in windows")."""
    return max(1, min(most, lookahead, started + 2))


def _median(xs) -> float | None:
    s = sorted(xs)
    return s[len(s) // 2] if s else None


@dataclass
class Pace:
    """This peer's compute time against the swarm's: whether it is slow enough to run free, the
    stride its speed needs, and when its declared round is due."""

    window: int = 16
    computes: deque = field(default_factory=lambda: deque(maxlen=16))  # seconds per step, ours
    completions: deque = field(default_factory=lambda: deque(maxlen=17))  # (round, time it completed)
    free: bool = False

    def computed(self, seconds: float) -> None:
        self.computes.append(float(seconds))

    def completed(self, rnd: int, t: float) -> None:
        """Round ``rnd`` became complete (its last expected payload arrived) at time ``t``."""
        if self.completions and rnd <= self.completions[-1][0]:
            return
        self.completions.append((int(rnd), float(t)))

    def step_s(self) -> float | None:
        """Our median compute time per step, seconds."""
        return _median(self.computes)

    def period(self) -> float | None:
        """The swarm's median time per round, from the rounds' completion times (None: too few)."""
        c = list(self.completions)
        gaps = [(t1 - t0) / (r1 - r0) for (r0, t0), (r1, t1) in zip(c, c[1:]) if r1 > r0]
        return _median(gaps) if len(gaps) >= 2 else None

    def update(self, others_s: Collection[float]) -> bool:
        """Decide, from the other contributors' compute times, whether we run free; returns it."""
        mine, theirs = self.step_s(), _median([x for x in others_s if x > 0])
        if mine is None or theirs is None or len(self.computes) < MIN_SEEN:
            return self.free
        if not self.free and mine > SLOW_FACTOR * theirs:
            self.free = True
        elif self.free and mine < FAST_AGAIN * theirs:
            self.free = False
        return self.free

    def stride(self) -> int:
        """Rounds our compute needs between two payloads: 1 when we keep up, else enough rounds of
        the swarm's period to fit a step with MARGIN to spare."""
        mine, per = self.step_s(), self.period()
        if not self.free or mine is None:
            return 1
        if per is None or per <= 0:
            return 2
        return max(2, min(MAX_STRIDE, math.ceil(MARGIN * mine / per)))

    def due(self, rnd: int, now: float) -> bool:
        """A free-running peer at a step boundary: send round ``rnd``'s payload now, because the
        swarm is computing it already, or will close it before our next step would end."""
        if not self.completions:
            return True
        last, t = self.completions[-1]
        if rnd <= last + 1:
            return True
        per, mine = self.period(), self.step_s()
        if per is None or mine is None:
            return False
        return now + MARGIN * mine >= t + (rnd - last - 1) * per
