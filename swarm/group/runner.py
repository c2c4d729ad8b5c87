"""One rank's role in a host group: what the peer's one step loop (Peer.steps) does on a rank of a
torchrun group, so that the ranks stay in lockstep.

The group is one member of the gradient gossip and N members of the table map (docs/design.md,
"Host groups"). Rank 0, the leader, decides what every rank does next and says so with a small
broadcast at the top of each iteration (HostGroup.command): take step t, load this state, or stop.
A step is the same sequence of collectives on every rank, in this order:

  rows:   pull (counts, keys, rows) from the group's owners while the HTTP share runs on the loop
  compute forward and backward on this rank's own batch
  dense:  all_reduce (mean of the ranks' gradients, in the compute job); the leader then sends the
          group's one payload
  rows:   push (counts, keys, gradients, acks) to the group's primaries, the rest over HTTP
          (on the last step the pushes come before the payload, as on a plain peer)
  round:  the leader takes the round as any peer does and broadcasts the aggregate it stepped on;
          the others step on the same bits

Only the leader's payload goes over HTTP, so the bytes between hosts do not grow with the ranks.
A prefetched pull runs its collective part (keys, rows) at a fixed point of the step on every
rank -- right after the payload, before the pushes (HostGroup.prefetch_started waits for it) --
and only its HTTP part travels beside the rest of the step, so the collectives' order stays the
same on every rank.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable

import numpy as np
import torch

from ..core.lifecycle import RESYNC, STOP
from ..tables.http import replicate
from .comm import Comm
from .rows import GroupRows, merge_parts

if TYPE_CHECKING:
    from ..node import Peer

CMD_STEP, CMD_STATE, CMD_STOP = 1, 2, 3


class HostGroup:
    def __init__(self, peer: "Peer", comm: Comm, rank_ids: list[str]):
        self.peer = peer
        self.comm = comm
        self.rank_ids = rank_ids
        self.rows = GroupRows(comm, rank_ids, peer.replica.table_specs, row_dtype=peer.cfg.pull_dtype(),
                              push_dtype=peer.cfg.push_dtype)
        self.error: str | None = None
        self._pulls_collected = 0  # pulls whose collective part is done (prefetch_started waits on it)
        self._collected = asyncio.Event()

    @property
    def leader(self) -> bool:
        return self.comm.rank == 0

    def status(self) -> dict:
        return {"rank": self.comm.rank, "size": self.comm.world, "backend": self.comm.backend,
                "leader": self.rank_ids[0], "ranks": self.rank_ids, "device": str(self.peer.replica.device),
                "collective_bytes": self.comm.bytes_moved, "rows": vars(self.rows.stats).copy(),
                "error": self.error}

    # -- the role this rank plays in Peer.steps (the one step loop) ------------------------------
    @property
    def gossips(self) -> bool:
        return self.leader  # only the leader's payload goes over HTTP

    prefetch = True  # the collective part of a prefetch at a fixed point (prefetch_started)

    @property
    def ranks(self) -> int:
        return self.comm.world  # the leader's payload carries every rank's reduced gradient

    async def run(self, loop: Callable[["HostGroup"], Awaitable[None]]) -> None:
        """Run the peer's step loop as this rank; a broken group (a rank died, a collective timed
        out) ends this rank's training with an event, not a traceback."""
        try:
            await loop(self)
        except RuntimeError as e:  # what torch.distributed raises when a rank is gone
            self.error = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            self.peer.event("group-lost", self.error)
            self.peer.stop()

    async def begin(self) -> bool:
        """The leader waits for --min-peers (or syncs state) and hands its replica to every rank;
        the others wait for it. False: the leader stopped the group before its first step."""
        p = self.peer
        if self.leader:
            await p.until_ready()
            await self._send_state()
            return True
        while True:
            cmd, step, size = await p.work(self.comm.broadcast_ints, None, 3)
            if cmd == CMD_STATE:
                await self._load_state(step, size)
                return True
            if cmd == CMD_STOP:
                p.book.reset(step)
                return False
            raise RuntimeError(f"the leader sent command {cmd} before its state")

    async def command(self) -> int | str:
        """The leader decides (as a plain peer does) and tells every rank; the others obey."""
        p = self.peer
        if self.leader:
            decision = p.next_step()
            if decision is STOP:
                await p.work(self.comm.broadcast_ints, [CMD_STOP, p.book.step, 0], 3)
            elif decision is not RESYNC:  # (a re-sync: the others get the new state in resync)
                await p.work(self.comm.broadcast_ints, [CMD_STEP, decision, 0], 3)
            return decision
        while True:
            cmd, step, size = await p.work(self.comm.broadcast_ints, None, 3)
            if cmd == CMD_STOP:
                p.book.reset(step)
                return STOP
            if cmd == CMD_STATE:  # the leader re-synced: a prefetched pull is stale, as the leader's is
                await self._load_state(step, size)
                return RESYNC
            if cmd != CMD_STEP or step != p.book.step:
                raise RuntimeError(f"the leader sent command {cmd} for step {step} at our step {p.book.step}")
            p.started = True  # from now on a peer that joins through us syncs state first
            return step

    async def resync(self) -> None:
        """The leader re-syncs and hands its new state to the others; on the others (they loaded it
        in command) there is nothing left to do."""
        if self.leader:
            await self.peer.resync()
            await self._send_state()

    async def _send_state(self) -> None:
        """The leader's replica to every rank: at the start, and after the leader re-synced."""
        p = self.peer
        blob = await p.work(p.replica.state_blob)
        await p.work(self.comm.broadcast_ints, [CMD_STATE, p.book.step, len(blob)], 3)
        await p.work(self.comm.broadcast_bytes, blob, len(blob))

    async def _load_state(self, step: int, size: int) -> None:
        p = self.peer
        blob = await p.work(self.comm.broadcast_bytes, None, size)
        await p.work(p.replica.load_state_blob, blob)
        p.book.reset(step)
        p.members.set_meta(step=step)
        p.follow(step, self.rank_ids[0])

    @property
    def reducer(self) -> Callable[[torch.Tensor], None]:
        """The mean of the ranks' dense gradients, in place (on the training thread, in the step's job)."""
        return self.comm.all_reduce_mean_

    async def round(self, step: int) -> None:
        """The leader takes the round as any peer does and hands every rank the aggregate it stepped
        on; the others step on the same bits."""
        p = self.peer
        if self.leader:
            await p.take_round(step)  # marks "round" and "apply"
            await p.work(self.comm.broadcast_ints, [p.last_report.count], 1)
            await p.work(self.comm.broadcast_, p.aggregate)
            return
        (count,) = await p.work(self.comm.broadcast_ints, None, 1)
        await p.work(self.comm.broadcast_, p.aggregate)
        p.step_times.mark("round")
        await p.work(p.replica.apply_aggregate, p.aggregate, step, count)
        p.step_times.mark("apply")
        p.book.reset(step + 1)

    async def end(self) -> None:
        return None

    # -- rows ----------------------------------------------------------------------------------
    async def pull(self, want: dict[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """A step's rows: the group's share through the collective while the rest (ours, other
        hosts') comes through TableClient.pull; rows the group did not serve are pulled over HTTP."""
        p = self.peer
        omap = p.tables.map
        per_rank, rest = self.rows.split_pull(omap, want, down=p.shell.suspects())
        http = asyncio.ensure_future(p.table_client.pull(rest))
        try:
            ex = await p.work(self.rows.request, per_rank, omap.view)
            served = await p.table_work(self.rows.serve, p.tables, ex)
            got, missed = await p.work(self.rows.receive, ex, served)
        except BaseException:
            http.cancel()
            raise
        finally:
            self._pulls_collected += 1
            self._collected.set()
        rows = {t: torch.zeros(len(ids), self.rows.dims[t]) for t, ids in want.items()}

        def place(ids_by_table: dict[str, np.ndarray], got_rows: dict[str, torch.Tensor]) -> None:
            for t, r in got_rows.items():
                ids = ids_by_table[t]
                if len(ids):
                    rows[t][torch.from_numpy(np.searchsorted(want[t], ids))] = r

        rest_rows, missing = await http
        place(rest, rest_rows)
        place({t: ids for t, (ids, _) in got.items()}, {t: r for t, (_, r) in got.items()})
        if missed:  # asked in the group, not served there (a slot on the move, views differing)
            late_rows, late_missing = await p.table_client.pull(missed)
            place(missed, late_rows)
            for t, ids in late_missing.items():
                missing[t] = np.union1d(missing.get(t, ids[:0]), ids)
        return rows, missing

    async def prefetch_started(self, fut: asyncio.Future) -> None:
        """Wait until the prefetch's collectives are done (or it ended): the step's next
        collectives (the pushes, the round) must come after them on every rank alike."""
        target = self._pulls_collected + 1  # the prefetch's pull: it has not begun yet
        while self._pulls_collected < target and not fut.done():
            self._collected.clear()
            waiter = asyncio.ensure_future(self._collected.wait())
            await asyncio.wait({waiter, fut}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()

    async def push(self, row_grads: dict, missing: dict, step: int) -> None:
        """Row gradients to their primaries: the group's through the collective (applied before
        this returns), the rest over HTTP in the background as a plain peer does."""
        p = self.peer
        grads = p.drop_missing(row_grads, missing)
        omap = p.tables.map
        per_rank, rest = self.rows.split_push(omap, grads)
        await p.drain_pushes(keep=1)
        p.push_in_background(rest, key=f"{p.id}:{step}")
        ex = await p.work(self.rows.send_grads, per_rank, omap.view)
        acks, forward = await p.table_work(self.rows.apply, p.tables, ex, step)
        if forward:
            p.spawn(replicate(p.table_client, forward), "replicate")
        refused = await p.work(self.rows.exchange_acks, ex, acks, per_rank)
        if refused:
            by_table: dict[str, list] = {}
            for parts in refused.values():
                for t, part in parts.items():
                    by_table.setdefault(t, []).append(part)
            again = {t: merge_parts(items) for t, items in by_table.items()}
            p.push_in_background(again, key=f"{p.id}/retry:{step}")
