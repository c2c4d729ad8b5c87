"""Robust aggregation of a round's gradient payloads, and per-peer scoring (sans-I/O).

Pure functions of a round's contributions in sum order (on-time by sender, then late by sender), so
every peer that holds the same payloads computes the same bits (docs/design.md, "Robust
aggregation"). Nothing here reads a clock: the scoreboard takes ``now`` like the membership core.

Rules (``--aggregation``):

* ``mean``: the historical aggregate: sum / (on-time count), late payloads at the same weight.
* ``trimmed``: coordinate-wise trimmed mean over *all* m contributors of the round, a sender that
  did not send an index counting as 0 there (see the design doc for why not "senders present").
* ``centered-clip`` (default): CenteredClip (Karimireddy, He, Jaggi 2021) on the densified vectors,
  ``v <- v + mean_i clip(x_i - v, tau)`` for a fixed number of iterations from v = 0, with tau the
  (lower) median of ``||x_i - v||`` at each iteration.

Weights: a payload that says the samples behind it (a slow peer's, or one that contributes every
few rounds with several steps' gradients) weighs by them, capped at ``WEIGHT_CAP`` x the round's
lower-median samples so no sender can claim the round for itself. ``mean`` is then sum(w x) /
(on-time weight); ``trimmed`` cuts ``trim`` of the total weight from each end of every coordinate
and takes the weighted mean of the rest; ``centered-clip`` moves by the weighted mean of the clipped
differences. When every payload says the same samples (or one says none) the unweighted rules run.

Before any rule, ``msg_clip`` > 0 clips each message to ``msg_clip`` x the round's lower-median
message norm. The robust rules need >= ``MIN_ROBUST`` (3) contributors; with fewer, the (clipped)
mean is used.

Determinism: norms are float64 numpy pairwise sums (independent of torch's thread count), scale
factors are rounded to float32 once, and every sum over contributors runs in a fixed Python loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch

RULES = ("mean", "trimmed", "centered-clip")
MIN_ROBUST = 3  # contributors needed before a robust rule is used (with 2, nobody is a majority)
CC_ITERS = 3  # CenteredClip iterations
OUTLIER_FACTOR = 4.0  # a message whose norm exceeds this x the round's median norm is an outlier
FULL_PENALTY_AT = OUTLIER_FACTOR ** 2  # an outlier this far out (x the median) loses the whole penalty
MIN_SEVERITY = 0.1  # the share of the penalty that an outlier just over OUTLIER_FACTOR loses
WEIGHT_CAP = 8.0  # a payload weighs at most this x the round's lower-median samples


@dataclass(frozen=True)
class RobustConfig:
    rule: str = "centered-clip"
    trim: float = 0.2  # fraction cut from each end per coordinate (trimmed)
    msg_clip: float = 2.0  # clip each message to msg_clip x the round's median norm; 0 = off

    def validate(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"aggregation rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not (0.0 <= self.trim < 0.5):
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim}")
        if not (self.msg_clip == 0 or self.msg_clip >= 1.0) or not math.isfinite(self.msg_clip):
            raise ValueError(f"msg_clip must be 0 (off) or >= 1, got {self.msg_clip}")


MEAN = RobustConfig(rule="mean", msg_clip=0.0)


@dataclass
class Report:
    """What one aggregation saw: per-sender norms and verdicts (in contribution order)."""

    count: int = 0
    rule: str = "mean"  # the rule actually applied (a robust rule falls back to mean below MIN_ROBUST)
    senders: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    median_norm: float = 0.0
    clipped: list[str] = field(default_factory=list)  # senders whose message msg_clip scaled down
    outliers: list[str] = field(default_factory=list)  # norm > OUTLIER_FACTOR x median (>= 3 contributors)
    # the share of the outlier penalty each outlier pays, where the rule that flagged it says (a
    # row flush: tables/http.py verdict_report); the others' comes from their norms (severity)
    severity: dict[str, float] = field(default_factory=dict)


def _values(c) -> torch.Tensor:
    return c.values.reshape(-1).to(torch.float32)


def _norm(v: torch.Tensor) -> float:
    """L2 norm, float64, pairwise summation: the same bits whatever torch's thread count."""
    a = v.detach().contiguous().numpy()
    return float(np.sqrt(np.add.reduce(np.square(a, dtype=np.float64))))


