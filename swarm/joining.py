"""How a peer enters the swarm: the swarm-wide settings agreed before its replica is built
(swarm/settings.py), the join (GET /v1/swarm, POST /v1/join, retried while the target starts),
and a checkpoint read and resumed. One per peer, composed; it reaches the peer only through its
public interface."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

from . import auth, checkpoint
from . import settings as swarm_settings
from .bodies import PROTOCOL_VERSION, unpack_map
from .config import ConfigError, bracket_host, parse_join
from .roundbook import RoundBook
from .robust import RobustConfig
from .transport import PeerUnreachable

if TYPE_CHECKING:
    from .node import Peer

__all__ = ["JoinError", "Joining", "not_a_peer"]


class JoinError(Exception):
    """The swarm could not be joined (unreachable, or it refused us with a reason)."""


def not_a_peer(join: str, why: str) -> str:
    return f"--join {join} is not a swarm peer: {why} (check the host and port)"


class Joining:
    def __init__(self, peer: "Peer"):
        self.peer = peer

    # -- the swarm's settings (swarm/settings.py) ------------------------------------------------
    async def agree_settings(self) -> None:
        """Before the replica is built: take the swarm-wide settings this peer was not given from its
        checkpoint, then from the swarm it joins; a given setting that differs is refused."""
        cfg = self.peer.cfg
        mine = swarm_settings.given(cfg)
        if cfg.checkpoint:
            saved = await asyncio.to_thread(checkpoint.read_settings, cfg.checkpoint)
            if saved is not None:
                clash = swarm_settings.conflict(saved, mine)
                if clash:
                    raise checkpoint.CheckpointError(f"{cfg.checkpoint} was written by a swarm with other settings: "
                                                     f"{clash.replace('this swarm uses', 'it uses')}")
                if cfg.is_given("steps") and not cfg.is_given("budget"):
                    saved = {**saved, "budget": cfg.budget}  # a resumed run's --steps extends its schedule
                swarm_settings.adopt(cfg, saved)
        if cfg.join:
            info = await self.swarm_info(cfg.join)
            clash = swarm_settings.conflict(info["settings"], mine)
            if clash:
                raise JoinError(clash)
            swarm_settings.adopt(cfg, info["settings"])
        self.peer.settings = swarm_settings.of(cfg)
        self.peer.book = RoundBook(max_staleness=cfg.max_staleness)
        self.peer.robust_cfg = RobustConfig(rule=cfg.aggregation, trim=cfg.trim, msg_clip=cfg.msg_clip)

    async def swarm_info(self, join: str) -> dict:
        """GET /v1/swarm of the join target (retried while it is unreachable or starting): its
        protocol and settings. Something that is not a swarm peer is a JoinError saying so."""
        data = await self.ask(join, "GET /v1/swarm", lambda target, to, pin: self.peer.transport.request(
            "GET", target + "/v1/swarm", to=to, pin=pin, timeout=5.0, kind="control"))
        try:
            info = unpack_map(data, 1 << 20)
        except Exception:
            info = None
        if not isinstance(info, dict) or info.get("swarm") != "swarm-peer":
            raise JoinError(not_a_peer(join, "its answer to GET /v1/swarm is not a swarm peer's"))
        if info.get("protocol") != PROTOCOL_VERSION:
            raise JoinError(f"{join} speaks swarm protocol {info.get('protocol')!r}, this peer {PROTOCOL_VERSION}: "
                            "run the same swarm version on every peer")
        try:
            info["settings"] = swarm_settings.parse(info.get("settings"))
        except ConfigError as e:
            raise JoinError(f"{join}: {e}") from None
        return info

    # -- checkpoints ---------------------------------------------------------------------------
    async def read_checkpoint(self) -> "checkpoint.Checkpoint | None":
        """Read --checkpoint (if any) and hold its table slots as candidates for the hand-offs."""
        if not self.peer.cfg.checkpoint:
            return None
        ck = await asyncio.to_thread(checkpoint.load, self.peer.cfg.checkpoint, self.peer.table_layout())
        if ck is not None:
            try:
                n = await self.peer.table_work(self.peer.tables.install_checkpoint, ck.tables)
            except ValueError as e:
                raise checkpoint.CheckpointError(f"{self.peer.cfg.checkpoint}: {e}") from None
            self.peer.event("checkpoint", f"read step {ck.step} with {n} table slots from {self.peer.cfg.checkpoint}")
        return ck

    async def resume(self, ck: "checkpoint.Checkpoint") -> None:
        """Resume the dense replica from the checkpoint, unless the swarm we joined is already
        training: its state is newer, and we sync it like any joiner."""
        if self.peer.started:
            self.peer.event("checkpoint", "the swarm is training: its state is newer than our checkpoint")
            self.peer.out(f"not resuming from the checkpoint in {self.peer.cfg.checkpoint} (step {ck.step}): the swarm is "
                     "training, so this peer syncs its newer state")
            return
        try:
            step = await self.peer.work(self.peer.replica.load_state_blob, ck.dense)
            self.peer.compressor.load_state_dict(ck.residual)
        except (ValueError, KeyError) as e:
            raise checkpoint.CheckpointError(f"{self.peer.cfg.checkpoint}: {e}") from None
        self.peer.book.reset(step)
        self.peer.members.set_meta(step=step)
        self.peer.event("resumed", f"dense state of step {step} from {self.peer.cfg.checkpoint}")
        self.peer.out(f"resumed from the checkpoint in {self.peer.cfg.checkpoint} at step {step}")

    async def ask(self, join: str, what: str, call: Callable[[str], Any]) -> Any:
        """``call(target)`` on the --join target, retried while it is unreachable or starting (up to
        --join-timeout); a refusal, or an answer that is not a swarm peer's, is a JoinError saying so."""
        host, port, pin = parse_join(join)
        target = self.target(join)
        to = auth.address_name(host, port)
        deadline = time.monotonic() + self.peer.cfg.join_timeout
        while True:
            try:
                return await call(target, to, pin)
            except PeerUnreachable as e:
                if e.code in ("fingerprint", "proof"):  # retrying cannot help: it is not the peer we mean
                    raise JoinError(f"{target} is not the peer --join {join} names: {e.reason}") from None
                if e.foreign and e.status is not None:
                    raise JoinError(not_a_peer(join, f"it answered {what} with HTTP {e.status}")) from None
                if e.status is not None and 400 <= e.status < 500:
                    raise JoinError(f"{target} refused to let us join: {e.reason}") from None
                if time.monotonic() > deadline:
                    hint = ""
                    if not self.peer.cfg.secret and "Disconnected" in e.reason:  # a TLS port hung up on HTTP
                        hint = " (a swarm with a --secret speaks TLS only: give this peer its --secret)"
                    raise JoinError(f"cannot reach {target} to join: {e.reason}{hint}") from None
                await asyncio.sleep(0.5)

    def target(self, join: str) -> str:
        """The URL of the --join target: https when the swarm has a secret (docs/security.md)."""
        host, port, _ = parse_join(join)
        return f"{'https' if self.peer.cfg.secret else 'http'}://{bracket_host(host)}:{port}"

    async def join(self, join: str) -> None:
        target = self.target(join)
        body = self.hello()
        reply = await self.ask(join, "POST /v1/join",
                                lambda t, to, pin: self.peer.transport.call(t, "/v1/join", body, to=to, pin=pin,
                                                                             timeout=5.0))
        try:
            self.peer.members.handle_join_reply(reply.get("membership"), time.monotonic())
            swarm_step, started = int(reply["step"]), bool(reply["started"])
        except (KeyError, TypeError, ValueError) as e:
            raise JoinError(f"{target} sent a malformed join reply: {e}") from None
        self.peer.join_target = target
        self.peer.event("joined", f"through {target} at swarm step {swarm_step}")
        if started:
            self.peer.book.reset(swarm_step)
            self.peer.started = True  # we must sync state before contributing

    def hello(self) -> dict:
        return {
            "protocol": PROTOCOL_VERSION,
            "task": self.peer.replica.fingerprint,
            "settings": self.peer.settings,
            "tables": self.peer.table_layout(),
            "membership": self.peer.members.join_request(),
        }
