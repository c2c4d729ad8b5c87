"""Robust combination of the row-gradient pushes of one flush (sans-I/O, deterministic).

A table primary applies ONE optimizer step per row on the combination of every push of a flush
(TableService.flush). Summing them as they came lets one member move any row it pushes as it likes
(a x1000 gradient dominates the sum, and its square fills Adam's second moment, freezing the row
for thousands of steps). The rule here (docs/design.md, "Robust row pushes"):

1. Each sender's *level* is the lower median of the L2 norms of the rows it pushed in this flush
   (per table: the tables' gradient scales differ).
2. The flush's *reference* is the lower median of the levels of the senders of this flush and of
   the senders seen in the last ``KEPT_FLUSHES`` flushes of this table (``Levels``): a sender
   controls one level, so with an honest majority the reference is an honest level however many
   rows, or whatever norms, one sender pushes; and the levels remembered from earlier flushes keep a
   flush that holds only the attacker's push (a push window it has to itself) from being measured
   against the attacker alone.
3. Every (sender, row) gradient whose norm exceeds ``clip`` x its bar is scaled down to that norm,
   then the rows are summed. The bar is the reference, or, for a row that >= ``MIN_ROBUST``
   senders pushed, the lower median of that row's pushes when it is larger (the rows of frequent
   n-grams sum many tokens' gradients and are large for every sender; one sender cannot raise a
   median of >= 3). Rows that only one sender pushed are clipped like the others, against the
   reference. A sender's several pushes in one flush count as one (summed first). ``clip`` 0 is
   the plain sum, bit for bit.
4. A sender whose level exceeds ``OUTLIER_FACTOR`` x the reference (judged with >= ``MIN_ROBUST``
   levels) is an outlier of this flush: the shell lowers its score (swarm/robust.py Scoreboard).
5. Direction (``agreement``, ``judge``): on the rows that >= 2 senders pushed, each sender's
   clipped gradient is compared with the sum of the OTHER senders' for the same row; its agreement
   is sum <g, o/|o|> / sum |g| over its shared rows (the part of its pushed mass along the others'
   direction). Honest senders' rows agree (measured in bench/row_attack.py: median 0.2, 5% under
   0.06, under 0 in ~1.7% of flush parts, the lowest -0.32), a sign-flipped sender's point against
   them (-0.40 to -0.90). With >= ``MIN_ROBUST`` senders that share >= ``MIN_SHARED`` rows, the
   lowest one below ``AGREE_BAR`` (-0.25) is *disagreeing*: its
   rows (all of them, shared or not) take no part in this flush and it is an outlier too; the
   others are judged again without it, one at a time. ``agree`` False skips this rule.

Determinism: only the primary computes this (replicas replay the applied gradients), but the same
inputs give the same bits: norms are float64 numpy sums (independent of torch's thread count),
medians are order statistics (exact), each scale is rounded to float32 once, and a row within the
bar is not multiplied at all; the agreement sums are float64 numpy reductions in a fixed order
(rows sorted stably, senders in first-seen order), and ties go to the first sender.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..robust import MIN_ROBUST, MIN_SEVERITY, OUTLIER_FACTOR, severity

MIN_SHARED = 8  # rows a sender must share with others in a flush before its agreement is judged
AGREE_BAR = -0.25  # a sender whose agreement is below this points against the others: excluded (measured: docs/design.md)
FULL_DISAGREEMENT = -0.5  # a disagreeing sender this far below pays the whole outlier penalty
KEPT_FLUSHES = 32  # a sender's level counts in the reference this many flushes after its last push
MAX_SENDERS = 256  # levels remembered per table (the oldest go first)


@dataclass(frozen=True)
class Part:
    """One sender's rows of one table in a flush: sorted-unique ids, fp32 [len(ids), dim] gradients."""

    sender: str
    ids: np.ndarray
    grads: torch.Tensor


@dataclass
class Combined:
    """One table's combined rows, and what the rule saw (per sender, in first-seen order)."""

    ids: np.ndarray
    grads: torch.Tensor
    reference: float = 0.0  # the flush's reference row norm (0: nothing to measure against)
    levels: dict[str, float] = field(default_factory=dict)  # each sender's median row norm
    rows: dict[str, int] = field(default_factory=dict)  # rows each sender pushed
    clipped: dict[str, int] = field(default_factory=dict)  # ... of which were scaled down
    outliers: list[str] = field(default_factory=list)
    # each sender's level over the reference, when the flush could judge levels (>= MIN_ROBUST of
    # them, a reference > 0): how far out an outlier is (its score pays by it: robust.severity)
    ratios: dict[str, float] = field(default_factory=dict)
    # agreement (rule 5): per sender with >= MIN_SHARED shared rows, the weighted mean cosine of its
    # rows with the sum of the other senders' pushes of the same rows; and how many rows it shared
    agreement: dict[str, float] = field(default_factory=dict)
    shared: dict[str, int] = field(default_factory=dict)
    disagreeing: list[str] = field(default_factory=list)  # agreement < AGREE_BAR: excluded, outliers