def lower_median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[(len(s) - 1) // 2] if s else 0.0


def aggregate(out: torch.Tensor, contributions: Sequence, cfg: RobustConfig = MEAN, *,
              divisor: int | None = None) -> Report:
    """out (zeroed fp32 [n]) <- the round's aggregate under ``cfg``; returns what it saw.

    ``contributions`` in sum order (each has step, sender, n, indices (None = dense), values and
    add_to); ``divisor`` is the mean's divisor (the on-time count; default len(contributions)).
    """
    cs = list(contributions)
    m = len(cs)
    rep = Report(count=m, rule="mean", senders=[c.sender for c in cs], steps=[int(c.step) for c in cs])
    if m == 0:
        return rep
    div = max(1, divisor if divisor is not None else m)
    have_values = all(hasattr(c, "values") for c in cs)
    if not have_values:  # a bare add_to contribution (tests): plain mean, nothing to measure
        for c in cs:
            c.add_to(out, 1.0 / div)
        return rep
    w = weights(cs)
    rep.norms = [_norm(_values(c)) for c in cs]
    med = rep.median_norm = lower_median(rep.norms)
    scale = [1.0] * m
    if cfg.msg_clip > 0 and med > 0:
        cap = cfg.msg_clip * med
        for i, nrm in enumerate(rep.norms):
            if nrm > cap:
                scale[i] = float(np.float32(cap / nrm))
                rep.clipped.append(cs[i].sender)
    if m >= MIN_ROBUST and med > 0:
        rep.outliers = [c.sender for c, nrm in zip(cs, rep.norms) if nrm > OUTLIER_FACTOR * med]
    if cfg.rule == "mean" or m < MIN_ROBUST:
        if w is None:
            for c, s in zip(cs, scale):
                c.add_to(out, s / div)
        else:
            total = float(sum(w[:div]))
            for c, s, wi in zip(cs, scale, w):
                c.add_to(out, float(np.float32(s * wi / total)))
        return rep
    rep.rule = cfg.rule
    idx, mat = _densify(cs, scale, out.numel())
    if cfg.rule == "trimmed":
        agg = _trimmed(mat, cfg.trim) if w is None else _trimmed_weighted(mat, w, cfg.trim)
    else:
        agg = _centered_clip(mat, w=w)
    if idx is None:
        out.add_(agg)
    else:
        out.index_add_(0, idx, agg)
    return rep


def weights(cs: Sequence) -> list[float] | None:
    """Each contribution's weight: the samples it says, capped at WEIGHT_CAP x the lower median;
    None (every payload weighs the same) when one says none or all say the same."""
    said = [getattr(c, "samples", None) for c in cs]
    if not said or any(x is None for x in said) or len(set(said)) == 1:
        return None
    cap = WEIGHT_CAP * lower_median([float(x) for x in said])
    return [min(float(x), cap) for x in said]


def _densify(cs: Sequence, scale: Sequence[float], n: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The contributions as rows of a [m, u] matrix over the union u of their indices (None = all n).

    Outside that union every contribution is 0, so both robust rules give 0 there (CenteredClip
    starts from v = 0 and only ever moves along differences that are 0 there): computing on the
    union is exact, and with Top-K it is ~m*k columns instead of n."""
    m = len(cs)
    if any(c.indices is None for c in cs):
        idx = None
        mat = torch.zeros(m, n, dtype=torch.float32)
        for i, c in enumerate(cs):
            c.add_to(mat[i], scale[i])
        return idx, mat
    # the union as a mask over all n coordinates (O(n) but vectorised; ~2x cheaper than sorting
    # the m*k indices with torch.unique), and each index's column through a position map
    mask = torch.zeros(n, dtype=torch.bool)
    for c in cs:
        mask[c.indices.reshape(-1).to(torch.int64)] = True
    idx = mask.nonzero().squeeze(1)  # sorted
    col = torch.empty(n, dtype=torch.int64)
    col[idx] = torch.arange(idx.numel())
    mat = torch.zeros(m, idx.numel(), dtype=torch.float32)
    for i, c in enumerate(cs):
        if c.indices.numel():
            v = _values(c)
            mat[i].index_copy_(0, col[c.indices.reshape(-1).to(torch.int64)], v if scale[i] == 1.0 else v * scale[i])
    return idx, mat


def _row_sum(rows: torch.Tensor) -> torch.Tensor:
    """Sum of rows in a fixed order (a Python loop: no reduction whose order depends on threads)."""
    acc = rows[0].clone()
    for r in rows[1:]:
        acc.add_(r)
    return acc


def _trimmed(mat: torch.Tensor, trim: float) -> torch.Tensor:
    m = mat.shape[0]
    cut = int(math.floor(trim * m))
    if cut == 0:
        return _row_sum(mat) / m
    srt = torch.sort(mat, dim=0).values  # sorting is exact: ties are equal values
    return _row_sum(srt[cut:m - cut]) / (m - 2 * cut)


def _trimmed_weighted(mat: torch.Tensor, w: Sequence[float], trim: float) -> torch.Tensor:
    """Per coordinate: sort the values, cut ``trim`` of the total weight W from each end (a value
    on the edge keeps the part of its weight inside), weighted mean of the rest."""
    total = float(sum(w))
    lo, hi = trim * total, (1.0 - trim) * total
    srt, order = torch.sort(mat, dim=0)
    wt = torch.tensor(w, dtype=torch.float64)[order]  # [m, u]: each sorted value's weight
    acc = torch.zeros(mat.shape[1], dtype=torch.float64)
    below = torch.zeros(mat.shape[1], dtype=torch.float64)
    for j in range(mat.shape[0]):  # fixed order: the same bits on every peer
        upto = below + wt[j]
        kept = (torch.minimum(upto, torch.full_like(upto, hi)) - torch.maximum(below, torch.full_like(below, lo))).clamp_(min=0)
        acc.add_(kept * srt[j].double())
        below = upto
    return (acc / (hi - lo)).float()


def _centered_clip(mat: torch.Tensor, iters: int = CC_ITERS, w: Sequence[float] | None = None) -> torch.Tensor:
    m = mat.shape[0]
    share = None if w is None else [float(np.float32(x / float(sum(w)))) for x in w]
    v = torch.zeros(mat.shape[1], dtype=torch.float32)
    for _ in range(iters):
        diff = mat - v
        d = [_norm(diff[i]) for i in range(m)]
        tau = lower_median(d)
        if tau <= 0:
            break
        step = torch.zeros_like(v)
        for i in range(m):
            s = 1.0 if d[i] <= tau else float(np.float32(tau / d[i]))
            step.add_(diff[i], alpha=s if share is None else float(np.float32(s * share[i])))
        v.add_(step, alpha=1.0 / m if share is None else 1.0)
    return v


# -- scoring -------------------------------------------------------------------------------------

def severity(ratio: float) -> float:
    """The share of the outlier penalty for a message at ``ratio`` x its round's median norm.

    Honest gradient norms are heavy-tailed: at batch 4 one step in a few hundred has a norm 4-5x
    its round's median (docs/design.md, "Scores and bans"), while an attack worth banning sends
    far more than that, every round. So the cost grows with the log of how far past
    OUTLIER_FACTOR a message is: MIN_SEVERITY just over it, all of it from FULL_PENALTY_AT on
    (a x100 attacker is banned at its third round, as with a flat penalty)."""
    if math.isnan(ratio) or ratio >= FULL_PENALTY_AT:  # inf: no norm to go by
        return 1.0
    if ratio <= OUTLIER_FACTOR:
        return MIN_SEVERITY
    return max(MIN_SEVERITY, math.log(ratio / OUTLIER_FACTOR) / math.log(FULL_PENALTY_AT / OUTLIER_FACTOR))


def outlier_ratios(report: Report) -> dict[str, float]:
    """Each sender's largest message norm over the round's median (empty when the report carries
    no norms: its outliers then lose the whole penalty, unless ``Report.severity`` says)."""
    if not report.norms or not report.median_norm > 0 or len(report.norms) != len(report.senders):
        return {}
    out: dict[str, float] = {}
    for sender, nrm in zip(report.senders, report.norms):
        out[sender] = max(out.get(sender, 0.0), nrm / report.median_norm)
    return out


BANNED = "banned"  # Peer.offer's verdict for a payload from a banned sender (the route answers 403)


@dataclass(frozen=True)
class ScoreConfig:
    ban_seconds: float = 60.0
    outlier_penalty: float = 0.3
    invalid_penalty: float = 0.2
    recovery: float = 0.01  # per round taken
    ban_below: float = 0.25  # banned when the score falls under this
    after_ban: float = 0.5  # the score a peer comes back with (one more offence bans it again)


@dataclass
class PeerScore:
    score: float = 1.0
    banned_until: float = 0.0
    outliers: int = 0
    clipped: int = 0
    invalid: int = 0
    refused: int = 0  # payloads refused (403) while banned
    excluded: int = 0  # payloads dropped from a round because the sender was banned
    bans: int = 0


class Scoreboard:
    """Per-sender scores: drop on invalid payloads and outlier rounds, recover slowly, ban below a bar.

    Round verdicts (``observe``) are a pure function of the round, so peers holding the same
    payloads ban the same sender at the same round; ``ban_seconds`` is then measured on each
    peer's own clock (docs/design.md for what that costs)."""

    def __init__(self, cfg: ScoreConfig | None = None):
        self.cfg = cfg or ScoreConfig()
        self.peers: dict[str, PeerScore] = {}

    def get(self, peer_id: str) -> PeerScore:
        p = self.peers.get(peer_id)
        if p is None:
            p = self.peers[peer_id] = PeerScore()
        return p

    def banned(self, peer_id: str, now: float) -> bool:
        p = self.peers.get(peer_id)
        return p is not None and p.banned_until > now

    def banned_ids(self, now: float) -> set[str]:
        return {pid for pid, p in self.peers.items() if p.banned_until > now}

    def _penalise(self, p: PeerScore, amount: float, now: float) -> bool:
        """Lower a score; returns True when this starts a ban."""
        if p.banned_until > now:
            return False
        self._expire(p, now)
        p.score = max(0.0, p.score - amount)
        if p.score < self.cfg.ban_below:
            p.banned_until = now + self.cfg.ban_seconds
            p.bans += 1
            return True
        return False

    def invalid(self, peer_id: str, now: float) -> bool:
        p = self.get(peer_id)
        p.invalid += 1
        return self._penalise(p, self.cfg.invalid_penalty, now)

    def refused(self, peer_id: str) -> None:
        self.get(peer_id).refused += 1

    def split(self, contributions: Iterable, now: float) -> tuple[list, list]:
        """(kept, dropped): contributions from banned senders are dropped from the round."""
        kept, dropped = [], []
        for c in contributions:
            (dropped if self.banned(c.sender, now) else kept).append(c)
        for c in dropped:
            self.get(c.sender).excluded += 1
        return kept, dropped

    def observe(self, report: Report, now: float) -> list[str]:
        """Score one aggregated round; returns the senders this round got banned. An outlier loses
        ``outlier_penalty`` x its share: ``report.severity``'s, else ``severity`` of its norm ratio
        (the whole penalty when the report has neither)."""
        out = set(report.outliers)
        clipped = set(report.clipped)
        ratio = outlier_ratios(report)
        newly = []
        for sender in dict.fromkeys(report.senders):
            p = self.get(sender)
            if sender in clipped:
                p.clipped += 1
            if sender in out:
                p.outliers += 1
                share = report.severity.get(sender)
                cost = self.cfg.outlier_penalty * (severity(ratio.get(sender, math.inf)) if share is None else share)
                if self._penalise(p, cost, now):
                    newly.append(sender)
        for p in self.peers.values():
            if p.banned_until <= now:
                self._expire(p, now)
                p.score = min(1.0, p.score + self.cfg.recovery)
        return newly

    def _expire(self, p: PeerScore, now: float) -> None:
        """A ban that ran out: the peer comes back on probation (one more offence bans it again)."""
        if p.banned_until and p.banned_until <= now and p.score < self.cfg.ban_below:
            p.score = self.cfg.after_ban

    def status(self, now: float, clock_offset: float = 0.0) -> dict:
        """Per-peer counts; ``banned_until`` is ``now``'s clock + ``clock_offset`` (e.g. to Unix time)."""
        return {pid: {"score": round(p.score, 3),
                      "banned_until": p.banned_until + clock_offset if p.banned_until > now else None,
                      "banned_for_s": round(p.banned_until - now, 1) if p.banned_until > now else 0.0,
                      "outliers": p.outliers, "clipped": p.clipped, "invalid": p.invalid,
                      "refused": p.refused, "excluded": p.excluded, "bans": p.bans}
                for pid, p in sorted(self.peers.items())}
