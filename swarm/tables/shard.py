"""The slots of one table that this peer holds, and the row-wise sparse optimizer (sans-I/O).

Storage: one pool per tensor kind (rows, optimizer state, per-row step counter) holding the held slots
back to back; slot s lives at pool[base[s] : base[s] + (hi - lo)]. A global row id maps to its pool
index with one np.searchsorted over the held slots' first rows, so reads and updates are vectorised
with no loop over rows or slots. Dropped slots leave holes that are reclaimed by compaction before
the pool grows. Only held slots take memory (at most about twice their size), and of those only the
rows ever written: a pool is allocated as zeros the kernel maps page by page on first write (an
anonymous mapping, ``_fresh``), and a slot created with zero rows (the built-in task's tables, any
``std=0`` ShardedEmbedding) is not written until a row of it is, so the slots a peer holds before
training (the first peer holds every slot until others join) or never trains cost no memory.

Optimizer (per touched row r, step counter t_r incremented first; all fp32 except the bias
corrections, computed in float64 and rounded to fp32):
    adam:    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g*g
             bc1 = 1 - b1**t_r ;  bc2 = 1 - b2**t_r
             row = row - lr * (m / bc1) / (sqrt(v / bc2) + eps)
    adagrad: acc = acc + g*g ;  row = row - lr * g / (sqrt(acc) + eps)
Untouched rows (and their state) are never written: "lazy" Adam.

Row-wise state (--row-state rowwise; TorchRec's PARTIAL_ROWWISE_ADAM and ROWWISE_ADAGRAD): the
second moment is one value per row, the mean over the row of g*g, instead of one per value, so the
optimizer state of a [n, dim] shard is [n, dim] + [n] (row-wise Adam, which keeps m per value) or
[n] (row-wise Adagrad) instead of 2 x or 1 x [n, dim]:
    rowwise-adam:    m as adam ;  v_row = b2*v_row + (1-b2)*mean(g*g)
                     row = row - lr * (m / bc1) / (sqrt(v_row / bc2) + eps)
    rowwise-adagrad: acc_row = acc_row + mean(g*g) ;  row = row - lr * g / (sqrt(acc_row) + eps)
Per-row state keys end in "_row" (``per_row``) and have shape [n]; they live in a [cap, R] pool of
their own beside the [cap, 1 + S, dim] pool of rows and per-value state.
"""
from __future__ import annotations

import hashlib
import math
import mmap
from dataclasses import dataclass
from typing import Callable, Union

import numpy as np
import torch

from .ownership import OwnershipMap, TableSpec, slot_bounds

__all__ = ["RowOptConfig", "TableShard", "ShardError", "state_keys", "per_row", "state_shape", "row_kind",
           "KINDS", "ROW_STATES"]

KINDS = ("adam", "adagrad", "rowwise-adam", "rowwise-adagrad")
ROW_STATES = ("full", "rowwise")  # --row-state: the second moment per value, or one per row


class ShardError(ValueError):
    """A request the shard cannot apply (slot not held, bad shapes/dtypes, non-finite values)."""


@dataclass
class RowOptConfig:
    kind: str = "adam"
    lr: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    # local steps (tables/window.py): every push carries a window's row delta (pulled minus the
    # working copy), applied as it is (rows -= delta, the update counter +1, the optimizer state
    # untouched) instead of an optimizer step on a gradient; the whole swarm agrees (--sync-every)
    deltas: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        if not (self.lr > 0 and np.isfinite(self.lr) and self.eps > 0 and np.isfinite(self.eps)):
            raise ValueError("lr and eps must be finite and > 0")
        self.betas = (float(b1), float(b2))


def state_keys(kind: str) -> tuple[str, ...]:
    """The fp32 optimizer-state tensors of `kind` (besides "rows" and the int64 [n] "step"): [n, dim]
    each, or [n] for a per-row one (``per_row``)."""
    return {"adam": ("m", "v"), "adagrad": ("acc",), "rowwise-adam": ("m", "v_row"),
            "rowwise-adagrad": ("acc_row",)}[kind]


