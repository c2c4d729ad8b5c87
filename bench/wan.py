#!/usr/bin/env python3
"""Slow-network benchmark: the swarm (per-step and local-step) against torch DDP (gloo), torchft's
DiLoCo and Hivemind on shaped links, at two link rates, in one run.

Needs root (network namespaces and tc); without root it prints one line saying so and exits 0.

N peers (default 4), each in its own network namespace, joined by veth pairs to a bridge in a hub
namespace (10.77.0.0/24, addresses exist only inside these namespaces). Every peer's link is shaped
with `tc tbf` in both directions (its veth egress = upload, the hub side = download), to each
--rate in turn (default 80mbit ~ 10 MB/s, then 8mbit ~ 1 MB/s): the same veths are re-shaped in
place (`tc qdisc replace`), unshaped = the qdisc removed.

--delay-ms D: a one-way delay of D ms between any two peers (RTT 2D). There is no netem in this
kernel, so each link is then two TAP devices (`wan0` in the peer, `vp{i}` on the bridge, MTU 64000,
tbf on both as above) joined by one user-space process, bench/delayline.c (built with gcc at start),
that holds every frame TOWARD a peer D ms and passes frames from it at once: a packet between two
peers crosses exactly one delay, the receiver's (FIFO per direction, so order is kept; at most 32 MB
held per link, more is dropped and counted). Every method's traffic crosses it alike. At start and
at each rate a ping p0 -> p1 is printed (bench/delayline_ping.py; "ping_rtt_ms" in the last line),
and every run prints the delay line's CPU (user + sys) over it ("delay_line_cpu"). --delay-line: the
TAP path also at D = 0 (to measure what it costs against the veths).

--slow-peer F: the last peer computes at F of its speed and keeps its CPU share (peer.py and
bench/ddp_baseline.py --compute-speed F: the forward/backward repeated, the extra passes thrown
away); in DDP every rank then waits for it. Hivemind and torchft are not run then (their baselines
have no such knob). The floor runs with it too (same contention); its step time is the fast peers'.
The last line adds "fast_peer_wait_share" {rate: {method: share}}: the fast peers' share of step
time spent waiting on others (swarm: their step_phases' wait_share, "rows" + "held" + "round"; DDP: the
backward time beyond the same under no_sync, from each rank's step lines), and the slow peer's
samples ("slow_peer_samples", "samples_by_peer") to show its samples still count.

On the same model (--model: SwarmLM at a preset size), data (stdlib corpus), seed, per-peer batch
and sample budget (--steps inner steps x --batch-size x N), one after another:
  floor          compute only: one `peer.py` alone, no network (also N of them at once, each alone,
                 which is the same CPU contention as the N-peer runs on this machine)
  swarm          `peer.py` x N, default codec (topk-int8, ratio 0.01), one round per step
  swarm-overlap  `peer.py` x N, the same with --overlap 1: each round travels while the next step
                 computes (not in the default set: --only swarm --only swarm-overlap measures it)
  swarm-dense    `peer.py` x N, --compression none (dense fp32 payloads every step; not in the default
                 set: about 12 minutes alone at 8mbit; --only swarm-dense)
  swarm-tls      `peer.py` x N, the default swarm with a --secret: TLS 1.3 on every link, a MAC on every
                 request (not in the default set: --only swarm --only swarm-tls measures what TLS costs)
  swarm-h8/-h32  `peer.py` x N, local steps: --sync-every 8 (--overlap 1) / 32 and the LOCAL_STEP table
                 below (SparseLoCo-ish: topk-int2 at 2%, error feedback decayed 0.95, outer lr 1)
  swarm-h32-lead `peer.py` x N, swarm-h32 with --push-lead auto: each window's row pushes go as many
                 inner steps before its end as the last window's took (not in the default set: --only
                 swarm-h32 --only swarm-h32-lead measures what that trades)
  swarm-diloco   `peer.py` x N, the swarm's dense DiLoCo: --sync-every 32 --compression none, outer
                 Nesterov SGD lr 0.7 momentum 0.9 (the DiLoCo paper's recipe; table DILOCO)
  ddp-sparse     bench/ddp_baseline.py x N: DDP-gloo, tables nn.Embedding(sparse=True) + SparseAdam
  ddp-dense      bench/ddp_baseline.py x N: DDP-gloo, tables as dense parameters (dense all-reduce)
  torchft-diloco bench/torchft_baseline.py x N: torchft.local_sgd.DiLoCo (H = 32, the same outer
                 recipe) with torchft.Manager and ProcessGroupGloo, each peer its own replica group,
                 one lighthouse in peer 0's namespace; tables as dense parameters like ddp-dense.
                 Runs when torchft imports and a lighthouse starts in --torchft-python (default: this
                 interpreter), otherwise skipped with the reason in the last line's "torchft" field.
                 Install it without its dependencies, so that the installed torch stays:
                     pip install --no-deps torchft==0.2.0
                     pip install opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
  hivemind       bench/hivemind_baseline.py x N: hivemind.Optimizer (tables as dense parameters, like
                 ddp-dense), target batch = batch x N, gradients and parameters averaged in groups found
                 through its DHT (peer 0's multiaddr is the initial peer). Runs when `import hivemind`
                 works in --hivemind-python (default: this interpreter; `pip install -e '.[hivemind]'`),
                 otherwise skipped with the reason in the last line's "hivemind" field. That field also
                 says how many epochs were averaged with other peers and flags a run where peers fell
                 back to training alone.

Which run at which rate:
  synchronous baselines (ddp-dense, ddp-sparse, torchft-diloco, hivemind): their loss at step k does
                 not depend on the link, so each runs its whole budget ONCE, at --sync-full-rate
                 (default: unshaped links), for its loss curve, val_loss and bytes; at every other rate
                 it is only timed, --timing-steps (10) steps or --timing-seconds (100 s, at least 3
                 steps; torchft: one whole sync window of 32 steps), and its curve there is the full
                 run's losses at the times of that rate (project_curve: (k-1) x its plain step time,
                 plus, for torchft, the measured extra time of each sync window that ended). The
                 table says "timed N steps here" for these rows.
  swarm methods: their whole budget at EVERY rate (they are asynchronous-ish: their loss may depend
                 on timing), and then up to --extra-steps-factor (default 1.5) x the budget, rounded
                 down to whole windows: the learning-rate schedule still runs on the budget (--budget,
                 then 10% of --lr), the peers are stopped (SIGTERM) as soon as the budget is done and
                 the target reached, and val_loss is the one every peer evaluated at the budget
                 (--eval-every), so it stays at equal samples. One that misses the target even so gets
                 its whole run as a lower bound on its time (flagged; its speedups become "at_most").
                 --extra-steps-factor 1: the budget only.

What is measured (the same way for every method):
  loss curve   each peer's training loss on the batch of each (inner) step, as a running mean over
               its last 10 steps (what `peer.py` prints every step with --progress-interval 0),
               averaged over the peers at equal step; time of step k = when the LAST peer finished it.
               Every batch is fresh (seen once, before its update), so this is an unbiased estimate of
               the loss on the training distribution, the same curve for every method.
  val_loss     at the end of the budget (equal samples), on the same val_batches (8 x batch), mean
               over peers.
  time         wall time from the end of step 1 (every method has formed its group by then),
               training only: a swarm run's evaluation at the budget (val_loss at equal samples,
               mid-run when it runs on) is left out, as peer.py's progress lines say the seconds
               their evaluations took (eval_time); the floor and the synchronous baselines
               evaluate only after their last step. (Until 2026-12-06 it was in: 3-6.5% of
               swarm-h32's run at 8mbit, docs/benchmarks.md.)
  target       the loss dense DDP reaches at the END of its budget: ddp-dense's final running-mean
               loss (+ --margin, default 0; or --target). Without ddp-dense (--only), the worst final
               loss of the methods run at the first rate.
  bytes        total bytes each peer's network interface transmitted during the run (all traffic:
               gradients, table rows, control, TCP/IP headers), mean over peers; bytes per sample =
               that / the samples the peer trained (inner steps x batch). A run's results also split
               it: tx_bytes_before_window (start to the end of step 1), tx_bytes_train_window (per
               peer) and tx_bytes_after_window (the last step to the end: final evaluation, linger),
               cut at the steps' wall times (evaluations included, unlike the curves' times).
  wait share   1 - (compute floor step time under the same contention) / (step time); for DDP also
               the measured wait (fwd+bwd time beyond the same under no_sync). The swarm's own
               `step_phases` (waiting for rows and for the round, against computing) are printed too.
  by kind      a swarm run's results hold `sent_by_kind` and `received_by_kind`: the request and
               reply body bytes of its peers by kind (rows: pulls and pushes; replica: replays;
               grads; control; handoff), mean over peers; what `bytes` has beyond their sum is
               HTTP headers and TCP/IP.
  step ratio   --local-method's step time (wall time per inner step) / its contended floor's (N peers
               alone at once with the same flags: its windows, no one to talk to; the plain floor
               pays a codec round on every step, which a local-step method does not), the
               median over --step-repeats (default 1) pairs per rate of the two run back to back (this
               machine's speed drifts by +-10% from one minute to the next, the ratio within a pair
               much less).

The LAST stdout line (one JSON object) is about ONE local-step configuration (--local-method,
default swarm-h32, named in "local_step_config"); each of these is {rate: value}:
  speedup_vs_ddp_time_to_ddp_loss, speedup_vs_sparse_ddp_time_to_ddp_loss,
  speedup_vs_dense_diloco_time_to_ddp_loss (swarm-diloco), speedup_vs_torchft_diloco_time_to_ddp_loss
               the baseline's time to the target / ours (> 1: we are faster); "speedup_bounds" names
               those that are bounds: at_least (the baseline missed the target) or at_most (we did)
  bytes_per_sample_vs_per_step_swarm   the per-step swarm's bytes per sample / ours (> 1: we send less)
  val_loss_gap_vs_ddp_at_equal_samples (ours - ddp-dense) / ddp-dense, val_loss at the budget
  local_step_time_over_compute_floor   see step ratio
and per rate and method: time_to_ddp_loss_s, time_to_ddp_loss_lower_bound_s, val_loss, bytes_per_sample,
step_time_s; "by_rate" holds the older per-method figures of each rate; "run_seconds" what each run took.

Writes a results JSON (--out) and a plot (--plot); the LAST stdout line is one JSON object.

    sudo python3 bench/wan.py                          # the default set, both rates, 224 steps (~50 min)
    sudo python3 bench/wan.py --model big              # 5.1M dense parameters, batch 4 (~80 min, see below)
    sudo python3 bench/wan.py --only ddp-dense --only swarm-h32 --steps 64 --rate 8mbit
    sudo python3 bench/wan.py --delay-ms 50 --rate 80mbit --only swarm --only ddp-dense --only ddp-sparse
    sudo python3 bench/wan.py --slow-peer 0.5 --rate 80mbit --only swarm --only ddp-dense --only ddp-sparse

Sizing (4 peers on this 2-core machine, small model, seconds per step measured on short runs at
80mbit / 8mbit; a swarm run adds ~20 s of start, evaluation and linger, a baseline ~10-40 s):
  floors        solo 0.14, contended 0.25-0.31 (the machine drifts; local-step floor 0.21-0.34)
  ddp-dense     unshaped 0.59-0.63; 80mbit 6.3-6.6; 8mbit 51-58 (its timing run there ~4-6 min)
  ddp-sparse    unshaped 0.36; 80mbit 1.4; 8mbit 11.7 (timing run ~4 min)
  torchft       unshaped 0.48; 80mbit 0.62-0.69 per step over a window; 8mbit 2.2 (a dense sync ~55 s)
  swarm         0.45-0.47 / 1.13      swarm-h8  0.37 / 0.52
  swarm-h32     0.35-0.41 / 0.31-0.48 swarm-diloco 0.39-0.41 / 0.48
With the defaults that is ~47-50 minutes when every swarm method runs its 1.5 x budget. --model big
(batch 4): contended floor 0.69-0.91, swarm 1.5 / 3.4, swarm-diloco 1.0 / 1.3, swarm-h32 0.60 / 0.62,
ddp-dense 0.51 unshaped / 5.5 / 51, torchft 0.41 / 0.69 / 2.2 s per step: about 80 minutes with the
defaults (the per-step swarm at 8mbit alone ~20 min), ~65 with --extra-steps-factor 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import delayline  # noqa: E402  (bench/delayline.py)

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 10  # running-mean window of the loss curves (= peer.py's progress line)
METHODS = ("swarm", "swarm-overlap", "swarm-dense", "swarm-tls", "swarm-h8", "swarm-h32", "swarm-h32-lead", "swarm-diloco",
           "ddp-sparse", "ddp-dense", "torchft-diloco", "hivemind")
# run without --only: all but swarm-overlap (--overlap 1: per-step rounds overlapped with the next
# step, for what that does: --only swarm --only swarm-overlap), swarm-dense (dense fp32 payloads
# every step: ~12 min alone at 8mbit) and swarm-tls (the default swarm with a secret, so TLS on every link: for its cost, --only swarm
# --only swarm-tls) and swarm-h32-lead (swarm-h32 with --push-lead auto: for what leading the row
# pushes trades, --only swarm-h32 --only swarm-h32-lead)
DEFAULT_METHODS = tuple(m for m in METHODS if m not in ("swarm-overlap", "swarm-dense", "swarm-tls", "swarm-h32-lead"))
TLS_SECRET = "swarm-wan-benchmark-secret-0123456789"  # any secret: a swarm with one runs TLS
# synchronous baselines: their loss at step k does not depend on the link, so they run their budget
# once (--sync-full-rate, default unshaped) and are only timed (--timing-steps) at each rate
SYNC_METHODS = ("ddp-dense", "ddp-sparse", "torchft-diloco", "hivemind")

# The settings of the swarm's local-step methods (swarm-h8, swarm-h32: H inner steps, then one
# compressed pseudo-gradient round). SparseLoCo-ish: 2-bit Top-K at 2% density with decaying error
# feedback as the outer momentum, plain outer step; a quarter of each window's row deltas pushed
# (the rest carried), and rows pulled as int4 (half of int8's pull replies: with local steps the
# pulled rows are only a window's starting point, the delta pushed is against what was pulled, so
# the quantization never reaches the pushes; bench/wan.py at 128 steps: 6767 -> 4648 bytes per
# sample at 8mbit, val_loss within noise). swarm-h32 takes its round between windows (at this model size a round is
# ~0.1 s against ~10 s of window: bench/local_steps.py measured overlap's delayed update costing
# 0.04-0.09 in val_loss at H = 32 over seven windows); swarm-h8 overlaps it.
LOCAL_STEP = {"compression": "topk-int2", "ratio": 0.02, "ef_decay": 0.95, "outer_lr": 1.0, "row_ratio": 0.25,
              "row_dtype": "int4", "overlap": False}
# swarm-diloco: the swarm's own dense DiLoCo, the DiLoCo paper's recipe (H = 32, outer Nesterov SGD)
DILOCO = {"compression": "none", "outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}
# torchft-diloco (bench/torchft_baseline.py): the same recipe in torchft.local_sgd.DiLoCo
TORCHFT = {"sync_every": 32, "outer_lr": 0.7, "outer_momentum": 0.9}

# --model: one model size per invocation. big: >= 5M dense parameters (5.1M) and small tables, so
# that the dense gradient dominates the bytes; a smaller batch keeps its step time near small's.
MODELS = {
    "small": {"d_model": 128, "layers": 2, "heads": 4, "context": 128, "table_rows": 32768, "batch_size": 16},
    "big": {"d_model": 320, "layers": 4, "heads": 4, "context": 128, "table_rows": 4096, "batch_size": 4},
}

# ----------------------------------------------------------------------------- pure parts (tested)

_STEP_RE = re.compile(r"^step (\d+) loss ([0-9.eE+-]+|nan|inf) ")
_EVAL_RE = re.compile(r" eval_time ([0-9.]+)s\b")


def parse_peer_lines(lines: list[tuple[float, str]], less_evals: bool = True
                     ) -> tuple[dict[int, tuple[float, float]], dict | None]:
    """`peer.py` stdout with read timestamps -> ({step: (t, running-mean loss)}, summary JSON or None).

    The summary is the last line if it is a JSON object; progress lines are `step N loss X ...`.
    A progress line's `eval_time Xs` (peer.py with --eval-every: the seconds its held-out
    evaluations took so far) is taken off its time: a curve's times, and the step times and times
    to target made of them, are the training's, without the evaluations that give val_loss at the
    budget (the floor and the synchronous baselines evaluate only after their last step).
    ``less_evals`` False: the times as read (wall clock), for what the interface counters saw when."""
    points: dict[int, tuple[float, float]] = {}
    for t, line in lines:
        m = _STEP_RE.match(line)
        if m:
            loss = float(m.group(2))
            ev = _EVAL_RE.search(line)
            if math.isfinite(loss):
                points[int(m.group(1))] = (t - (float(ev.group(1)) if ev and less_evals else 0.0), loss)
    summary = None
    for _, line in reversed(lines):
        if line.strip():
            try:
                obj = json.loads(line)
                summary = obj if isinstance(obj, dict) else None
            except ValueError:
                pass
            break
    return points, summary


def eval_seconds_between(lines: list[tuple[float, str]], first: int, last: int) -> float:
    """What parse_peer_lines took off a peer's curve between steps ``first`` and ``last``: the
    growth of its progress lines' eval_time (0 without --eval-every)."""
    at: dict[int, float] = {}
    for _, line in lines:
        m, ev = _STEP_RE.match(line), _EVAL_RE.search(line)
        if m and ev:
            at[int(m.group(1))] = float(ev.group(1))
    return max(0.0, at.get(last, 0.0) - at.get(first, 0.0)) if first in at and last in at else 0.0


