"""Command line: parse flags (and SWARM_* variables), build a Peer, run it, print the summary.

Exit codes: 0 on a finished run or a graceful stop (Ctrl-C, SIGTERM); 2 on bad flags, a bad task,
an unreachable --join or a swarm that refuses us, always as one line on stderr without a traceback;
1 when the task's own code raised (its traceback is printed: it is the user's to debug), after the
peer left the swarm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import traceback
from typing import Any, Callable

from . import threads
from .allocator import keep_freed_memory, limit_arenas
from .config import CAP_BY, PUSH_ACKS, WIRE_COMPRESSIONS, ConfigError, PeerConfig, field_names, from_env, parse_push_lead, parse_window_push_wait
from .limits import MEMBER_BUDGET, OUTSIDER_BUDGET
from .task_errors import TaskError, UserCodeError, parse_task_args

EPILOG = """Every flag has an environment-variable twin: --batch-size 8 is SWARM_BATCH_SIZE=8.
A flag on the command line wins over the environment.

Swarm-wide settings (what shapes the shared update: --seed, --budget, --lr, --aggregation, --trim,
--msg-clip, --compression, --ratio, --chunk, --warmup-steps, --min-payload, --clip-norm, --table-lr,
--push-dtype, --row-state, --row-clip, --max-staleness, --sketch-every, --ef-decay, --max-contributors, --cap-by, and the local-step
settings --sync-every, --outer-lr, --outer-momentum, --outer-nesterov, --overlap, --row-ratio) are fixed by the
peer that starts the swarm and kept in its checkpoints; a joiner adopts those it does not give and is refused (exit 2) when it gives
another value. Every other flag is this peer's own.

Without --task, the built-in byte LM trains; its size is task args: --task-arg d_model=256
--task-arg layers=4 (also heads, context, table_rows). --batch-size, --lr, --data, --table-rows and
--eval-batches are the built-in task's and are refused with --task.

On a host with several GPUs, `torchrun --nproc-per-node N peer.py [--join HOST:PORT]` starts N ranks
that join the swarm as one host group (docs/design.md, "Host groups")."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2: argparse's default prints the usage block too
        if message.endswith("expected one argument"):  # e.g. "--secret -x...": the value reads as a flag
            message += "; a value that starts with '-' goes as --FLAG=VALUE"
        sys.stderr.write(f"peer.py: error: {message} (see --help)\n")
        raise SystemExit(2)


