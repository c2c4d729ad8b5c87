"""Local steps (--sync-every H): one round per window of H inner steps, run by the peer's step loop.

A window: H times, a batch, its rows (each pulled at most once per window, tables/window.py), one
step of the task's optimizer on this peer's local model; then the window's pseudo-gradient (global
minus local) goes through the codec (error feedback, --ef-decay) as round ``w``'s payload, the
window's row deltas go to their primaries (applied there before the payload goes, so the next
window pulls rows with every peer's window ``w`` in them; with --push-lead L they go L inner steps
before the window's end, so they travel while its last steps compute, and what those steps change
joins the next window's push), and the round's aggregate is one outer step on the global vector
(swarm/outer.py) that every peer applies alike; the next window's first rows are pulled
while that round completes (--prefetch, _begin_next), and its first inner step is taken before
it, on the peer's own model and rows, its progress carried onto the round's (--early-step,
_early_step). A peer clearly slower
than the others takes fewer than H inner steps, so that its windows end when theirs do, and its
payload says the samples behind it (core/cadence.py window_steps; docs/design.md "Uneven peers in
windows").

With --overlap, the round of window w travels while window w+1 computes: each loop iteration for
round w computes and sends window w+1, then takes round w (whose payloads arrived meanwhile). Window
w+1 therefore starts from the global model without window w's update: a one-window-delayed outer
update (docs/design.md, "Local steps"), and its rows, pulled while window w's pushes travel, are a
window stale as well. The first window after a start or a re-sync has nothing to overlap with: its
iteration computes window w first.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from .codec import Encoded
from .core import cadence

if TYPE_CHECKING:
    from .node import Peer
    from .roles import Role


class Ahead(NamedTuple):
    """An inner step of the window ahead: its batch and the pull its rows come in (a pull may
    serve several steps: --pull-steps)."""
    pulled: asyncio.Future
    batch: Any
    want: dict


class Early(NamedTuple):
    """A window's first inner step, taken while the last window's end travelled (--early-step):
    on the peer's own model and rows as that window left them, its progress carried onto the new
    global model (Replica.resume_local) and the window's rows (WindowRows.add_progress)."""
    window: int
    started: float  # when it began (monotonic s): the window's start
    ended: float
    samples: int
    want: dict  # {table: sorted-unique ids} its batch read
    rows: dict  # {table: what it moved those rows by, fp32 in ids order}
    dense: torch.Tensor  # what it moved the local model by (Replica.local_progress)


