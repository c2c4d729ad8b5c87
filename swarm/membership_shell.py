"""The membership shell of a peer: SWIM's actions carried out over HTTP, their outcomes fed back to
the sans-I/O core (swarm/membership.py), and the table map re-cut when the live set changes.

One per peer, composed (not mixed in): it reaches the peer only through its public interface
(``members``, ``transport``, ``tables``, ``table_client``, ``timeline``, ``rejected``, ``table_work``,
``spawn``, ``event``, ``stopping``, ``wake``, ``forget``) and owns nothing of its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from .membership import MembershipError, SendLeave, SendPing, SendPingReq, SendSync
from .transport import PeerUnreachable

if TYPE_CHECKING:
    from .node import Peer

log = logging.getLogger("swarm")


class MembershipShell:
    def __init__(self, peer: "Peer"):
        self.peer = peer

    async def run(self) -> None:
        """Tick the core, carry out its actions, and follow the live set: wake the round when a
        peer died or left, re-cut the table map when the live set changed, release old slots."""
        p = self.peer
        alive_before = set(p.members.alive_ids())
        live_before: set[str] = set()  # the first pass adopts the map of whoever joined while we started
        last_release = time.monotonic()
        while not p.stopping:
            for action in p.members.tick(time.monotonic()):
                p.spawn(self.carry_out(action), "membership-action")
            alive, live = set(p.members.alive_ids()), set(p.members.live_ids())
            if alive != alive_before:
                p.wake()  # a round may now be complete (a peer died or left)
                for gone in alive_before - alive:
                    p.forget(gone)
                alive_before = alive
            if live != live_before:
                live_before = live
                await self.update_map()
            if time.monotonic() - last_release > 1.0:
                last_release = time.monotonic()
                await p.table_work(p.tables.release, time.monotonic())
            await asyncio.sleep(0.1)

    async def update_map(self) -> None:
        """Re-cut the tables over the live members and fetch the slots we newly own."""
        p = self.peer
        live = p.members.live_ids()
        if not live:  # we have left (we are no live member any more): the map stays as it was
            return
        fetch = await p.table_work(p.tables.set_members, live, time.monotonic())
        if fetch and p.winding_down():  # the run is over for every live peer: nobody reads them
            p.event("handoff", f"not fetching {len(fetch)} slots: every live peer has finished (view {p.tables.view})")
        elif fetch:
            p.event("handoff", f"fetching {len(fetch)} slots (view {p.tables.view})")
            p.spawn(p.table_client.fetch(fetch), "handoff")

    def addr_of(self, peer_id: str) -> str | None:
        """A live (alive or suspect) member's address, else None."""
        m = self.peer.members.get(peer_id)
        return m.addr if m is not None and m.state in ("alive", "suspect") else None

    def suspects(self) -> set[str]:
        return {m.peer_id for m in self.peer.members.members() if m.state == "suspect"}

    async def carry_out(self, action: Any) -> None:
        """Do one membership action over HTTP and feed the outcome back to the core."""
        p, now = self.peer, time.monotonic
        if isinstance(action, SendPing):
            t0 = now()
            try:
                reply = await p.transport.call(action.addr, "/v1/ping", action.msg, to=action.target, timeout=action.timeout)
                p.members.handle_ack(action.probe_id, reply, now(), origin=action.target)
                p.timeline.record_rtt(action.target, now() - t0)
            except (PeerUnreachable, MembershipError) as e:
                if isinstance(e, MembershipError):
                    p.rejected["membership"] += 1
                for req in p.members.probe_failed(action.probe_id, now()):
                    p.spawn(self.carry_out(req), "membership-action")
        elif isinstance(action, SendPingReq):
            try:
                reply = await p.transport.call(action.via_addr, "/v1/ping-req", action.msg, to=action.via, timeout=action.timeout)
                ok = bool(reply.get("ok"))
                p.members.ping_req_result(action.probe_id, ok, reply.get("ack") if ok else None, now())
            except (PeerUnreachable, MembershipError):
                p.members.ping_req_result(action.probe_id, False, None, now())
        elif isinstance(action, SendSync):
            try:
                reply = await p.transport.call(action.addr, "/v1/sync", action.msg, to=action.target, timeout=action.timeout)
                self._fed(functools.partial(p.members.handle_sync_reply, origin=action.target), reply, now())
            except PeerUnreachable:
                pass
        elif isinstance(action, SendLeave):
            try:
                await p.transport.call(action.addr, "/v1/leave", action.msg, to=action.target, timeout=action.timeout)
            except PeerUnreachable:
                pass

    def _fed(self, fn: Callable, *args: Any) -> None:
        """Feed a peer's reply to the membership core; a malformed one is logged and dropped."""
        try:
            fn(*args)
        except ValueError as e:
            self.peer.rejected["membership"] += 1
            log.warning("dropped a malformed membership reply: %s", e)

    async def forward_ping(self, ping: SendPing) -> dict:
        """For /v1/ping-req: ping the target on a requester's behalf."""
        try:
            ack = await self.peer.transport.call(ping.addr, "/v1/ping", ping.msg, to=ping.target, timeout=ping.timeout)
            return {"ok": True, "ack": ack}
        except PeerUnreachable:
            return {"ok": False}