class _Version(argparse.Action):
    """``--version``: what a bug report needs (swarm/versions.py), without importing torch. Not
    argparse's own "version" action: that one wants its text when the parser is built, so every
    start would read the packages' metadata (and import swarm/bodies.py) for a flag rarely given."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .versions import line

        sys.stdout.write(line() + "\n")
        parser.exit(0)


def _auto_or(parse: Callable[[str], Any], unit: str) -> Callable[[str], Any]:
    """An argparse type for a flag that takes "auto" or a number of ``unit`` (config.PARSERS):
    a bad value is one line naming what was expected, not a traceback."""
    def read(raw: str) -> Any:
        try:
            return parse(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected auto or a number of {unit}, got {raw!r}") from None
    return read


def build_parser() -> argparse.ArgumentParser:
    d = PeerConfig()
    p = _Parser(prog="peer.py", description="Run one swarm peer: train together with the peers it finds.",
                epilog=EPILOG)
    a = p.add_argument
    a("--version", action=_Version, help="print swarm's version, its wire protocol's, Python's and torch's, and exit")
    a("--host", help=f"address to listen on (default {d.host})")
    a("--port", type=int, help="port to listen on; 0 picks any free port (default 0)")
    a("--advertise", help="host[:port] the other peers should use to reach this one (default: --host)")
    a("--join", help="host:port of any live member of the swarm to join; with a --secret, host:port#FP pins "
                     "its TLS certificate (SHA-256 fingerprint, as the join command of --secret generate prints it)")
    a("--secret", help="shared secret of the swarm: every link is TLS and every request carries a MAC under it; "
                       "'generate' (first peer only) makes one (kept next to the --key-file or in --checkpoint) "
                       "and prints the join command. Default: none, the swarm is open (see docs/security.md)")
    a("--key-file", help="this peer's Ed25519 key (made on first use, mode 0600); its peer id is derived from it. "
                         "Default: peer.key in --checkpoint, else a new key (and id) every start")
    a("--status-port", type=int, help="also serve the status page, /api/status, /api/events and /metrics over "
                                      "plain HTTP on this port of 127.0.0.1, for local use (default 0: off; with "
                                      "a --secret the main port is https only)")
    a("--status-auth", type=int, help="1: the status page, /api/status, /api/events and /metrics need the secret "
                                      "too (?token=, printed at start); 0: open (default 0)")
    a("--client-limits", type=int, choices=(0, 1), help="1: per-client limits on this peer's HTTP server: requests "
      "per second, open connections and /api/events streams per client, answered with 429 and Retry-After beyond "
      "them; members are counted by identity, outsiders by address (docs/security.md; default 1)")
    a("--member-limits", metavar="KEY=VALUE,...", help="a member's budget on this peer: any of rate (requests/s), "
      f"burst, connections, streams (default {MEMBER_BUDGET.text()})")
    a("--outsider-limits", metavar="KEY=VALUE,...", help="the budget of each address that is no member's (a "
      f"browser on the status page fits): same keys (default {OUTSIDER_BUDGET.text()})")
    a("--task", help="what to train: MODULE:ATTR or path/to/file.py:ATTR, a swarm.Task or a function returning "
                     "one (default: the built-in byte LM)")
    a("--task-arg", action="append", metavar="KEY=VALUE", dest="task_arg",
      help="an argument of the task function, converted to its parameter's type (repeatable); without --task, "
           "the built-in task's size: d_model, layers, heads, context, table_rows")
    a("--join-timeout", type=float, help=f"seconds to keep retrying an unreachable --join (default {d.join_timeout})")
    a("--steps", type=int, help="stop once the swarm reaches this step, evaluate, and print a JSON summary "
                                "(default 0: train until stopped); on a joiner it only says when it leaves")
    a("--budget", type=int, help="swarm-wide: the step budget the learning-rate schedule runs on (default: the first "
                                 "peer's --steps; a joiner adopts the swarm's)")
    a("--sketch-every", type=int, help="swarm-wide: peers compare their replicas' sketches every this many steps and "
                                       "one that differs from the majority re-syncs (0 = off; default 100)")
    a("--batch-size", type=int, help=f"built-in task: sequences of 128 bytes per step on this peer (default {d.batch_size})")
    a("--lr", type=float, help=f"built-in task: peak learning rate (default {d.lr})")
    a("--ratio", type=float, help=f"fraction of gradient entries sent per step (default {d.ratio})")
    a("--compression", help=f"none, topk, topk-int8, topk-int4 or topk-int2 (default {d.compression})")
    a("--chunk", type=int, help="chunk-wise Top-K: each run of this many gradient entries keeps its share of "
      "--ratio, so every part of the model is updated every step (0 = the largest of the whole vector; default 0)")
    a("--min-payload", type=int, help="bytes: send at least the entries that fill this much per step (a small "
      f"model's payloads would otherwise be sparser than worth it; 0 = only --ratio; default {d.min_payload})")
    a("--warmup-steps", type=int, help=f"steps over which the ratio decays to --ratio (default {d.warmup_steps})")
    a("--ef-decay", type=float, help="the error-feedback residual is multiplied by this before each payload "
      "(SparseLoCo's outer momentum; 1 = exact error feedback, the default)")
    a("--sync-every", type=int, metavar="H", help="local steps: take H steps of the task's optimizer on this "
      "peer's copy, then send one compressed pseudo-gradient (global minus local parameters) per window; "
      "--steps counts these inner steps (the last window takes what is left when it is not a multiple of H; "
      "default 1: every step is a round)")
    a("--outer-lr", type=float, help="with --sync-every: the outer step's learning rate on the aggregated "
      "pseudo-gradient (default 1.0: with no momentum, the peers' models are averaged)")
    a("--outer-momentum", type=float, help="with --sync-every: the outer step's momentum (default 0)")
    a("--outer-nesterov", type=int, help="with --sync-every: 1 = Nesterov outer momentum (DiLoCo: --outer-lr 0.7 "
      "--outer-momentum 0.9 --outer-nesterov 1; default 0)")
    a("--overlap", type=int, help="1 = a round travels while the next step (with --sync-every: the next window) "
      "computes, and its update lands one round later (per-step: with weight prediction); default 0: each round is "
      "taken before the next step or window")
    a("--max-contributors", type=int, help="about this many payloads' bytes per round: with 2C or more contributing "
                                           "peers (C: this) each sends every round's payload at 1/floor(peers / C) of "
                                           "its entries (--cap-by bytes; with --sync-every always), so a peer's bytes "
                                           "stay about C payloads at any size; 0: every peer sends whole payloads "
                                           f"(default {d.max_contributors})")
    a("--cap-by", choices=CAP_BY, help="how --max-contributors holds per step: bytes (every peer every round, at "
      "1/k of its entries; error feedback keeps the rest) or rounds (a whole payload every min(8, k) rounds, the "
      "mean of the steps since the last: fewer peers per round to wait for, staler sums); a dense codec "
      f"(--compression none) caps by rounds (default {d.cap_by})")
    a("--row-ratio", type=float, help="with --sync-every: push only this share of a window's table-row deltas, "
      "the largest first; the others are kept and added to the row's next delta (error feedback; default 1: all)")
    a("--clip-norm", type=float, help="clip each step's gradient to this L2 norm before compression (0 = off)")
    a("--seed", type=int, help=f"the swarm seed: every peer builds the model under it, and all must use the same "
                               f"(default {d.seed})")
    a("--data", help="built-in task: train on these text files (a file or a directory) instead of the Python "
                     "standard library")
    a("--threads", type=int, help="torch threads for this peer (default: the CPUs this process may use "
      "(affinity, cgroup quota), divided among the ranks of a torchrun host; "
      f"{d.threads} here); give each of several peers on one machine its share")
    a("--min-peers", type=int, help="wait until this many contributing peers are there before the first step; a "
                                    "torchrun host group counts as one (its leader contributes for its ranks); a "
                                    "swarm that is already training is joined instead (default 1)")
    a("--table-rows", type=int, help=f"built-in task: rows of each hashed embedding table (default {d.table_rows})")
    a("--table-slots", type=int, help=f"slots (row ranges) per table, the unit of ownership (default {d.table_slots})")
    a("--replicas", type=int, help=f"owners of each table slot, primary included (default {d.replicas})")
    a("--table-lr", type=float, help="learning rate of the row-wise Adam on table rows (default: the task's "
                                     "table_lr; the built-in task's is 0.03)")
    a("--micro-batch", type=int, help="samples per forward/backward: a batch is taken in pieces of this many and "
      "their gradients accumulate (the same gradient, less activation memory); 0: the whole batch at once "
      "(default: the task's micro_batch; the built-in task's is 4)")
    a("--row-state", help="swarm-wide: the table optimizer's second moment: full (one per value, Adam) or rowwise "
      "(one per row, the mean of the row's squared gradient, as TorchRec's row-wise Adam: a third less table "
      f"memory; default {d.row_state})")
    a("--row-dtype", help="dtype of pulled rows on the wire: fp32, fp16, bf16, int8 or int4 (default int8; int4 with "
      "--sync-every > 1)")
    a("--push-dtype", help=f"dtype of row gradients on the wire: fp32, fp16, bf16, int8 or int4 (default {d.push_dtype})")
    a("--prefetch", type=int, help="1: pull the next step's rows while this step's round completes (with --sync-every > 1 "
      "and no --overlap: the next window's first rows, once this window's row pushes are answered; default 1)")
    a("--row-lookahead", type=int, help="with --sync-every > 1: pull the rows of this many inner steps ahead while "
      f"one computes (each row once a window; default {d.row_lookahead})")
    a("--pull-steps", type=int, help="with --sync-every > 1: the most inner steps whose rows one pull asks for "
      "together, at most --row-lookahead; a window's pulls ramp up to it: 2, 3, ... steps (fewer requests, less CPU "
      f"on both ends; default {d.pull_steps})")
    a("--early-step", type=int, help="with --sync-every > 1 (no --overlap, --prefetch 1): 1: take the next window's "
      "first inner step while this window's end travels, on this peer's own model and rows, and carry its progress "
      f"onto the new global model; 0: after the round (default {d.early_step})")
    a("--push-lead", type=_auto_or(parse_push_lead, "inner steps"), help="with --sync-every > 1: send a window's row deltas this many inner steps "
      "before its end, so they travel while its last steps compute; those steps' row deltas go with the next "
      "window's push. 0: at the window's end; auto: as many steps as the last window's pushes took (not the time "
      "their primaries held them for the other peers' pushes), none where "
      "they took under half a step, at most H/4 (default 0)")
    a("--held-rows", type=int, help="with --sync-every > 1: rows of the last window kept, so that a pull asks their owners "
      f"only for the rows that changed since (0 = pull every row whole; default {d.held_rows})")
    a("--wire-compression", choices=WIRE_COMPRESSIONS,
      help="zstd: compress what this peer sends (row pulls' replies, pushes, replays, payloads, state) where that "
           "saves 3%% or more, losslessly (about 20%% of a per-step peer's bytes); none: send every body as it is. "
           f"Every peer reads both (default {d.wire_compression})")
    a("--push-ack", choices=PUSH_ACKS,
      help="when this peer, as a table primary, answers a row push: applied (once its flush is applied here; the "
           "replicas get the flush before the next one), replicated (once its replicas have replayed it too) or auto "
           "(applied with --sync-every > 1, replicated with per-step rounds; default auto)")
    a("--push-window", type=float, help="seconds a table primary gathers row pushes to apply them as one update "
      f"per row (default {d.push_window:g}); with --sync-every > 1 it flushes as soon as every contributor's "
      "push of the window is in")
    a("--window-push-wait", type=_auto_or(parse_window_push_wait, "seconds"), help="with --sync-every > 1: seconds a table primary waits after "
      "a window's first row push for one from every contributor, so the window's pushes make one flush (0: "
      "--push-window; auto: --round-timeout / 8, 2.5 s by default; a number must be under --round-timeout / 4; "
      "default auto)")
    a("--linger", type=float, help=f"seconds to keep serving rows after --steps for peers still evaluating (default {d.linger})")
    a("--round-timeout", type=float, help=f"longest wait for one round's payloads, seconds (default {d.round_timeout})")
    a("--free-run", type=int, choices=(0, 1), help="1: when this peer computes clearly slower than the swarm it stops "
                                                     "waiting for each round and sends the sum of its steps when its "
                                                     "declared round is due (with --sync-every and no --overlap: takes fewer inner "
                                                     f"steps a window, so windows end together); 0: it waits, and the others wait for it (default {d.free_run})")
    a("--compute-speed", type=float, help="for tests and benchmarks: compute at this fraction of this peer's speed, "
                                          "repeating its forward/backward (the extra passes are discarded) so that "
                                          f"it keeps its CPU share (default {d.compute_speed:g})")
    a("--max-staleness", type=int, help=f"late payloads older than this many steps are dropped (default {d.max_staleness})")
    a("--aggregation", help="how a round's payloads are combined: mean, trimmed (coordinate-wise trimmed mean) "
                            f"or centered-clip (default {d.aggregation}; robust rules need >= 3 contributors)")
    a("--trim", type=float, help=f"trimmed: fraction of contributors cut from each end per coordinate (default {d.trim})")
    a("--msg-clip", type=float, help="clip each received payload to this x the round's median payload norm; "
                                     f"0 = off (default {d.msg_clip})")
    a("--row-clip", type=float, help="a table primary clips each pushed row gradient to this x the flush's reference "
                                     "row norm (the median of the senders' median row norms) and scores the senders "
                                     f"of outlier rows; 0 = off, the plain sum (default {d.row_clip})")
    a("--ban-seconds", type=float, help="refuse the payloads of a peer whose score fell too low (outliers, "
                                        f"invalid payloads) this long (default {d.ban_seconds})")
    a("--sync-timeout", type=float, help=f"a joiner waits this long for gradient traffic before syncing state (default {d.sync_timeout})")
    a("--eval-batches", type=int, help=f"built-in task: held-out batches evaluated (default {d.eval_batches})")
    a("--eval-every", type=int, help="also evaluate the held-out batches every this many steps, for the val_loss "
                                     "curve on the status page and in the summary (default 0: only at the end)")
    a("--device", help="where the model and each step's rows live: auto (this rank's GPU if torch sees one), "
                       "cpu or cuda (default auto)")
    a("--backend", help="collectives inside a torchrun host group: auto (nccl when each rank has a GPU of "
                        "its own, gloo otherwise), nccl or gloo (default auto)")
    a("--group-timeout", type=float, help="seconds a host group's collective waits for the other ranks before "
                                          f"the group gives up (default {d.group_timeout})")
    a("--checkpoint", help="directory for periodic, atomic checkpoints; a peer started on it resumes from it")
    a("--checkpoint-every", type=float, help=f"seconds between checkpoints (default {d.checkpoint_every})")
    a("--progress-interval", type=float, help=f"seconds between progress lines (default {d.progress_interval})")
    a("--name", help="a label for this peer in its summary and status (its id is derived from its key)")
    a("-v", "--verbose", action="store_true", help="log membership and round events to stderr")
    return p


def parse_config(argv: list[str] | None = None) -> tuple[PeerConfig, bool]:
    args = build_parser().parse_args(argv)
    values = from_env()
    for name in field_names():
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    try:
        values["task_args"] = parse_task_args(args.task_arg or [])
    except TaskError as e:
        raise ConfigError(str(e)) from None
    given = set(values) - {"task_args"}
    cfg = PeerConfig(**values, given=frozenset(given))
    if cfg.task:
        cfg.check_user_task()
    cfg.validate()
    return cfg, bool(args.verbose)


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # before the model and the tables allocate (swarm/allocator.py)
    limit_arenas()  # before any thread starts: one malloc arena for the peer's threads
    try:
        cfg, verbose = parse_config(argv)
    except ConfigError as e:
        sys.stderr.write(f"peer.py: error: {e}\n")
        return 2
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        return asyncio.run(_run(cfg))
    except KeyboardInterrupt:
        return 0


def _user_code_failed(e: UserCodeError) -> int:
    """The task's own code raised: its traceback (the user's to debug), then our one line."""
    cause = e.__cause__ or e
    sys.stderr.write("".join(traceback.format_exception(type(cause), cause, cause.__traceback__)))
    sys.stderr.write(f"peer.py: error: {e} (the traceback above is from the task's code)\n")
    return 1


async def _run(cfg: PeerConfig) -> int:
    from .group.comm import GroupError
    from .node import JoinError, Peer

    def out(line: str) -> None:
        print(line, flush=True)

    # this process's asyncio.to_thread helpers, named for the OS like the peer's other threads
    asyncio.get_running_loop().set_default_executor(threads.pool(threads.HELPER, min(32, (os.cpu_count() or 1) + 4)))

    try:
        peer = Peer(cfg, out=out)
    except (ConfigError, GroupError, TaskError) as e:
        sys.stderr.write(f"peer.py: error: {e}\n")
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, peer.stop)
    try:
        await peer.start()
        summary = await peer.run()
    except UserCodeError as e:
        await peer.close()
        return _user_code_failed(e)
    except (JoinError, GroupError, TaskError) as e:
        sys.stderr.write(f"peer.py: error: {e}\n")
        await peer.close()
        return 2
    except (ValueError, OSError) as e:  # e.g. unusable --data, port already taken
        sys.stderr.write(f"peer.py: error: {e}\n")
        await peer.close()
        return 2
    print(json.dumps(summary), flush=True)
    if summary.get("failure"):  # a task the peer cannot do without stopped it (its traceback is in the log)
        sys.stderr.write(f"peer.py: error: {summary['failure']}\n")
        return 1
    return 0