def parse_ddp_lines(lines: list[str]) -> tuple[dict[int, tuple[float, float]], dict | None, list[dict]]:
    """bench/ddp_baseline.py stdout -> ({step: (t, running-mean loss)}, summary or None, raw step records)."""
    steps, summary = [], None
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "step" in obj and "loss" in obj and "t" in obj:
            steps.append(obj)
        elif "val_loss" in obj:
            summary = obj
    steps.sort(key=lambda r: r["step"])
    means = running_mean([r["loss"] for r in steps], WINDOW)
    return {r["step"]: (r["t"], m) for r, m in zip(steps, means)}, summary, steps


def running_mean(values: list[float], window: int = WINDOW) -> list[float]:
    """Mean of the last `window` values at each position (fewer at the start), like peer.py's line."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def merge_curves(per_peer: list[dict[int, tuple[float, float]]]) -> list[tuple[int, float, float]]:
    """Peers' {step: (t, loss)} -> [(step, t, loss)] over the steps every peer reported: t = the
    latest peer's time (the step is done when all are), loss = mean over peers."""
    if not per_peer:
        return []
    common = set(per_peer[0])
    for p in per_peer[1:]:
        common &= set(p)
    return [(s, max(p[s][0] for p in per_peer), sum(p[s][1] for p in per_peer) / len(per_peer))
            for s in sorted(common)]


def time_to_target(curve: list[tuple[int, float, float]], target: float) -> tuple[float | None, int | None]:
    """(seconds from the first point of the curve, step) at which loss first gets <= target; (None,
    None) if never."""
    if not curve:
        return None, None
    t0 = curve[0][1]
    for step, t, loss in curve:
        if loss <= target:
            return t - t0, step
    return None, None


def step_time(curve: list[tuple[int, float, float]]) -> float | None:
    """Mean seconds per step between the first and the last point of a curve."""
    if len(curve) < 2 or curve[-1][0] == curve[0][0]:
        return None
    return (curve[-1][1] - curve[0][1]) / (curve[-1][0] - curve[0][0])


def pick_target(curves: dict[str, list[tuple[int, float, float]]], margin: float,
                exclude: tuple[str, ...] = ("hivemind",)) -> float | None:
    """A loss every method reaches: the worst final loss among the curves, plus `margin`. Methods in
    `exclude` do not set it (Hivemind, whose loss after the budget is far above the others', would
    put the target in the first few steps of everyone else); one that does not reach it gets a
    lower bound on the speedup instead (see summarize)."""
    finals = [c[-1][2] for m, c in curves.items() if c and m not in exclude]
    return max(finals) + margin if finals else None


def elapsed(curve: list[tuple[int, float, float]]) -> float | None:
    """Seconds from the first to the last point of a curve."""
    return curve[-1][1] - curve[0][1] if len(curve) >= 2 else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def summarize(runs: dict[str, dict], floor_contended: float | None, floor_solo: float | None,
              target: float | None, pairs: list[tuple[float, float]] | None = None) -> dict:
    """The final JSON line from per-method results ({"curve", "bytes_per_peer", ...}); ``pairs``:
    (contended floor, swarm) step times of back-to-back runs, whose median ratio is the step-time
    figure (without pairs: the swarm run against the floor run)."""
    ttt = {m: r.get("time_to_target_s") for m, r in runs.items()}
    sw = runs.get("swarm", {})
    # a baseline that never reached the target took longer than its whole run: a lower bound
    bound = {m: elapsed(r.get("curve") or []) for m, r in runs.items() if ttt.get(m) is None and m != "swarm"}
    out = {
        "target_loss": None if target is None else round(target, 4),
        "time_to_target_s": {m: None if v is None else round(v, 2) for m, v in ttt.items()},
        "speedup_vs_ddp_time_to_loss": ratio(ttt.get("ddp-dense") or bound.get("ddp-dense"), ttt.get("swarm")),
        "speedup_vs_sparse_ddp_time_to_loss": ratio(ttt.get("ddp-sparse") or bound.get("ddp-sparse"), ttt.get("swarm")),
        "speedup_vs_hivemind_time_to_loss": ratio(ttt.get("hivemind") or bound.get("hivemind"), ttt.get("swarm")),
        "speedup_vs_dense_swarm_time_to_loss": ratio(ttt.get("swarm-dense") or bound.get("swarm-dense"),
                                                     ttt.get("swarm")),
        # methods that never reached the target: their speedup above is "at least" (whole run / swarm's time)
        "speedup_lower_bound_for": sorted(m for m, v in bound.items() if v is not None),
        "bytes_ratio_vs_ddp": ratio(runs.get("ddp-dense", {}).get("bytes_per_peer"), sw.get("bytes_per_peer")),
        "bytes_ratio_vs_ddp_whole_run": ratio(runs.get("ddp-dense", {}).get("run_bytes_per_peer"),
                                              sw.get("run_bytes_per_peer")),
        "bytes_ratio_vs_sparse_ddp": ratio(runs.get("ddp-sparse", {}).get("bytes_per_peer"), sw.get("bytes_per_peer")),
        "bytes_ratio_vs_hivemind": ratio(runs.get("hivemind", {}).get("bytes_per_peer"), sw.get("bytes_per_peer")),
        "step_time_over_compute_floor": (round(statistics.median(sw_s / fl_s for fl_s, sw_s in pairs), 3) if pairs
                                         else ratio(sw.get("step_time_s"), floor_contended)),
        "step_time_ratios": [round(sw_s / fl_s, 3) for fl_s, sw_s in pairs or []],
        "step_time_over_solo_compute_floor": ratio(sw.get("step_time_s"), floor_solo),
        "compute_floor_step_s": None if floor_contended is None else round(floor_contended, 4),
        "solo_compute_floor_step_s": None if floor_solo is None else round(floor_solo, 4),
        "step_time_s": {m: None if r.get("step_time_s") is None else round(r["step_time_s"], 4)
                        for m, r in runs.items()},
        "bytes_per_peer": {m: r.get("bytes_per_peer") for m, r in runs.items()},
        "val_loss": {m: None if r.get("val_loss") is None else round(r["val_loss"], 4) for m, r in runs.items()},
        "network_wait_share": {m: r.get("wait_share") for m, r in runs.items()},
    }
    return out


