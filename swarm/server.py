"""aiohttp routes: parse, validate, hand to the peer's cores, answer. Nothing else lives here.

Every route reads its body through a size limit before parsing it, and every malformed input is
answered with a 4xx and a reason; nothing a request carries reaches the model unless the codec
and the round book accepted it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING

from aiohttp import web

from . import auth, encoding, robust, roundbook, settings
from .config import ConfigError
from .codec import CodecError, HEADER, MODES, decode_payload
from .codec.config import MAX_SPARSE_RATIO
from .membership import MembershipError
from .replica import fingerprint_differs as task_differs
from .tables.http import add_routes as add_table_routes
from .tables.http import body_limits as table_body_limits
from .status import routes as status_page
from .bodies import (BODY, INLINE_BYTES, PROTOCOL_VERSION, SENDER, WIRE_BYTES, BadRequest, error_response,
                     msgpack_response, read_body, unpack_map)

if TYPE_CHECKING:
    from .node import Peer

PEER: web.AppKey[Peer] = web.AppKey("peer")
CONTROL_LIMIT = 256 * 1024  # membership and join messages
CONTROL_PATHS = ("/v1/join", "/v1/ping", "/v1/ping-req", "/v1/sync", "/v1/leave")
# the status routes --status-auth 1 closes (/static/* stays open: the page's assets hold no data)
STATUS_PATHS = ("/", "/api/status", "/api/events", "/metrics")
STATUS_COOKIE = "swarm_status"
VERIFIER: web.AppKey[auth.Verifier] = web.AppKey("verifier")
# the routes a joiner calls before it knows our id: the signature may name our address instead
FIRST_CONTACT = (("GET", "/v1/swarm"), ("POST", "/v1/join"))

NAMES: web.AppKey[auth.Names] = web.AppKey("names")
STATUS_TOKEN: web.AppKey[str | None] = web.AppKey("status_token")  # None: the status routes are open
# Every authentication failure gets exactly this answer, whatever failed (docs/security.md).
UNAUTHORIZED_REASON = ("unauthorized: this peer only answers requests signed by a peer for this peer, "
                       "with the swarm's --secret if it has one (HTTP 401)")


def grads_limit(manifest) -> int:
    """Largest POST /v1/grads body: a dense fp32 payload plus its header."""
    return manifest.numel * 4 + (1 << 16)


def body_limit(request: web.Request) -> int:
    """The body limit of the route ``request`` goes to (the same one its handler reads with)."""
    path = request.path
    if request.method in ("GET", "HEAD"):
        return 0  # no GET route takes a body
    if path in CONTROL_PATHS:
        return CONTROL_LIMIT
    peer = request.app[PEER]
    if path == "/v1/grads":
        if peer.replica is None:
            raise BadRequest("peer is starting", 503)
        return grads_limit(peer.replica.manifest)
    if path.startswith("/v1/rows/"):
        if getattr(peer, "tables", None) is None:
            raise BadRequest("this peer serves no tables yet", 503, code="starting")
        return table_body_limits(peer.tables).get(path, 0)
    return 0


def _unauthorized() -> web.Response:
    return error_response(UNAUTHORIZED_REASON, 401, "unauthorized")


@web.middleware
async def authenticate(request: web.Request, handler):
    """Every /v1/* request must be signed by its sender for this peer (swarm/auth.py; with a
    --secret, MACed under it too); the sender's id goes to ``request[SENDER]``. With --status-auth 1
    the status routes need the status token (``?token=``, ``Authorization: Bearer``, the cookie the
    page sets) or a signature. The body is read here (through the route's limit) because the
    signature covers its hash; the handler gets the same bytes from ``read_body``. With TLS on, the
    plain-HTTP status port (--status-port) serves the status routes only."""
    verifier = request.app[VERIFIER]
    names = request.app[NAMES]
    path = request.path
    if names.tls and not request.secure and not (path in STATUS_PATHS or path.startswith("/static/")):
        return error_response("this port serves the status page only; peer-to-peer routes are on the https port",
                              404, "not-here")
    if not path.startswith("/v1/"):
        token = request.app[STATUS_TOKEN]
        if token is None or path not in STATUS_PATHS:
            return await handler(request)
        presented = request.query.get("token")
        if auth.token_ok(presented, token):
            resp = await handler(request)
            if path == "/" and isinstance(resp, web.StreamResponse) and not resp.prepared:
                # the page's own fetches (/api/events, /api/status) then carry the token as a cookie
                resp.set_cookie(STATUS_COOKIE, token, httponly=True, samesite="Strict", path="/")
            return resp
        bearer = request.headers.get("Authorization", "")
        if (bearer.startswith("Bearer ") and auth.token_ok(bearer[7:].strip(), token)) or \
                auth.token_ok(request.cookies.get(STATUS_COOKIE), token):
            return await handler(request)
        if not any(h in request.headers for h in auth.HEADERS):
            return _unauthorized()
    now = time.time()
    receivers = names.first_contact if (request.method, path) in FIRST_CONTACT else names.own
    if not verifier.check_headers(request.headers, now, receivers):
        return _unauthorized()  # refused before reading a byte of the body
    try:
        body = await read_body(request, body_limit(request))
    except BadRequest as e:
        return error_response(e.reason, e.status, e.code)
    sender = verifier.verify(request.method, request.raw_path, auth.body_hash(body), request.headers, now, receivers)
    if sender is None:
        return _unauthorized()
    request[WIRE_BYTES] = len(body)
    if "Content-Encoding" in request.headers:  # after the signature, which covers the bytes as sent
        try:
            body = (encoding.decompress(body, request.headers["Content-Encoding"], body_limit(request))
                    if len(body) <= INLINE_BYTES else
                    await asyncio.to_thread(encoding.decompress, body, request.headers["Content-Encoding"],
                                            body_limit(request)))
        except encoding.EncodingError as e:
            return error_response(e.reason, e.status, "encoding")
    request[BODY] = body
    request[SENDER] = sender
    resp = await handler(request)
    to = request.headers[auth.TO]
    if names.proof_secret and to.startswith("@") and isinstance(resp, web.StreamResponse) and not resp.prepared:
        # a joiner that did not pin our certificate checks this before it believes the reply
        resp.headers[auth.PROOF] = auth.proof(names.proof_secret, names.fingerprint, request.headers[auth.NONCE])
    return resp


@web.middleware
async def errors(request: web.Request, handler):
    """Map validation failures to a 4xx with a reason; never leak a traceback."""
    try:
        return await handler(request)
    except BadRequest as e:
        return error_response(e.reason, e.status, e.code)
    except MembershipError as e:
        return error_response(f"bad membership message: {e}", 400)


def _peer(request: web.Request) -> "Peer":
    peer = request.app[PEER]
    if peer.members is None or peer.replica is None:
        raise BadRequest("peer is starting", 503)
    return peer


async def _control(request: web.Request) -> dict:
    return unpack_map(await read_body(request, CONTROL_LIMIT), CONTROL_LIMIT)


async def join(request: web.Request) -> web.Response:
    peer = _peer(request)
    msg = await _control(request)
    if msg.get("protocol") != PROTOCOL_VERSION:
        raise BadRequest(f"protocol version {msg.get('protocol')!r} is not {PROTOCOL_VERSION}", 409)
    differs = task_differs(peer.replica.fingerprint, msg.get("task"))
    if differs:
        raise BadRequest(differs, 409, code="task")
    theirs = msg.get("settings")
    try:
        theirs = settings.parse(theirs)
    except ConfigError as e:
        raise BadRequest(f"join message: {e}", 409, code="settings") from None
    clash = settings.conflict(peer.settings, theirs)
    if clash:
        raise BadRequest(clash.replace("this peer gives", "the joiner gives"), 409, code="settings")
    if msg.get("tables") != peer.table_layout():
        raise BadRequest(f"table layout differs: this swarm uses {peer.table_layout()} "
                         "(check --table-rows, --table-slots and --replicas)", 409)
    if not isinstance(msg.get("membership"), dict):
        raise BadRequest("join message lacks its membership part")
    reply = peer.members.handle_join(msg["membership"], time.monotonic(), origin=request[SENDER])
    return msgpack_response({"membership": reply, "step": peer.book.step,
                             # a peer resumed from a checkpoint has state a joiner must sync, even before it trains
                             "started": peer.started or peer.book.step > 0})


async def swarm_info(request: web.Request) -> web.Response:
    """What a peer about to join must know before it builds its replica: the protocol, the swarm's
    settings (swarm/settings.py) and the task fingerprint."""
    peer = _peer(request)
    return msgpack_response({"swarm": "swarm-peer", "protocol": PROTOCOL_VERSION, "settings": peer.settings,
                             "task": peer.replica.fingerprint, "step": peer.book.step,
                             "started": peer.started or peer.book.step > 0})


async def ping(request: web.Request) -> web.Response:
    peer = _peer(request)
    return msgpack_response(peer.members.handle_ping(await _control(request), time.monotonic(),
                                                     origin=request[SENDER]))


async def ping_req(request: web.Request) -> web.Response:
    peer = _peer(request)
    forward = peer.members.handle_ping_req(await _control(request), time.monotonic(), origin=request[SENDER])
    if forward is None:
        return msgpack_response({"ok": False})
    return msgpack_response(await peer.shell.forward_ping(forward))


async def sync(request: web.Request) -> web.Response:
    peer = _peer(request)
    return msgpack_response(peer.members.handle_sync(await _control(request), time.monotonic(),
                                                     origin=request[SENDER]))


async def leave(request: web.Request) -> web.Response:
    peer = _peer(request)
    peer.members.handle_leave(await _control(request), time.monotonic(), origin=request[SENDER])
    return msgpack_response({"ok": True})


async def grads(request: web.Request) -> web.Response:
    """A peer's compressed gradient for one step (docs/protocol.md, "Gradient payload")."""
    peer = _peer(request)
    mode = request.headers.get(HEADER)
    if mode not in MODES:
        raise BadRequest(f"{HEADER} header must be one of {', '.join(MODES)}, got {mode!r}")
    manifest = peer.replica.manifest
    limit = grads_limit(manifest)
    body = await read_body(request, limit)
    decode = functools.partial(decode_payload, body, manifest, header_mode=mode, max_ratio=MAX_SPARSE_RATIO,
                               max_bytes=limit)
    try:
        # a Top-K payload (~33 KB by default, ~0.4 ms) is decoded on the loop: cheaper than a thread hop
        decoded = decode() if len(body) <= INLINE_BYTES else await asyncio.to_thread(decode)
    except CodecError as e:
        peer.rejected["codec"] += 1
        claimed = request[SENDER]  # charged to its signer's score, if a live member (docs/design.md)
        if claimed and claimed != peer.id and (m := peer.members.get(claimed)) and m.state in ("alive", "suspect"):
            peer.robust.invalid(claimed, time.monotonic())
        raise BadRequest(f"rejected payload: {e}") from None
    if decoded.sender != request[SENDER]:  # a payload can only be made by the peer it names
        peer.rejected["sender"] += 1
        raise BadRequest(f"payload names sender {decoded.sender[:16]!r} but was signed by {request[SENDER][:16]!r}",
                         403, code="sender")
    if decoded.sender == peer.id:
        peer.rejected["sender"] += 1
        raise BadRequest("payload claims to come from this peer", 400)
    member = peer.members.get(decoded.sender)
    if member is None or member.state not in ("alive", "suspect"):
        peer.rejected["sender"] += 1
        raise BadRequest(f"sender {decoded.sender[:16]!r} is not a live member of this swarm", 409,
                         code="unknown-sender")
    verdict = peer.offer(decoded, request.get(WIRE_BYTES, len(body)))  # (as it came over the wire)
    if verdict == robust.BANNED:
        peer.rejected["banned"] += 1
        raise BadRequest(f"sender {decoded.sender[:16]!r} is banned for now: its recent payloads were outliers or "
                         "invalid (docs/design.md, \"Robust aggregation\")", 403, code="banned")
    if verdict not in (roundbook.ACCEPTED, roundbook.LATE):
        peer.rejected[verdict] += 1
        raise BadRequest(f"payload for step {decoded.step} refused: {verdict} (this peer is at step {peer.book.step})",
                         409, code=verdict)
    peer.counts.add_received("grads", request.get(WIRE_BYTES, len(body)), len(body))
    return web.json_response({"result": verdict, "step": peer.book.step})


async def state(request: web.Request) -> web.StreamResponse:
    """Dense parameters and optimizer state, streamed as one safetensors blob."""
    peer = _peer(request)
    if not (peer.started and peer.active) and peer.book.step == 0:
        raise BadRequest("this peer has no state to give yet (not training)", 503)
    accept = request.headers.get("Accept-Encoding")
    plain = 0

    def packed() -> tuple[bytes, dict[str, str]]:
        nonlocal plain
        blob = peer.replica.state_blob()
        plain = len(blob)
        return encoding.reply(blob, accept, peer.transport.compress)

    blob, headers = await peer.work(packed)
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                       "X-Swarm-Step": str(peer.replica.step), **headers})
    resp.content_length = len(blob)
    await resp.prepare(request)
    view = memoryview(blob)
    for i in range(0, len(blob), 1 << 20):
        await resp.write(view[i:i + (1 << 20)])
    await resp.write_eof()
    peer.counts.add_sent("state", len(blob), plain)
    return resp


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[PEER].status())


def build_app(peer: "Peer") -> web.Application:
    guard = getattr(peer, "guard", None)  # per-client limits: screen before authentication, admit after (guard.py)
    middlewares = [authenticate, errors] if guard is None else [guard.screen, authenticate, guard.admit, errors]
    app = web.Application(middlewares=middlewares, client_max_size=CONTROL_LIMIT)
    app[PEER] = peer
    app[VERIFIER] = peer.verifier
    app[NAMES] = peer.names
    app[STATUS_TOKEN] = getattr(peer, "status_token", None)
    app.router.add_get("/v1/swarm", swarm_info)
    app.router.add_post("/v1/join", join)
    app.router.add_post("/v1/ping", ping)
    app.router.add_post("/v1/ping-req", ping_req)
    app.router.add_post("/v1/sync", sync)
    app.router.add_post("/v1/leave", leave)
    app.router.add_post("/v1/grads", grads)
    app.router.add_get("/v1/state", state)
    add_table_routes(app, _peer)
    app.router.add_get("/api/status", status)
    status_page.setup(app, peer)  # "/", /static/*, /api/events (SSE) and /metrics: see docs/status.md
    return app