@dataclass
class Levels:
    """Per table: each recent sender's level and the flush it was last seen at."""

    seen: dict[str, dict[str, tuple[float, int]]] = field(default_factory=dict)

    def others(self, table: str, now: int, exclude) -> list[float]:
        """The levels of senders seen within KEPT_FLUSHES flushes of ``now``, but not in ``exclude``."""
        return [lv for s, (lv, at) in self.seen.get(table, {}).items() if s not in exclude and now - at < KEPT_FLUSHES]

    def remember(self, table: str, levels: dict[str, float], now: int) -> None:
        d = self.seen.setdefault(table, {})
        for s, lv in levels.items():
            d.pop(s, None)  # re-insert: the dict stays in last-seen order
            d[s] = (lv, now)
        for s in [s for s, (_, at) in d.items() if now - at >= KEPT_FLUSHES]:
            del d[s]
        while len(d) > MAX_SENDERS:
            del d[next(iter(d))]


def verdict_severity(ratio: float, agreement: float | None, disagreed: bool) -> float:
    """The share of the outlier penalty a flush's outlier pays: by how far its level is past
    OUTLIER_FACTOR x the reference (``ratio``: robust.severity, as a dense payload), or, when it
    disagreed, by how far its agreement is below AGREE_BAR: MIN_SEVERITY just under it, all of it
    at FULL_DISAGREEMENT and below (measured: honest parts reach -0.35 at batch 4, sign-flipped
    ones lie at -0.40 to -0.90; docs/design.md "Robust row pushes"). The larger of the two."""
    share = severity(ratio) if ratio > OUTLIER_FACTOR else 0.0
    if disagreed:
        if agreement is None or not agreement > FULL_DISAGREEMENT:
            return 1.0
        share = max(share, MIN_SEVERITY, (AGREE_BAR - agreement) / (AGREE_BAR - FULL_DISAGREEMENT))
    return min(1.0, share) if share > 0 else 1.0


def row_norms(g: torch.Tensor) -> np.ndarray:
    """float64 L2 norm of each row (numpy: the same bits whatever torch's thread count)."""
    a = g.detach().contiguous().numpy()
    return np.sqrt(np.add.reduce(np.square(a, dtype=np.float64), axis=1))


def lower_median(a: np.ndarray) -> float:
    """The lower median (an element of ``a``: with an honest majority, an honest value)."""
    if not a.size:
        return 0.0
    k = (a.size - 1) // 2
    return float(np.partition(a, k)[k])


def sum_rows(parts: list[tuple[np.ndarray, torch.Tensor]]) -> tuple[np.ndarray, torch.Tensor]:
    """Row gradient parts (each with sorted-unique ids) as one: sorted-unique ids, and the sum of
    the parts' gradients for an id that several parts carry."""
    if len(parts) == 1:
        return parts[0]
    ids, inverse = np.unique(np.concatenate([p[0] for p in parts]), return_inverse=True)
    grads = torch.cat([p[1] for p in parts])
    out = torch.zeros(len(ids), grads.shape[1], dtype=grads.dtype)
    out.index_add_(0, torch.from_numpy(inverse.reshape(-1)), grads)
    return ids, out


def agreement(g: np.ndarray, inv: np.ndarray, who: np.ndarray, n: int,
              active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sender (0..n-1): the agreement of its rows with the others' on the rows it shares, and
    how many rows it shares, counting only the entries of ``active`` senders.

    ``g``: float64 [N, dim] (sender, row) gradients, ``inv``: each one's row, ``who``: its sender.
    For an entry e of a row that >= 2 active senders pushed, o_e is the sum of the OTHER active
    senders' gradients of that row; a sender's agreement is sum_e <g_e, o_e / |o_e|> / sum_e |g_e|
    over its shared entries: the part of the mass it pushed that goes along the others' direction
    (+1: all along it, -1: all against it; the sender chooses its norms, but cannot make the
    numerator, its net push along the others' direction, positive while pushing against them)."""
    live = active[who]
    count = np.bincount(inv[live], minlength=int(inv.max()) + 1 if inv.size else 0)
    shared = live & (count[inv] >= 2)
    if not shared.any():
        return np.zeros(n), np.zeros(n, np.int64)
    e = np.flatnonzero(shared)
    e = e[np.argsort(inv[e], kind="stable")]  # entries by row (then as they came): a fixed sum order
    rs = inv[e]
    starts = np.flatnonzero(np.r_[True, rs[1:] != rs[:-1]])
    mine = g[e]
    total = np.add.reduceat(mine, starts, axis=0)  # each shared row's sum over active senders
    others = total[np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(e)]))]
    others -= mine
    # row-wise dot products without [E, dim] temporaries: this runs on every flush of a primary
    on = np.sqrt(np.einsum("ij,ij->i", others, others))
    gn = np.sqrt(np.einsum("ij,ij->i", mine, mine))
    along = np.einsum("ij,ij->i", mine, others) / np.where(on > 0, on, 1.0)
    by = who[e]
    num = np.bincount(by, weights=along, minlength=n)
    den = np.bincount(by, weights=gn, minlength=n)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0), np.bincount(by, minlength=n)