def parse_hivemind_maddrs(lines: list[str]) -> list[str]:
    """The multiaddrs of bench/hivemind_baseline.py's `hivemind listening on MADDR [MADDR ...]` line."""
    for line in lines:
        if line.startswith("hivemind listening on "):
            return line[len("hivemind listening on "):].split()
    return []


def pick_maddr(maddrs: list[str], ip: str) -> str | None:
    """The multiaddr on `ip` (the namespace's address), else the first non-loopback one, else None."""
    for m in maddrs:
        if m.startswith(f"/ip4/{ip}/"):
            return m
    others = [m for m in maddrs if not m.startswith("/ip4/127.")]
    return others[0] if others else None


def hivemind_health(summaries: list[dict], peers: int) -> dict:
    """Did Hivemind's peers train together? From the peers' summary lines: the final epoch, how many
    gradient rounds were averaged with a group of >1 peer (`collaborative_epochs`, the fewest over
    peers) or ended with local gradients only (`local_epochs`, the most), and a `warning` when a peer
    is missing or more of its rounds were local than collaborative (it trained mostly alone);
    `out_of_sync` = the most times a peer fell an epoch behind and downloaded the state from another."""
    out: dict = {"peers_reporting": len(summaries)}
    if not summaries:
        return {**out, "warning": "no hivemind peer printed a summary"}
    collab = [int(s.get("collaborative_epochs") or 0) for s in summaries]
    local = [int(s.get("local_epochs") or 0) for s in summaries]
    sizes = [s["mean_group_size"] for s in summaries if s.get("mean_group_size") is not None]
    steps = [int(s.get("steps") or 0) for s in summaries]
    epochs = [int(s.get("epoch") or 0) for s in summaries]
    out.update(epochs=max(epochs), collaborative_epochs=min(collab), local_epochs=max(local),
               mean_group_size=round(sum(sizes) / len(sizes), 2) if sizes else None,
               local_steps_per_epoch=round(max(steps) / max(epochs), 2) if max(epochs) else None,
               out_of_sync=max(int(s.get("out_of_sync") or 0) for s in summaries))
    problems = []
    if len(summaries) < peers:
        problems.append(f"{peers - len(summaries)} of {peers} peers printed no summary")
    if any(lo > c for c, lo in zip(collab, local)):
        problems.append("some peers fell back to local training on most epochs")
    elif max(local) > 0:
        problems.append(f"up to {max(local)} epochs ended with local gradients only")
    if problems:
        out["warning"] = "; ".join(problems)
    return out


def wait_share(step_s: float | None, floor_s: float | None) -> float | None:
    if step_s is None or floor_s is None or step_s <= 0:
        return None
    return round(max(0.0, 1.0 - floor_s / step_s), 3)


# ----------------------------------------------------------------------------- a slow peer, a delay (tested)


def slow_flags(slow_peer: float | None, i: int, n: int) -> list[str]:
    """`--compute-speed F` for the slow peer (the last of n, with --slow-peer F), nothing for the others."""
    return ["--compute-speed", f"{slow_peer:g}"] if slow_peer is not None and i == n - 1 else []


def check_options(delay_ms: float, slow_peer: float | None, peers: int) -> list[str]:
    """The problems of --delay-ms / --slow-peer (one line each), [] when they are fine."""
    out = []
    if not (0 <= delay_ms <= 1000) or not math.isfinite(delay_ms):
        out.append(f"--delay-ms must be in [0, 1000] (one-way, ms), got {delay_ms:g}")
    if slow_peer is not None:
        if not (0 < slow_peer <= 1) or not math.isfinite(slow_peer):
            out.append(f"--slow-peer must be in (0, 1], got {slow_peer:g}")
        if peers < 2:
            out.append("--slow-peer needs at least 2 peers (one of them slow)")
    return out


def has_compute_speed(help_text: str) -> bool:
    """Does `peer.py --help` offer --compute-speed (the slow-peer knob)?"""
    return "--compute-speed" in help_text


def fast_slow_split(summaries: list[dict], slow_id: str | None) -> tuple[list[dict], dict | None]:
    """(the fast peers' summaries, the slow peer's or None), by `name` (--name p<i>); without a slow peer
    every peer is fast."""
    slow = next((s for s in summaries if slow_id is not None and s.get("name") == slow_id), None)
    return [s for s in summaries if s is not slow], slow


def peer_wait_share(summaries: list[dict]) -> float | None:
    """Mean over these peers of the share of step time spent waiting on other peers (their
    step_phases' wait_share: the "rows", "held" and "round" phases, swarm/steptimes.py)."""
    shares = [w for s in summaries if (w := (s.get("step_phases") or {}).get("wait_share")) is not None]
    return round(sum(shares) / len(shares), 3) if shares else None


def rank_wait_shares(records: list[list[dict]]) -> list[float | None]:
    """Per DDP rank (its step records, bench/ddp_baseline.py), the measured wait share: comm_s /
    (compute_s + comm_s) over its steps (comm = fwd+bwd time beyond the same under no_sync). From
    the step lines, so a timing run that was stopped (no summary) has it too."""
    out = []
    for recs in records:
        comp = sum(r.get("compute_s") or 0.0 for r in recs)
        comm = sum(r.get("comm_s") or 0.0 for r in recs)
        out.append(round(comm / (comp + comm), 3) if comp + comm > 0 else None)
    return out


def line_cpu(cpu_s: float | None, seconds: float, steps: int | None) -> dict | None:
    """The delay line's CPU over one run: seconds, share of one core over the run's wall time,
    milliseconds per (inner) step."""
    if cpu_s is None:
        return None
    return {"cpu_s": round(cpu_s, 3), "core_share": round(cpu_s / seconds, 4) if seconds > 0 else None,
            "cpu_ms_per_step": round(cpu_s * 1000 / steps, 2) if steps else None}


# ----------------------------------------------------------------------------- methods, budgets, rates (tested)


def local_flags(settings: dict, sync_every: int) -> list[str]:
    """peer.py flags of a local-step method: --sync-every H, then its settings (LOCAL_STEP, DILOCO):
    a key becomes `--key value`, a True switch (outer_nesterov, overlap) `--key 1`, a False one nothing."""
    out = ["--sync-every", str(sync_every)]
    for key, v in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(v, bool):
            out += [flag, "1"] if v else []
        elif v is not None:
            out += [flag, str(v)]
    return out


SWARM_FLAGS = {
    "swarm": [],  # the default codec (topk-int8, ratio 0.01), one round per step
    "swarm-overlap": ["--overlap", "1"],  # the same, each round travelling while the next step computes
    "swarm-dense": ["--compression", "none"],
    "swarm-tls": ["--secret", TLS_SECRET],  # the default swarm, every link TLS 1.3 (docs/security.md)
    "swarm-h8": local_flags({**LOCAL_STEP, "overlap": True}, 8),  # short windows: the round overlapped
    "swarm-h32": local_flags(LOCAL_STEP, 32),
    # the same, each window's row pushes led by as many inner steps as the last window's took
    "swarm-h32-lead": local_flags({**LOCAL_STEP, "push_lead": "auto"}, 32),
    "swarm-diloco": local_flags(DILOCO, 32),
}


def sync_every_of(method: str) -> int:
    """H of a method: inner steps per round (1 for the per-step ones)."""
    if method == "torchft-diloco":
        return int(TORCHFT["sync_every"])
    flags = SWARM_FLAGS.get(method, [])
    return int(flags[flags.index("--sync-every") + 1]) if "--sync-every" in flags else 1


def check_budget(steps: int, methods: list[str]) -> str | None:
    """None when every method's H divides the budget (peer.py and torchft need it), else why not."""
    bad = [f"{m} (H={sync_every_of(m)})" for m in methods if steps % sync_every_of(m)]
    return f"--steps {steps} is not a multiple of the sync period of {', '.join(bad)}" if bad else None