def per_row(key: str) -> bool:
    """Whether optimizer-state tensor `key` holds one value per row ([n]) rather than per value."""
    return key.endswith("_row")


def state_shape(key: str, n: int, dim: int) -> tuple[int, ...]:
    """The shape of state tensor `key` for n rows of width dim."""
    return (n,) if per_row(key) else (n, dim)


def row_kind(kind: str, row_state: str) -> str:
    """The optimizer kind for --row-state: `kind` ("adam" / "adagrad") itself for "full", its
    row-wise variant for "rowwise"."""
    if row_state not in ROW_STATES or kind not in ("adam", "adagrad"):
        raise ValueError(f"row_state must be one of {ROW_STATES} and kind adam or adagrad, got {row_state!r}, {kind!r}")
    return f"rowwise-{kind}" if row_state == "rowwise" else kind


Layout = Union[OwnershipMap, int, Callable[[int], tuple[int, int]]]
RowInit = Callable[[int, int], torch.Tensor]  # (lo, hi) -> the initial fp32 rows [hi - lo, dim]


class TableShard:
    """The slots of ONE table that this peer holds (as primary or replica): rows + per-row optimizer state."""

    def __init__(self, spec: TableSpec, layout: Layout, opt: RowOptConfig | None = None,
                 init: RowInit | None = None):
        self.spec = spec
        # the rows a fresh slot starts from (the task's init, the same on every peer); None = zeros
        self.init = init
        self.opt = opt if opt is not None else RowOptConfig()
        self.dim = spec.dim
        if isinstance(layout, OwnershipMap):
            if layout.spec(spec.name) != spec:
                raise ValueError(f"ownership map has a different spec for table {spec.name!r}")
            self._slot_rows = lambda s, _m=layout: _m.slot_rows(spec.name, s)
        elif isinstance(layout, (int, np.integer)) and not isinstance(layout, bool):
            n = min(int(layout), spec.rows)
            if n < 1:
                raise ValueError("n_slots must be >= 1")
            b = slot_bounds(spec.rows, n)  # the ownership map's layout

            def _rows(s, n=n, b=b):
                if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= int(s) < n:
                    raise ValueError(f"slot must be an int in [0, {n}), got {s!r}")
                return int(b[s]), int(b[int(s) + 1])
            self._slot_rows = _rows
        elif callable(layout):
            self._slot_rows = layout
        else:
            raise ValueError("layout must be an OwnershipMap, a slot count or a slot -> (lo, hi) callable")
        self.state_keys = state_keys(self.opt.kind)
        self._value_keys = tuple(k for k in self.state_keys if not per_row(k))
        self._row_keys = tuple(k for k in self.state_keys if per_row(k))
        self._held: dict[int, tuple[int, int, int]] = {}   # slot -> (lo, hi, pool base)
        self._n_held = 0  # rows of the held slots
        self._cap = 0
        self._used = 0
        self._clean_from = 0  # pool positions from here on were never written: they read as zeros
        # one pool per shard: a row's values and its per-value optimizer state side by side,
        # [cap, 1 + S, dim] (rows, then the per-value state_keys), so an optimizer step gathers and
        # scatters each row once, from one contiguous block, instead of once per tensor (~1.4x
        # faster Adam steps); per-row state (row-wise kinds) in _rpool [cap, R]; _rows and
        # _state[k] are views of them
        self._pool = _fresh((0, 1 + len(self._value_keys), self.dim), torch.float32)
        self._rpool = _fresh((0, len(self._row_keys)), torch.float32)
        self._step = _fresh((0,), torch.int64)
        self._views()
        self._layout = 0  # bumped by every re-index: pool positions taken before it are stale
        self._index()

    def _views(self) -> None:
        self._rows = self._pool[:, 0]
        self._state = {k: self._pool[:, 1 + i] for i, k in enumerate(self._value_keys)}
        self._state.update({k: self._rpool[:, j] for j, k in enumerate(self._row_keys)})

    # --- slots ------------------------------------------------------------------------------

    def slots(self) -> list[int]:
        return sorted(self._held)

    def has_slot(self, slot) -> bool:
        return isinstance(slot, (int, np.integer)) and not isinstance(slot, bool) and int(slot) in self._held

    def rows_held(self) -> int:
        return self._n_held  # kept as slots come and go: releasing thousands of slots must not be O(n^2)

    def rows_allocated(self) -> int:
        """Rows the pool has room for: the held rows, holes dropped slots left, and room to grow.
        The shard's memory is this many rows of values and optimizer state (see the module
        docstring: at most about twice ``rows_held()``, and exactly it after a ``reserve``)."""
        return self._cap

    def nbytes(self) -> int:
        """Bytes the shard's pools take at their capacity (rows_allocated): rows, optimizer state
        and update counters. Row-wise state makes this (2 dim + 1) x 4 + 8 bytes per row for Adam
        instead of 3 dim x 4 + 8."""
        return sum(t.numel() * t.element_size() for t in (self._pool, self._rpool, self._step))

    def _range(self, slot) -> tuple[int, int]:
        try:
            lo, hi = self._slot_rows(slot)
        except Exception as e:
            raise ShardError(f"table {self.spec.name!r}: bad slot {slot!r}: {e}") from None
        if not 0 <= lo < hi <= self.spec.rows:
            raise ShardError(f"table {self.spec.name!r}: slot {slot!r} has a bad row range [{lo}, {hi})")
        return int(lo), int(hi)

    def _held_or_raise(self, slot) -> tuple[int, int, int]:
        if not self.has_slot(slot):
            raise ShardError(f"table {self.spec.name!r}: slot {slot!r} is not held here")
        return self._held[int(slot)]

    def reserve(self, rows: int) -> None:
        """Pre-size the pool for `rows` held rows (e.g. the sum over the slots a new map gives us),
        so a burst of create/import does not over-allocate by doubling."""
        if rows > self._cap:
            if self.rows_held() < self._used:
                self._compact()
            if rows > self._cap:
                self._grow(int(rows))

    def _alloc(self, n: int) -> int:
        if self._used + n > self._cap:
            live = self.rows_held()
            if live < self._used:
                self._compact()
            if self._used + n > self._cap:
                self._grow(max(self._used + n, 2 * self._cap, 64))
        base = self._used
        self._used += n
        return base

    def _grow(self, cap: int) -> None:
        self._move(cap, {s: v[2] for s, v in self._held.items()})  # every slot where it was
        self._cap = cap
        self._clean_from = self._used

    def _compact(self) -> None:
        bases, base = {}, 0
        for s in sorted(self._held):
            lo, hi, _ = self._held[s]
            bases[s] = base
            base += hi - lo
        self._move(max(base, 64), bases)
        self._cap, self._used, self._clean_from = max(base, 64), base, base
        self._dirty = True

    def _move(self, cap: int, bases: dict[int, int]) -> None:
        """New pools of ``cap`` rows (never-written zeros), each held slot's rows copied to its
        position in ``bases``; rows that are all zero (rows, state and step) are not copied, so
        that rows never written stay unmapped."""
        pool = _fresh((cap, *self._pool.shape[1:]), torch.float32)
        rpool = _fresh((cap, *self._rpool.shape[1:]), torch.float32)
        step = _fresh((cap,), torch.int64)
        if self._held:
            src = np.concatenate([np.arange(v[2], v[2] + v[1] - v[0]) for v in self._held.values()])
            dst = np.concatenate([np.arange(bases[s], bases[s] + v[1] - v[0]) for s, v in self._held.items()])
            s_t = torch.from_numpy(src)
            live = (self._pool.index_select(0, s_t).flatten(1).ne(0).any(1) | self._step.index_select(0, s_t).ne(0)
                    | self._rpool.index_select(0, s_t).ne(0).any(1)).numpy()
            s_t, d_t = torch.from_numpy(src[live]), torch.from_numpy(dst[live])
            pool.index_copy_(0, d_t, self._pool.index_select(0, s_t))
            rpool.index_copy_(0, d_t, self._rpool.index_select(0, s_t))
            step.index_copy_(0, d_t, self._step.index_select(0, s_t))
        for s, b in bases.items():
            lo, hi, _ = self._held[s]
            self._held[s] = (lo, hi, b)
        self._pool, self._rpool, self._step = pool, rpool, step
        self._views()

    def _index(self) -> None:
        self._dirty = False
        self._layout += 1
        order = sorted(self._held.items(), key=lambda kv: kv[1][0])
        self._h_slot = np.array([s for s, _ in order], dtype=np.int64)
        self._h_lo = np.array([v[0] for _, v in order], dtype=np.int64)
        self._h_hi = np.array([v[1] for _, v in order], dtype=np.int64)
        self._h_base = np.array([v[2] for _, v in order], dtype=np.int64)
        self._h_mask: np.ndarray | None = None  # held_mask's, built on first use

    def _place(self, slot: int, rows: torch.Tensor, state: dict[str, torch.Tensor] | None,
               step: torch.Tensor | None) -> None:
        """Hold ``slot`` with these tensors (``state`` and ``step`` None: zeros). Zero rows with zero
        state are not written where the pool was never written: it reads as zeros already."""
        lo, hi = self._range(slot)
        n = hi - lo
        if int(slot) in self._held:
            base = self._held[int(slot)][2]
        else:
            base = self._alloc(n)
            self._n_held += n
        if state is not None or step is not None or base < self._clean_from or bool(rows.any()):
            self._rows[base:base + n] = rows
            for k in self.state_keys:
                self._state[k][base:base + n] = 0.0 if state is None else state[k]
            self._step[base:base + n] = 0 if step is None else step
        self._clean_from = max(self._clean_from, base + n)
        self._held[int(slot)] = (lo, hi, base)
        self._dirty = True

    def create_slots(self, slots) -> None:
        """create_slot for many slots at once, with one allocation."""
        slots = [int(s) for s in slots if not self.has_slot(s)]
        self.reserve(self.rows_held() + sum(hi - lo for lo, hi in map(self._range, slots)))
        for s in slots:
            self.create_slot(s)

    def create_slot(self, slot: int) -> None:
        """Hold `slot` with its initial rows (``init``, else zeros) and zero optimizer state
        (overwrites it if already held)."""
        lo, hi = self._range(slot)
        n = hi - lo
        rows = torch.zeros(n, self.dim) if self.init is None else self.init(lo, hi)
        if tuple(rows.shape) != (n, self.dim) or rows.dtype != torch.float32 or not all_finite(rows):
            raise ShardError(f"table {self.spec.name!r}: the initial rows of slot {slot} are not finite fp32 "
                             f"[{n}, {self.dim}]")
        self._place(slot, rows, None, None)

    def export_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies: "rows" fp32 [n, dim], state fp32 (state_keys: [n, dim], or [n] per row), "step" int64 [n]."""
        lo, hi, base = self._held_or_raise(slot)
        n = hi - lo
        out = {"rows": self._rows[base:base + n].clone()}
        for k in self.state_keys:
            out[k] = self._state[k][base:base + n].clone()
        out["step"] = self._step[base:base + n].clone()
        return out

    def import_slot(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Hold `slot` with these rows and state (validated first; nothing changes on ShardError)."""
        lo, hi = self._range(slot)
        n = hi - lo
        want = {"rows", "step", *self.state_keys}
        if not isinstance(tensors, dict) or set(tensors) != want:
            got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
            raise ShardError(f"slot tensors must be exactly {sorted(want)}, got {got}")
        self._check_values(tensors, n, f"slot {slot}")
        self._place(slot, tensors["rows"], {k: tensors[k] for k in self.state_keys}, tensors["step"])

    def drop_slot(self, slot: int) -> None:
        lo, hi, _ = self._held_or_raise(slot)
        del self._held[int(slot)]
        self._n_held -= hi - lo
        if not self._held:
            self._used = 0
        self._dirty = True
        if self._cap > 256 and self.rows_held() < self._cap // 4:
            self._compact()  # give memory back once most of the pool is holes

    def digest(self, slot) -> tuple[int, str]:
        """(update count, checksum) of a held slot: the sum of its rows' step counters, which only
        grows, and checksum(slot). A replica audit compares these with the primary's."""
        lo, hi, base = self._held_or_raise(slot)
        return int(self._step[base:base + hi - lo].sum()), self.checksum(slot)

    def checksum(self, slot) -> str:
        """sha256 (32 hex chars) of the slot's range, rows, state and step counters (hashed where
        they lie, each row beside its state: no copy)."""
        lo, hi, base = self._held_or_raise(slot)
        h = hashlib.sha256(f"{self.spec.name}:{lo}:{hi}:{self.opt.kind}".encode())
        h.update(self._pool[base:base + hi - lo].numpy().data)
        if self._row_keys:
            h.update(self._rpool[base:base + hi - lo].numpy().data)
        h.update(self._step[base:base + hi - lo].numpy().data)
        return h.hexdigest()[:32]

    # --- validation -------------------------------------------------------------------------

    def _check_values(self, t: dict[str, torch.Tensor], n: int, what: str) -> None:
        for k in ("rows", *self.state_keys):
            v, shape = t[k], state_shape(k, n, self.dim)
            if not isinstance(v, torch.Tensor) or v.dtype != torch.float32 or tuple(v.shape) != shape:
                raise ShardError(f"{what}: {k!r} must be float32 {list(shape)}, got {_desc(v)}")
            if not bool(torch.isfinite(v).all()):
                raise ShardError(f"{what}: {k!r} has non-finite values")
        for k in self.state_keys:
            if k != "m" and bool((t[k] < 0).any()):
                raise ShardError(f"{what}: {k!r} has negative values")
        s = t["step"]
        if not isinstance(s, torch.Tensor) or s.dtype != torch.int64 or tuple(s.shape) != (n,):
            raise ShardError(f"{what}: 'step' must be int64 [{n}], got {_desc(s)}")
        if n and int(s.min()) < 0:
            raise ShardError(f"{what}: 'step' has negative values")

    def _pool_index(self, ids) -> torch.Tensor:
        """Pool positions of global row ids (any order); ShardError if one's slot is not held."""
        ids = _int64_ids(ids, "ids")
        if not ids.size:
            return torch.zeros(0, dtype=torch.int64)
        if self._dirty:
            self._index()
        pos = np.searchsorted(self._h_lo, ids, side="right") - 1
        posc = np.maximum(pos, 0)
        ok = (pos >= 0) & (ids < self._h_hi[posc]) if self._h_lo.size else np.zeros(ids.shape, bool)
        if not bool(ok.all()):
            bad = ids[~ok][:8].tolist()
            raise ShardError(f"table {self.spec.name!r}: rows {bad} are not in a slot held here")
        return torch.from_numpy(self._h_base[posc] + ids - self._h_lo[posc])

    @staticmethod
    def _sorted_unique(ids, what: str) -> np.ndarray:
        ids = _int64_ids(ids, what)
        if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise ShardError(f"{what}: ids must be sorted and unique")
        return ids

    # --- rows -------------------------------------------------------------------------------

    def read(self, ids: np.ndarray) -> torch.Tensor:
        """fp32 [len(ids), dim] copies of the rows, in ids order."""
        return self._rows.index_select(0, self._pool_index(ids))

    def held_slots(self) -> np.ndarray:
        """int64 array of the held slot numbers (cached with the slot index)."""
        if self._dirty:
            self._index()
        return self._h_slot

    def held_mask(self, n_slots: int) -> np.ndarray:
        """bool [n_slots]: whether each slot is held (cached with the slot index), so that checking
        a request's ids is one gather, not a sort and a set lookup."""
        if self._dirty:
            self._index()
        m = self._h_mask
        if m is None or m.size != n_slots:
            m = np.zeros(n_slots, dtype=bool)
            m[self._h_slot[self._h_slot < n_slots]] = True
            m.flags.writeable = False
            self._h_mask = m
        return m

    def untouched(self, slot: int) -> bool:
        """True while no optimizer step has touched the slot and its rows are still all zero
        (a slot as create_slot made it: a hand-off can say so instead of shipping it)."""
        lo, hi, base = self._held_or_raise(slot)
        n = hi - lo
        return bool((self._step[base:base + n] == 0).all()) and not bool(self._rows[base:base + n].any())

    def steps(self, ids: np.ndarray) -> torch.Tensor:
        """int64 update counters of these rows (how many optimizer steps each has had)."""
        return self._step.index_select(0, self._pool_index(ids))

    def read_state(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        """{"ids", "rows", state..., "step"} of these (sorted-unique) rows: a replica update."""
        ids = self._sorted_unique(ids, "read_state")
        idx = self._pool_index(ids)
        out = {"ids": torch.from_numpy(ids.copy()), "rows": self._rows.index_select(0, idx)}
        for k in self.state_keys:
            out[k] = self._state[k].index_select(0, idx)
        out["step"] = self._step.index_select(0, idx)
        return out

    def check_grads(self, ids: np.ndarray, grads: torch.Tensor) -> "CheckedGrads":
        """Raise ShardError unless apply_grads(ids, grads) is well formed: sorted-unique held ids,
        finite float32 [len(ids), dim] gradients. Returns them checked, for apply_checked (a caller
        that checks several tables before applying any does not pay for the checks twice)."""
        ids = self._sorted_unique(ids, "apply_grads")
        k = ids.size
        if not isinstance(grads, torch.Tensor) or grads.dtype != torch.float32 or tuple(grads.shape) != (k, self.dim):
            raise ShardError(f"grads must be float32 [{k}, {self.dim}], got {_desc(grads)}")
        if not all_finite(grads):
            raise ShardError("grads have non-finite values")
        idx = self._pool_index(ids)
        return CheckedGrads(self, self._layout, ids, idx, grads)

    def apply_grads(self, ids: np.ndarray, grads: torch.Tensor) -> dict[str, torch.Tensor]:
        """One optimizer step on exactly these rows; returns the replica update
        {"ids" int64 [k], "rows" fp32 [k, dim], state fp32 [k, dim] or [k]..., "step" int64 [k]}.
        Transactional: on ShardError (bad ids/shapes, non-finite grads or results) nothing changes."""
        return self.apply_checked(self.check_grads(ids, grads))

    def apply_checked(self, checked: "CheckedGrads") -> dict[str, torch.Tensor]:
        """apply_grads on what check_grads returned (by this shard, with no slot change since)."""
        if checked.shard is not self or checked.layout != self._layout or self._dirty:
            raise ShardError("checked gradients are stale (the held slots changed): check them again")
        ids, idx, g = checked.ids, checked.idx, checked.grads
        x = self._pool.index_select(0, idx)  # [k, 1 + S, dim]: each row with its state, one gather
        r = self._rpool.index_select(0, idx)  # [k, R]: per-row state (row-wise kinds)
        row = x[:, 0]
        step = self._step.index_select(0, idx) + 1
        # in place on the gathered copies
        new_state = {k: x[:, 1 + i] for i, k in enumerate(self._value_keys)}
        new_state.update({k: r[:, j] for j, k in enumerate(self._row_keys)})
        new_state = {k: new_state[k] for k in self.state_keys}
        if self.opt.deltas:
            row.sub_(g)
        else:
            row_step(self.opt, row, new_state, step, g)
        if not (all_finite(x) and all_finite(r)):  # name the culprit (the rare path)
            bad = next(name for name, tns in (("rows", row), *new_state.items()) if not all_finite(tns))
            raise ShardError(f"the update makes {bad!r} non-finite (gradient too large)")
        self._pool.index_copy_(0, idx, x)
        if self._row_keys:
            self._rpool.index_copy_(0, idx, r)
        self._step.index_copy_(0, idx, step)
        return {"ids": torch.from_numpy(ids.copy()), "rows": row, **new_state, "step": step}

    def apply_replica_update(self, update: dict[str, torch.Tensor]) -> None:
        """Overwrite rows, state and step counters of update["ids"] (validated; idempotent)."""
        want = {"ids", "rows", "step", *self.state_keys}
        if not isinstance(update, dict) or set(update) != want:
            got = sorted(update) if isinstance(update, dict) else type(update).__name__
            raise ShardError(f"replica update must be exactly {sorted(want)}, got {got}")
        i = update["ids"]
        if not isinstance(i, torch.Tensor) or i.dtype not in (torch.int64, torch.int32) or i.dim() != 1:
            raise ShardError(f"replica update 'ids' must be int64/int32 1-D, got {_desc(i)}")
        ids = self._sorted_unique(i.to(torch.int64), "replica update")
        self._check_values(update, ids.size, "replica update")
        idx = self._pool_index(ids)
        self._rows.index_copy_(0, idx, update["rows"])
        for k in self.state_keys:
            self._state[k].index_copy_(0, idx, update[k])
        self._step.index_copy_(0, idx, update["step"])


def row_step(o: RowOptConfig, row: torch.Tensor, state: dict[str, torch.Tensor], step: torch.Tensor,
             g: torch.Tensor) -> None:
    """One step of the row optimizer, in place on ``row`` [k, dim] and its ``state`` tensors
    (state_keys(o.kind): [k, dim], or [k] per row), ``step`` the rows' update counts after it
    (int64 [k], for Adam's bias correction). A primary's shard and a local-step window's working
    copy (tables/window.py) step rows by this one rule."""
    if o.kind in ("adam", "rowwise-adam"):
        b1, b2 = o.betas
        m = state["m"]
        m.mul_(b1).add_(g, alpha=1.0 - b1)
        t = step.to(torch.float64)
        bc1 = (1.0 - torch.pow(torch.tensor(b1, dtype=torch.float64), t)).to(torch.float32).unsqueeze(1)
        bc2 = (1.0 - torch.pow(torch.tensor(b2, dtype=torch.float64), t)).to(torch.float32).unsqueeze(1)
        if o.kind == "adam":
            v = state["v"]
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            denom = (v / bc2).sqrt_().add_(o.eps)
        else:
            v = state["v_row"]
            v.mul_(b2).add_((g * g).mean(1), alpha=1.0 - b2)
            denom = (v / bc2[:, 0]).sqrt_().add_(o.eps).unsqueeze(1)
        row.sub_((m / bc1).div_(denom), alpha=o.lr)
    elif o.kind == "adagrad":
        acc = state["acc"]
        acc.add_(g * g)
        row.sub_(o.lr * g / (torch.sqrt(acc) + o.eps))
    else:
        acc = state["acc_row"]
        acc.add_((g * g).mean(1))
        row.sub_(o.lr * g / (torch.sqrt(acc) + o.eps).unsqueeze(1))


@dataclass(frozen=True)
class CheckedGrads:
    """Gradients TableShard.check_grads accepted, with the pool positions of their rows."""
    shard: TableShard
    layout: int  # the shard's slot layout they were checked under
    ids: np.ndarray
    idx: torch.Tensor
    grads: torch.Tensor


def _fresh(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros that take no memory until written: an anonymous mapping of their own, faulted in one
    4 KiB page at a time as rows are written. Not torch.zeros (it writes every byte), nor np.zeros
    (numpy asks for transparent huge pages on large blocks: one written row maps 2 MiB, and a pool
    whose held rows are spread among holes is soon all resident; measured: 96 MiB resident after
    one write per 2 MiB, against 0.2 MiB here)."""
    np_dtype = np.float32 if dtype == torch.float32 else np.int64
    n = math.prod(shape) * np.dtype(np_dtype).itemsize
    if n == 0:
        return torch.from_numpy(np.zeros(shape, dtype=np_dtype))
    # private (the default is a shared mapping, counted as shmem); the array keeps it alive, and
    # it is unmapped with the last view
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)  # where THP is "always"
    return torch.from_numpy(np.frombuffer(buf, dtype=np_dtype).reshape(shape))


def _int64_ids(ids, what: str) -> np.ndarray:
    """A 1-D integer array or tensor as int64 numpy; ShardError for anything else."""
    if isinstance(ids, torch.Tensor):
        ids = ids.numpy()
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ShardError(f"{what}: ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64, copy=False)


def _desc(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype} {tuple(v.shape)}"
    return type(v).__name__


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value is finite. A sum is NaN or Inf when any value is, and costs a tenth of
    the elementwise test (measured: 0.05 against 0.6 ms for [2300, 128]); only a sum that overflowed
    on finite values needs the exact test."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())
