"""The Peer: wires membership, gradient rounds, the task's replica and the HTTP server together.

Data flows one way: batch -> forward/backward (training thread) -> codec -> POST to peers ->
(peers) validated -> round book -> aggregate -> optimizer step. The event loop only moves bytes
and makes decisions; every piece of compute runs on the training thread (``work``) or, for
decoding received payloads, on a helper thread, so the peer keeps answering pings and pulls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from aiohttp import web

from . import auth, checkpoint, credentials, divergence, encoding, evaluation, robust, roundbook, threads, tls
from . import settings as swarm_settings
from .allocator import release_free
from .codec import CodecConfig, Compressor, Encoded, HEADER
from .config import ConfigError, PeerConfig, bracket_host, parse_hostport
from .core import rounds
from .core.lifecycle import RESYNC, STOP, JoinTraining, Lifecycle, MinPeersGate, Start, State, linger_over, winding_down
from .core.meta import PeerMeta
from .group.comm import Comm, GroupEnv, GroupError, pick_backend, pick_device
from .identity import PeerKey
from .membership import Membership, MembershipConfig, SendSync
from .joining import JoinError, Joining
from .local_steps import LocalSteps
from .membership_shell import MembershipShell
from .status import report
from .status.timeline import Timeline
from .steptimes import StepTimes
from .tables import RowOptConfig
from .tables.audit import ReplicaAudit
from .tables.shard import row_kind
from .tables.window import WindowRows
from .tables.http import TableClient
from .tables.ownership import slot_bounds
from .tables.service import TableService
from .outer import OuterConfig
from .pacing import Pacing, Send
from .replica import MAX_NONFINITE, Replica, StepStats
from .roles import Role, Solo
from .task import Task, TaskError, TaskTypeError, load_task
from .tasks import default_task
from .transport import ByteCounts, PeerUnreachable, Transport

log = logging.getLogger("swarm")

FIRST_CHECK = 10  # replicas also compare sketches at this step: when a racing join is likeliest to have split them
SYNC_ATTEMPTS = 4  # state downloads of one join: a round lost to the joiner while it catches up asks for a newer one
SEND_ATTEMPTS = 5  # per payload and peer, ~2.5 s in all, for refusals that go away by themselves


@dataclass
class Progress:
    losses: list[float] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0  # samples x the task's tokens_per_sample (language models)
    contributed: int = 0  # steps this peer computed a gradient for
    started_at: float = 0.0
    wire_bytes: int = 0  # gradient payload bytes produced (once, not per target)
    dense_equiv: int = 0  # fp32 bytes of the same gradients
    val_loss: float | None = None
    val_history: list[tuple[int, float]] = field(default_factory=list)
    # wall seconds the held-out evaluations of --eval-every took so far (the progress line says it,
    # so a benchmark can leave them out of the training's time: bench/wan.py)
    eval_seconds: float = 0.0
    lr_history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=5000))  # (step, lr after it)
    skipped_steps: int = 0


class Peer:
    """One swarm peer training ``task`` (a swarm.Task; None or omitted: the built-in byte LM, sized
    by ``cfg``). ``Peer(cfg)`` is ``Peer(None, cfg)``. ``async with Peer(task, cfg) as peer:`` starts
    it (joining ``cfg.join``) and leaves the swarm at the end; ``await peer.run()`` trains."""

    def __init__(self, task: "Task | PeerConfig | None" = None, cfg: PeerConfig | None = None, *,
                 out: Callable[[str], None] = print):
        if isinstance(task, PeerConfig):
            if cfg is not None:
                raise TypeError("Peer(task, cfg): the first argument is the task")
            task, cfg = None, task
        cfg = cfg if cfg is not None else PeerConfig()
        if task is not None and not isinstance(task, Task):
            raise TaskTypeError(f"Peer needs a swarm.Task, got {type(task).__name__}")
        cfg.validate()
        if task is not None:
            if cfg.task:
                raise ConfigError(f"a Task was given and --task {cfg.task!r} too: give one")
            cfg.check_user_task()
        self.task = task
        self.cfg = cfg
        self.out = out
        # under torchrun this process is one rank of a host group (swarm/group, docs/design.md)
        self.group_env = GroupEnv.detect()
        if self.group_env is not None and cfg.sync_every > 1:
            raise ConfigError("--sync-every > 1 is not supported in a torchrun host group yet: run one peer per process")
        self.group = None  # the HostGroup, once started
        # self-certifying: the id is derived from the key (swarm/identity.py); a rank of a host group
        # shares its host's key and is "<host id>~<rank>" (start)
        self.key, self.key_origin = credentials.load_key(cfg) if self.group_env is None or self.group_env.rank == 0 \
            else (PeerKey.generate(), "")
        self.id = self.key.id
        self.tls = bool(cfg.secret)  # a swarm with a secret runs every link over TLS (docs/security.md)
        if self.group_env is not None and cfg.checkpoint:  # one directory per rank: each holds its own slots
            cfg.checkpoint = os.path.join(cfg.checkpoint, f"rank{self.group_env.rank}")
        self.counts = ByteCounts()
        self.dense_bytes = 0  # what sending dense fp32 gradients to the same targets would have cost
        self.progress = Progress()
        self.step_times = StepTimes()  # where each step's wall time goes (summary, /api/status)
        self.book = roundbook.RoundBook(max_staleness=cfg.max_staleness)
        self.rejected: collections.Counter[str] = collections.Counter()
        # per-sender scores, outlier counts and bans (swarm/robust.py; docs/design.md "Robust aggregation")
        self.robust = robust.Scoreboard(robust.ScoreConfig(ban_seconds=cfg.ban_seconds))
        self.events: collections.deque[dict] = collections.deque(maxlen=200)
        self.timeline = Timeline()  # the status page's bounded series and per-peer link stats
        # what the peer holds is released in the reverse order it was taken, by close() (also when
        # start() fails half-way): the threads last, after the server, the transport and the group
        self._exit = contextlib.AsyncExitStack()
        self._pool = threads.pool(threads.TRAIN, 1, self.id[:6])
        self._exit.callback(self._pool.shutdown, wait=True, cancel_futures=True)
        # the table shard is touched by one thread only, separate from training so that serving
        # other peers' pulls never waits for our forward/backward
        self._table_pool = threads.pool(threads.TABLES, 1, self.id[:6])
        self._exit.callback(self._table_pool.shutdown, wait=True, cancel_futures=True)
        self.tables: TableService | None = None
        self.table_client: TableClient | None = None
        self._pushes: collections.deque[asyncio.Task] = collections.deque()
        self._last_checkpoint = time.monotonic()
        self._last_print = time.monotonic()
        self._arrival = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._outboxes: dict[str, asyncio.Queue] = {}
        self.transport = Transport(self.counts, compress=cfg.wire_compression == "zstd")
        self._exit.push_async_callback(self.transport.close)
        # background tasks whose failure was an event: by task name (/metrics swarm_task_failures)
        self.task_failures: collections.Counter[str] = collections.Counter()
        self.failure: str | None = None  # why a task the peer cannot do without stopped it
        self.shell = MembershipShell(self)  # SWIM's actions over HTTP; the table map follows the live set
        self.joining = Joining(self)  # settings agreed, the join, a checkpoint resumed (swarm/joining.py)
        self.replica: Replica | None = None
        # the last round's combined payloads, in the replica's flat space (a host group's leader
        # broadcasts it: its ranks step on the same bits), and what combining them found
        self.aggregate: torch.Tensor | None = None
        self.last_report: robust.Report | None = None
        self.robust_cfg = robust.RobustConfig(rule=cfg.aggregation, trim=cfg.trim, msg_clip=cfg.msg_clip)
        self.settings = swarm_settings.of(cfg)  # the swarm's, once agreed (start)
        self.sketch_note: divergence.Note | None = None  # our last published sketch
        self.diverged_from: str | None = None  # a peer of the majority to re-sync from (divergence.verdict)
        self.resyncs: collections.Counter[str] = collections.Counter()  # re-syncs by cause: lag, diverged
        self.lifecycle = Lifecycle(time.monotonic())  # starting .. left (core/lifecycle.py)
        self.table_audit = ReplicaAudit()  # our table replicas against their primaries (swarm/tables/audit.py)
        self._auditing: asyncio.Task | None = None
        self.compressor: Compressor | None = None
        self.members: Membership | None = None
        self.addr = ""
        self.active = False  # contributing gradients (false while a joiner syncs)
        self.started = False  # has begun its first step (joiners then need a state sync)
        self.dropped_sends = 0
        # local steps (--sync-every H > 1): a round per window of H inner steps (docs/design.md)
        self.window = cfg.sync_every
        # rounds --steps stands for (0: no end); with local steps the last window takes what is left
        self.rounds_total = -(-cfg.steps // cfg.sync_every)
        self.inner_step = 0  # inner steps of the window being computed, counted from the swarm's start
        self.window_steps = 0  # inner steps our last window took (fewer than --sync-every: a slow peer's)
        # inner steps before our last window's end that its row pushes went (--push-lead; the run's
        # last window, which always pushes at its end, leaves it as it was)
        self.push_lead = 0
        self.sent_through = -1  # the last round computed and sent (with --overlap, one ahead of the rounds taken)
        self.window_rows: WindowRows | None = None
        self.local_steps = LocalSteps(self) if self.window > 1 else None
        self.pacing = Pacing(self)  # which rounds we send for, and whether we run free (swarm/pacing.py)
        self.last_sketch: list[float] | None = None  # refreshed every few steps on the training thread
        self._runner: web.AppRunner | None = None
        self.guard = None  # swarm/guard.py's Guard once started (None: --client-limits 0)

    # -- compute off the event loop -------------------------------------------------------------
    async def work(self, fn: Callable, *args: Any) -> Any:
        """Run blocking compute on this peer's training thread, one call at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def table_work(self, fn: Callable, *args: Any) -> Any:
        """Run a TableService call on this peer's table thread, one at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._table_pool, functools.partial(fn, *args))

    # -- start-up ----------------------------------------------------------------------------
    async def __aenter__(self) -> "Peer":
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.leave()

    def _build_replica(self, device: str) -> Replica:
        """The task's replica, tried once on a batch before the peer listens (training thread)."""
        task = self.task
        if task is None and self.cfg.task:
            self.cfg.check_user_task()
            task = load_task(self.cfg.task, self.cfg.task_args)
        elif task is None:
            task = default_task(self.cfg)  # the built-in byte LM, sized by the built-in flags and task args
        elif self.cfg.task_args:
            raise TaskError("task args (--task-arg) are for a task loaded by name (--task) or the built-in one")
        replica = Replica(task, seed=self.cfg.seed, device=device, table_lr=self.cfg.table_lr or None,
                          micro_batch=None if self.cfg.micro_batch < 0 else self.cfg.micro_batch)
        replica.check()
        return replica

    def _tables_line(self) -> str:
        specs = self.replica.table_specs
        return ("; tables " + ", ".join(f"{t.name} {t.rows}x{t.dim}" for t in specs)) if specs else ""

    def state_limit(self) -> int:
        """Bytes a state download may have: the model's state, up to three times that again for the
        optimizer's (Adam keeps two moments), and room for the metadata."""
        r = self.replica
        model_bytes = sum(t.numel() * t.element_size() for t in [*r.params, *r.frozen.values(), *r.buffers.values()])
        return 4 * model_bytes + (16 << 20)

    async def start(self) -> None:
        """Build the replica, start serving, and join the swarm if --join was given. A start that
        fails half-way releases what it took (close) before the error goes on."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        torch.set_num_threads(self.cfg.threads)
        genv = self.group_env
        device = pick_device(self.cfg.device, genv.local_rank if genv else 0)
        comm = None
        if genv is not None:
            # forming the group blocks until every rank is there: on the training thread, where all
            # of this rank's collectives run
            backend = pick_backend(self.cfg.backend, device, genv.world)
            comm = await self.work(Comm, genv, backend, device, self.cfg.group_timeout)
            self._exit.push_async_callback(asyncio.to_thread, comm.close)
            # "<host>~<rank>": the table map keeps a slot's owners on different hosts (tables/ownership.py);
            # every rank signs with its host's key (the ranks of one host trust each other: docs/security.md)
            seed = (await self.work(comm.all_gather_text, self.key.seed().hex()))[0]
            self.key = PeerKey.from_seed(bytes.fromhex(seed))
            self.id = f"{self.key.id}~{comm.rank}"
        from .guard import for_peer as guard_for
        from .server import build_app  # the routes are a thin shell over this object

        generated = self.cfg.secret == "generate"  # (config: only without --join)
        kept = False
        if generated:
            self.cfg.secret, kept = credentials.generated_secret(self.cfg)
        self.verifier = auth.Verifier(self.cfg.secret or None)
        self.status_token = auth.status_token(self.cfg.secret) if self.cfg.secret and self.cfg.status_auth else None
        self.transport.signer = auth.Signer(self.key, self.id, self.cfg.secret or None)
        self.transport.secret = self.cfg.secret or None
        self.transport.pin_of = self._pin_of
        self.names = auth.Names(self.id, tls=self.tls, fingerprint=self.key.fingerprint() if self.tls else "",
                                proof_secret=self.cfg.secret if self.tls else None)
        await self.joining.agree_settings()
        self.replica = await self.work(self._build_replica, device)
        self.aggregate = torch.zeros(self.replica.numel, dtype=torch.float32)
        self.replica.predict_ahead = self.overlap and self.window == 1
        if self.window > 1:
            self.replica.use_local_steps(OuterConfig(self.cfg.outer_lr, self.cfg.outer_momentum,
                                                     bool(self.cfg.outer_nesterov)))
            self.window_rows = WindowRows({t.name: t.dim for t in self.replica.table_specs},
                                          RowOptConfig(kind=row_kind("adam", self.cfg.row_state), lr=self.replica.table_lr),
                                          ratio=self.cfg.row_ratio)
        # the codec counts rounds: with local steps, --warmup-steps (inner steps) is that many windows
        codec_cfg = CodecConfig(mode=self.cfg.compression, ratio=self.cfg.ratio, chunk=self.cfg.chunk,
                                warmup_steps=self.cfg.warmup_steps // self.window, ef_decay=self.cfg.ef_decay,
                                clip_norm=self.cfg.clip_norm or None, min_bytes=self.cfg.min_payload)
        codec_cfg.validate()
        self.compressor = Compressor(self.replica.manifest, codec_cfg, sender=self.id)
        self.tables = TableService(self.id, self.replica.table_specs, replicas=self.cfg.replicas,
                                   slots=self.cfg.table_slots,
                                   opt=RowOptConfig(kind=row_kind("adam", self.cfg.row_state), lr=self.replica.table_lr,
                                                    deltas=self.window > 1),
                                   inits=self.replica.table_inits, row_clip=self.cfg.row_clip)
        if not self.cfg.secret:
            print("warning: no --secret: this swarm is open to anyone who can reach it", file=sys.stderr, flush=True)
        if (hint := self.cfg.local_step_hint()) is not None:
            print(hint, file=sys.stderr, flush=True)
        self.guard = guard_for(self)  # per-client limits (swarm/guard.py); None with --client-limits 0
        # auto_decompress off: a compressed body is decompressed after its signature is checked,
        # within its route's limit (server.authenticate, swarm/encoding.py)
        self._runner = web.AppRunner(build_app(self), access_log=None, handle_signals=False, auto_decompress=False)
        await self._runner.setup()
        self._exit.push_async_callback(self._runner.cleanup)
        port = self.cfg.port + genv.local_rank if genv is not None and self.cfg.port else self.cfg.port
        ssl_context = tls.server_context(self.key) if self.tls else None
        try:
            if self.guard is not None:  # the guard accepts first (per-client limits: swarm/guard.py)
                listener = await self.guard.listen(self._runner, self.cfg.host, port, ssl_context=ssl_context)
                self._exit.push_async_callback(listener.close)
                port = listener.port
            else:
                site = web.TCPSite(self._runner, self.cfg.host, port, ssl_context=ssl_context)
                await site.start()
                port = self._runner.addresses[0][1]
        except OSError as e:  # say which address: a group's rank r listens on --port + r, not on --port
            rank = f" (rank {genv.local_rank} of this host's group listens on --port + {genv.local_rank})" \
                if genv is not None and self.cfg.port and genv.local_rank else ""
            raise OSError(f"cannot listen on {self.cfg.host}:{port}{rank}: {e.strerror or e}") from e
        self.port = port
        if self.cfg.status_port:  # plain HTTP, loopback only: the status routes (server.authenticate)
            await web.TCPSite(self._runner, "127.0.0.1", self.cfg.status_port).start()
        adv_host, adv_port = (parse_hostport(self.cfg.advertise, what="--advertise", port_optional=True)
                              if self.cfg.advertise else (self.cfg.host, None))
        if adv_host in ("0.0.0.0", "::", ""):
            adv_host = "127.0.0.1"
        scheme = "https" if self.tls else "http"
        self.addr = f"{scheme}://{bracket_host(adv_host)}:{adv_port or port}"
        self.names.set_addresses(self.cfg.host, port, adv_host, adv_port or port)
        self.members = Membership(self.key, self.addr, time.monotonic(), MembershipConfig(),
                                  meta={"step": 0, "active": 0, "active_from": 0}, peer_id=self.id,
                                  tls=self.key.fingerprint() if self.tls else "")
        self.table_client = TableClient(self.tables, self.transport, self.table_work, self.id, self.shell.addr_of,
                                        self.shell.suspects, row_dtype=self.cfg.pull_dtype(), push_dtype=self.cfg.push_dtype,
                                        push_window=self.cfg.push_window, ban_seconds=self.cfg.ban_seconds,
                                        event=self.event,
                                        complete_pushes=self.window_pushers if self.window > 1 else None,
                                        ack_when_applied=self.cfg.acks_when_applied(self.window),
                                        whole_wait=self.cfg.window_push_wait_s())
        if self.window > 1:
            self.table_client.use_held(self.cfg.held_rows)
        self._exit.callback(self.table_client.close)
        self.out(f"listening on {scheme}://{bracket_host(self.cfg.host)}:{port} as peer {self.id} "
                 f"(task {self.replica.task.name}: {self.replica.manifest.numel / 1e6:.2f}M dense values{self._tables_line()})")
        if self.key_origin:
            self.out(f"peer key: {self.key_origin}")
        if generated:
            pin = f"#{self.key.fingerprint()}" if self.tls else ""
            self.out(f"join this swarm with: python3 peer.py --join {self.addr.split('://', 1)[1]}{pin} "
                     f"{credentials.secret_arg(self.cfg.secret)}" + (" (the secret kept from an earlier start)" if kept else ""))
        if self.status_token:
            self.out(f"status page: {self.addr}/?token={self.status_token}")
        if self.cfg.status_port:
            self.out(f"status page (plain HTTP, this machine only): http://127.0.0.1:{self.cfg.status_port}/"
                     + (f"?token={self.status_token}" if self.status_token else ""))
        join = self.cfg.join
        if comm is not None:
            join = await self._form_group(comm, join)
        resume = await self.joining.read_checkpoint()
        if join:
            await self.joining.join(join)
        if resume is not None:
            await self.joining.resume(resume)
        await self.shell.update_map()
        self._spawn(self.shell.run(), "membership", critical=True)

    def _pin_of(self, peer_id: str) -> str | None:
        """The certificate fingerprint a member's signed record gives (the transport pins it)."""
        pin = self.members.pin(peer_id) if self.members is not None else None
        return (pin[1] or None) if pin is not None else None

    async def save_checkpoint(self) -> None:
        """Write a checkpoint: dense state on the training thread, table slots on the table thread,
        the files from a helper thread (each atomic)."""
        dense = await self.work(self.replica.state_blob)
        residual = await self.work(self.compressor.state_dict)
        tables = await self.table_work(checkpoint.tables_blob, self.tables.shards, self.table_layout())
        await asyncio.to_thread(checkpoint.save, self.cfg.checkpoint, dense=dense, residual=residual,
                                tables=tables, step=self.replica.step, layout=self.table_layout(), peer_id=self.id,
                                settings=self.settings)
        self._last_checkpoint = time.monotonic()

    async def _form_group(self, comm: Comm, join: str) -> str:
        """Learn the other ranks' ids and addresses; returns whom to join (--join, else rank 0)."""
        from .group.runner import HostGroup

        try:
            ids = await self.work(comm.all_gather_text, self.id)
            addrs = await self.work(comm.all_gather_text, self.addr)
        except RuntimeError as e:  # what torch.distributed raises when a rank is gone (its own error says why)
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise GroupError(f"another rank of this host's group stopped while the group formed "
                             f"(its own error says why): {first}") from None
        if len(set(ids)) != len(ids):
            raise JoinError("two ranks of this host group have the same peer id")
        self.group = HostGroup(self, comm, ids)
        self.members.set_meta(group=ids[0], grank=comm.rank)
        self.event("group", f"rank {comm.rank} of {comm.world} ({comm.backend}, {self.replica.device}); "
                             f"leader {ids[0][:8]}")
        if not join and comm.rank > 0:
            # rank 0 serves the certificate of the key every rank shares: pin it
            join = addrs[0].split("://", 1)[1] + (f"#{self.key.fingerprint()}" if self.tls else "")
        return join

    def table_layout(self) -> str:
        """What every peer must agree on for the ownership maps to agree: rows, width, slots, replicas."""
        specs = ",".join(f"{t.name}:{t.rows}x{t.dim}" for t in self.replica.table_specs)
        return f"{specs}/slots={self.cfg.table_slots}/replicas={self.cfg.replicas}"

    # -- gradient rounds -------------------------------------------------------------------------
    def metas(self, live: bool = False) -> dict[str, PeerMeta]:
        """The other members' parsed metadata: alive ones, or (``live``) alive and suspect ones."""
        ids = self.members.live_ids(include_self=False) if live else self.members.alive_ids(include_self=False)
        return {pid: PeerMeta.parse(m.meta) for pid in ids if (m := self.members.get(pid)) is not None}

    def winding_down(self) -> bool:
        """We and every live peer have finished the run (core/lifecycle.py winding_down)."""
        me = self.members.get(self.id)
        return me is not None and winding_down(PeerMeta.parse(me.meta), self.metas(live=True))

    def window_pushers(self) -> set[str]:
        """With local steps, whose row pushes make a window's whole at a primary: every contributor's
        (ours too while we contribute); PushBatcher flushes once each has come."""
        mine = {self.id} if self.active else set()
        return mine | {pid for pid, m in self.metas().items() if m.contributor}

    def expected(self, step: int) -> set[str]:
        """Peers whose step payload round ``step`` waits for (core/rounds.py)."""
        paced = self.window == 1  # windows of local steps: every peer contributes to every window
        return rounds.expected(step, self.metas(live=True), self.book.active_senders(step, window=2),
                               self.robust.banned_ids(time.monotonic()), self.id,
                               self.active and (not paced or self.pacing.sends_for(step)),
                               declared=self.book.declared_for if paced else None)

    def offer(self, decoded: Any, nbytes: int) -> str:
        """File a validated payload of ``nbytes`` from the network (called by the /v1/grads route)."""
        self.timeline.payload_from(decoded.sender, nbytes)
        if self.robust.banned(decoded.sender, time.monotonic()):
            self.robust.refused(decoded.sender)
            return robust.BANNED  # the route answers 403
        verdict = self.book.offer(decoded, time.monotonic())
        if verdict in (roundbook.ACCEPTED, roundbook.LATE):
            self._arrival.set()
        return verdict

    async def _wait_round(self, step: int, give_up: Callable[[set[str]], Any] | None = None) -> set[str]:
        """The peers round ``step`` waits for, once they are all in (or its deadline, a stop, a lag
        that calls for a re-sync, or ``give_up`` of them says so)."""
        while True:
            exp = self.expected(step)
            if (self.book.ready(step, exp, time.monotonic(), self.cfg.round_timeout) or self._stop.is_set()
                    or (self.active and self._behind() > rounds.RESYNC_LAG) or (give_up is not None and give_up(exp))):
                return exp
            self._arrival.clear()
            try:
                await asyncio.wait_for(self._arrival.wait(), 0.1)
            except asyncio.TimeoutError:
                pass

    def _broadcast(self, enc: Encoded) -> None:
        """Queue the same bytes for every live peer; a full queue drops its oldest payload. The ranks
        of a host group other than its leader get nothing: they step on their leader's aggregate."""
        wire: tuple[bytes, str | None] | None = None
        for pid in self.members.live_ids(include_self=False):
            m = self.members.get(pid)
            if m is None or PeerMeta.parse(m.meta).follower:
                continue
            q = self._outboxes.get(pid)
            if q is None:
                q = self._outboxes[pid] = asyncio.Queue(maxsize=4)
                self._spawn(self._sender(pid, m.addr, q), f"sender:{pid[:8]}", on_failure=lambda pid=pid, q=q: (
                    self._outboxes.pop(pid, None) if self._outboxes.get(pid) is q else None))
            if q.full():
                q.get_nowait()
                self.dropped_sends += 1
            if wire is None:  # the same bytes to every peer: compressed once (~0.05 ms for 50 KB)
                wire = encoding.compress(enc.blob) if self.transport.compress else (enc.blob, None)
            q.put_nowait((enc, *wire))

    async def _sender(self, pid: str, addr: str, q: asyncio.Queue) -> None:
        """Deliver queued payloads to one peer in step order, each retried briefly on a transient refusal."""
        while not self._stop.is_set() and self._outboxes.get(pid) is q:
            try:
                enc, body, content_encoding = await asyncio.wait_for(q.get(), 1.0)
            except asyncio.TimeoutError:
                continue
            for attempt in range(SEND_ATTEMPTS):
                try:
                    await self.transport.request("POST", addr + "/v1/grads", to=pid, body=body, timeout=30.0,
                                                 content_type="application/octet-stream", headers={HEADER: enc.mode},
                                                 kind="grads", reply_kind="control", content_encoding=content_encoding,
                                                 plain_bytes=len(enc.blob))
                    self.dense_bytes += enc.dense_bytes
                    self.timeline.sent_to(pid, len(body))
                    break
                except PeerUnreachable as e:
                    # It has not heard of us yet (membership still spreading), or it is unreachable for
                    # a moment: try again shortly. Any other refusal is final for this payload.
                    transient = e.status is None or e.code == "unknown-sender"
                    if not transient or attempt == SEND_ATTEMPTS - 1 or self._stop.is_set():
                        self.rejected["sent-refused" if e.status else "sent-failed"] += 1
                        log.info("step %d payload to %s not delivered: %s", enc.step, pid[:8], e.reason)
                        break
                    await asyncio.sleep(0.25 * (attempt + 1))

    # -- the training loop --------------------------------------------------------------------
    async def run(self) -> dict:
        """Train until --steps is reached or stop() is called; then evaluate, leave, and summarise."""
        try:
            if self.group is not None:  # a rank of a host group: the leader decides (swarm/group/runner.py)
                await self.group.run(self.steps)
            else:
                await self.steps(Solo(self))
            self.lifecycle.to(State.FINISHING, time.monotonic())
            if self.replica.step > 0 or self.cfg.steps:
                await self._settle_rows()
                # training's freed heap back to the kernel before the evaluation and the sketch
                # allocate on top of it, where a peer's resident size peaks (swarm/allocator.py)
                await self.work(release_free)
                await self._evaluate_now()
            sketch = self.last_sketch = await self.work(self.replica.sketch)
            if self.cfg.checkpoint and self.replica.step > 0:
                await self.save_checkpoint()
            if self.cfg.steps and not self._stop.is_set():
                if self.group is None and self.active:
                    # our last round is taken: the swarm's later rounds (a joiner that leaves before
                    # the others) must not wait for us while we linger
                    self.stop_contributing(last=max(self.book.step - 1, self.sent_through))
                await self._linger()
        finally:
            await self.leave()
        return self.summary(sketch)

    async def _settle_rows(self) -> None:
        """Let the last step's row updates land before the final evaluation, so that every peer
        evaluates the same tables: every peer queues its last step's row push before its last
        payload (Peer.steps), and a primary applies a push within one --push-window of receiving it.
        With local steps the last payload waits for its pushes to be applied (LocalSteps), and the
        evaluation reads the primaries (evaluate), not a replica copy a replay may not have reached."""
        if self.table_client is None:
            return
        await asyncio.sleep(self.cfg.push_window)
        await self.table_client.batcher.settled()

    async def until_ready(self) -> None:
        """Wait for --min-peers, or (a joiner of a running swarm) sync state and catch up first."""
        if self.started:
            await self._sync_state()
        else:
            self._announce(0)
            gate = MinPeersGate(self.cfg.min_peers)
            self.lifecycle.to(State.WAITING, time.monotonic())
            while not self._stop.is_set():
                decision = gate.decide(self.metas(), time.monotonic())
                if isinstance(decision, Start):
                    break
                if isinstance(decision, JoinTraining):  # the swarm went ahead without us: do not split it
                    self.event("min-peers", f"the swarm is training (step {decision.step}) with fewer than "
                                             f"{self.cfg.min_peers} peers: joining it instead of waiting")
                    self.stop_contributing(last=-1)
                    self.book.reset(decision.step)
                    await self._sync_state()
                    break
                await asyncio.sleep(0.1)
        self.started = True
        self.active = True
        self.lifecycle.to(State.TRAINING, time.monotonic())
        self.members.set_meta(run=1)  # training: a peer waiting for --min-peers joins us instead

    def _shard(self) -> tuple[int, int, int]:
        """(index, count, seed) of our share of the data: one share per live member."""
        ids = self.members.alive_ids()
        seed = (self.cfg.seed * 7919 + int.from_bytes(self.id.encode()[:8], "little")) % (1 << 32)
        return ids.index(self.id), len(ids), seed

    def take_shard(self) -> None:
        """Draw batches from our share of the data (the task's batches(shard))."""
        self.replica.set_shard(*self._shard())

    async def sample_batch(self) -> tuple[Any, dict]:
        """The next batch and the table ids it reads; a new shard first when the membership moved
        (the task's batches() is called again with it)."""
        index, count, seed = self._shard()
        shard = self.replica.shard
        if shard is None or (shard.index, shard.count) != (index, count):
            await self.work(self.replica.set_shard, index, count, seed)
        return await self.work(self.replica.sample)

    def _announce(self, from_step: int) -> None:
        """Take a data shard and tell the swarm we contribute from ``from_step`` on."""
        self.take_shard()
        self.members.set_meta(active=1, active_from=from_step, step=self.book.step, nx=from_step, cs=-1)
        self.event("active", f"contributing from step {from_step}")

    async def _sync_state(self, donor_id: str | None = None) -> None:
        """Download parameters and optimizer state from a live peer (``donor_id`` if it is one), then
        replay buffered rounds up to our first own one; a newer snapshot when a round is lost to us."""
        self.lifecycle.to(State.SYNCING, time.monotonic())
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.cfg.sync_timeout and not self._stop.is_set():
            if rounds.traffic_reaches_us(self.metas(), self.book.last_step_from):
                break  # no round after the snapshot is lost to us
            await asyncio.sleep(0.1)
        for attempt in range(SYNC_ATTEMPTS):
            donor_id = await self._download_state(donor_id)
            lost = await self._catch_up(watch=attempt + 1 < SYNC_ATTEMPTS)
            if lost is None:
                return
            step, senders = lost
            self.stop_contributing(last=step)  # we announced a first round we will not make: not waited for
            self.event("sync-retry", f"round {step}'s payload from {', '.join(p[:8] for p in senders)} is lost to "
                                     f"us (a later one of theirs came): downloading a newer state")

    async def _download_state(self, donor_id: str | None) -> str:
        """Load the state of a contributing peer (``donor_id`` if it is one) whose snapshot no round
        that reached us is missing from; returns the donor's id."""
        limit = self.state_limit()
        t0 = time.monotonic()
        not_ready: set[str] = set()  # donors that answered they have no state yet, this attempt
        while True:
            # a peer that declared itself contributing may still be joining itself (its state not
            # loaded: 503); many peers starting at once meet that, so another one is asked, or the
            # same again a moment later, until the sync deadline
            metas = self.metas()
            donor_id = rounds.pick_donor({p: m for p, m in metas.items() if p not in not_ready} or metas, donor_id)
            donor = self.members.get(donor_id) if donor_id is not None else None
            if donor is None:
                raise JoinError("no live, contributing peer to sync state from")
            try:
                blob = await self.transport.request("GET", donor.addr + "/v1/state", to=donor.peer_id, timeout=300.0,
                                                    reply_limit=limit, kind="state")
                step = await self.work(self.replica.load_state_blob, blob)
            except PeerUnreachable as e:
                if e.status != 503 or time.monotonic() - t0 > self.cfg.sync_timeout + 30 or self._stop.is_set():
                    raise JoinError(f"state sync from {donor.addr} failed: {e}") from None
                self.event("sync-retry", f"{donor.peer_id[:8]} has no state to give yet: asking another peer")
                not_ready.add(donor.peer_id)
                if not_ready >= {p for p, m in metas.items() if m.active}:
                    not_ready.clear()  # every contributor said so: ask them again, a moment later
                donor_id = None
                await asyncio.sleep(0.5)
                continue
            except ValueError as e:
                raise JoinError(f"state sync from {donor.addr} failed: {e}") from None
            donor_id = donor.peer_id  # a newer snapshot (below) from the same peer
            self.book.reset(step)
            gap = rounds.snapshot_gap(step, self.metas(), lambda p: self.book.has(step, p), self.book.last_step_from)
            if not gap or time.monotonic() - t0 > self.cfg.sync_timeout + 30 or self._stop.is_set():
                break
            # a round-``step`` payload was sent before its sender knew us: a newer snapshot has it applied
            self.event("sync-retry", f"state of step {step} is older than the payloads that reached us from "
                                     f"{', '.join(p[:8] for p in gap)}: downloading a newer one")
            await asyncio.sleep(0.3)
        self.event("synced", f"state of step {step} from {donor.peer_id[:8]} ({len(blob) / 1e6:.1f} MB)")
        return donor.peer_id

    async def _catch_up(self, watch: bool) -> tuple[int, list[str]] | None:
        """Replay every round whose payloads are all here, then join at the front a few steps on, so
        that the others know to wait for us before our first payload is due, and take the rounds
        until then. ``watch``: stop at a round one of whose payloads is lost to us
        (core.rounds.lost_in_catch_up) and return it with its senders; None once caught up."""
        while not self._stop.is_set():
            exp = self.expected(self.book.step)
            if not exp or self.book.missing(self.book.step, exp):
                break
            await self.work(self.apply_round, self.book.take(self.book.step, exp, time.monotonic(), 0))
        # (a window takes seconds: two of them are plenty for the news to spread)
        start = self.book.step + (4 if self.window == 1 else 2)
        self.sent_through = -1
        self._announce(start)
        for pid in self.members.alive_ids(include_self=False):
            m = self.members.get(pid)
            self._spawn(self.shell.carry_out(SendSync(target=pid, addr=m.addr, msg=self.members.sync_message())), "sync")
        while (self.book.step < start and not self._stop.is_set()
               and not self.is_last_round(self.book.step - 1)):  # no round comes after the last
            step = self.book.step

            def lost(exp: set[str]) -> list[str]:
                return rounds.lost_in_catch_up(step, exp, lambda p: self.book.has(step, p), self.book.last_step_from)

            exp = await self._wait_round(step, give_up=lost if watch else None)  # not active yet: not expected
            if watch and (gone := lost(exp)):
                return step, gone
            result = self.book.take(step, exp, time.monotonic(), self.cfg.round_timeout)
            if result.timed_out:
                self.event("round-timeout", f"step {step} (catching up) went ahead without "
                                            f"{', '.join(p[:8] for p in result.missing)}")
            await self.work(self.apply_round, result)
        return None

    @staticmethod
    def drop_missing(row_grads: dict, missing: dict) -> dict:
        """Row gradients without the rows we never had (zeros were used for them: no update)."""
        grads = {}
        for name, (ids, g) in row_grads.items():
            if name in missing and len(missing[name]):
                keep = ~np.isin(ids, missing[name], assume_unique=True)
                ids, g = ids[keep], g[torch.from_numpy(keep)]
            grads[name] = (ids, g)
        return grads

    async def push_rows(self, row_grads: dict, missing: dict, step: int) -> None:
        """Send row gradients to their primaries in the background (at most 2 pushes in flight:
        first wait for all but the previous one)."""
        await self.drain_pushes(keep=1)
        self.push_in_background(self.drop_missing(row_grads, missing), key=f"{self.id}:{step}")

    def _behind(self) -> int:
        """How many steps the furthest contributing peer is ahead of us (0 if none is)."""
        return rounds.behind(self.book.step, self.metas())

    def stop_contributing(self, last: int) -> None:
        """Tell every peer at once that our last payload was for round ``last``: no round after it
        waits for us (the gossip alone would take a while to reach them all)."""
        self.members.set_meta(active=0, active_until=last)
        for pid in self.members.alive_ids(include_self=False):
            m = self.members.get(pid)
            if m is not None:
                self._spawn(self.shell.carry_out(SendSync(target=pid, addr=m.addr, msg=self.members.sync_message())), "sync")

    def next_step(self) -> int | str:
        """What the loop does next, as a plain peer or a host group's leader decides it: STOP (stop()
        was called, or --steps is reached), RESYNC (core.rounds.must_resync), else the step to take."""
        if self.stopping or self.is_last_round(self.book.step - 1):  # the last round is taken
            return STOP
        return RESYNC if self.must_resync() else self.book.step

    def is_last_round(self, step: int) -> bool:
        """Round ``step`` is the last that --steps stands for (never, without --steps)."""
        return self.rounds_total != 0 and step + 1 >= self.rounds_total

    def must_resync(self) -> bool:
        """Fallen too far behind the swarm, or our replica differs from the majority's."""
        return rounds.must_resync(self.book.step, self.metas(), self.diverged_from is not None)

    async def resync(self) -> None:
        """We fell behind (stalled, stopped, cut off) or our replica diverged: stop contributing,
        sync state like a joiner (from a peer of the majority when we diverged)."""
        donor, self.diverged_from = self.diverged_from, None
        cause = "diverged" if donor is not None else "lag"
        self.resyncs[cause] += 1
        if donor is None:
            self.event("resync", f"{self._behind()} steps behind the swarm: syncing state from a peer")
        self.active = False
        self.lifecycle.to(State.RESYNCING, time.monotonic())
        self.sketch_note = None
        self.stop_contributing(last=max(self.book.step - 1, self.sent_through))
        self.book.reset(self.book.step)
        try:
            await self._sync_state(donor)
        except JoinError as e:
            self.event("resync-failed", str(e))
        self.active = True
        self.lifecycle.to(State.TRAINING, time.monotonic())

    async def steps(self, role: "Role") -> None:
        """The step loop, one for every peer: a plain peer (Solo) and each rank of a host group
        (group/runner.py) run it; ``role`` says where rows, the dense reduction and the round come
        from. One step: rows pulled -> forward/backward -> (reduced) -> payload out -> row grads
        pushed -> round taken -> replica stepped. The next step's rows are prefetched while the
        round completes where the role allows it."""
        if not await role.begin():
            return
        self.progress.started_at = self._last_print = time.monotonic()
        await self.evaluate_first()
        prefetched: asyncio.Future | None = None
        clock = self.step_times
        try:
            while True:
                cmd = await role.command()
                if cmd is STOP:
                    break
                if cmd is RESYNC:
                    prefetched = await _cancelled(prefetched)
                    if self.local_steps is not None:  # the next window's first rows: not after a re-sync
                        await self.local_steps.drop_next()
                    await role.resync()
                    continue
                step = cmd
                if self.local_steps is not None:  # a round per window of inner steps (swarm/local_steps.py)
                    await self.local_steps.round(role, step)
                    continue
                if self.group is None and self.active and self.pacing.free_running():
                    prefetched = await _cancelled(prefetched)
                    await self.free_step(role, step)  # slower than the swarm: do not hold its rounds up
                    continue
                clock.start()  # one entry per round: with --overlap the first holds two computes, the last none
                loss: float | None = None  # of the step computed last (none: the last round of an overlap)
                if self.sent_through < step:  # not computed yet (always, without --overlap)
                    prefetched, loss = await self.one_step(role, step, prefetched)
                if self.overlap and not self.is_last_round(step) and not self.stopping:
                    # --overlap: step + 1 computes (on the model without round ``step``) while round
                    # ``step``'s payloads travel; the round is taken after it (docs/design.md)
                    prefetched, loss = await self.one_step(role, step + 1, prefetched)
                await role.round(step)  # marks "round" and "apply"
                await self.after_step(step, loss if loss is not None else self.recent_loss())
                clock.mark("after")
                clock.end()
        finally:
            await _cancelled(prefetched)
            if self.local_steps is not None:
                await self.local_steps.drop_next()
        await role.end()
        await self.drain_pushes(keep=0)

    async def one_step(self, role: "Role", step: int, prefetched: asyncio.Future | None
                       ) -> tuple[asyncio.Future | None, float]:
        """Step ``step``'s compute and what it sends: its rows (``prefetched`` or pulled now),
        forward/backward, its payload when the round is ours, the next step's rows started, its row
        gradients pushed. Returns the next step's prefetch and this step's loss; the round is the
        caller's (Peer.steps: this round, or with --overlap the one before)."""
        clock = self.step_times  # started by the caller
        batch, want, rows, missing = await (prefetched if prefetched is not None else self._fetch_batch(role))
        prefetched = None
        clock.mark("rows")
        send = role.gossips and self.pacing.due_round(step) == step  # our round (swarm/pacing.py)
        ahead = step > self.book.step  # overlapped: round step - 1 is not applied yet
        stats, row_grads, enc = await self.work(self._compute, batch, want, rows, step, role.reducer,
                                                self.pacing.plan_next(step) if send else None, role.ranks, ahead)
        clock.mark("compute")
        self.check_finite(stats, step)
        last = self.is_last_round(step)
        if last:  # the last rows go out before the last payload (_settle_rows relies on it)
            await role.push(row_grads, missing, step)
        if enc is not None:
            # the payload before the row pushes: the round waits for it, while row pushes only
            # need to land within the owners' push window (on a slow link, bytes queued ahead
            # of it delay everyone)
            self.send_payload(enc)
            self.pacing.publish()
        self.sent_through = step
        if role.prefetch and self.cfg.prefetch and not last:
            # the next step's rows travel while this step's round completes; they may miss
            # this step's own row update (one step stale), which is the price of the overlap
            prefetched = asyncio.ensure_future(self._fetch_batch(role))
            await role.prefetch_started(prefetched)
        if not last:
            await role.push(row_grads, missing, step)
        self.record_contribution(stats, enc)
        clock.mark("send")
        return prefetched, stats.loss

    def _compute(self, batch, want, rows, step: int, reducer: Callable[[torch.Tensor], None] | None,
                 send: Send | None, ranks: int = 1, ahead: bool = False) -> tuple[StepStats, dict, Encoded | None]:
        """Forward/backward, the role's reduction of the dense gradient (a host group's all_reduce),
        its gradient summed since our last payload, and (``send``: the round we declare next and the
        payload's share, Pacing.plan_next) round ``step``'s payload of that sum: one trip to the training thread."""
        t0 = time.perf_counter()
        stats, flat, row_grads = self.replica.compute(batch, want, rows, ahead)
        self.slow_down(t0, batch, want, rows)
        self.pacing.computed(time.perf_counter() - t0)
        if reducer is not None:
            reducer(flat)
        self.pacing.add(flat, stats.samples * ranks if stats.finite else 0)
        enc = self.pacing.payload(step, send, self.replica.manifest.numel) if send is not None else None
        return stats, row_grads, enc

    async def free_step(self, role: "Role", step: int) -> None:
        """A step of a free-running peer (swarm/pacing.py): compute on the model as it is, take the
        rounds that are complete without waiting for the others, and send the sum of our steps when
        the round we declared is about to close."""
        clock = self.step_times
        clock.start()
        batch, want, rows, missing = await self._fetch_batch(role)
        clock.mark("rows")
        stats, row_grads, _ = await self.work(self._compute, batch, want, rows, step, None, None, role.ranks)
        clock.mark("compute")
        self.check_finite(stats, step)
        await role.push(row_grads, missing, step)
        self.record_contribution(stats, None)
        clock.mark("send")
        while not self.stopping and not self.is_last_round(self.book.step - 1):
            s = self.book.step
            if not self.book.ready(s, self.expected(s), time.monotonic(), self.cfg.round_timeout):
                break
            await self.take_round(s)  # complete: no wait
            await self.after_step(s, stats.loss)
        due = self.pacing.due_round(self.book.step)
        if self.pacing.pending_steps and not self.is_last_round(due - 1) and self.pacing.pace.due(due, time.monotonic()):
            send = self.pacing.plan_next(due)
            enc = await self.work(self.pacing.payload, due, send, self.replica.manifest.numel)
            self.send_payload(enc)
            self.record_payload(enc)
            self.pacing.publish()
        clock.mark("after")
        clock.end()

    def slow_down(self, t0: float, batch, want, rows) -> None:
        """--compute-speed F < 1 (tests, benchmarks): repeat the step's forward/backward until the
        compute begun at ``t0`` took 1/F of its time (training thread)."""
        if self.cfg.compute_speed < 1:
            one = time.perf_counter() - t0
            until = t0 + one / self.cfg.compute_speed
            # a pass starts only while more than half of one is left: the overshoot stays under half a pass
            while until - time.perf_counter() > one / 2 and not self._stop.is_set():
                self.replica.rehearse(batch, want, rows)

    async def _fetch_batch(self, role: "Role") -> tuple[Any, dict, dict, dict]:
        """The next batch and its table rows, pulled from their owners as the role does it."""
        batch, want = await self.sample_batch()
        rows, missing = await role.pull(want)
        return batch, want, rows, missing

    # -- what a role may use of the peer (group/runner.py) ------------------------------------------
    @property
    def overlap(self) -> bool:
        """--overlap (a swarm setting, agreed at join): round t travels while step or window t + 1
        computes. A host group's ranks step in lockstep with their leader's rounds: no overlap."""
        return bool(self.cfg.overlap) and self.group_env is None

    @property
    def stopping(self) -> bool:
        """stop() was called (or the peer is closing): the loop ends after the current step."""
        return self._stop.is_set()

    def spawn(self, coro, name: str) -> asyncio.Task:
        """Run ``coro`` in the background for as long as the peer lives (cancelled at close); its
        failure is an event and counts in swarm_task_failures{task=name}."""
        return self._spawn(coro, name)

    def push_in_background(self, grads: dict, key: str) -> None:
        """Send row gradients to their primaries without waiting (drain_pushes waits)."""
        self._pushes.append(asyncio.ensure_future(self.table_client.push(grads, key=key)))

    async def pushes_landed(self, timeout: float) -> bool:
        """Wait until every row push in flight is answered (applied at its primaries), at most
        ``timeout`` seconds; the pushes go on after it. True when all were answered in time."""
        if not self._pushes:
            return True
        _, late = await asyncio.wait(list(self._pushes), timeout=timeout)
        return not late

    async def drain_pushes(self, keep: int) -> None:
        """Wait until at most ``keep`` row pushes are still in flight."""
        while len(self._pushes) > keep:
            await asyncio.gather(self._pushes.popleft(), return_exceptions=True)

    def wake(self) -> None:
        """Look at the round again now (a payload arrived, or a peer died or left)."""
        self._arrival.set()

    def forget(self, peer_id: str) -> None:
        """A member is gone: its send queue goes (its sender task ends on its own)."""
        self._outboxes.pop(peer_id, None)

    def follow(self, step: int, leader: str) -> None:
        """A rank of a host group took its leader's state of ``step``: it trains from there."""
        if self.replica.shard is None:
            self.take_shard()
            self.event("active", f"following {leader[:8]} (rank 0) from step {step}")
        self.lifecycle.to(State.TRAINING, time.monotonic())

    def check_finite(self, stats: StepStats, step: int) -> None:
        """A non-finite loss skipped the step (its gradient was dropped) and is counted; too many in
        a row stop the peer with a TaskError."""
        if stats.finite:
            return
        run = self.replica.nonfinite_run
        self.event("nonfinite", f"step {step}: the loss was {stats.loss}; the step's gradient was dropped ({run} in a row)")
        if run >= MAX_NONFINITE:
            raise TaskError(f"the task's loss was not finite in {run} steps in a row (last at step {step}): stopping")

    def send_payload(self, enc: Encoded) -> None:
        """File our own payload for its round and queue it for every peer."""
        self.book.offer(enc.decoded)
        self._broadcast(enc)

    def record_payload(self, enc: Encoded) -> None:
        """Count the bytes of a payload we sent (a window's, with local steps)."""
        self.progress.wire_bytes += enc.wire_bytes
        self.progress.dense_equiv += enc.dense_bytes
        self.progress.skipped_steps = self.compressor.skipped_steps

    def record_contribution(self, stats: Any, enc: Encoded | None) -> None:
        """Count a computed step (``enc``: the payload we sent for it, if we sent one)."""
        p = self.progress
        if stats.finite:
            p.losses.append(stats.loss)
        p.samples += stats.samples
        p.tokens += stats.samples * self.replica.task.tokens_per_sample
        p.contributed += 1
        if enc is not None:
            self.record_payload(enc)

    def apply_round(self, result: roundbook.RoundResult) -> int:
        """Combine a round's payloads by the swarm's rule into ``aggregate`` and step the replica on
        it (training thread). Returns how many contributions it combined; ``last_report`` keeps
        their norms and verdicts (the scoreboard reads them)."""
        self.aggregate.zero_()
        self.last_report = roundbook.aggregate_report(self.aggregate, result, self.robust_cfg)
        self.replica.apply_aggregate(self.aggregate, result.step, self.last_report.count)
        return self.last_report.count

    async def take_round(self, step: int) -> None:
        """Wait for round ``step`` (or its deadline), aggregate it and step the replica."""
        exp = await self._wait_round(step)
        self.step_times.mark("round")
        result = self.book.take(step, exp, time.monotonic(), self.cfg.round_timeout)
        self.pacing.completed(step, result.completed_at)
        if result.timed_out:
            self.event("round-timeout", f"step {step} went ahead without {', '.join(p[:8] for p in result.missing)}")
        # payloads of banned senders (filed before the ban) leave the round, on every peer alike
        result.on_time = self.robust.split(result.on_time, time.monotonic())[0]
        result.late = self.robust.split(result.late, time.monotonic())[0]
        await self.work(self.apply_round, result)
        self.step_times.mark("apply")
        for pid in self.robust.observe(self.last_report, time.monotonic()):
            self.event("banned", f"{pid[:8]} for {self.cfg.ban_seconds:g} s: its payloads were outliers")

    async def after_step(self, step: int, loss: float) -> None:
        """After a step was applied: tell the swarm, keep the status series, evaluate, checkpoint, print."""
        self.members.set_meta(step=self.book.step)
        self.members.set_meta(**self.timeline.record_step(self, step, loss))  # our loss and tok/s for the others
        if self.cfg.sketch_every and (self.book.step % self.cfg.sketch_every == 0 or self.book.step == FIRST_CHECK):
            await self.publish_sketch()
            if self._auditing is None or self._auditing.done():
                self._auditing = self._spawn(self.audit_tables(), "table-audit")  # off the step's path
        self.check_divergence()
        self.progress.lr_history.append((self.book.step, self.replica.lr()))
        if self.cfg.eval_every and self.book.step % self.cfg.eval_every == 0 and self.book.step != self.rounds_total:
            await self._evaluate_now()
        if self.cfg.checkpoint and time.monotonic() - self._last_checkpoint >= self.cfg.checkpoint_every:
            await self.save_checkpoint()
        self.maybe_print()

    def maybe_print(self) -> None:
        """A progress line, when --progress-interval has passed since the last one."""
        if time.monotonic() - self._last_print >= self.cfg.progress_interval:
            self._last_print = time.monotonic()
            self.out(self.progress_line())

    def recent_loss(self) -> float:
        """The mean training loss of the last 10 steps this peer computed (NaN before the first)."""
        tail = self.progress.losses[-10:]
        return sum(tail) / len(tail) if tail else float("nan")

    def position(self) -> int:
        """Steps of the task's optimizer the swarm has taken: rounds, or with local steps the inner
        steps up to the window being computed (what the progress line and the summary count)."""
        if self.window == 1:
            return self.book.step
        done = max(self.inner_step, self.book.step * self.window)
        return min(done, self.cfg.steps) if self.cfg.steps else done  # a short last window

    async def publish_sketch(self) -> None:
        """The replica's sketch, for the status page and, in our membership metadata, for the other
        peers to compare theirs with (swarm/divergence.py)."""
        sketch = self.last_sketch = await self.work(self.replica.sketch)
        meta = divergence.meta_of(self.book.step, sketch, self.replica.device.type)
        self.members.set_meta(**meta)
        self.sketch_note = divergence.note_of(self.id, {**meta, "active_from": self.members.get(self.id).meta.get(
            "active_from", 0)})

    async def audit_tables(self) -> int:
        """Compare the table slots we replicate with their primaries' (update count and checksum)
        and replace the copies that differ by the primary's; says so in the event log. Returns the
        number of slots repaired."""
        if self.table_client is None or self.tables is None or self.tables.map is None:
            return 0
        try:
            repaired = await self.table_client.audit(self.table_audit)
        except Exception as e:  # an audit must never take the peer down; the next one tries again
            log.exception("table replica audit failed")
            self.event("audit-failed", f"{type(e).__name__}: {e}")
            return 0
        if repaired:
            tables = sorted({t for t, _ in repaired})
            self.event("table-repair", f"{len(repaired)} replica slots of {', '.join(tables)} differed from "
                                        f"their primary's: replaced by its copy")
        return len(repaired)

    def check_divergence(self) -> None:
        """Compare our last sketch with the other contributors' of the same step; when ours is out of
        line, note a peer of the majority to re-sync from (the loop does it before its next step)."""
        me = self.sketch_note
        if me is None or self.diverged_from is not None or not self.active:
            return
        notes, contributors = [], 0
        for pid, meta in self.metas().items():
            if meta.contributor:
                contributors += 1
                n = divergence.note_of(pid, self.members.get(pid).meta)
                if n is not None and n.step == me.step:
                    notes.append(n)
        if not notes or len(notes) < contributors:
            return  # judge only on every contributor's note of this step (a partial count can mislead)
        donor = divergence.verdict(me, notes)
        if donor is not None:
            self.diverged_from = donor
            self.event("diverged", f"our replica's sketch at step {me.step} differs from the majority's "
                                    f"({len(notes)} other peers compared): re-syncing from {donor[:8]}")

    async def evaluate_first(self) -> None:
        """With --eval-every, the held-out curve starts where this peer's training does (before
        round 0: on the initial rows, drawn here; swarm/evaluation.py)."""
        if self.cfg.eval_every and not self.progress.val_history:
            await self._evaluate_now(initial=self.book.step == 0)

    async def _evaluate_now(self, initial: bool = False) -> None:
        t0 = time.monotonic()
        v = await self.evaluate(initial)
        self.progress.eval_seconds += time.monotonic() - t0
        self.progress.val_loss = v
        if v is not None:  # the status page and the summary plot these points
            self.progress.val_history.append((self.book.step, v))

    async def evaluate(self, initial: bool = False) -> float | None:
        """Mean loss over the fixed held-out batches, with their rows pulled from the owners, or
        (``initial``: the swarm's model before round 0) drawn from the tables' init here (None when
        the corpus is too small to hold a held-out batch)."""
        if not self.replica.val:
            return None
        val = self.replica.val
        wants = [await self.work(self.replica.rows_of, batch) for batch in val]
        if initial:  # each table's slot layout and row width, as its owners have them
            specs = self.replica.table_specs
            bounds = {s.name: slot_bounds(s.rows, self.cfg.table_slots) for s in specs}
            dims = {s.name: s.dim for s in specs}
        losses = []
        for group in evaluation.group_batches(wants):  # rows the batches share are pulled once
            union = evaluation.union_ids([wants[i] for i in group])
            if initial:
                rows = await self.work(evaluation.initial_rows, union, bounds, dims, self.replica.table_inits)
            else:
                rows, _ = await self.table_client.pull(union, dtype=self.cfg.eval_pull_dtype(),
                                                       primaries=self._replicas_may_lag())
            for i in group:
                sub = evaluation.rows_for(wants[i], union, rows)
                losses.append(await self.work(self.replica.eval_loss, val[i], wants[i], sub))
        return sum(losses) / len(losses)

    def _replicas_may_lag(self) -> bool:
        """Whether a replica's copy can be a replay behind its primary after the pushes that made
        it were answered: with local steps (--push-ack auto answers when applied) or --push-ack
        applied. An evaluation then reads the primaries, so that every peer evaluates the same
        rows; otherwise its own copies, which are as current and are read exactly (fp32)."""
        return self.window > 1 or self.cfg.acks_when_applied(self.window)

    async def _linger(self) -> None:
        """After --steps: keep serving rows until every live peer has evaluated too (bounded)."""
        self.members.set_meta(done=1)
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.cfg.linger and not self._stop.is_set():
            if linger_over(self.metas(live=True)):
                return
            await asyncio.sleep(0.1)

    def progress_line(self) -> str:
        return report.progress_line(self)

    # -- leaving -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the peer to finish its current step and leave (signal handlers call this)."""
        self._stop.set()
        self._arrival.set()

    async def leave(self) -> None:
        """Tell the swarm we are going, then shut the server and threads down."""
        if self.members is not None and self.members.get(self.id).state != "left":
            # give queued payloads a moment to go out, so the others' last round is complete
            t0 = time.monotonic()
            while any(not q.empty() for q in self._outboxes.values()) and time.monotonic() - t0 < 3.0:
                await asyncio.sleep(0.05)
            # our replicas are about to take over our slots: the rows a replay missed go first
            if self.table_client is not None and not await self.table_client.pay_debts(within=3.0):
                self.event("rows-owed", f"left with {len(self.table_client.owed)} replica rows not caught up")
            actions = self.members.leave(time.monotonic())
            await asyncio.gather(*(self.shell.carry_out(a) for a in actions), return_exceptions=True)
            self.event("left", "")
        self.lifecycle.to(State.LEFT, time.monotonic())
        self._stop.set()
        await self.close()

    async def close(self) -> None:
        """Stop every background task, then release what start() took, newest first (idempotent)."""
        self._stop.set()
        while self._tasks:  # a task being cancelled may spawn another (a last sync): until none is left
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)
        self._runner = None
        await self._exit.aclose()

    # -- background tasks ------------------------------------------------------------------------
    def _spawn(self, coro, name: str, critical: bool = False, on_failure: Callable[[], Any] | None = None
               ) -> asyncio.Task:
        """A background task that lives no longer than the peer (close cancels it) and whose
        exception is never lost. Rules: a failure is logged with its traceback, an event
        (``task-failed``) and a count (swarm_task_failures{task}); ``on_failure`` then runs (a
        payload sender's queue is dropped, so the next broadcast starts a new sender: the restart
        rule); a ``critical`` task (the membership loop: without it the peer is blind) stops the
        peer, and its summary says why."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if t.cancelled() or t.exception() is None:
                return
            e = t.exception()
            log.error("background task %s failed", name, exc_info=e)
            self.task_failures[name.split(":")[0]] += 1
            self.event("task-failed", f"{name}: {type(e).__name__}: {e}"[:300])
            if on_failure is not None:
                on_failure()
            if critical and not self._stop.is_set():
                self.failure = f"the {name} task failed: {type(e).__name__}: {e}"[:300]
                self.stop()

        task.add_done_callback(done)
        return task

    def event(self, kind: str, detail: str) -> None:
        """A line in the peer's event log (status page, /api/events)."""
        self.events.append({"at": time.time(), "kind": kind, "detail": detail})
        log.info("%s %s", kind, detail)

    def summary(self, sketch: list[float]) -> dict:
        """The JSON summary a finished peer prints (swarm/status/report.py)."""
        return report.summary(self, sketch)

    def task_info(self) -> dict | None:
        return report.task_info(self)

    def status(self) -> dict:
        """The /api/status document (swarm/status/report.py; docs/protocol.md)."""
        return report.status(self)


async def _cancelled(fut: asyncio.Future | None) -> None:
    """Cancel a prefetch that will not be used and wait for it to unwind; always None."""
    if fut is not None:
        fut.cancel()
        await asyncio.gather(fut, return_exceptions=True)
    return None
