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

Determinism: only the primary computes this (replicas replay the applied gradients), but the same
inputs give the same bits: norms are float64 numpy sums (independent of torch's thread count),
medians are order statistics (exact), each scale is rounded to float32 once, and a row within the
bar is not multiplied at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..robust import MIN_ROBUST, OUTLIER_FACTOR

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


def combine(parts: list[Part], clip: float, remembered: list[float] | tuple = ()) -> Combined:
    """The robust sum of one table's parts (module docstring); ``remembered``: the levels of recent
    senders not in this flush (Levels.others). ``clip`` 0: the plain sum, nothing measured."""
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
    if len(per) == 1:
        out.ids, out.grads = uniq, grads
    else:
        out.ids = uniq
        out.grads = torch.zeros(len(uniq), grads.shape[1], dtype=grads.dtype)
        out.grads.index_add_(0, torch.from_numpy(inv), grads)
    if pool.size >= MIN_ROBUST and ref > 0:
        out.outliers = [s for s, lv in levels.items() if lv > OUTLIER_FACTOR * ref]
    return out