class LocalSteps:
    """The window side of a peer's step loop (Peer.steps calls ``round`` once per round)."""

    def __init__(self, peer: "Peer"):
        self.peer = peer
        self.h = peer.cfg.sync_every
        self.overlap = bool(peer.cfg.overlap)
        # windows end with the others' (a slow peer's are shorter) only without --overlap: there every
        # window starts when the last round is applied, so the peers' windows start together and
        # their times compare; overlapped, each peer's next window starts when its own last ended
        self.fit = bool(peer.cfg.free_run) and not self.overlap
        # our last windows: w -> (its start, when each inner step ended, when its payload went), monotonic s
        self.windows: dict[int, tuple[float, list[float], float]] = {}
        # our last windows' row pushes: w -> (when they went, when they were all answered or None)
        self.pushed: dict[int, tuple[float, float | None]] = {}
        # our last rounds: w -> when the other contributors' windows w were over, as we saw it, and
        # whether their row pushes said so (else their payloads)
        self.others_done: dict[int, tuple[float, bool]] = {}
        # the next window's first batch, its rows' pull started once our pushes of this one were
        # answered, so that it travels while the round completes: (that window, its first step)
        self.first: tuple[int, Ahead] | None = None
        # pulls this window's steps after its first have started (_refill): their size ramps up
        self.pulls = 0
        self.early: Early | None = None  # the next window's first step, taken at this one's end
        self.early_steps = 0  # inner steps taken so (the summary's early_steps)

    async def round(self, role: "Role", step: int) -> None:
        """Round ``step``: its window (unless an overlapped iteration sent it already), the next
        window with --overlap, then the round taken and the outer step applied."""
        peer = self.peer
        if peer.sent_through < step:
            if not await self.window(role, step):
                return  # stopped mid-window: nothing sent, the loop ends
        if self.overlap and not peer.is_last_round(step) and not peer.stopping:
            if not await self.window(role, step + 1, ends_step=False):
                return
        await role.round(step)  # marks "round" and "apply"
        done = self.others_done_at(step)
        if done is not None:
            self.others_done[step] = done
        await peer.after_step(step, peer.recent_loss())
        peer.step_times.mark("after")
        peer.step_times.end()

    async def window(self, role: "Role", w: int, ends_step: bool = True) -> bool:
        """Compute window ``w`` and send its payload and row pushes; False when the peer stopped
        before the window was done (nothing is sent). The step clock files each inner step; the
        window's last one also holds what follows it (send, and round and apply with ``ends_step``)."""
        peer, clock, rows = self.peer, self.peer.step_times, self.peer.window_rows
        # a peer slower than the others takes fewer inner steps, so the window ends when theirs do
        # (core/cadence.py window_steps); its payload says the samples behind it
        started, h, samples, ends = time.monotonic(), self.steps_for(w), 0, []
        last = peer.is_last_round(w)
        lead, pushed_early = self.lead(w, h, last), False
        # the rows of the next --row-lookahead inner steps travel while this one computes: a
        # window's first steps need the most new rows, more than one step's compute hides on a slow
        # link, its later ones few (most rows recur), so pulling further ahead evens the link out
        ahead: deque[Ahead] = deque()  # the next steps' batches, their rows' pulls started
        self.pulls = 0
        # its first inner step taken at the last window's end (--early-step, _early_step): the
        # window started then, and the local model goes on from that step's progress
        early, self.early = self._early_for(w), None
        if early is not None:
            started, samples, ends = early.started, early.samples, [early.ended]
            await peer.work(peer.replica.resume_local, early.dense)
        if self.first is not None and self.first[0] == w:  # begun at the end of the last window (_begin_next)
            ahead.append(self.first[1])
            self.first = None
        else:
            await self._cancel_first()
            await self._new_window_rows()
            if early is not None:
                ahead.append(await self._first_of(role, early))
        try:
            for i in range(len(ends), h):
                if peer.stopping:
                    return False
                clock.start()
                if not ahead:  # the window's first step
                    ahead.extend(await self._next_batch(role))
                pulled, batch, want = ahead.popleft()
                await pulled  # in order: rows an earlier pull claimed are in
                clock.mark("rows")
                ahead.extend(await self._refill(role, len(ahead), h - i - 1))
                # the swarm's inner step this one stands for (a short window's steps spread over its length)
                peer.inner_step = w * self.h + (i + 1) * self.length(w) // h
                stats = await peer.work(self._inner, batch, want)
                ends.append(time.monotonic())
                clock.mark("compute")
                peer.check_finite(stats, peer.inner_step - 1)
                peer.record_contribution(stats, None)
                samples += stats.samples if stats.finite else 0
                if lead and i + 1 == h - lead:
                    await self._push_early(role, w)
                    pushed_early = True
                    clock.mark("send")
                if self.fit and cadence.end_window_now(h, i + 1, self.others_in(w)):
                    # the swarm's window is over and waits for us: this step was our last (what
                    # was pulled ahead for the steps left out is dropped below)
                    peer.event("window", f"window {w}: the others' windows are over (their payloads or row "
                                         f"pushes are in); sending after {i + 1} "
                                         f"of {h} inner steps")
                    h, peer.inner_step = i + 1, w * self.h + self.length(w)
                    break
                if i + 1 < h:
                    clock.end()
                    peer.maybe_print()
        finally:
            pulls = list({id(a.pulled): a.pulled for a in ahead}.values())  # a pull serves several steps
            for fut in pulls:
                fut.cancel()
            await asyncio.gather(*pulls, return_exceptions=True)
        peer.window_steps = h
        if not last:  # the run's last window always pushes at its end: the summary says what the others did
            peer.push_lead = lead if pushed_early else 0
        pushes = None
        if pushed_early:  # the steps since the early push: their row deltas go with the next window's
            await peer.work(rows.carry_tail, 1.0 / self._contributors())
        else:
            pushes = await peer.work(rows.pushes, 1.0 / self._contributors())
        # the rows go before the payload without --overlap (below), and the last window's always
        # (Peer._settle_rows relies on it); with --overlap the payload goes first, as the round waits for it
        rows_first = not self.overlap or last
        held_s, landed = 0.0, False
        if rows_first and pushes is not None:
            await self._push(role, pushes, w)
        prefetch = not last and role.prefetch and peer.cfg.prefetch
        early_next = prefetch and not self.overlap and bool(peer.cfg.early_step) and not peer.stopping
        # the payload is encoded while the pushes travel (it goes only once they are answered), so
        # its encoding is not on the window's end; with an early step next, the local model stays
        # as it is (the step goes on from it) and the round brings it to the global model
        # with more contributors than --max-contributors each payload takes its share of the bytes
        # (read here, on the event loop: the membership is the loop's)
        share = peer.pacing.payload_share()
        enc: Encoded = await peer.work(self._payload, w, h, samples, early_next, share)
        if early_next:
            clock.mark("send")
            await self._early_step(role, w + 1)
            clock.mark("compute")
        if rows_first:
            # the window's row deltas are applied (at their primaries) before its
            # payload goes: a peer has round w only once every contributor's pushes of window w
            # landed, so window w+1 pulls rows with all of window w in them. Sent beside the
            # payload, they waited out the primaries' --push-window while the next window's first
            # pulls, its most frequent rows, read them without window w (a window stale). A push
            # held up (a primary just died, its slots moving) holds the payload a quarter of the
            # round's deadline at most, so the others' round does not time out on us. With
            # --overlap only the last window waits: once a peer has the last round, every
            # contributor's last pushes are applied at their primaries, so the final evaluations,
            # which read the primaries (Peer.evaluate), read the same rows
            bound = peer.cfg.round_timeout / 4
            waited = time.monotonic()
            landed = await peer.pushes_landed(bound)
            if not landed:
                peer.event("rows", f"window {w}: row pushes not answered within {bound:g} s; "
                                   "the payload goes without waiting for them")
            held_s = min(self._held(w), time.monotonic() - waited)
        peer.send_payload(enc)
        peer.sent_through = w
        self.windows[w] = (started, ends, time.monotonic())
        if landed and prefetch and not peer.stopping:
            await self._begin_next(role, w + 1)
        for book in (self.windows, self.pushed, self.others_done):
            for old in [k for k in book if k < w - 4]:
                del book[old]
        if not rows_first and pushes is not None:
            await self._push(role, pushes, w)
        peer.record_payload(enc)
        clock.mark("send")
        clock.move("send", "held", held_s)  # waiting for the others' pushes, not sending ours
        if not ends_step:
            clock.end()
        peer.maybe_print()
        return True

    async def _new_window_rows(self) -> None:
        """Empty the working copy for a new window; the last window's pulled rows are what its
        pulls may reuse (tables/held.py)."""
        await self.peer.work(self.peer.window_rows.clear)
        self.peer.table_client.next_window()

    async def _begin_next(self, role: "Role", w: int) -> None:
        """Window ``w``'s first batch is sampled and its rows' pull started now, once our pushes of
        window w - 1 are answered, so that it travels while round w - 1 completes (on a slow link a
        wait at every window's start: its first step needs the most new rows of the window). Only
        the first: the pulls of the steps after it would mostly wait for the last window's replays
        (read-your-writes), and starting them too was slower (docs/benchmarks.md). Each primary
        we pushed to has then applied every contributor's push of the last window (its flush waits
        for them all, PushBatcher), so these rows hold it as the window's later pulls do; a primary
        we did not push to, or a flush that went without a late pusher, may serve a row without
        that delta, as any pull may when a push is late. The outer step does not touch the rows.
        With an early step (_early_step) the pull is of its rows, again, and the next step's."""
        await self._new_window_rows()
        first = await self._first_of(role, self._early_for(w))
        self.first = (w, first)
        await role.prefetch_started(first.pulled)  # a host group: its collectives before the round's

    def _early_for(self, w: int) -> Early | None:
        """The early step taken for window ``w``, if that is the one we hold."""
        return self.early if self.early is not None and self.early.window == w else None

    async def _first_of(self, role: "Role", early: Early | None) -> Ahead:
        """A window's first pull (its rows empty): its first step's batch; or, when that step was
        taken early, its rows pulled again from their owners (the last window's pushes in them now)
        and moved by what the step did to them, together with the next step's batch: the window's
        first step to take waits for both."""
        if early is None:
            return (await self._next_batch(role))[0]
        peer, rows = self.peer, self.peer.window_rows
        need = await peer.work(rows.claim, early.want)

        async def again() -> None:
            await self._pull_into_window(role, need)
            await peer.work(rows.add_progress, early.want, early.rows)

        moved = asyncio.ensure_future(again())
        nxt = (await self._next_batch(role))[0]

        async def both() -> None:
            await moved
            await nxt.pulled

        fut = asyncio.ensure_future(both())
        # cancelled (a stop, a re-sync), it takes both pulls with it, started or not
        fut.add_done_callback(lambda f: f.cancelled() and (moved.cancel(), nxt.pulled.cancel()))
        return Ahead(fut, nxt.batch, nxt.want)

    async def _early_step(self, role: "Role", w: int) -> None:
        """Window ``w``'s first inner step, taken now, at the end of window w - 1 (--early-step):
        the pushes of w - 1 are being applied and its round completes, which on a slow link takes
        about a second in which the cores would sit idle. The step runs on this peer's own model and
        rows as window w - 1 left them (its rows that window did not pull are pulled now, as their
        owners hold them), as one more local step would; what it moves is kept (Early) and added to
        the new global model and to the rows pulled again once the round and the pushes are in
        (window, _first_of). Its gradient is thus a round old, once a window, as with --overlap for
        every step of a window; the payload of w - 1 was taken before it, so it goes into window w's."""
        peer, rows = self.peer, self.peer.window_rows
        t0 = time.monotonic()
        batch, want = await peer.sample_batch()
        # the window's pulls are over (or cancelled): what they claimed and never brought is pulled
        await self._pull_into_window(role, await peer.work(rows.missing, want, False))
        before = await peer.work(rows.rows, want)  # copies
        peer.inner_step = w * self.h + 1
        stats = await peer.work(self._inner, batch, want)
        peer.check_finite(stats, peer.inner_step - 1)
        peer.record_contribution(stats, None)

        def progress() -> tuple[dict, torch.Tensor]:
            after = rows.rows(want)
            return {t: after[t] - before[t] for t in want}, peer.replica.local_progress()

        moved, dense = await peer.work(progress)
        self.early = Early(w, t0, time.monotonic(), stats.samples if stats.finite else 0, want, moved, dense)
        self.early_steps += 1

    async def _cancel_first(self) -> None:
        first, self.first = self.first, None
        if first is not None:
            first[1].pulled.cancel()
            await asyncio.gather(first[1].pulled, return_exceptions=True)

    async def drop_next(self) -> None:
        """Forget the next window's first pull and its early step (_begin_next, _early_step) when
        they will not be used: a re-sync, a stop, a window other than the one they were begun for."""
        self.early = None
        await self._cancel_first()

    def _contributors(self) -> int:
        """P, the swarm's contributors: each peer's row delta counts 1/P, so a row's update is the
        mean over the swarm of the peers' deltas (zero for a peer that did not touch it), as the
        dense part's is."""
        return 1 + sum(1 for m in self.peer.metas().values() if m.contributor)

    async def _push_early(self, role: "Role", w: int) -> None:
        """--push-lead: window ``w``'s row deltas so far go to their primaries now, in the
        background, while the window's last inner steps compute (on a slow link they took the time
        between the window's end and its payload); what those steps change after it is carried to
        the next window's push (WindowRows.rebase, carry_tail). The payload still waits for them to
        be answered, so the next window's rows hold every peer's push of this one."""
        rows, scale = self.peer.window_rows, 1.0 / self._contributors()

        def take() -> dict:
            out = rows.pushes(scale)
            rows.rebase()
            return out

        await self._push(role, await self.peer.work(take), w)

    async def _push(self, role: "Role", pushes: dict, w: int) -> None:
        """Window ``w``'s row pushes go (in the background), and when they are all answered is
        noted: how long they took sets the next windows' --push-lead auto. Not counted: the time a
        primary held them for the window's other pushes (its flush waits for every contributor's,
        PushBatcher), which leading ours would not shorten; counted, an early pusher's lead grew
        with the others' lateness, to H/4 (measured, docs/benchmarks.md)."""
        await role.push(pushes, {}, w)
        sent = time.monotonic()
        self.pushed[w] = (sent, None)

        async def landed() -> None:
            if await self.peer.pushes_landed(self.peer.cfg.round_timeout) and self.pushed.get(w, (None,))[0] == sent:
                held = self._held(w)
                self.pushed[w] = (sent, max(sent, time.monotonic() - held))

        self.peer.spawn(landed(), "push-timing")

    def _held(self, w: int) -> float:
        """Seconds window ``w``'s row pushes were held at their primaries for the rest of their
        flushes (the others' pushes), the most of any; 0 before their answers came."""
        client = self.peer.table_client
        return client.push_held(f"{self.peer.id}:{w}") if client is not None else 0.0

    def lead(self, w: int, h: int, last: bool) -> int:
        """Inner steps before the end of window ``w`` (of ``h``) at which its row pushes go:
        --push-lead, or with auto what core/cadence.py push_lead makes of the newest of our windows
        whose pushes were timed. None in the last window: nothing computes after it to hide them
        behind, and the deltas of its last steps would stay carried."""
        if last or h < 2:
            return 0
        if self.peer.cfg.push_lead >= 0:
            return min(self.peer.cfg.push_lead, h - 1)
        for r in sorted((r for r in self.pushed if r < w and r in self.windows), reverse=True):
            sent, landed = self.pushed[r]
            started, ends, _ = self.windows[r]
            if landed is not None:
                return min(h - 1, cadence.push_lead(h, [e - started for e in ends], landed - sent))
        return 0

    async def _refill(self, role: "Role", queued: int, left: int) -> list[Ahead]:
        """The inner steps whose rows to start pulling now, with ``queued`` steps' pulls started
        and ``left`` steps of the window after this one: up to --row-lookahead steps ahead, in
        pulls of a ramp of steps each (cadence.pull_group: 2, 3, ... up to --pull-steps; the
        window's last ones may be fewer), none while fewer than the next pull's steps are free."""
        out: list[Ahead] = []
        room = min(left, self.peer.cfg.row_lookahead) - queued
        while room > 0:
            group = cadence.pull_group(self.pulls, self.peer.cfg.pull_steps, self.peer.cfg.row_lookahead)
            if room < group and queued + len(out) + room != left:
                break
            n = min(room, group)
            out += await self._next_batch(role, n)
            self.pulls += 1
            room -= n
        return out

    async def _next_batch(self, role: "Role", n: int = 1) -> list[Ahead]:
        """Sample the next ``n`` batches now (training thread) and start one pull of their rows
        that this window has neither pulled nor claimed yet; its future is done once they are in
        the working copy (rows an earlier, unfinished pull claimed are in once that pull's future
        is done). One pull for several steps because a request costs CPU at both ends (HTTP,
        authentication, the owner's table work) on the cores the inner steps share."""
        peer = self.peer
        batches, need = [], {}
        for _ in range(n):
            batch, want = await peer.sample_batch()
            batches.append((batch, want))
            for t, ids in (await peer.work(peer.window_rows.claim, want)).items():
                need[t] = np.union1d(need[t], ids) if t in need else ids  # each id claimed once: disjoint

        pulled = asyncio.ensure_future(self._pull_into_window(role, need))
        return [Ahead(pulled, batch, want) for batch, want in batches]

    async def _pull_into_window(self, role: "Role", need: dict[str, np.ndarray]) -> None:
        """Pull ``need`` (ids not in the window yet) and add the rows to the window's working copy."""
        if any(len(ids) for ids in need.values()):
            got, absent = await role.pull(need)
            await self.peer.work(self.peer.window_rows.add, need, got, absent)

    def length(self, w: int) -> int:
        """The swarm's length of window ``w``: H, but the run's last window takes the inner steps
        --steps has left (--steps need not be a multiple of H)."""
        steps = self.peer.cfg.steps
        return min(self.h, steps - w * self.h) if steps and self.peer.is_last_round(w) else self.h

    def steps_for(self, w: int) -> int:
        """Inner steps window ``w`` takes: its length (H, or what is left in the run's last), or
        fewer (--free-run 1, no --overlap): what core/cadence.py window_steps makes of the newest of
        our windows whose round was taken knowing when the others' ended (others_done_at then,
        against when ours was over by the same mark: cadence.window_over)."""
        return min(self.length(w), self._fit_steps(w))

    def _fit_steps(self, w: int) -> int:
        if not self.fit:
            return self.h
        for r in sorted((r for r in self.windows if r < w), reverse=True):
            done = self.others_done.get(r)
            if done is not None:
                others, by_pushes = done
                started, ends, sent = self.windows[r]
                pushed = self.pushed.get(r)
                ours = cadence.window_over(ends, sent, pushed[0] if pushed else None, by_pushes)
                return cadence.window_steps(self.h, [e - started for e in ends], ours - started, others - started)
        return self.h

    def others_done_at(self, w: int) -> tuple[float, bool] | None:
        """When every other contributor's window ``w`` was over, as we saw it (monotonic s), and
        whether their row pushes said so (None: not yet, or nobody else): their payloads all in, or
        earlier, their row pushes of it all in at our primary. With --window-push-wait their payloads
        wait for our own push (a primary holds a window's pushes until every contributor's is in),
        so they come in when our window ends, however long it takes, and only the pushes say when
        theirs did."""
        others = self.peer.expected(w) - {self.peer.id}
        if not others:
            return None
        payloads, pushes = self.peer.pacing.completed_at(w), self._pushed_in(w, others)
        if pushes is not None and (payloads is None or pushes <= payloads):
            return pushes, True
        return (payloads, False) if payloads is not None else None

    def others_in(self, w: int) -> bool:
        """Every other contributor's window ``w`` is over: their payloads for round ``w`` are in, or
        their row pushes of it (others_done_at; there is at least one other)."""
        others = self.peer.expected(w) - {self.peer.id}
        if not others:
            return False
        return not self.peer.book.missing(w, others) or self._pushed_in(w, others) is not None

    def _pushed_in(self, w: int, others: set[str]) -> float | None:
        """When ``others``' row pushes of window ``w`` were all in at our primary (None: not yet, or
        we hold no tables)."""
        client = self.peer.table_client
        return client.pushed_in(w, others) if client is not None else None

    def _inner(self, batch: Any, want: dict) -> Any:
        """One inner step on the window's working rows (training thread)."""
        rows = self.peer.window_rows.rows(want)
        t0 = time.perf_counter()
        stats, row_grads = self.peer.replica.inner_step(batch, want, rows)
        self.peer.slow_down(t0, batch, want, rows)
        self.peer.window_rows.update(row_grads)
        return stats

    def _payload(self, w: int, steps: int, samples: int, keep: bool = False, share: int = 1) -> Encoded:
        """The window's pseudo-gradient, compressed as round ``w``'s payload, saying the ``samples``
        behind it (its weight where the window's payloads say different ones: a slow peer's short
        window, core/cadence.py window_steps); a window of fewer ``steps`` than its length also moves the
        learning-rate schedule on by the steps it left out, so it stays the swarm's (training thread).
        ``keep``: the local model stays as it is, for an early step to go on from (_early_step).
        ``share``: the contributor cap's k (Pacing.payload_share): the payload carries 1/k of the
        entries (and of the byte floor) a sparse codec would send, the rest kept in the error
        feedback (docs/design.md, "The cap in windows")."""
        replica = self.peer.replica
        if steps < self.length(w):
            replica.skip_schedule(self.length(w) - steps)
        return self.peer.compressor.compress(replica.end_window(self.overlap or keep, w), w, samples=samples or None,
                                             share=share)