def extended_steps(budget: int, factor: float, sync_every: int) -> int:
    """The most inner steps a swarm method may run with --extra-steps-factor: budget x factor, rounded
    down to a multiple of its H (at least the budget)."""
    return max(budget, int(budget * factor) // sync_every * sync_every)


def model_flags(preset: dict, defaults: dict) -> tuple[list[str], list[str]]:
    """(peer.py flags, bench/*_baseline.py flags) of a model preset's size; the peer gets a size only
    where it differs from the built-in task's default (so the small model runs exactly as before)."""
    peer, base = [], []
    for key, task_arg, flag in (("d_model", "d_model", "--d-model"), ("layers", "layers", "--layers"),
                                ("heads", "heads", "--heads"), ("context", "context", "--context")):
        if preset[key] != defaults[key]:
            peer += ["--task-arg", f"{task_arg}={preset[key]}"]
            base += [flag, str(preset[key])]
    return peer, base


def plan(methods: list[str], rates: list[str], full_rate: str | None, local: str | None,
         repeats: int) -> list[tuple[str, str | None, str | None]]:
    """The order of the runs: [(kind, method, rate)]. kind: floor-solo / floor (the contended compute
    floor; with a method: N peers alone with that method's flags, the local method's own floor), full (a synchronous baseline's whole budget at full_rate, None = unshaped; ddp-dense
    first, it sets the target), timing (a synchronous baseline timed at a rate where it did not run
    its budget), run (a swarm method's budget at a rate), pair (the local method again, after a
    floor, for the step-time median). At each rate the local method runs right after a floor."""
    sync = sorted((m for m in methods if m in SYNC_METHODS), key=lambda m: m != "ddp-dense")
    swarm = [m for m in methods if m in SWARM_FLAGS and m != local]
    out: list[tuple[str, str | None, str | None]] = [("floor-solo", None, None), ("floor", None, None)]
    out += [("full", m, full_rate) for m in sync]
    for r in rates:
        out += [("timing", m, r) for m in sync if r != full_rate]
        out += [("run", m, r) for m in swarm]
        if local in methods:
            out += [("floor", local, r), ("run", local, r)]
            for _ in range(1, repeats):
                out += [("floor", local, r), ("pair", local, r)]
    return out


def project_curve(full: list[tuple[int, float, float]], timing: list[tuple[int, float, float]],
                  sync_every: int = 1) -> tuple[list[tuple[int, float, float]], dict]:
    """A synchronous baseline's curve at another link rate: its loss at step k does not depend on the
    link, its time does. From a short run at that rate (``timing``): the plain step time p (the mean
    step time for H = 1; the median of the intervals that end no sync window for H > 1) and the extra
    seconds x of a step that ends one (its mean interval - p). Step k of the full run then ends
    (k - 1) p + (windows ended in steps 2..k) x after step 1."""
    info: dict = {"timing_steps": timing[-1][0] if timing else 0}
    if len(timing) < 2:
        return [], {**info, "error": "the timing run gave fewer than 2 steps"}
    gaps = [(b[0], (b[1] - a[1]) / (b[0] - a[0])) for a, b in zip(timing, timing[1:])]
    if sync_every <= 1:
        p, x = step_time(timing), 0.0
    else:
        plain = [g for s, g in gaps if s % sync_every]
        ends = [g for s, g in gaps if s % sync_every == 0]
        p = statistics.median(plain) if plain else step_time(timing)
        x = max(0.0, statistics.mean(ends) - p) if ends else 0.0
        if not ends:
            info["warning"] = f"the timing run ended no sync window (H={sync_every}): sync time unknown"
    info.update(plain_step_s=round(p, 4), sync_extra_s=round(x, 4), sync_every=sync_every)
    if not full:
        return [], info
    k0, t0 = full[0][0], full[0][1]

    def windows(k: int) -> int:
        return k // sync_every - k0 // sync_every if sync_every > 1 else 0

    return [(k, t0 + (k - k0) * p + windows(k) * x, loss) for k, _, loss in full], info


def timing_done(curve: list[tuple[int, float, float]], min_steps: int, cap_s: float) -> bool:
    """Has a timing run seen enough: at least `min_steps` steps (for H > 1 a whole sync window) and
    `cap_s` seconds since step 1? (At 8mbit a dense DDP step takes about a minute.)"""
    return len(curve) >= 3 and curve[-1][0] >= min_steps and curve[-1][1] - curve[0][1] >= cap_s


def ddp_target(runs: dict[str, dict]) -> float | None:
    """The target loss: the final running-mean training loss of dense DDP at the end of its budget."""
    c = (runs.get("ddp-dense") or {}).get("curve") or []
    return c[-1][2] if c else None


def reached(curve: list[tuple[int, float, float]], budget: int, target: float | None) -> bool:
    """Can a run with an extended budget stop: the budget is done and the target was reached."""
    return bool(curve) and target is not None and curve[-1][0] >= budget and any(l <= target for _, _, l in curve)


def val_at(summaries: list[dict], step: int) -> float | None:
    """Mean over peers of the val_loss each evaluated at `step` (peer.py's val_history, --eval-every)."""
    vals = [v for s in summaries for st, v in (s.get("val_history") or []) if st == step]
    return sum(vals) / len(vals) if vals else None


def time_or_bound(run: dict | None) -> tuple[float | None, bool]:
    """(seconds to the target, False), or (its whole run, True: a lower bound) when it missed it."""
    if not run:
        return None, False
    if run.get("time_to_target_s") is not None:
        return run["time_to_target_s"], False
    return elapsed(run.get("curve") or []), True


def speedup(base: dict | None, ours: dict | None) -> tuple[float | None, str | None]:
    """Baseline's time to the target / ours (> 1: we are faster) and what it is: "exact",
    "at_least" (the baseline missed the target: its time is a lower bound), "at_most" (we missed
    it); (None, None) when both missed it or a time is unknown."""
    tb, lb = time_or_bound(base)
    to, lo = time_or_bound(ours)
    if tb is None or to is None or (lb and lo):
        return None, None
    return ratio(tb, to), "at_least" if lb else "at_most" if lo else "exact"


def bytes_per_sample(run: dict | None, batch: int) -> float | None:
    """All bytes a peer's interface sent during the run / the samples that peer trained (mean over
    peers; samples = inner steps done x batch, or what the peers' summaries say they trained when
    they all do: a slow peer trains fewer)."""
    if not run or not run.get("steps") or not run.get("tx_bytes_run"):
        return None
    tx = run["tx_bytes_run"]
    said = list((run.get("samples_by_peer") or {}).values())
    if len(said) == len(tx) and all(isinstance(x, int) and x > 0 for x in said):
        return sum(tx) / sum(said)
    return sum(tx) / len(tx) / (run["steps"] * batch)


def gap(ours: float | None, base: float | None) -> float | None:
    if ours is None or base is None or base == 0:
        return None
    return round((ours - base) / base, 4)


SPEEDUP_KEYS = {"ddp-dense": "speedup_vs_ddp_time_to_ddp_loss",
                "ddp-sparse": "speedup_vs_sparse_ddp_time_to_ddp_loss",
                "swarm-diloco": "speedup_vs_dense_diloco_time_to_ddp_loss",
                "torchft-diloco": "speedup_vs_torchft_diloco_time_to_ddp_loss"}


def summarize_rates(per_rate: dict[str, dict[str, dict]], local: str, target: float | None,
                    pairs: dict[str, list[tuple[float, float]]], batch: int) -> dict:
    """The local-step figures of the last line, each {rate: value}: speedups in time to dense DDP's
    final loss (with `speedup_bounds` saying which are bounds), bytes per sample of the per-step swarm
    over ours, the val_loss gap to dense DDP at equal samples, our step time over the contended
    floor's (median over the rate's back-to-back pairs); and per rate and method the times to the
    target (or the lower bounds of those that missed it), val_loss, bytes per sample, step time."""
    out: dict = {"local_step_config": {"method": local, "sync_every": sync_every_of(local),
                                       "peer_flags": SWARM_FLAGS.get(local, [])},
                 "target_loss": None if target is None else round(target, 4)}
    bounds: dict[str, dict[str, str]] = {}
    for base, key in SPEEDUP_KEYS.items():
        out[key] = {}
        for rate, runs in per_rate.items():
            v, kind = speedup(runs.get(base), runs.get(local))
            out[key][rate] = v
            if kind not in (None, "exact"):
                bounds.setdefault(key, {})[rate] = kind
    out["speedup_bounds"] = bounds
    out["bytes_per_sample_vs_per_step_swarm"] = {
        r: ratio(bytes_per_sample(runs.get("swarm"), batch), bytes_per_sample(runs.get(local), batch))
        for r, runs in per_rate.items()}
    out["val_loss_gap_vs_ddp_at_equal_samples"] = {
        r: gap((runs.get(local) or {}).get("val_loss"), (runs.get("ddp-dense") or {}).get("val_loss"))
        for r, runs in per_rate.items()}
    out["local_step_time_over_compute_floor"] = {
        r: round(statistics.median(o / f for f, o in pairs[r]), 3) if pairs.get(r) else None for r in per_rate}
    out["local_step_time_ratios"] = {r: [round(o / f, 3) for f, o in pairs.get(r, [])] for r in per_rate}
    out["local_floor_step_s"] = {r: [round(f, 4) for f, _ in pairs.get(r, [])] for r in per_rate}
    out["time_to_ddp_loss_s"] = {r: {m: None if run.get("time_to_target_s") is None else round(run["time_to_target_s"], 2)
                                     for m, run in runs.items()} for r, runs in per_rate.items()}
    out["time_to_ddp_loss_lower_bound_s"] = {
        r: {m: round(t, 2) for m, run in runs.items() for t, lb in [time_or_bound(run)] if lb and t is not None}
        for r, runs in per_rate.items()}
    out["val_loss"] = {r: {m: None if run.get("val_loss") is None else round(run["val_loss"], 4)
                           for m, run in runs.items()} for r, runs in per_rate.items()}
    out["bytes_per_sample"] = {r: {m: None if (b := bytes_per_sample(run, batch)) is None else int(b)
                                   for m, run in runs.items()} for r, runs in per_rate.items()}
    out["step_time_s"] = {r: {m: None if run.get("step_time_s") is None else round(run["step_time_s"], 4)
                              for m, run in runs.items()} for r, runs in per_rate.items()}
    return out


def parse_stat(text: str) -> tuple[int, int, int, int] | None:
    """/proc/PID/stat -> (ppid, pgid, sid, start time in ticks); None if malformed. The command name
    (field 2) may hold spaces and parentheses, so fields are counted after its LAST ')'."""
    _, paren, rest = text.rpartition(")")
    f = rest.split()
    if not paren or len(f) < 20:
        return None
    try:
        return int(f[1]), int(f[2]), int(f[3]), int(f[19])
    except ValueError:
        return None


def related(leader: int, table: dict[int, tuple[int, int, int, int]]) -> set[int]:
    """Processes tied to `leader` in a {pid: (ppid, pgid, sid, start)} table: its descendants (also
    those that left its session, like hivemind's torch_shm_manager) and every member of its process
    group or session (also orphans whose parent has exited). `leader` itself is not included."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [leader]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out and c != leader:
                out.add(c)
                todo.append(c)
    out |= {pid for pid, (_, pgid, sid, _s) in table.items() if leader in (pgid, sid) and pid != leader}
    return out


def root_check() -> str | None:
    """None when we can make namespaces, otherwise the one line to print before exiting 0."""
    if os.geteuid() != 0:
        return "bench/wan.py needs root (network namespaces and tc); skipped."
    return None


# ----------------------------------------------------------------------------- processes

_PROCS: list[subprocess.Popen] = []
_TREES: dict[int, dict[int, int]] = {}  # leader pid -> {related pid: its start time}, see _watch
_WATCH: list[threading.Thread] = []


def proc_table() -> dict[int, tuple[int, int, int, int]]:
    """{pid: (ppid, pgid, sid, start)} of every process now (from /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                st = parse_stat((d / "stat").read_text())
            except OSError:
                continue
            if st:
                out[int(d.name)] = st
    return out


def _watch() -> None:
    """Every 0.5 s, remember the processes related to each running child (see `related`), so that
    kill() also finds those that leave its process group or outlive it (hivemind starts a p2pd daemon,
    averager processes and torch_shm_manager, which calls setsid)."""
    while True:
        live = [p for p in list(_PROCS) if p.poll() is None]
        if live:
            table = proc_table()
            for p in live:
                tree = _TREES.setdefault(p.pid, {})
                for pid in related(p.pid, table):
                    tree.setdefault(pid, table[pid][3])
        time.sleep(0.5)


class Proc:
    """A child process (in its own session/process group) whose stdout lines are timestamped."""

    def __init__(self, argv: list[str], env: dict | None = None, log: Path | None = None):
        self.p = subprocess.Popen(argv, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                  stderr=open(log, "w") if log else subprocess.DEVNULL,
                                  env={**os.environ, **(env or {})}, start_new_session=True)
        _PROCS.append(self.p)
        if not _WATCH:
            _WATCH.append(threading.Thread(target=_watch, daemon=True))
            _WATCH[0].start()
        self.lines: list[tuple[float, str]] = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        try:
            code = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            kill(self.p)
            code = -9
        self.t.join(5)
        return code

    def has(self, pattern: str) -> bool:
        return any(pattern in line for _, line in list(self.lines))


def kill(p: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the child's process group while the child runs, and to every process
    seen related to it (see _watch) that still runs, also after the child itself has exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = _stragglers(p)
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 3.0
        while time.time() < deadline and (p.poll() is None or _stragglers(p)):
            time.sleep(0.05)
        if p.poll() is not None and not _stragglers(p):
            return


def _stragglers(p: subprocess.Popen) -> list[int]:
    """The processes related to `p` (as recorded by _watch, or found now while `p` runs, so that its
    pid cannot have been reused) that still run: same pid and start time, not zombies."""
    table = proc_table()
    tree = dict(_TREES.get(p.pid, {}))
    if p.poll() is None:
        for pid in related(p.pid, table):
            tree.setdefault(pid, table[pid][3])
    out = []
    for pid, start in tree.items():
        if pid in table and table[pid][3] == start and not _zombie(pid):
            out.append(pid)
    return out


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def kill_all() -> None:
    for p in _PROCS:
        kill(p)


# ----------------------------------------------------------------------------- network namespaces


def sh(*cmd: str, check: bool = True) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


class Wan:
    """Hub namespace with a bridge; one namespace per peer with `wan0` = 10.77.0.(i+1)/24, shaped.

    Without a delay: veth pairs (`wan0` in the peer, `vp{i}` on the bridge). With `delay_ms` > 0 (or
    `tap`): two TAP devices per link with the same names, joined by the delay line
    (bench/delayline.py), which holds every frame toward a peer `delay_ms`: RTT = 2 x delay_ms. The
    TAPs and the bridge then have MTU delayline.MTU. Either way tbf shapes both directions."""

    def __init__(self, n: int, rate: str | None, tag: str, delay_ms: float = 0.0, tap: bool = False):
        self.n, self.rate, self.tag, self.delay_ms = n, rate, tag, delay_ms
        self.tap = tap or delay_ms > 0
        self.hub = f"{tag}-hub"
        self.ns = [f"{tag}-p{i}" for i in range(n)]
        self.line: delayline.DelayLine | None = None

    def ip(self, i: int) -> str:
        return f"10.77.0.{i + 1}"

    def up(self) -> None:
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "set", "lo", "up")
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        if self.tap:
            self.line = delayline.DelayLine(self.delay_ms, [delayline.Link(ns, "wan0", self.hub, f"vp{i}")
                                                            for i, ns in enumerate(self.ns)])
            self.line.start()
        for i, ns in enumerate(self.ns):
            mtu = ["mtu", str(delayline.MTU)] if self.tap else []
            if not self.tap:
                sh("ip", "-n", self.hub, "link", "add", f"vp{i}", "type", "veth", "peer", "name", "wan0", "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", f"vp{i}", *mtu, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", f"vp{i}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "wan0")
            sh("ip", "-n", ns, "link", "set", "wan0", *mtu, "up")
        self.shape(self.rate)

    def shape(self, rate: str | None) -> None:
        """Every link shaped to `rate` (tbf, each direction: the peer's `wan0` egress = upload, the hub
        side = download), re-shaping the existing devices in place; None: unshaped. (The burst, 64kb,
        holds one frame of the delay line's MTU.)"""
        for i, ns in enumerate(self.ns):
            for where, dev in ((ns, "wan0"), (self.hub, f"vp{i}")):  # upload, download
                if rate is None:
                    sh("ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    sh("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                       "rate", rate, "burst", "64kb", "latency", "50ms")
        self.rate = rate

    def ping(self, src: int = 0, dst: int = 1, count: int = 6) -> dict | None:
        """Round trips from peer `src` to peer `dst` (bench/delayline_ping.py): {median_ms, ...}."""
        r = subprocess.run([*self.exec(src), *PY, str(delayline.PING), self.ip(dst), "--count", str(count)],
                           capture_output=True, text=True, timeout=count * 4 + 10)
        return delayline.parse_ping(r.stdout)

    def line_cpu_s(self) -> float | None:
        """The delay line's CPU seconds so far (None without one)."""
        return self.line.cpu_s() if self.line else None

    def down(self) -> None:
        if self.line is not None:
            self.line.stop()
        for ns in [*self.ns, self.hub]:
            sh("ip", "netns", "del", ns, check=False)

    def exec(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]]

    def tx_bytes(self, i: int) -> int:
        return int(sh(*self.exec(i), "cat", "/sys/class/net/wan0/statistics/tx_bytes").strip())


def proc_tx_bytes(pid: int, dev: str = "wan0") -> int | None:
    """Bytes `dev` transmitted, read from /proc/PID/net/dev (the network namespace of process PID)."""
    try:
        for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                return int(rest.split()[8])
    except (OSError, ValueError, IndexError):
        return None
    return None


class TxSampler:
    """Samples each process's interface tx counter every `period` s: [(t, [bytes per peer])]."""

    def __init__(self, pids: list[int], period: float = 0.25):
        self.pids, self.period = pids, period
        self.samples: list[tuple[float, list[int | None]]] = []
        self._stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), [proc_tx_bytes(p) for p in self.pids]))
            self._stop.wait(self.period)

    def stop(self) -> list[tuple[float, list[int | None]]]:
        self._stop.set()
        self.t.join(2)
        return self.samples