def combine(parts: list[Part], clip: float, remembered: list[float] | tuple = (), agree: bool = True) -> Combined:
    """The robust sum of one table's parts (module docstring); ``remembered``: the levels of recent
    senders not in this flush (Levels.others). ``clip`` 0: the plain sum, nothing measured.
    ``agree`` False: no agreement check (rule 5)."""
    if clip <= 0 or not parts:
        ids, grads = sum_rows([(p.ids, p.grads) for p in parts]) if parts else (np.zeros(0, np.int64), torch.zeros(0, 0))
        return Combined(ids, grads)
    # one (ids, grads) per sender: two pushes of one sender in a flush count as one voice per row
    mine: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = {}
    for p in parts:
        mine.setdefault(p.sender, []).append((p.ids, p.grads))
    senders = list(mine)
    per = [sum_rows(mine[s]) for s in senders]
    norms = [row_norms(g) for _, g in per]
    levels = {s: lower_median(n) for s, n in zip(senders, norms)}
    pool = np.asarray([*levels.values(), *remembered], dtype=np.float64)
    ref = lower_median(pool)
    out = Combined(np.zeros(0, np.int64), torch.zeros(0, 0), ref, levels,
                   {s: len(n) for s, n in zip(senders, norms)}, {s: 0 for s in senders})
    all_ids = np.concatenate([i for i, _ in per])
    norm = np.concatenate(norms)
    who = np.repeat(np.arange(len(senders)), [len(n) for n in norms])
    uniq, inv, counts = np.unique(all_ids, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    # a row that >= MIN_ROBUST senders pushed is also measured against its own lower-median push
    # (the rows of frequent n-grams are large for everyone): order the norms by row, then by size
    order = np.lexsort((norm, inv))
    row_ref = norm[order][np.cumsum(counts) - counts + (counts - 1) // 2]
    row_ref[counts < MIN_ROBUST] = 0.0
    cap = clip * np.maximum(ref, row_ref)[inv]
    over = (norm > cap) & (cap > 0)
    grads = torch.cat([g for _, g in per])
    if over.any():
        scale = np.ones(len(norm), dtype=np.float32)
        scale[over] = (cap[over] / norm[over]).astype(np.float32)
        grads = grads * torch.from_numpy(scale)[:, None]  # a row within the bar is x1.0: the same bits
        for j, k in zip(*np.unique(who[over], return_counts=True)):
            out.clipped[senders[int(j)]] = int(k)
    voices = len(per)
    if agree and voices >= MIN_ROBUST:
        gone = judge(out, grads, inv, who, senders)
        if gone.any():  # a disagreeing sender's rows take no part in this flush
            keep = ~gone[who]
            voices -= int(gone.sum())
            grads = grads[torch.from_numpy(keep)]
            uniq, inv = np.unique(all_ids[keep], return_inverse=True)
            inv = inv.reshape(-1)
    if voices == 1:
        out.ids, out.grads = uniq, grads
    else:
        out.ids = uniq
        out.grads = torch.zeros(len(uniq), grads.shape[1], dtype=grads.dtype)
        out.grads.index_add_(0, torch.from_numpy(inv), grads)
    if pool.size >= MIN_ROBUST and ref > 0:
        out.ratios = {s: lv / ref for s, lv in levels.items()}
        out.outliers = [s for s, lv in levels.items() if lv > OUTLIER_FACTOR * ref]
    out.outliers += [s for s in out.disagreeing if s not in out.outliers]
    return out


def judge(out: Combined, grads: torch.Tensor, inv: np.ndarray, who: np.ndarray, senders: list[str]) -> np.ndarray:
    """Rule 5: find the senders whose (clipped) rows point against the others'; fills
    ``out.agreement`` / ``out.shared`` / ``out.disagreeing`` and returns the mask of the senders to
    leave out. One at a time, the worst first: a sender below AGREE_BAR is left out and the others
    are judged again without it (its push lowers their agreement too), while >= MIN_ROBUST senders
    with >= MIN_SHARED shared rows remain (with two, either could be the one pointing the wrong way)."""
    n = len(senders)
    g = grads.detach().contiguous().numpy().astype(np.float64)
    active = np.ones(n, bool)
    gone = np.zeros(n, bool)
    while True:
        score, shared = agreement(g, inv, who, n, active)
        judged = active & (shared >= MIN_SHARED)
        if not out.agreement:  # report the first pass (every sender in)
            out.agreement = {senders[i]: float(score[i]) for i in np.flatnonzero(judged)}
            out.shared = {senders[i]: int(shared[i]) for i in range(n) if shared[i]}
        if judged.sum() < MIN_ROBUST:
            break
        worst = int(np.flatnonzero(judged)[np.argmin(score[judged])])
        if not score[worst] < AGREE_BAR:
            break
        active[worst] = False
        gone[worst] = True
        out.disagreeing.append(senders[worst])
    return gone
