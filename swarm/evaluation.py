"""Which table rows an evaluation pulls, and in which pulls (sans-I/O).

An evaluation runs the fixed held-out batches on the global model, each batch on rows pulled from
their owners. The batches share most of their rows (the built-in task's 8 held-out batches read
27,124 rows, 13,453 of them distinct), so pulling each batch's rows on its own sends most rows
several times. Batches are grouped instead, in order, while the distinct rows of a group stay
under a cap (a bound on the memory the pulled rows take), and each group's rows are pulled once;
a batch then reads its rows out of its group's. The rows a batch sees are the same either way: a
pull returns each row as its owner holds it, whichever other ids ride along.

The evaluation before the first step pulls nothing: until round 0 is applied the swarm's model is
its initial one, whose rows every peer can draw itself (the task's init, per slot, as an owner
draws a fresh slot's). Pulled, it raced the other peers' first row pushes (a peer that evaluated
later read rows some peers had already stepped), so peers' first val points differed.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import torch

__all__ = ["EVAL_PULL_ROWS", "group_batches", "union_ids", "rows_for", "initial_rows"]

EVAL_PULL_ROWS = 1 << 16  # distinct rows (all tables) one evaluation pull may carry: 32 MB of fp32 at dim 128


def union_ids(wants: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """{table: sorted-unique int64 ids} read by any of ``wants`` (each {table: sorted-unique ids})."""
    tables: dict[str, list[np.ndarray]] = {}
    for want in wants:
        for t, ids in want.items():
            tables.setdefault(t, []).append(np.asarray(ids, np.int64))
    return {t: np.unique(np.concatenate(parts)) for t, parts in tables.items()}


def group_batches(wants: list[dict[str, np.ndarray]], cap: int | None = None) -> list[list[int]]:
    """Consecutive runs of batch indices whose distinct rows (all tables together) stay within
    ``cap`` (default EVAL_PULL_ROWS); a batch that alone reads more is a group of its own."""
    cap = EVAL_PULL_ROWS if cap is None else cap
    if cap < 1:
        raise ValueError(f"cap must be >= 1 row, got {cap}")
    groups: list[list[int]] = []
    seen: dict[str, np.ndarray] = {}
    for i, want in enumerate(wants):
        merged = union_ids([seen, want])
        if groups and sum(len(v) for v in merged.values()) <= cap:
            groups[-1].append(i)
            seen = merged
        else:
            groups.append([i])
            seen = union_ids([want])
    return groups


def rows_for(want: dict[str, np.ndarray], union: dict[str, np.ndarray],
             rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch's rows ({table: rows in ``want``'s id order}) out of its group's pulled ``rows``
    (in ``union``'s id order); every id of ``want`` must be in ``union``."""
    out = {}
    for t, ids in want.items():
        pos = np.searchsorted(union[t], ids)
        if len(ids) and (pos.max() >= len(union[t]) or not np.array_equal(union[t][pos], ids)):
            raise ValueError(f"ids of table {t!r} missing from the group's pull")
        out[t] = rows[t].index_select(0, torch.from_numpy(pos.astype(np.int64)))
    return out


def initial_rows(union: Mapping[str, np.ndarray], bounds: Mapping[str, np.ndarray], dims: Mapping[str, int],
                 inits: Mapping[str, Callable[[int, int], torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """The initial rows of ``union`` ({table: sorted-unique ids}; fp32, in id order), drawn per slot
    as an owner draws a fresh slot's (``inits[table](lo, hi)``, zeros without one): ``bounds`` is
    each table's slot layout (ownership.slot_bounds), ``dims`` its row width."""
    out = {}
    for t, ids in union.items():
        ids = np.asarray(ids, np.int64)
        b, init, dim = bounds[t], inits.get(t), dims[t]
        rows = torch.zeros(len(ids), dim)
        if init is None or not len(ids):
            out[t] = rows
            continue
        if ids.min() < 0 or ids.max() >= b[-1]:
            raise ValueError(f"ids of table {t!r} outside its {int(b[-1])} rows")
        slots = np.searchsorted(b, ids, side="right") - 1
        cuts = np.flatnonzero(np.diff(slots)) + 1  # ids are sorted: each slot's ids are one run
        for run in np.split(np.arange(len(ids)), cuts):
            s = int(slots[run[0]])
            lo, hi = int(b[s]), int(b[s + 1])
            drawn = init(lo, hi)
            if tuple(drawn.shape) != (hi - lo, dim):
                raise ValueError(f"table {t!r}: the init of rows {lo}..{hi} has shape {tuple(drawn.shape)}")
            rows[torch.from_numpy(run)] = drawn.to(torch.float32)[torch.from_numpy(ids[run] - lo)]
        out[t] = rows
    return out