def bytes_between(samples: list[tuple[float, list[int | None]]], t0: float, t1: float) -> list[int] | None:
    """Per-peer counter increase between the samples nearest to t0 and t1 (linear interpolation)."""
    def at(t: float) -> list[float] | None:
        ok = [(ts, v) for ts, v in samples if all(x is not None for x in v)]
        if not ok:
            return None
        if t <= ok[0][0]:
            return [float(x) for x in ok[0][1]]
        for (ta, va), (tb, vb) in zip(ok, ok[1:]):
            if ta <= t <= tb:
                w = (t - ta) / (tb - ta) if tb > ta else 0.0
                return [x + w * (y - x) for x, y in zip(va, vb)]
        return [float(x) for x in ok[-1][1]]
    a, b = at(t0), at(t1)
    if a is None or b is None:
        return None
    return [int(round(y - x)) for x, y in zip(a, b)]


def stale_namespaces() -> list[str]:
    """Namespaces left by an earlier run of this benchmark whose process is gone."""
    out = []
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(r"^swwan(\d+)-", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            out.append(name)
    return out


# ----------------------------------------------------------------------------- the runs

PY = [sys.executable]


def peer_argv(a, i: int, host: str, port: int, steps: int, extra: list[str]) -> list[str]:
    return [*PY, str(ROOT / "peer.py"), "--host", host, "--port", str(port), "--steps", str(steps),
            "--batch-size", str(a.batch_size), "--table-rows", str(a.table_rows), "--seed", str(a.seed),
            "--threads", "1", "--name", f"p{i}", "--progress-interval", "0", *a.peer_model_flags,
            *slow_flags(getattr(a, "slow_peer", None), i, a.peers), *extra]


def run_floor(wan: Wan, a, k: int, log: Path, method: str | None = None) -> dict:
    """k single peers at once, each alone in its namespace on its loopback: compute only. With a
    swarm method, its flags (a local-step method's floor: its own windows, nobody to talk to).
    With --slow-peer the last of the N is slow here too (the same CPU contention as the runs), and
    the floor's step time is the fast peers' (the slow one's is `slow_peer_step_time_s`)."""
    flags = SWARM_FLAGS[method] if method else []
    procs = [Proc([*wan.exec(i), *peer_argv(a, i, "127.0.0.1", 0, a.steps, flags)],
                  log=log / f"floor{k}{'-' + method if method else ''}-p{i}.err") for i in range(k)]
    curves, vals = [], []
    for p in procs:
        p.wait(a.run_timeout)
        pts, summ = parse_peer_lines(p.lines)
        curves.append(merge_curves([pts]))
        vals.append(summ.get("val_loss") if summ else None)
    per_peer = [step_time(c) for c in curves]
    slow = getattr(a, "slow_peer", None) is not None and k == a.peers
    steps = [st for st in (per_peer[:-1] if slow else per_peer) if st is not None]
    out = {"step_time_s": sum(steps) / len(steps) if steps else None, "curve": curves[0] if curves else [],
           "val_loss": _mean([v for v in vals if v is not None])}
    if slow:
        out.update(slow_peer_step_time_s=per_peer[-1], peer_step_times_s=per_peer)
    return out


def run_swarm(wan: Wan, a, name: str, log: Path, steps: int | None = None, target: float | None = None) -> dict:
    """peer.py x N with the method's flags (SWARM_FLAGS), peer 0 first. With steps beyond the budget
    (--extra-steps-factor), the learning-rate schedule still runs on the budget (--budget), every
    peer evaluates at the budget (--eval-every) for val_loss at equal samples, and the peers are
    stopped (SIGTERM: they finish the step, evaluate and print their summary) as soon as the budget
    is done and the curve has reached `target`. (peer.py's --eval-every and val_history count
    rounds: a window of H inner steps is one.)"""
    steps = steps or a.steps
    tx0 = [wan.tx_bytes(i) for i in range(wan.n)]
    extra = ["--min-peers", str(wan.n), *SWARM_FLAGS[name]]
    rounds = a.steps // sync_every_of(name)  # --eval-every and val_history count rounds (windows)
    if steps > a.steps:
        extra += ["--budget", str(a.steps), "--eval-every", str(rounds)]
    port = 7100
    procs = [Proc([*wan.exec(0), *peer_argv(a, 0, wan.ip(0), port, steps, extra)], log=log / f"{name}-{wan.rate or 'unshaped'}-p0.err")]
    deadline = time.time() + 60
    while not procs[0].has("listening on") and time.time() < deadline and procs[0].p.poll() is None:
        time.sleep(0.1)
    for i in range(1, wan.n):
        procs.append(Proc([*wan.exec(i), *peer_argv(a, i, wan.ip(i), port, steps,
                                                     [*extra, "--join", f"{wan.ip(0)}:{port}"])],
                          log=log / f"{name}-{wan.rate or 'unshaped'}-p{i}.err"))
    sampler = TxSampler([p.p.pid for p in procs])
    stopped_at = None
    deadline = time.time() + a.run_timeout
    if steps > a.steps:
        while any(p.p.poll() is None for p in procs) and time.time() < deadline:
            curve = merge_curves([parse_peer_lines(list(p.lines))[0] for p in procs])
            if stopped_at is None and reached(curve, a.steps, target):
                stopped_at = curve[-1][0]
                for p in procs:
                    if p.p.poll() is None:
                        p.p.send_signal(signal.SIGTERM)
            time.sleep(0.5)
    codes = [p.wait(max(1.0, deadline - time.time())) for p in procs]
    samples = sampler.stop()
    tx = [wan.tx_bytes(i) - tx0[i] for i in range(wan.n)]
    parsed = [parse_peer_lines(p.lines) for p in procs]
    curve = merge_curves([pts for pts, _ in parsed])
    # the interface counters' samples are on the wall clock: the training window's bytes are cut
    # at the steps' wall times, not at the curve's (its times leave the evaluations out, which
    # moved the window's ends earlier by them: bytes of the last steps were counted after it)
    wall = merge_curves([parse_peer_lines(p.lines, less_evals=False)[0] for p in procs])
    summaries = [s for _, s in parsed if s]
    app = [s.get("bytes_sent", 0) + s.get("control_bytes_sent", 0) + s.get("row_bytes_sent", 0) for s in summaries]
    val_end = _mean([s["val_loss"] for s in summaries if s.get("val_loss") is not None])
    out = {"curve": curve, "exit_codes": codes, **traffic(tx, samples, wall),
           "app_bytes_per_peer": int(_mean(app)) if app else None,
           "grad_bytes_per_peer": int(_mean([s.get("bytes_sent", 0) for s in summaries])) if summaries else None,
           "row_bytes_per_peer": int(_mean([s.get("row_bytes_sent", 0) for s in summaries])) if summaries else None,
           "val_loss": val_end if steps <= a.steps else val_at(summaries, rounds),
           "step_time_s": step_time(curve), "steps": curve[-1][0] if curve else 0,
           # the evaluations left out of the curve's span (mean over peers; parse_peer_lines)
           "eval_s_left_out": round(_mean([eval_seconds_between(list(p.lines), curve[0][0], curve[-1][0])
                                           for p in procs]), 2) if curve else 0.0,
           "sync_every": [s.get("sync_every") for s in summaries],
           "push_lead": [s.get("push_lead") for s in summaries],  # inner steps the row pushes led by (--push-lead)
           # inner steps taken while the last window's end travelled (--early-step), per peer
           "early_steps": [s.get("early_steps") for s in summaries],
           "rounds_timed_out": [s.get("rounds_timed_out") for s in summaries],
           # per peer: [pulls that waited for a replay to reach its replica copy, seconds they waited]
           "replay_waits": [[(s.get("rows") or {}).get("replay_waits"), (s.get("rows") or {}).get("replay_wait_s")]
                            for s in summaries],
           "step_phases_ms": mean_phases([s.get("step_phases") or {} for s in summaries]),
           "sent_by_kind": mean_by_kind([s.get("sent_by_kind") or {} for s in summaries]),
           "received_by_kind": mean_by_kind([s.get("received_by_kind") or {} for s in summaries]),
           **peer_split(summaries, wan.n, getattr(a, "slow_peer", None))}
    if steps > a.steps:
        out.update(max_steps=steps, stopped_at_step=stopped_at, val_loss_at_end=val_end)
    return out


def mean_by_kind(counts: list[dict[str, int]]) -> dict[str, int]:
    """Request (or reply) body bytes by kind, mean over the peers that reported: where a run's
    interface bytes go, next to the headers and TCP that `tx_bytes_run` also counts."""
    kinds = sorted({k for c in counts for k in c})
    return {k: int(sum(c.get(k, 0) for c in counts) / len(counts)) for k in kinds} if counts else {}


def peer_split(summaries: list[dict], n: int, slow_peer: float | None) -> dict:
    """What the fast peers waited and what each peer trained: `fast_peer_wait_share` (the mean wait
    share of the peers that are not slow: all of them without --slow-peer), `samples_by_peer`
    {name: samples}, and with a slow peer its samples and wait share."""
    slow_id = f"p{n - 1}" if slow_peer is not None else None
    fast, slow = fast_slow_split(summaries, slow_id)
    out = {"fast_peer_wait_share": peer_wait_share(fast),
           "samples_by_peer": {s.get("name"): s.get("samples") for s in summaries}}
    if slow_id is not None:
        out.update(slow_peer_id=slow_id, slow_peer_samples=slow.get("samples") if slow else None,
                   slow_peer_steps_contributed=slow.get("steps_contributed") if slow else None,
                   slow_peer_wait_share=peer_wait_share([slow]) if slow else None)
    return out


def mean_phases(reports: list[dict]) -> dict[str, float] | None:
    """The peers' mean milliseconds per step phase (swarm/steptimes.py), averaged over peers, and
    the measured share of the step spent waiting on other peers (rows + round)."""
    reports = [r for r in reports if r.get("steps")]
    if not reports:
        return None
    phases = [k for k, v in reports[0].items() if isinstance(v, dict)]
    out = {k: round(_mean([r[k]["mean_ms"] for r in reports if k in r]), 1) for k in phases}
    out["wait_share"] = round(_mean([r["wait_share"] for r in reports if r.get("wait_share") is not None]), 3)
    return out


def run_ddp(wan: Wan, a, tables: str, log: Path, steps: int, enough=None) -> dict:
    name = f"ddp-{tables}"
    tx0 = [wan.tx_bytes(i) for i in range(wan.n)]
    procs = []
    for i in range(wan.n):
        argv = [*wan.exec(i), *PY, str(ROOT / "bench" / "ddp_baseline.py"), "--rank", str(i), "--world", str(wan.n),
                "--master", f"{wan.ip(0)}:29500", "--tables", tables, "--steps", str(steps),
                "--batch-size", str(a.batch_size), "--table-rows", str(a.table_rows), "--seed", str(a.seed),
                "--peer-id", f"p{i}", "--threads", "1", *a.base_model_flags,
                *slow_flags(getattr(a, "slow_peer", None), i, wan.n)]
        procs.append(Proc(argv, env={"GLOO_SOCKET_IFNAME": "wan0"}, log=log / f"{name}-{wan.rate or 'unshaped'}-p{i}.err"))
    return collect_baseline(wan, a, procs, tx0, enough)[0]


def collect_baseline(wan: Wan, a, procs: list[Proc], tx0: list[int],
                     enough=None) -> tuple[dict, list[dict]]:
    """Wait for a baseline's ranks (bench/ddp_baseline.py, bench/hivemind_baseline.py or
    bench/torchft_baseline.py, the same output format) and measure them like any method; also
    returns their summaries. ``enough(curve)``: end the run (kill it) once true, a timing run."""
    sampler = TxSampler([p.p.pid for p in procs])
    deadline = time.time() + a.run_timeout
    while enough is not None and any(p.p.poll() is None for p in procs) and time.time() < deadline:
        curve = merge_curves([parse_ddp_lines([line for _, line in list(p.lines)])[0] for p in procs])
        if enough(curve):
            for p in procs:
                kill(p.p)
            break
        time.sleep(0.5)
    codes = [p.wait(max(1.0, deadline - time.time())) for p in procs]
    samples = sampler.stop()
    tx = [wan.tx_bytes(i) - tx0[i] for i in range(wan.n)]
    parsed = [parse_ddp_lines([line for _, line in p.lines]) for p in procs]
    curve = merge_curves([pts for pts, _, _ in parsed])
    summaries = [s for _, s, _ in parsed if s]
    measured_wait = [s["comm_s"] / (s["compute_s"] + s["comm_s"]) for s in summaries
                     if s.get("compute_s", 0) + s.get("comm_s", 0) > 0]
    ranks = rank_wait_shares([raw for _, _, raw in parsed])
    fast = [w for w in (ranks[:-1] if getattr(a, "slow_peer", None) is not None else ranks) if w is not None]
    return {"curve": curve, "exit_codes": codes, **traffic(tx, samples, curve),
            "val_loss": _mean([s["val_loss"] for s in summaries]), "step_time_s": step_time(curve),
            "steps": curve[-1][0] if curve else 0,
            "measured_wait_share": round(_mean(measured_wait), 3) if measured_wait else None,
            "rank_wait_shares": ranks, "fast_peer_wait_share": round(_mean(fast), 3) if fast else None}, summaries


def probe_hivemind(python: str, module: str = "hivemind") -> tuple[str | None, str | None]:
    """(version, None) if `import hivemind` works in interpreter `python`, else (None, why not)."""
    code = f"import sys, {module} as m; sys.stdout.write(str(getattr(m, '__version__', '?')))"
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cannot run {python}: {e}"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["exit code %d" % r.returncode])[-1]
        return None, f"`import {module}` fails in {python} ({last}); pip install -e '.[hivemind]' or pass --hivemind-python"
    return r.stdout.strip(), None


def run_hivemind(wan: Wan, a, log: Path, python: str, steps: int, enough=None) -> dict:
    """bench/hivemind_baseline.py x N, peer 0 first; the others join its DHT at its multiaddr."""
    name = "hivemind"
    tx0 = [wan.tx_bytes(i) for i in range(wan.n)]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # also in hivemind's forked helper processes

    def argv(i: int, extra: list[str]) -> list[str]:
        return [*wan.exec(i), python, str(ROOT / "bench" / "hivemind_baseline.py"), "--index", str(i),
                "--peers", str(wan.n), "--host", wan.ip(i), "--port", str(7300 + i), "--steps", str(steps),
                "--batch-size", str(a.batch_size), "--table-rows", str(a.table_rows), "--seed", str(a.seed),
                "--peer-id", f"p{i}", "--threads", "1", "--run-id", f"swarm_wan_{os.getpid()}",
                "--matchmaking-time", str(a.hivemind_matchmaking_time),
                "--averaging-timeout", str(a.hivemind_averaging_timeout),
                "--average-state-every", str(a.hivemind_average_state_every), *a.base_model_flags, *extra]

    procs = [Proc(argv(0, []), env=env, log=log / f"{name}-{wan.rate or 'unshaped'}-p0.err")]
    deadline = time.time() + 120
    maddr = None
    while maddr is None and time.time() < deadline and procs[0].p.poll() is None:
        maddr = pick_maddr(parse_hivemind_maddrs([line for _, line in procs[0].lines]), wan.ip(0))
        time.sleep(0.1)
    if maddr is None:
        kill(procs[0].p)
        return {"curve": [], "exit_codes": [procs[0].p.poll()], "error": "peer 0 printed no multiaddr",
                **traffic([0] * wan.n, [], []), "val_loss": None, "step_time_s": None, "steps": 0,
                "health": {"warning": "peer 0 printed no multiaddr"}}
    for i in range(1, wan.n):
        procs.append(Proc(argv(i, ["--initial-peer", maddr]), env=env, log=log / f"{name}-{wan.rate or 'unshaped'}-p{i}.err"))
    out, summaries = collect_baseline(wan, a, procs, tx0, enough)
    return {**out, "health": hivemind_health(summaries, wan.n)}


TORCHFT_PROBE = ("import torchft, torchft.local_sgd\n"
                 "from torchft.coordination import LighthouseServer\n"
                 "s = LighthouseServer(bind='127.0.0.1:0', min_replicas=1); s.shutdown()\n"
                 "import sys; sys.stdout.write(str(getattr(torchft, '__version__', None) or "
                 "__import__('importlib.metadata').metadata.version('torchft')))")


def probe_torchft(python: str, code: str = TORCHFT_PROBE) -> tuple[str | None, str | None]:
    """(version, None) if torchft imports and a lighthouse starts in interpreter `python`, else
    (None, why not)."""
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=180, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cannot run {python}: {e}"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["exit code %d" % r.returncode])[-1]
        return None, (f"torchft does not run in {python} ({last}); pip install --no-deps torchft==0.2.0 and "
                      f"pip install opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http")
    return r.stdout.strip(), None


def run_torchft(wan: Wan, a, log: Path, python: str, steps: int, enough=None) -> dict:
    """bench/torchft_baseline.py x N (one replica group of one rank each) and its lighthouse, in
    peer 0's namespace at its address."""
    name, script = "torchft-diloco", str(ROOT / "bench" / "torchft_baseline.py")
    tx0 = [wan.tx_bytes(i) for i in range(wan.n)]
    lh = Proc([*wan.exec(0), python, script, "--serve-lighthouse", "--bind", "0.0.0.0:29510", "--world", str(wan.n)],
              log=log / f"{name}-{wan.rate or 'unshaped'}-lighthouse.err")
    deadline = time.time() + 120
    while not lh.has("lighthouse listening") and time.time() < deadline and lh.p.poll() is None:
        time.sleep(0.1)
    if not lh.has("lighthouse listening"):
        kill(lh.p)
        return {"curve": [], "exit_codes": [lh.p.poll()], "error": "the torchft lighthouse did not start",
                **traffic([0] * wan.n, [], []), "val_loss": None, "step_time_s": None, "steps": 0}
    procs = []
    for i in range(wan.n):
        argv = [*wan.exec(i), python, script, "--rank", str(i), "--world", str(wan.n), "--host", wan.ip(i),
                "--lighthouse", f"http://{wan.ip(0)}:29510", "--steps", str(steps),
                "--sync-every", str(TORCHFT["sync_every"]), "--outer-lr", str(TORCHFT["outer_lr"]),
                "--outer-momentum", str(TORCHFT["outer_momentum"]), "--batch-size", str(a.batch_size),
                "--table-rows", str(a.table_rows), "--seed", str(a.seed), "--peer-id", f"p{i}", "--threads", "1",
                *a.base_model_flags]
        procs.append(Proc(argv, env={"GLOO_SOCKET_IFNAME": "wan0"}, log=log / f"{name}-{wan.rate or 'unshaped'}-p{i}.err"))
    try:
        out, summaries = collect_baseline(wan, a, procs, tx0, enough)
    finally:
        kill(lh.p)
    out["outer_steps_committed"] = [s.get("outer_steps_committed") for s in summaries]
    return out


def traffic(tx: list[int], samples, curve) -> dict:
    """Whole-run bytes per peer (interface counters) and the same over the training window only
    (end of step 1 to end of the last step), per step and extrapolated to the whole budget."""
    out = {"tx_bytes_run": tx, "run_bytes_per_peer": int(_mean(tx))}
    win = bytes_between(samples, curve[0][1], curve[-1][1]) if len(curve) >= 2 else None
    if win is not None:
        per_step = _mean(win) / (curve[-1][0] - curve[0][0])
        out.update(tx_bytes_train_window=win, bytes_per_step_per_peer=int(per_step),
                   bytes_per_peer=int(per_step * curve[-1][0]),
                   # what the whole run sent beyond its training window: the start and step 1 (the
                   # first window's pulls), and after the last step (the final evaluation, linger, leave)
                   tx_bytes_before_window=int(_mean(bytes_between(samples, samples[0][0], curve[0][1]) or [0])),
                   tx_bytes_after_window=int(_mean(bytes_between(samples, curve[-1][1], samples[-1][0]) or [0])))
    else:
        out.update(bytes_per_step_per_peer=None, bytes_per_peer=int(_mean(tx)))
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------- report


COLORS = {"swarm": "C0", "swarm-dense": "C1", "swarm-tls": "C9", "swarm-overlap": "tab:cyan", "ddp-sparse": "C2",
          "ddp-dense": "C3", "hivemind": "C4",
          "swarm-h8": "C5", "swarm-h32": "C6", "swarm-h32-lead": "tab:olive", "swarm-diloco": "C7", "torchft-diloco": "C8", "floor": "0.5"}


def plot(per_rate: dict[str, dict[str, dict]], floor: dict, target: float | None, a, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(per_rate), 2, figsize=(12, 4.2 * len(per_rate)), squeeze=False)
    per_step = a.batch_size * a.peers
    for (rate, runs), (ax1, ax2) in zip(per_rate.items(), axes):
        for name, r in [*runs.items(), ("floor", floor)]:
            c = r.get("curve") or []
            if not c:
                continue
            t0 = c[0][1]
            label = name if name != "floor" else "compute floor (1 peer, no network; samples x1)"
            if r.get("timing"):
                label += f" (timed {r['timing'].get('timing_steps')} steps)"
            mult = per_step if name != "floor" else a.batch_size
            ls = "--" if r.get("timing") else "-"
            ax1.plot([max(t - t0, 1e-2) for _, t, _ in c], [l for _, _, l in c], ls, color=COLORS.get(name), label=label)
            ax2.plot([s * mult for s, _, _ in c], [l for _, _, l in c], ls, color=COLORS.get(name), label=label)
            if r.get("val_loss") is not None and name != "floor":
                ax2.plot([a.steps * mult], [r["val_loss"]], "x", color=COLORS.get(name))
        for ax in (ax1, ax2):
            if target is not None:
                ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target:.3f} (ddp-dense final)")
            ax.set_ylabel("train loss (10-step running mean)")
            ax.grid(alpha=0.3)
        ax1.set_xscale("log")
        ax1.set_xlabel(f"wall time since step 1 [s] (log), links {rate}")
        ax2.set_xlabel("samples (sequences, all peers); x = val_loss at the budget")
        ax2.legend(fontsize=7)
    fig.suptitle(f"{a.peers} peers, model {a.model}, batch {a.batch_size}/peer, budget {a.steps} steps, "
                 f"table rows {a.table_rows}; dashed: synchronous baselines' full-budget loss, timed at the rate")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def how(name: str, r: dict, full_rate: str | None) -> str:
    """How a method's row at a rate was measured (for the table)."""
    if r.get("timing"):
        return f"timed {r['timing'].get('timing_steps')} steps here; loss of its budget at {full_rate or 'unshaped'}"
    if r.get("max_steps"):
        return f"up to {r['max_steps']} steps, stopped at {r.get('stopped_at_step') or r.get('steps')}"
    return "its budget here"


