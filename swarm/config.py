"""Every setting of a peer in one dataclass.

CLI flags (peer.py) and environment variables (``SWARM_<FIELD>``, upper case) map onto these fields;
a flag given on the command line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .limits import MEMBER_BUDGET, OUTSIDER_BUDGET, LimitsError, parse_budget
from .threads import default_threads

COMPRESSION_MODES = ("none", "topk", "topk-int8", "topk-int4", "topk-int2")
ROW_DTYPES = ("fp32", "fp16", "bf16", "int8", "int4")  # table rows and row gradients on the wire
AGGREGATION_RULES = ("mean", "trimmed", "centered-clip")  # swarm/robust.py RULES
# how the contributor cap holds per step (swarm/pacing.py): every peer sends every round at 1/k of its
# entries, or a whole payload every k rounds (a dense codec's payload cannot split: it caps by rounds)
CAP_BY = ("bytes", "rounds")
ROW_STATES = ("full", "rowwise")  # the table optimizer's second moment: per value, or one per row (tables/shard.py)


class ConfigError(ValueError):
    """A setting is out of range or malformed; the message names the setting."""


@dataclass
class PeerConfig:
    # networking
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str = ""  # host[:port] other peers should use; defaults to host:port
    join: str = ""  # host:port of any live member
    join_timeout: float = 10.0  # keep retrying an unreachable --join this long, then give up
    # security (docs/security.md)
    secret: str = field(default="", repr=False)  # shared swarm secret; "" = open swarm; "generate" (first peer)
    status_auth: int = 0  # 1 = the status page, /api/status, /api/events and /metrics need the secret too
    # per-client limits (swarm/limits.py): 0 = off; budgets as "rate=R,burst=B,connections=C,streams=S"
    # (any of them; "" = the defaults), for members (by identity) and outsiders (by address)
    client_limits: int = 1
    member_limits: str = ""
    outsider_limits: str = ""
    # what to train (swarm/task.py): "MODULE:ATTR" or "FILE.py:ATTR"; empty = the built-in byte LM
    task: str = ""
    task_args: Mapping[str, str] = field(default_factory=dict)  # --task-arg KEY=VALUE, converted by the task
    # training
    steps: int = 0  # 0 = train until stopped; else stop once the swarm step reaches this
    budget: int = 0  # the swarm's step budget the lr schedule runs on; 0 = the first peer's --steps
    seed: int = 0  # the swarm seed: every peer builds the model under it
    # built-in task only (refused with a user task): sequences of 128 bytes per step, peak lr, text files
    batch_size: int = 16
    lr: float = 3e-3
    data: str = ""  # path of the user's text files; empty = the Python standard library
    # torch threads: the CPUs this process may use, shared among a torchrun host's ranks (threads.py)
    threads: int = field(default_factory=default_threads)
    min_peers: int = 1  # wait until this many peers are alive before the first step
    eval_batches: int = 8
    eval_every: int = 0  # also evaluate every this many steps (0 = only at the end)
    device: str = "auto"  # where the model and each step's rows live: auto (a GPU if torch sees one), cpu, cuda
    # host groups (torchrun; docs/design.md, "Host groups")
    backend: str = "auto"  # collectives inside a host group: auto (nccl on GPUs, else gloo), nccl, gloo
    group_timeout: float = 600.0  # a collective waits this long for the other ranks before the group gives up
    # codec
    compression: str = "topk-int8"
    ratio: float = 0.01
    chunk: int = 0  # > 0: chunk-wise Top-K, each run of this many entries keeps its share (0 = global)
    warmup_steps: int = 20
    ef_decay: float = 1.0  # the error-feedback residual is multiplied by this before each payload (1 = exact)
    # local steps (docs/design.md, "Local steps"): H inner steps of the task's optimizer, then one round
    sync_every: int = 1  # H; 1 = every step is a round
    outer_lr: float = 1.0  # the outer step on the aggregated pseudo-gradient (1, no momentum: averaging)
    outer_momentum: float = 0.0
    outer_nesterov: int = 0  # 1 = Nesterov outer momentum (DiLoCo's recipe: lr 0.7, momentum 0.9)
    overlap: int = 0  # 1 = round t travels while step (or window) t+1 computes (a one-round-delayed update)
    # a round's payload bytes, about this many payloads' worth: with P >= 2C contributing peers each
    # sends 1/floor(P / C) of its entries (--cap-by bytes) or a payload every floor(P / C) rounds,
    # summing its steps between them (--cap-by rounds); 0: no cap
    max_contributors: int = 4
    cap_by: str = "bytes"  # how the cap holds per step (windows always split bytes): "bytes" or "rounds"
    row_ratio: float = 1.0  # with local steps: the share of a window's row deltas pushed (largest first; the rest carried)
    # with local steps: a window's row deltas go this many inner steps before its end, so that they
    # travel while its last steps compute; those steps' deltas are carried to the next push (0: at
    # the end; -1, "auto": as many as the last window's pushes took, at most H/4: core/cadence.py push_lead)
    push_lead: int = 0
    min_payload: int = 32768  # bytes: a gradient payload is never sparser than what fills this
    clip_norm: float = 0.0  # 0 = no clipping
    # model size and the sharded tables
    table_rows: int = 65536
    replicas: int = 2  # owners of each table slot: a primary and replicas-1 replicas
    table_slots: int = 4096  # contiguous row ranges per table, the unit of ownership and hand-off
    table_lr: float = 0.0  # row-wise Adam on the table rows; 0 = the task's table_lr (built-in: 0.03)
    # samples per forward/backward, the gradients accumulated (this peer's memory, not the swarm's
    # math); 0 = the whole batch at once, -1 = the task's micro_batch (built-in: 4)
    micro_batch: int = -1
    row_state: str = "full"  # "rowwise": the table Adam keeps one second-moment value per row, not per value
    # rows on the wire (pull replies; int8/int4: per-row power-of-two scales); "" = int8 for per-step
    # rounds, int4 with --sync-every > 1 (pull_dtype)
    row_dtype: str = ""
    push_dtype: str = "int4"  # row gradients on the wire (and the replays to replicas)
    # bodies this peer sends (requests, and replies to peers that accept it) zstd-compressed where
    # that saves >= 3% (swarm/encoding.py): "zstd" or "none"; a peer's own choice, every peer
    # decompresses either way
    wire_compression: str = "zstd"
    prefetch: int = 1  # 1 = pull the next step's (window's first) rows while waiting for this step's round
    # with --sync-every > 1: the inner steps ahead whose batches are sampled and rows pulled while
    # this one computes (each row still pulled once a window)
    row_lookahead: int = 8
    # with --sync-every > 1: the most inner steps whose rows one pull asks for together (each
    # request costs CPU at both ends; a window's pulls ramp up to it, core/cadence.py pull_group;
    # a peer's own choice)
    pull_steps: int = 4
    # with --sync-every > 1 (no --overlap, --prefetch 1): take the next window's first inner step
    # while this window's end travels (its pushes applied, its round), on our own state, and carry
    # its progress onto the new global model (local_steps.py; a peer's own choice; 0 = after the round)
    early_step: int = 1
    # with --sync-every > 1: rows of the last window kept with their tags, so that a pull asks their
    # owners only for the rows that changed since (tables/held.py; 0 = every pull whole)
    held_rows: int = 1 << 17
    push_window: float = 0.25  # a primary applies the pushes that arrive within this many seconds together
    # with --sync-every > 1: seconds a primary waits after a window's first row push for one from
    # every contributor (0: --push-window; -1, "auto": --round-timeout / 8); a primary's own choice
    # (docs/design.md "Tables in windows")
    window_push_wait: float = -1.0
    # when a primary answers a row push: "applied" (its flush is applied here; the replicas get it
    # before the next flush), "replicated" (its replicas have replayed it too), "auto" (applied with
    # --sync-every > 1, replicated with per-step rounds); a primary's own choice (docs/design.md)
    push_ack: str = "auto"
    linger: float = 20.0  # after --steps, keep serving rows this long for peers still evaluating
    # replicas compare param_sketches every this many steps and re-sync one that differs (0 = off)
    sketch_every: int = 100
    # rounds
    round_timeout: float = 20.0  # never wait longer than this for one round's payloads
    # a testing knob: compute at this fraction of our speed (forward/backward repeated, the extra
    # passes discarded), so a slow peer keeps its CPU share in tests and benchmarks
    compute_speed: float = 1.0
    # a peer clearly slower than the swarm stops waiting for each round (swarm/pacing.py); 0: it
    # waits like the others, and they wait for it
    free_run: int = 1
    max_staleness: int = 16  # payloads older than this many steps are dropped, not applied
    sync_timeout: float = 10.0  # a joiner waits at most this long for gradient traffic before syncing
    # robust aggregation (docs/design.md, "Robust aggregation")
    aggregation: str = "centered-clip"  # mean, trimmed or centered-clip (robust rules need >= 3 contributors)
    trim: float = 0.2  # trimmed: fraction of contributors cut from each end, per coordinate
    msg_clip: float = 2.0  # clip each payload to this x the round's median payload norm; 0 = off
    # a table primary clips each pushed row to this x the flush's reference row norm (docs/design.md,
    # "Robust row pushes"); 0 = off (the plain sum)
    row_clip: float = 2.0
    ban_seconds: float = 60.0  # a peer whose score falls too low is refused this long
    # checkpoints
    checkpoint: str = ""  # directory; empty = no checkpoints
    checkpoint_every: float = 60.0  # seconds between checkpoints while training
    # output
    progress_interval: float = 3.0
    name: str = ""  # a label for summaries and status; the peer id is derived from the key
    key_file: str = ""  # the peer's Ed25519 key; empty: peer.key in --checkpoint, else a new key per start
    status_port: int = 0  # plain-HTTP status routes on 127.0.0.1:PORT (0: off)
    extra: Mapping[str, Any] = field(default_factory=dict)
    # the fields given on the command line or in SWARM_* variables (the CLI fills it); a Python
    # caller's non-default values count as given too
    given: frozenset = field(default_factory=frozenset, repr=False)

    def is_given(self, name: str) -> bool:
        return name in self.given or getattr(self, name) != getattr(_DEFAULTS, name)

    def acks_when_applied(self, window: int) -> bool:
        """Whether this peer, as a table primary, answers a row push once its flush is applied here
        rather than once its replicas replayed it too (--push-ack; ``window``: the swarm's agreed
        --sync-every). auto: applied with local steps, whose window barrier would otherwise wait for
        the replays on every window (docs/design.md, "When a primary answers a push")."""
        return self.push_ack == "applied" or (self.push_ack == "auto" and window > 1)

    def window_push_wait_s(self) -> float | None:
        """How long this peer, as a table primary with local steps, waits after a window's first row
        push for every contributor's (PushBatcher ``whole_wait``; None: the push window): auto is an
        eighth of --round-timeout, half the quarter a pusher holds its payload for the answers."""
        if self.window_push_wait < 0:
            return self.round_timeout / 8
        return self.window_push_wait or None

    def pull_dtype(self) -> str:
        """The dtype this peer's row pulls ask for: --row-dtype, or by default int8 for per-step
        rounds and int4 with local steps (a pulled row is then only the start of a window's working
        copy, and the pushed delta is taken against it: docs/benchmarks.md measured 31% fewer bytes
        per sample at H=32, val_loss within noise). Read after the swarm's settings are agreed."""
        return self.row_dtype or ("int4" if self.sync_every > 1 else "int8")

    def local_step_hint(self) -> str | None:
        """One line for the peer that starts a swarm in windows of local steps with the codec left
        at its per-step defaults (None otherwise): the settings measured best in windows
        (bench/wan.py's swarm-h32), which it may have meant. A joiner adopts the swarm's settings,
        so it gets none."""
        if self.sync_every <= 1 or self.join or any(self.is_given(n) for n in LOCAL_STEP_BEST):
            return None
        flags = " ".join(f"--{n.replace('_', '-')} {v}" for n, v in LOCAL_STEP_BEST.items())
        return (f"note: --sync-every {self.sync_every} with the per-step codec settings; measured best in windows: "
                f"{flags} (README, \"Slow links: local steps\")")

    def eval_pull_dtype(self) -> str:
        """The dtype of the rows an evaluation pulls: the training pulls', but never below int8, so
        that val_loss measures the model rather than int4's rounding (a peer reads its own slots
        exactly, so int4 pulls also made peers' val_loss differ by which rows they own)."""
        return "int8" if self.pull_dtype() == "int4" else self.pull_dtype()

    def check_user_task(self) -> None:
        """A user task brings its own batches, optimizer and tables: the built-in task's flags would
        mean nothing, so they are refused (ConfigError naming the first)."""
        for name in BUILTIN_ONLY:
            if self.is_given(name):
                raise ConfigError(f"--{name.replace('_', '-')} is a setting of the built-in task; with a user task "
                                  "set it in the task (a --task-arg, if the task takes one)")

    def validate(self) -> None:
        """Raise ConfigError naming the first bad setting."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(0 <= self.port <= 65535, f"--port must be in 0..65535, got {self.port}")
        need(self.steps >= 0, f"--steps must be >= 0, got {self.steps}")
        need(self.budget >= 0, f"--budget must be >= 0, got {self.budget}")
        need(self.sketch_every >= 0, f"--sketch-every must be >= 0, got {self.sketch_every}")
        need(1 <= self.batch_size <= 4096, f"--batch-size must be in 1..4096, got {self.batch_size}")
        need(0 < self.lr < 1, f"--lr must be in (0, 1), got {self.lr}")
        need(1 <= self.threads <= 256, f"--threads must be in 1..256, got {self.threads}")
        need(self.min_peers >= 1, f"--min-peers must be >= 1, got {self.min_peers}")
        need(self.compression in COMPRESSION_MODES,
             f"--compression must be one of {', '.join(COMPRESSION_MODES)}, got {self.compression!r}")
        need(0 < self.ratio <= 1, f"--ratio must be in (0, 1], got {self.ratio}")
        need(self.chunk == 0 or 64 <= self.chunk <= 1 << 24, f"--chunk must be 0 or in 64..{1 << 24}, got {self.chunk}")
        need(0 < self.ef_decay <= 1, f"--ef-decay must be in (0, 1], got {self.ef_decay}")
        need(1 <= self.sync_every <= 100000, f"--sync-every must be in 1..100000, got {self.sync_every}")
        need(0 < self.outer_lr <= 10, f"--outer-lr must be in (0, 10], got {self.outer_lr}")
        need(0 <= self.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        need(self.outer_nesterov in (0, 1), f"--outer-nesterov must be 0 or 1, got {self.outer_nesterov}")
        need(not self.outer_nesterov or self.outer_momentum > 0, "--outer-nesterov needs an --outer-momentum > 0")
        need(self.overlap in (0, 1), f"--overlap must be 0 or 1, got {self.overlap}")
        need(0 <= self.max_contributors <= 4096, f"--max-contributors must be in 0..4096, got {self.max_contributors}")
        need(self.cap_by in CAP_BY, f"--cap-by must be one of {', '.join(CAP_BY)}, got {self.cap_by!r}")
        need(0 < self.row_ratio <= 1, f"--row-ratio must be in (0, 1], got {self.row_ratio}")
        need(self.row_ratio == 1 or self.sync_every > 1, "--row-ratio needs --sync-every > 1 (it selects window deltas)")
        need(self.push_lead in (-1, 0) or 0 < self.push_lead < self.sync_every,
             f"--push-lead must be auto or in 0..{max(0, self.sync_every - 1)} (inner steps before a window's end; "
             f"more than 0 needs --sync-every > 1), got {self.push_lead}")
        need(self.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        need(0 <= self.min_payload <= 1 << 30, f"--min-payload must be in [0, 2**30] bytes, got {self.min_payload}")
        need(self.clip_norm >= 0, f"--clip-norm must be >= 0, got {self.clip_norm}")
        need(1024 <= self.table_rows <= 1 << 26, f"--table-rows must be in 1024..{1 << 26}, got {self.table_rows}")
        need(1 <= self.table_slots <= 1 << 16, f"--table-slots must be in 1..65536, got {self.table_slots}")
        need(1 <= self.replicas <= 8, f"--replicas must be in 1..8, got {self.replicas}")
        need(0 <= self.table_lr < 1, f"--table-lr must be in (0, 1) (0 = the task's), got {self.table_lr}")
        need(-1 <= self.micro_batch <= 1 << 20,
             f"--micro-batch must be >= 0 samples (0: the whole batch; -1: the task's), got {self.micro_batch}")
        need(self.row_state in ROW_STATES, f"--row-state must be full or rowwise, got {self.row_state!r}")
        need(self.row_dtype in ("", *ROW_DTYPES),
             f"--row-dtype must be fp32, fp16, bf16, int8 or int4, got {self.row_dtype!r}")
        need(self.push_dtype in ROW_DTYPES,
             f"--push-dtype must be fp32, fp16, bf16, int8 or int4, got {self.push_dtype!r}")
        need(self.prefetch in (0, 1), f"--prefetch must be 0 or 1, got {self.prefetch}")
        need(0 <= self.held_rows <= 1 << 24, f"--held-rows must be in [0, 2**24] rows, got {self.held_rows}")
        need(1 <= self.row_lookahead <= 64, f"--row-lookahead must be in 1..64 inner steps, got {self.row_lookahead}")
        need(1 <= self.pull_steps <= 64, f"--pull-steps must be in 1..64 inner steps, got {self.pull_steps}")
        need(self.early_step in (0, 1), f"--early-step must be 0 or 1, got {self.early_step}")
        need(self.wire_compression in WIRE_COMPRESSIONS,
             f"--wire-compression must be one of {', '.join(WIRE_COMPRESSIONS)}, got {self.wire_compression!r}")
        need(self.push_ack in PUSH_ACKS, f"--push-ack must be one of {', '.join(PUSH_ACKS)}, got {self.push_ack!r}")
        need(0 <= self.push_window <= 5, f"--push-window must be in [0, 5] seconds, got {self.push_window}")
        # below the quarter of --round-timeout a pusher holds its payload for the answers (local_steps.py)
        need(self.window_push_wait == -1 or 0 <= self.window_push_wait < self.round_timeout / 4,
             f"--window-push-wait must be auto or in [0, --round-timeout / 4) seconds, got {self.window_push_wait}")
        need(self.linger >= 0, f"--linger must be >= 0, got {self.linger}")
        need(self.round_timeout > 0, f"--round-timeout must be > 0, got {self.round_timeout}")
        need(self.free_run in (0, 1), f"--free-run must be 0 or 1, got {self.free_run}")
        need(0 < self.compute_speed <= 1, f"--compute-speed must be in (0, 1], got {self.compute_speed}")
        need(self.max_staleness >= 0, f"--max-staleness must be >= 0, got {self.max_staleness}")
        need(self.aggregation in AGGREGATION_RULES,
             f"--aggregation must be one of {', '.join(AGGREGATION_RULES)}, got {self.aggregation!r}")
        need(0 <= self.trim < 0.5, f"--trim must be in [0, 0.5), got {self.trim}")
        need(self.msg_clip == 0 or 1 <= self.msg_clip < float("inf"),
             f"--msg-clip must be 0 (off) or >= 1 (x the round's median norm), got {self.msg_clip}")
        need(self.row_clip == 0 or 1 <= self.row_clip < float("inf"),
             f"--row-clip must be 0 (off) or >= 1 (x the flush's reference row norm), got {self.row_clip}")
        need(0 <= self.ban_seconds < float("inf"), f"--ban-seconds must be >= 0, got {self.ban_seconds}")
        need(self.join_timeout > 0, f"--join-timeout must be > 0, got {self.join_timeout}")
        need(self.checkpoint_every > 0, f"--checkpoint-every must be > 0, got {self.checkpoint_every}")
        if self.checkpoint:
            need(not os.path.exists(self.checkpoint) or os.path.isdir(self.checkpoint),
                 f"--checkpoint {self.checkpoint!r} exists and is not a directory")
        need(self.eval_batches >= 1, f"--eval-batches must be >= 1, got {self.eval_batches}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda, got {self.device!r}")
        need(self.backend in ("auto", "nccl", "gloo"), f"--backend must be auto, nccl or gloo, got {self.backend!r}")
        need(self.group_timeout > 0, f"--group-timeout must be > 0, got {self.group_timeout}")
        need(self.status_auth in (0, 1), f"--status-auth must be 0 or 1, got {self.status_auth}")
        need(not self.status_auth or bool(self.secret), "--status-auth 1 needs a --secret")
        need(self.client_limits in (0, 1), f"--client-limits must be 0 or 1, got {self.client_limits}")
        for flag, text, base in (("--member-limits", self.member_limits, MEMBER_BUDGET),
                                 ("--outsider-limits", self.outsider_limits, OUTSIDER_BUDGET)):
            try:
                parse_budget(text, base, flag)
            except LimitsError as e:
                raise ConfigError(str(e)) from None
        if self.secret == "generate":
            need(not self.join, "--secret generate is for the first peer only; "
                                "a joiner needs the swarm's secret (--secret VALUE)")
        elif self.secret:
            need(len(self.secret) >= 16 and self.secret.isprintable() and self.secret.strip() == self.secret,
                 "--secret must be at least 16 printable characters without surrounding spaces "
                 "(or 'generate' on the first peer)")
        need(len(self.name) <= 64 and self.name.isprintable() and self.name.strip() == self.name,
             f"--name must be printable, at most 64 characters, without surrounding spaces, got {self.name[:40]!r}")
        need(0 <= self.status_port <= 65535, f"--status-port must be 0..65535, got {self.status_port}")
        need(not self.key_file or not os.path.isdir(self.key_file), f"--key-file {self.key_file!r} is a directory")
        if self.join:
            pin = parse_join(self.join)[2]
            need(pin is None or bool(self.secret),
                 "--join HOST:PORT#FP pins a TLS certificate: the swarm needs a --secret")
        if self.advertise:
            parse_hostport(self.advertise, what="--advertise", port_optional=True)
        if self.data:
            need(os.path.exists(self.data), f"--data {self.data!r} does not exist")


def bracket_host(host: str) -> str:
    """An IPv6 address in brackets, for a URL (any other host as it is)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def parse_hostport(text: str, *, what: str, port_optional: bool = False) -> tuple[str, int | None]:
    """'host:port' (or '[v6]:port') -> (host, port); ConfigError on anything else."""
    text = text.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):].rstrip("/")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep:
            raise ConfigError(f"{what} {text!r} is not host:port")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, ""
    if not host:
        raise ConfigError(f"{what} {text!r} has no host")
    if not port_text:
        if port_optional:
            return host, None
        raise ConfigError(f"{what} {text!r} needs a port (host:port)")
    if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise ConfigError(f"{what} {text!r} has a bad port")
    return host, int(port_text)


