"""The aiohttp shell of the per-client limits (swarm/limits.py): who a connection or a request is
charged to, 429 answers with ``Retry-After``, and a listening site that sees every connection.

Who a client is (docs/security.md, "Per-client limits"):
  * a request whose signature verified (``request[bodies.SENDER]``, the signer's peer id, set by
    server.authenticate): that member, whatever its address;
  * before its signature is checked (the screen, below), a request from the address of a host where
    a live member (or this peer) is: that member host, with the member budget times the members
    there, so that the new connections of several peers on one machine are not refused before
    they can show who they are; the request moves to its member's own budget once it verified;
  * anyone else: the outsider at its address (IPv6: its /64, which one host usually holds).

Order of the checks (``build_app``'s middlewares ``screen, authenticate, admit, errors``):
  1. a new connection is charged to its address right after ``accept()`` (GuardedListener): over the
     address's connection cap, or with its request budget spent, it gets a fixed ``HTTP/1.1 429``
     and is closed before asyncio makes a transport, parses HTTP or (under TLS) shakes hands;
  2. ``screen``, before authentication reads a body or checks a signature: the request is charged
     to its connection's client: the member a connection belongs to once it carried that member's
     authenticated request, else its address. Unauthenticated floods and forged signatures are
     refused here, at the price of one HTTP parse;
  3. ``admit``, after authentication: a request that turned out to be a member's gives its address
     its token back and is charged to the member's own budget instead; its connection then counts
     against the member, not the address. ``/api/events`` streams are counted here.
So an outsider at another address can never spend a member's budget, and one at the same address
can only delay that member's new connections (its established ones are its own).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping
from urllib.parse import urlsplit

from aiohttp import web

from .bodies import SENDER, error_response
from .limits import MEMBER, OUTSIDER, Decision, Key, Limits, parse_budget, MEMBER_BUDGET, OUTSIDER_BUDGET

if TYPE_CHECKING:
    from .node import Peer

log = logging.getLogger(__name__)

EVENTS_PATH = "/api/events"
# request key: (client key, scale) that screen took a token from
CHARGED = web.RequestKey("swarm_charged", tuple) if hasattr(web, "RequestKey") else "swarm.charged"
BACKLOG = 1024  # listen queue: a burst of connections waits there to be refused, not in SYN retries
# An outsider's refusal is held back this long: the connection waits, costing nothing but a
# descriptor, instead of coming straight back for another refusal. A flood's rate is then bounded by
# its connections, not by how fast we can say no (docs/security.md).
TARPIT_S = 2.0
HELD_MAX = 1024  # refused connections held at once; beyond that they are refused at once
HOSTS_TTL = 5.0  # seconds the member hosts are cached (at most; a membership change refreshes them)


def client_address(remote: str | None) -> str:
    """The address an outsider is keyed by: IPv4 as it is, IPv6 by its /64."""
    addr = remote or ""
    if addr.startswith("::ffff:") and "." in addr:
        return addr[7:]  # an IPv4 client on a dual-stack socket
    if ":" in addr:
        try:
            return str(ipaddress.ip_network(f"{addr.split('%')[0]}/64", strict=False))
        except ValueError:
            return addr
    return addr


def _refusal_bytes(retry: int) -> bytes:
    body = json.dumps({"error": f"too many connections or requests from this address; retry after {retry} s",
                       "code": "rate_limited"}).encode()
    return (f"HTTP/1.1 429 Too Many Requests\r\nRetry-After: {retry}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


_REFUSALS = {n: _refusal_bytes(n) for n in range(1, 11)}


class _Conn:
    """Who one open connection is charged to."""

    __slots__ = ("key", "scale")

    def __init__(self, key: Key, scale: int):
        self.key = key
        self.scale = scale


class _Guarded(asyncio.Protocol):
    """Wraps the protocol aiohttp would use for one connection: counts the connection against its
    client while it is open (``taken``: already counted at accept; None: refuse it here when its
    client is over budget) and passes everything on."""

    __slots__ = ("_guard", "_factory", "_taken", "_inner", "_transport")

    def __init__(self, guard: "Guard", factory: Callable[[], asyncio.Protocol], taken: _Conn | None = None):
        self._guard = guard
        self._factory = factory
        self._taken = taken
        self._inner: Any = None
        self._transport: Any = None

    def connection_made(self, transport) -> None:
        if self._taken is not None:
            self._guard._conns[transport] = self._taken
        else:
            peer = transport.get_extra_info("peername")
            if not self._guard.connected(transport, peer[0] if isinstance(peer, (tuple, list)) and peer else ""):
                return
        self._transport = transport
        self._inner = self._factory()  # only a connection that is served costs a request handler
        self._inner.connection_made(transport)

    def connection_lost(self, exc) -> None:
        if self._inner is not None:
            self._guard.disconnected(self._transport)
            self._inner.connection_lost(exc)
            self._inner = None

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class GuardedListener:
    """A listening socket whose connections go through the guard first, served by ``factory``
    (an aiohttp runner's ``server``), with ``ssl_context`` (or None) for TLS.

    It accepts on its sockets itself: a connection over its client's budget is answered with a
    fixed 429 and closed right after ``accept()``, before asyncio makes a transport (or, under TLS,
    a handshake: that client sees the TLS handshake fail), at about a tenth of what serving it
    would cost; an outsider's is held back ``guard.tarpit`` seconds first (its client waits instead
    of coming straight back). The others are handed to asyncio (``connect_accepted_socket``),
    counted from that moment. Only public socket and event loop calls: no aiohttp site internals."""

    def __init__(self, guard: "Guard", factory: Callable[[], asyncio.Protocol], host: str | None, port: int, *,
                 ssl_context=None, backlog: int = BACKLOG):
        self._guard = guard
        self._factory = factory
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._backlog = backlog
        self._socks: list[socket.socket] = []
        self._held: set[socket.socket] = set()  # refused connections waiting for their answer
        self._tasks: set[asyncio.Task] = set()
        self.port = port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self._host or None, self._port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        seen = set()
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                # every address on the same port: the first one's, when it was 0
                sock.bind((addr[0], self.port, *addr[2:]) if self._socks else addr)
                sock.listen(self._backlog)
                sock.setblocking(False)
            except OSError:
                sock.close()
                if len(seen) == 1:  # the first address must work; a further one (say IPv6) may not
                    raise
                continue
            if not self._socks:
                self.port = sock.getsockname()[1]
            self._socks.append(sock)
            loop.add_reader(sock.fileno(), self._accept, loop, sock)
        if not self._socks:
            raise OSError(f"cannot listen on {self._host}:{self._port}")

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._socks:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._socks.clear()
        for conn in list(self._held):
            conn.close()
        self._held.clear()
        for t in list(self._tasks):
            t.cancel()

    def _accept(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        guard = self._guard
        for _ in range(self._backlog):
            try:
                conn, addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: stop accepting for a second, as asyncio does
                log.warning("accept failed (retrying in 1 s): %s", e)
                loop.remove_reader(sock.fileno())
                loop.call_later(1.0, self._resume, loop, sock)
                return
            host = addr[0] if isinstance(addr, tuple) and addr else ""
            taken = guard.take(host)
            if isinstance(taken, Decision):
                refusal = _REFUSALS.get(taken.retry_seconds, _REFUSALS[10])
                if guard.tarpit > 0 and len(self._held) < HELD_MAX:  # answered later: its client waits
                    self._held.add(conn)
                    loop.call_later(guard.tarpit, self._refuse, conn, refusal)
                else:
                    self._refuse(conn, refusal)
                continue
            task = loop.create_task(self._serve(loop, conn, taken))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _refuse(self, conn: socket.socket, refusal: bytes) -> None:
        self._held.discard(conn)
        if conn.fileno() < 0:
            return  # the listener closed meanwhile
        try:
            conn.setblocking(False)
            conn.send(refusal)
        except OSError:
            pass
        conn.close()

    def _resume(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        if sock.fileno() >= 0:  # not closed meanwhile
            loop.add_reader(sock.fileno(), self._accept, loop, sock)

    async def _serve(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, taken: _Conn) -> None:
        guard = self._guard
        try:
            conn.setblocking(False)
            await loop.connect_accepted_socket(lambda: _Guarded(guard, self._factory, taken), conn, ssl=self._ssl)
        except (OSError, ValueError) as e:  # a failed TLS handshake (ssl.SSLError is an OSError), a reset
            log.debug("connection dropped before it was served: %s", e)
            guard.limits.disconnect(taken.key, guard.clock())
            conn.close()


class Guard:
    """One per peer: the limits, who each open connection is charged to, the two middlewares.

    ``hosts()`` maps the addresses where members live to how many live there."""

    def __init__(self, limits: Limits, *, hosts: Callable[[], Mapping[str, int]] = dict,
                 clock: Callable[[], float] = time.monotonic, tarpit: float = TARPIT_S):
        self.limits = limits
        self.hosts = hosts
        self.clock = clock
        self.tarpit = tarpit  # seconds an outsider's refusal is held back (0: answered at once)
        self.sleep = asyncio.sleep
        self._conns: dict[Any, _Conn] = {}  # transport -> its client (the transport a request arrives on)

    # -- who ---------------------------------------------------------------------------------------
    def address_key(self, remote: str | None) -> tuple[Key, int]:
        """The client an unauthenticated request or connection from ``remote`` is charged to."""
        addr = client_address(remote)
        n = self.hosts().get(addr, 0)
        if n:
            return (MEMBER, "@" + addr), n
        return (OUTSIDER, addr), 1

    def member_key(self, request: web.Request) -> tuple[Key, int] | None:
        """The member an authenticated request is from, or None when authentication named nobody."""
        sender = request.get(SENDER)
        if isinstance(sender, str) and sender:
            return (MEMBER, sender), 1
        return None

    # -- connections (from _Guarded) ---------------------------------------------------------------
    def take(self, host: str) -> _Conn | Decision:
        """Count a new connection from ``host`` against its address: who it is charged to, or
        the refusal."""
        key, scale = self.address_key(host)
        d = self.limits.connect(key, self.clock(), scale)
        return _Conn(key, scale) if d.ok else d

    def connected(self, transport, host: str) -> bool:
        key, scale = self.address_key(host)
        d = self.limits.connect(key, self.clock(), scale)
        if not d.ok:
            try:
                transport.write(_REFUSALS.get(d.retry_seconds, _REFUSALS[10]))
            finally:
                transport.close()
            return False
        self._conns[transport] = _Conn(key, scale)
        return True

    def disconnected(self, transport) -> None:
        conn = self._conns.pop(transport, None)
        if conn is not None:
            self.limits.disconnect(conn.key, self.clock())

    # -- requests ----------------------------------------------------------------------------------
    async def refused(self, d: Decision, key: Key) -> web.Response:
        """``refusal``, held back ``tarpit`` seconds for an outsider: its connection waits instead of
        asking again at once. A member's is answered at once."""
        if key[0] == OUTSIDER and self.tarpit > 0:
            await self.sleep(self.tarpit)
        return self.refusal(d, key)

    def refusal(self, d: Decision, key: Key) -> web.Response:
        """The 429 for a refused request: the usual JSON error body and ``Retry-After``. An
        outsider's connection is closed with it, so its next try is a new connection, refused
        before any HTTP parsing while its budget is spent."""
        retry = d.retry_seconds
        what = {"rate": "too many requests", "connections": "too many open connections",
                "streams": "too many open event streams", "clients": "too many clients"}.get(d.reason, d.reason)
        resp = error_response(f"rate limited: {what} from this {'member' if key[0] == MEMBER else 'address'}; "
                              f"retry after {retry} s", 429, "rate_limited")
        resp.headers["Retry-After"] = str(retry)
        if key[0] == OUTSIDER:
            resp.force_close()
        return resp

    @web.middleware
    async def screen(self, request: web.Request, handler):
        """Before authentication: charge the request to its connection's client (a member's
        connection: the member; any other: its address) and refuse it if over budget."""
        conn = self._conns.get(request.transport)
        key, scale = (conn.key, conn.scale) if conn is not None else self.address_key(request.remote)
        d = self.limits.request(key, self.clock(), scale)
        if not d.ok:
            return await self.refused(d, key)
        request[CHARGED] = (key, scale)
        return await handler(request)

    @web.middleware
    async def admit(self, request: web.Request, handler):
        """After authentication: a member's request moves from its address's budget to the
        member's own (and so does its connection); event streams are counted."""
        now = self.clock()
        charged = request.get(CHARGED)
        found = self.member_key(request)
        if charged is None:  # no screen in front (an app built without it): charge here
            key, scale = found or self.address_key(request.remote)
            d = self.limits.request(key, now, scale)
            if not d.ok:
                return await self.refused(d, key)
        else:
            key, scale = charged
            if found is not None and found[0] != key:
                self.limits.refund(key, now)
                key, scale = found
                d = self.limits.request(key, now, scale)
                if not d.ok:
                    return await self.refused(d, key)
        conn = self._conns.get(request.transport)
        if conn is not None and key[0] == MEMBER and conn.key != key:
            d = self.limits.claim(conn.key, key, now, scale)
            if not d.ok:
                resp = self.refusal(d, key)
                resp.force_close()
                return resp
            conn.key, conn.scale = key, scale
        if request.path != EVENTS_PATH:
            return await handler(request)
        d = self.limits.open_stream(key, now, scale)
        if not d.ok:
            return await self.refused(d, key)
        try:
            return await handler(request)
        finally:
            self.limits.close_stream(key, self.clock())

    async def listen(self, runner: web.BaseRunner, host: str | None, port: int, *,
                     ssl_context=None) -> GuardedListener:
        """Start listening for ``runner`` (set up) on host:port; close() the listener to stop."""
        listener = GuardedListener(self, runner.server, host, port, ssl_context=ssl_context)
        await listener.start()
        return listener

    def status(self) -> dict:
        return self.limits.status()