def table(runs: dict[str, dict], floor: dict, target: float | None, a, rate: str, full_rate: str | None) -> str:
    rows = [f"links {rate}:",
            "| method | how | s/step | x floor | time to target [s] | step | final loss | val_loss "
            "| bytes/sample | MB sent/peer, whole run |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in runs.items():
        c = r.get("curve") or []
        st = r.get("step_time_s")
        t, lb = time_or_bound(r)
        ttt = "-" if t is None else (f">= {t:.1f} (missed)" if lb else f"{t:.1f}")
        bps = bytes_per_sample(r, a.batch_size)
        rows.append(f"| {name} | {how(name, r, full_rate)} | {_f(st, 3)} | {_f(ratio(st, floor.get('step_time_s')), 2)} "
                    f"| {ttt} | {r.get('target_step') or '-'} | {_f(c[-1][2] if c else None, 3)} "
                    f"| {_f(r.get('val_loss'), 3)} | {_f(bps, 0)} | {(r.get('run_bytes_per_peer') or 0) / 1e6:.1f} |")
    return "\n".join(rows)


def _f(v, d: int) -> str:
    return "-" if v is None else f"{v:.{d}f}"


# ----------------------------------------------------------------------------- main


def peer_help() -> str:
    """`peer.py --help` (to see whether it has --compute-speed)."""
    r = subprocess.run([*PY, str(ROOT / "peer.py"), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    return r.stdout


def report_ping(wan: Wan, delay_ms: float) -> dict | None:
    """Ping p0 -> p1 now, print it against the configured RTT, return bench/delayline.parse_ping's dict."""
    res = wan.ping(0, 1)
    got = "no reply" if res is None else (f"median {res['median_ms']:.2f} ms (min {res['min_ms']:.2f}, "
                                          f"max {res['max_ms']:.2f}, {res['replies']}/{res['sent']} replies)")
    print(f"ping p0 -> p1 at {wan.rate or 'unshaped'}: {got}; configured RTT {2 * delay_ms:g} ms", flush=True)
    return res


def link_figures(a, wan: Wan, pings: dict[str, dict | None], line_cpu_runs: dict, cpu0: float | None,
                 cpu1: float | None, seconds: float, per_rate: dict[str, dict[str, dict]]) -> dict:
    """The last line's keys about the links and the slow peer: the delay (configured RTT, the
    measured ping, the delay line's CPU per run and over the whole benchmark, its counters) and,
    per rate and method, the fast peers' wait share and the slow peer's samples."""
    first = next(iter(pings.values()), None) if pings else None
    out: dict = {
        "delay_ms": a.delay_ms, "rtt_configured_ms": 2 * a.delay_ms,
        "ping_rtt_ms": None if first is None else first["median_ms"],
        "ping_rtt_ms_by_rate": {r: None if p is None else p["median_ms"] for r, p in pings.items()},
        "delay_line": None if wan.line is None else {
            "how": f"TAP pair per link, frames toward the peer held {a.delay_ms:g} ms (bench/delayline.c)",
            "mtu": delayline.MTU, "queue_bytes": delayline.QUEUE_BYTES, "sched": wan.line.sched,
            "counters": wan.line.counters,
            "cpu_s_total": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 2),
            "core_share_total": None if cpu0 is None or cpu1 is None or seconds <= 0 else round((cpu1 - cpu0) / seconds, 4)},
        "delay_line_cpu": line_cpu_runs,
        "slow_peer": a.slow_peer,
        "fast_peer_wait_share": {r: {m: run.get("fast_peer_wait_share") for m, run in runs.items()}
                                 for r, runs in per_rate.items()},
    }
    if a.slow_peer is not None:
        out["slow_peer_id"] = f"p{a.peers - 1}"
        out["slow_peer_samples"] = {r: {m: run.get("slow_peer_samples") for m, run in runs.items()
                                        if "slow_peer_samples" in run} for r, runs in per_rate.items()}
        out["samples_by_peer"] = {r: {m: run.get("samples_by_peer") for m, run in runs.items()
                                      if "samples_by_peer" in run} for r, runs in per_rate.items()}
    return out


def run_method(wan: Wan, a, m: str, log: Path, steps: int, target: float | None, pythons: dict,
               enough=None) -> dict:
    if m in SWARM_FLAGS:
        return run_swarm(wan, a, m, log, steps, target)
    if m == "hivemind":
        return run_hivemind(wan, a, log, pythons["hivemind"], steps, enough)
    if m == "torchft-diloco":
        return run_torchft(wan, a, log, pythons["torchft"], steps, enough)
    return run_ddp(wan, a, m.split("-")[1], log, steps, enough)


def main() -> int:
    ap = argparse.ArgumentParser(description="swarm vs DDP-gloo, torchft DiLoCo and Hivemind on shaped links (needs root)")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rate", action="append", default=None,
                    help="tbf rate of every link, each direction (repeatable; default 80mbit ~ 10 MB/s and 8mbit)")
    ap.add_argument("--sync-full-rate", default="none",
                    help="rate at which the synchronous baselines run their whole budget (default none: unshaped); "
                         "at every other --rate they are timed for --timing-steps steps")
    ap.add_argument("--timing-steps", type=int, default=10,
                    help="steps a synchronous baseline is timed at a rate (torchft: rounded up to whole sync windows)")
    ap.add_argument("--timing-seconds", type=float, default=100.0,
                    help="a timing run also ends after this many seconds past step 1 once it has 3 steps "
                         "(torchft: one sync window); dense DDP takes about a minute a step at 8mbit")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay between any two peers, ms (RTT = 2x): every link's frames toward its peer are "
                         "held this long by a user-space TAP delay line (bench/delayline.c; no netem here)")
    ap.add_argument("--delay-line", action="store_true",
                    help="use the TAP delay line also at --delay-ms 0 (to measure its own cost against the veths)")
    ap.add_argument("--slow-peer", type=float, default=None, metavar="F",
                    help="the last peer computes at F (0 < F <= 1) of its speed, keeping its CPU share (peer.py and "
                         "bench/ddp_baseline.py --compute-speed F); hivemind and torchft-diloco are then not run")
    ap.add_argument("--model", choices=sorted(MODELS), default="small",
                    help="model preset (small: the built-in size; big: 5.1M dense parameters, small tables, batch 4)")
    ap.add_argument("--steps", type=int, default=224,
                    help="the sample budget in inner steps per peer (a multiple of every method's H; default 224 = 7 x 32)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the model preset's (small 16, big 4)")
    ap.add_argument("--table-rows", type=int, default=None, help="default: the model preset's (small 32768, big 4096)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--margin", type=float, default=0.0, help="added to dense DDP's final loss to make the target")
    ap.add_argument("--target", type=float, default=None, help="fixed target loss instead")
    ap.add_argument("--only", action="append", choices=METHODS,
                    help=f"run only these methods (repeatable; default all but swarm-dense: {', '.join(DEFAULT_METHODS)})")
    ap.add_argument("--local-method", choices=[m for m in SWARM_FLAGS
                                               if m not in ("swarm", "swarm-overlap", "swarm-dense", "swarm-tls")],
                    default="swarm-h32", help="the local-step configuration the last line's figures are about")
    ap.add_argument("--step-repeats", type=int, default=1,
                    help="(contended floor, local method) pairs per rate whose median step-time ratio is reported")
    ap.add_argument("--extra-steps-factor", type=float, default=1.5,
                    help="swarm methods may run up to this x the budget to reach the target (stopped once reached "
                         "after the budget; val_loss still at the budget); 1: the budget only, a lower bound if missed")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take (the time cap)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "wan.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "wan.png"))
    ap.add_argument("--log-dir", default="/tmp/swarm-wan-logs")
    ap.add_argument("--torchft-python", default=None,
                    help="interpreter with torchft installed for torchft-diloco (default: this one)")
    ap.add_argument("--hivemind-python", default=None,
                    help="interpreter with `hivemind` installed for the hivemind method (default: this one)")
    ap.add_argument("--hivemind-matchmaking-time", type=float, default=3.0,
                    help="hivemind.Optimizer matchmaking_time (groups are closed at --peers peers)")
    ap.add_argument("--hivemind-averaging-timeout", type=float, default=60.0,
                    help="hivemind.Optimizer averaging_timeout (an all-reduce of the dense model takes ~5-10 s at 10 MB/s)")
    ap.add_argument("--hivemind-average-state-every", type=int, default=1,
                    help="hivemind.Optimizer average_state_every (hivemind's default 1: parameters averaged every epoch)")
    a = ap.parse_args()

    msg = root_check()
    if msg:
        print(msg)
        return 0
    rates = list(dict.fromkeys(a.rate or ["80mbit", "8mbit"]))
    full_rate = None if a.sync_full_rate.lower() in ("none", "unshaped", "") else a.sync_full_rate
    preset = MODELS[a.model]
    a.batch_size = a.batch_size or preset["batch_size"]
    a.table_rows = a.table_rows or preset["table_rows"]
    a.peer_model_flags, a.base_model_flags = model_flags(preset, MODELS["small"])
    methods = [m for m in METHODS if m in (a.only or DEFAULT_METHODS)]
    local = a.local_method
    problems = [p for p in (check_budget(a.steps, methods),) if p]
    if a.step_repeats < 1:
        problems.append("--step-repeats must be at least 1")
    problems += check_options(a.delay_ms, a.slow_peer, a.peers)
    if a.slow_peer is not None and not problems and not has_compute_speed(peer_help()):
        problems.append("--slow-peer needs peer.py --compute-speed, which this peer.py does not have yet")
    if a.timing_steps < 3:
        problems.append("--timing-steps must be at least 3")
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    for ns in stale_namespaces():
        sh("ip", "netns", "del", ns, check=False)
    log = Path(a.log_dir)
    log.mkdir(parents=True, exist_ok=True)
    pythons = {"hivemind": a.hivemind_python or sys.executable, "torchft": a.torchft_python or sys.executable}
    notes: dict[str, str | dict] = {"hivemind": "not run (--only)", "torchft": "not run (--only)"}
    for m, key, probe in (("hivemind", "hivemind", lambda py: probe_hivemind(py)),
                          ("torchft-diloco", "torchft", probe_torchft)):
        if m in methods:
            version, why = probe(pythons[key])
            if version is None:
                methods.remove(m)
                notes[key] = f"skipped: {why}"
                print(f"{m} skipped: {why}", flush=True)
            else:
                notes[key] = {"version": version, "python": pythons[key]}
    if a.slow_peer is not None:
        for m, key in (("hivemind", "hivemind"), ("torchft-diloco", "torchft")):
            if m in methods:
                methods.remove(m)
                notes[key] = "skipped: --slow-peer (its baseline has no --compute-speed)"
                print(f"{m} skipped: --slow-peer (its baseline has no --compute-speed)", flush=True)
    steps_plan = plan(methods, rates, full_rate, local, a.step_repeats)
    t_start = time.time()
    wan = Wan(a.peers, full_rate, f"swwan{os.getpid()}", a.delay_ms, a.delay_line)
    pings: dict[str, dict | None] = {}
    line_cpu_runs: dict[str, dict[str, dict | None]] = {}
    cpu_total0 = None
    full: dict[str, dict] = {}
    per_rate: dict[str, dict[str, dict]] = {r: {} for r in rates}
    pairs: dict[str, list[tuple[float, float]]] = {r: [] for r in rates}
    durations: list[dict] = []
    target, target_from = a.target, "--target" if a.target is not None else None
    solo = floor = last_floor = {}
    try:
        wan.up()
        cpu_total0 = wan.line_cpu_s()
        print(f"namespaces up: {a.peers} peers; model {a.model}, steps {a.steps}, batch {a.batch_size}/peer, table rows "
              f"{a.table_rows}; rates {', '.join(rates)}; synchronous baselines' budget at {full_rate or 'unshaped'}; "
              f"{len(steps_plan)} runs" + (f"; slow peer p{a.peers - 1} at {a.slow_peer:g}" if a.slow_peer else ""),
              flush=True)
        if wan.line is not None:
            print(f"delay line: one-way {a.delay_ms:g} ms toward each peer (configured RTT {2 * a.delay_ms:g} ms), "
                  f"TAP MTU {delayline.MTU}, scheduling {wan.line.sched}", flush=True)
        pings[wan.rate or "unshaped"] = report_ping(wan, a.delay_ms)
        for kind, m, r in steps_plan:
            if kind != "floor-solo" and (kind == "full" or r is not None) and wan.rate != r:
                wan.shape(r)
                print(f"links now {r or 'unshaped'}", flush=True)
                if (r or "unshaped") not in pings:
                    pings[r or "unshaped"] = report_ping(wan, a.delay_ms)
            t0 = time.time()
            cpu0 = wan.line_cpu_s()
            if kind == "floor-solo":
                res = solo = run_floor(wan, a, 1, log)
            elif kind == "floor":
                res = last_floor = run_floor(wan, a, a.peers, log, m)
                if m is None:
                    floor = res
            elif kind == "full":
                res = full[m] = run_method(wan, a, m, log, a.steps, None, pythons)
                if r in per_rate:
                    per_rate[r][m] = res
                if m == "ddp-dense" and target is None and ddp_target(full) is not None:
                    target, target_from = ddp_target(full) + a.margin, "ddp-dense final running-mean loss"
            elif kind == "timing":
                H = sync_every_of(m)
                n = -(-a.timing_steps // H) * H if H > 1 else a.timing_steps  # whole windows
                min_steps = H if H > 1 else 3
                res = run_method(wan, a, m, log, n, None, pythons,
                                 enough=lambda c, k=min_steps: timing_done(c, k, a.timing_seconds))
                curve, info = project_curve(full[m].get("curve") or [], res.get("curve") or [], H)
                per_rate[r][m] = {**full[m], "curve": curve, "step_time_s": step_time(curve),
                                  "timing": {**info, "measured_step_time_s": res.get("step_time_s"),
                                             "bytes_per_step_per_peer": res.get("bytes_per_step_per_peer"),
                                             "exit_codes": res.get("exit_codes"), "seconds": round(time.time() - t0, 1)}}
            else:  # run / pair: a swarm method's budget (a run may be extended), a pair's repeat is not
                ext = kind == "run" and a.extra_steps_factor > 1
                steps = extended_steps(a.steps, a.extra_steps_factor, sync_every_of(m)) if ext else a.steps
                res = run_method(wan, a, m, log, steps, target, pythons)
                if kind == "run":
                    per_rate[r][m] = res
                else:
                    per_rate[r][m].setdefault("repeat_step_times_s", []).append(res.get("step_time_s"))
                if m == local and res.get("step_time_s") and last_floor.get("step_time_s"):
                    pairs[r].append((last_floor["step_time_s"], res["step_time_s"]))
            secs = time.time() - t0
            cpu1 = wan.line_cpu_s()
            lc = line_cpu(None if cpu0 is None or cpu1 is None else cpu1 - cpu0, secs, res.get("steps"))
            durations.append({"kind": kind, "method": m, "rate": r or "unshaped", "seconds": round(secs, 1),
                              **({"delay_line_cpu": lc} if lc else {})})
            if lc and kind not in ("pair",):
                line_cpu_runs.setdefault(r or "unshaped", {})[m if kind not in ("floor", "floor-solo") else
                                                                f"{kind}{'-' + m if m else ''}"] = lc
            if kind == "timing":
                per_rate[r][m].update(fast_peer_wait_share=res.get("fast_peer_wait_share"),
                                      rank_wait_shares=res.get("rank_wait_shares"))
            what = f"{kind} {m or 'floor'}" + (f" at {r or 'unshaped'}" if kind not in ("floor-solo",) else "")
            if kind in ("floor-solo", "floor"):
                print(f"{what}: {_f(res.get('step_time_s'), 3)} s/step, {secs:.0f} s", flush=True)
            else:
                print(f"{what}: {_f(res.get('step_time_s'), 3)} s/step, {(res.get('run_bytes_per_peer') or 0) / 1e6:.1f} MB"
                      f"/peer, final loss {_f((res.get('curve') or [[0, 0, None]])[-1][2], 4)}, val_loss "
                      f"{_f(res.get('val_loss'), 4)}, exit {res.get('exit_codes')}, {secs:.0f} s"
                      + (f" (evaluations left out of its time: {res['eval_s_left_out']:.1f} s)"
                         if res.get("eval_s_left_out") else ""), flush=True)
                if res.get("step_phases_ms"):
                    print(f"  step phases, ms per step (mean over peers): {res['step_phases_ms']}", flush=True)
                if res.get("replay_waits"):
                    print(f"  replay waits per peer [pulls, s]: {res['replay_waits']}", flush=True)
                if any(res.get("early_steps") or []):
                    print(f"  early steps per peer: {res['early_steps']}", flush=True)
                if a.slow_peer is not None and "samples_by_peer" in res:
                    print(f"  fast peers' wait share {_f(res.get('fast_peer_wait_share'), 3)}; slow peer "
                          f"{res.get('slow_peer_id')}: samples {res.get('slow_peer_samples')} (all: "
                          f"{res.get('samples_by_peer')}), wait share {_f(res.get('slow_peer_wait_share'), 3)}", flush=True)
                elif a.slow_peer is not None:
                    print(f"  fast ranks' wait share {_f(res.get('fast_peer_wait_share'), 3)} (per rank, the slow one "
                          f"last: {res.get('rank_wait_shares')}; every rank trains every step)", flush=True)
            if lc:
                per_step = f", {lc['cpu_ms_per_step']:.1f} ms/step" if lc.get("cpu_ms_per_step") else ""
                print(f"  delay line CPU {lc['cpu_s']:.2f} s ({100 * (lc['core_share'] or 0):.1f}% of one core{per_step})",
                      flush=True)
                if m == "hivemind" and isinstance(notes["hivemind"], dict):
                    notes["hivemind"].update(res.get("health") or {})
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        kill_all()
        cpu_total1 = wan.line_cpu_s()
        wan.down()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    if target is None and per_rate.get(rates[0]):
        target = pick_target({m: r["curve"] for m, r in per_rate[rates[0]].items()}, a.margin)
        target_from = f"worst final loss at {rates[0]} (ddp-dense was not run)" if target is not None else None
    floor_s = floor.get("step_time_s")
    for runs in per_rate.values():
        for r in runs.values():
            r["time_to_target_s"], r["target_step"] = (time_to_target(r["curve"], target) if target is not None
                                                       else (None, None))
            r["wait_share"] = wait_share(r.get("step_time_s"), floor_s)
    result = summarize_rates(per_rate, local, target, pairs, a.batch_size)
    result.update(
        target_from=target_from,
        sync_baselines=(f"{', '.join(m for m in methods if m in SYNC_METHODS) or 'none'}: whole budget once at "
                        f"{full_rate or 'unshaped links'} (loss and bytes), timed {a.timing_steps} steps or "
                        f"{a.timing_seconds:g} s (at least 3 steps; torchft whole sync windows) at every other rate; their time to the target there is "
                        f"projected from the timing run (plain step time and sync extra)"),
        swarm_methods=("whole budget at every rate" + (f", extended up to x{a.extra_steps_factor:g} until the target "
                                                       f"(val_loss at the budget)" if a.extra_steps_factor > 1 else
                                                       "; a method that misses the target gets its whole run as a "
                                                       "lower bound")),
        model={"preset": a.model, **preset, "batch_size": a.batch_size, "table_rows": a.table_rows},
        steps=a.steps, peers=a.peers, rates=rates,
        compute_floor_step_s=None if floor_s is None else round(floor_s, 4),
        solo_compute_floor_step_s=None if solo.get("step_time_s") is None else round(solo["step_time_s"], 4),
        by_rate={r: summarize(runs, floor_s, solo.get("step_time_s"), target) for r, runs in per_rate.items()},
        torchft=notes["torchft"], hivemind=notes["hivemind"], run_seconds=durations,
        seconds=round(time.time() - t_start, 1))
    result.update(link_figures(a, wan, pings, line_cpu_runs, cpu_total0, cpu_total1, time.time() - t_start, per_rate))
    for r, runs in per_rate.items():
        print(table(runs, floor, target, a, r, full_rate) + "\n")
    print(f"target loss {_f(target, 4)} ({target_from}); samples per step {a.batch_size * a.peers}; compute floor "
          f"{_f(floor_s, 3)} s/step ({a.peers} alone at once), {_f(solo.get('step_time_s'), 3)} s/step (1 alone)")
    doc = {"args": vars(a), "summary": result, "floor": floor, "solo_floor": solo, "full_runs": full, "runs": per_rate}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    try:
        plot(per_rate, floor, target, a, Path(a.plot))
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
