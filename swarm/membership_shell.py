"""The membership shell of a peer: SWIM's actions carried out over HTTP, their outcomes fed back to
the sans-I/O core (swarm/membership.py), and the table map re-cut when the live set changes.

A mixin of ``node.Peer``: it uses the peer's ``members``, ``transport``, ``tables``, ``table_client``,
``timeline`` and task helpers, and owns nothing of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from .membership import MembershipError, SendLeave, SendPing, SendPingReq, SendSync
from .transport import PeerUnreachable

log = logging.getLogger("swarm")


class MembershipShell:
    async def _membership_loop(self) -> None:
        alive_before = set(self.members.alive_ids())
        live_before: set[str] = set()  # the first pass adopts the map of whoever joined while we started
        last_release = time.monotonic()
        while not self._stop.is_set():
            for action in self.members.tick(time.monotonic()):
                self._spawn(self._carry_out(action))
            alive, live = set(self.members.alive_ids()), set(self.members.live_ids())
            if alive != alive_before:
                self._arrival.set()  # a round may now be complete (a peer died or left)
                for gone in alive_before - alive:
                    self._outboxes.pop(gone, None)
                alive_before = alive
            if live != live_before:
                live_before = live
                await self._update_map()
            if time.monotonic() - last_release > 1.0:
                last_release = time.monotonic()
                await self.table_work(self.tables.release, time.monotonic())
            await asyncio.sleep(0.1)

    async def _update_map(self) -> None:
        """Re-cut the tables over the live members and fetch the slots we newly own."""
        fetch = await self.table_work(self.tables.set_members, self.members.live_ids(), time.monotonic())
        if fetch:
            self._event("handoff", f"fetching {len(fetch)} slots (view {self.tables.view})")
            self._spawn(self.table_client.fetch(fetch))

    def _addr_of(self, peer_id: str) -> str | None:
        m = self.members.get(peer_id)
        return m.addr if m is not None and m.state in ("alive", "suspect") else None

    def _suspects(self) -> set[str]:
        return {m.peer_id for m in self.members.members() if m.state == "suspect"}

    async def _carry_out(self, action: Any) -> None:
        """Do one membership action over HTTP and feed the outcome back to the core."""
        now = time.monotonic
        if isinstance(action, SendPing):
            t0 = now()
            try:
                reply = await self.transport.call(action.addr, "/v1/ping", action.msg, timeout=action.timeout)
                self.members.handle_ack(action.probe_id, reply, now())
                self.timeline.record_rtt(action.target, now() - t0)
            except (PeerUnreachable, MembershipError) as e:
                if isinstance(e, MembershipError):
                    self.rejected["membership"] += 1
                for req in self.members.probe_failed(action.probe_id, now()):
                    self._spawn(self._carry_out(req))
        elif isinstance(action, SendPingReq):
            try:
                reply = await self.transport.call(action.via_addr, "/v1/ping-req", action.msg, timeout=action.timeout)
                ok = bool(reply.get("ok"))
                self.members.ping_req_result(action.probe_id, ok, reply.get("ack") if ok else None, now())
            except (PeerUnreachable, MembershipError):
                self.members.ping_req_result(action.probe_id, False, None, now())
        elif isinstance(action, SendSync):
            try:
                reply = await self.transport.call(action.addr, "/v1/sync", action.msg, timeout=action.timeout)
                self._membership_call(self.members.handle_sync_reply, reply, now())
            except PeerUnreachable:
                pass
        elif isinstance(action, SendLeave):
            try:
                await self.transport.call(action.addr, "/v1/leave", action.msg, timeout=action.timeout)
            except PeerUnreachable:
                pass

    def _membership_call(self, fn: Callable, *args: Any) -> None:
        """Feed a peer's reply to the membership core; a malformed one is logged and dropped."""
        try:
            fn(*args)
        except ValueError as e:
            self.rejected["membership"] += 1
            log.warning("dropped a malformed membership reply: %s", e)

    async def forward_ping(self, ping: SendPing) -> dict:
        """For /v1/ping-req: ping the target on a requester's behalf."""
        try:
            ack = await self.transport.call(ping.addr, "/v1/ping", ping.msg, timeout=ping.timeout)
            return {"ok": True, "ack": ack}
        except PeerUnreachable:
            return {"ok": False}