def _host(addr: str) -> str:
    try:
        return client_address(urlsplit(addr).hostname or "")
    except ValueError:
        return ""


def member_hosts(peer: "Peer", clock: Callable[[], float] = time.monotonic) -> Callable[[], Mapping[str, int]]:
    """``hosts()`` for a peer's guard: its own advertised host and those of its live members, with
    how many live at each; cached per membership epoch, and at most HOSTS_TTL seconds."""
    cache: dict[str, Any] = {"at": -HOSTS_TTL, "epoch": None, "hosts": {}}

    def hosts() -> Mapping[str, int]:
        now = clock()
        members = peer.members
        epoch = members.epoch if members is not None else None
        if now - cache["at"] < HOSTS_TTL and epoch == cache["epoch"]:
            return cache["hosts"]
        out: dict[str, int] = {}
        addrs = [peer.addr] if peer.addr else []
        if members is not None:
            addrs += [m.addr for m in members.members() if m.state in ("alive", "suspect") and m.peer_id != peer.id]
        for a in addrs:
            h = _host(a)
            if h:
                out[h] = out.get(h, 0) + 1
        cache.update(at=now, epoch=epoch, hosts=out)
        return out

    return hosts


def for_peer(peer: "Peer") -> Guard | None:
    """The guard of a peer from its config (None with --client-limits 0)."""
    cfg = peer.cfg
    if not cfg.client_limits:
        return None
    limits = Limits(parse_budget(cfg.member_limits, MEMBER_BUDGET, "--member-limits"),
                    parse_budget(cfg.outsider_limits, OUTSIDER_BUDGET, "--outsider-limits"))
    return Guard(limits, hosts=member_hosts(peer))