def parse_join(text: str) -> tuple[str, int, bytes | None]:
    """'host:port[#FP]' -> (host, port, the pinned certificate's SHA-256 or None); ConfigError on
    anything else."""
    from .identity import parse_fingerprint  # (cryptography: only when a join address is parsed)

    where, _, fp = text.partition("#")
    host, port = parse_hostport(where, what="--join")
    try:
        return host, port, (parse_fingerprint(fp) if fp else None)
    except ValueError as e:
        raise ConfigError(f"--join {text}: {e}") from None


BUILTIN_ONLY = ("batch_size", "lr", "data", "table_rows", "eval_batches")
_DEFAULTS = PeerConfig()


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(PeerConfig) if f.name not in ("extra", "task_args", "given")]


PUSH_ACKS = ("auto", "applied", "replicated")
# the codec settings measured best in windows of local steps (bench/wan.py LOCAL_STEP, docs/benchmarks.md)
LOCAL_STEP_BEST = {"compression": "topk-int2", "ratio": 0.02, "ef_decay": 0.95, "row_ratio": 0.25}
WIRE_COMPRESSIONS = ("zstd", "none")


def parse_push_lead(raw: str) -> int:
    """--push-lead's value: "auto" (-1) or a count of inner steps."""
    return -1 if raw.strip().lower() == "auto" else int(raw)


def parse_window_push_wait(raw: str) -> float:
    """--window-push-wait's value: "auto" (-1) or seconds (PeerConfig.validate bounds them)."""
    return -1.0 if raw.strip().lower() == "auto" else float(raw)


# fields whose flag takes words as well as numbers: how a value is read (CLI and SWARM_* alike), and
# what it must be
PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "push_lead": (parse_push_lead, "value (auto or an integer)"),
    "window_push_wait": (parse_window_push_wait, "value (auto or seconds)")}


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Settings found in SWARM_* variables, converted to each field's type."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    defaults = PeerConfig()
    for name in field_names():
        key = "SWARM_" + name.upper()
        if key not in environ:
            continue
        raw = environ[key]
        kind = type(getattr(defaults, name))
        read, what = PARSERS.get(name, (kind, kind.__name__))
        try:
            out[name] = read(raw)
        except ValueError:
            raise ConfigError(f"{key}={raw!r} is not a valid {what}") from None
    return out
