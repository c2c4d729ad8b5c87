"""A local-step window's table rows (--sync-every H): each row pulled at most once per window, a
working copy the inner steps update, one push per row per window (sans-I/O, training thread).

Within a window a peer trains on its own copy of the rows it has pulled: every inner step's row
gradients update that copy with the row optimizer's rule (Adam, its state local to the peer), so
later inner steps see the rows move, as the dense parameters do. A row's optimizer state (and step
count) outlives the window when the next window pulls the row again, as the task's optimizer keeps
the dense parameters' across windows; a fresh state made each row's first step of every window a
sign step of the full learning rate (measured: 0.027 in val_loss at H=32, docs/benchmarks.md). What goes to each
row's primary at the end of the window is a **delta**: the row as pulled minus its working copy
(one push, its key the window), scaled by 1/P for a swarm of P contributors: a row's update is
the mean over the swarm of the peers' deltas, zero for a peer that did not touch it, as the dense
pseudo-gradients are averaged. A swarm with local steps runs its shards in delta mode
(RowOptConfig.deltas): a primary subtracts each push as it is, whether the peers' pushes of one
row reach it in one flush or several, and replicas replay the same subtraction. A gradient summed over the window would
have been one Adam step per window at the primary: a row would learn H times slower than the
peer's local copy did (measured: H=32 lost 0.25 in val_loss against 200 per-step rounds). Rows the
owners could not serve (zeros were used) get no push, as in per-step training.
"""
from __future__ import annotations

import numpy as np
import torch

from .shard import RowOptConfig, row_step, state_keys, state_shape


class _Rows:
    """One table's rows of this window. They are stored in the order they were pulled, in buffers
    that grow by doubling, and found by id through a sorted index (``sorted_ids``, ``order``): a
    window pulls its rows in dozens of parts (an inner step's new rows each), and keeping the
    tensors themselves sorted copied every row pulled so far, with its optimizer state, on each
    part, on the training thread (measured: 20 ms an inner step on the built-in task, H=32)."""

    def __init__(self, dim: int, keys: tuple[str, ...]):
        self.dim = dim
        self.keys = keys  # the row optimizer's state tensors (shard.state_keys; [n, dim], or [n] per row)
        self.reset()  # no rows: n, sorted_ids, order
        self._ids = np.zeros(0, np.int64)
        self._rows, self._orig = torch.zeros(0, dim), torch.zeros(0, dim)  # working copy; as pulled
        self._state = {k: torch.zeros(state_shape(k, 0, dim)) for k in keys}
        self._t = torch.zeros(0, dtype=torch.int64)  # local steps per row
        self._absent = np.zeros(0, bool)  # never served: no push
        self._stepped = np.zeros(0, bool)  # stepped this window (``t`` may count earlier windows': WindowRows.kept)

    def _grow(self, cap: int) -> None:
        """Buffers of ``cap`` rows, holding the ``n`` rows there are."""
        n = self.n

        def resized(old, new):
            new[:n] = old[:n]
            return new

        self._ids = resized(self._ids, np.zeros(cap, np.int64))
        self._rows = resized(self._rows, torch.zeros(cap, self.dim))
        self._orig = resized(self._orig, torch.zeros(cap, self.dim))
        self._state = {k: resized(v, torch.zeros(state_shape(k, cap, self.dim))) for k, v in self._state.items()}
        self._t = resized(self._t, torch.zeros(cap, dtype=torch.int64))
        self._absent = resized(self._absent, np.zeros(cap, bool))
        self._stepped = resized(self._stepped, np.zeros(cap, bool))

    def reset(self) -> None:
        """No rows, the buffers kept: the next window fills the same memory instead of growing new
        buffers from nothing, which zero-filled and copied them again at each doubling (measured,
        bench/window_rows.py: ``add`` took 120 ms a window instead of 173)."""
        self.n = 0
        self.sorted_ids = np.zeros(0, np.int64)  # the window's ids, ascending
        self.order = np.zeros(0, np.int64)  # the buffer position of each of sorted_ids

    # views of the rows there are, in buffer order (positions() gives buffer positions)
    ids = property(lambda self: self._ids[:self.n])
    rows = property(lambda self: self._rows[:self.n])
    orig = property(lambda self: self._orig[:self.n])
    t = property(lambda self: self._t[:self.n])
    absent = property(lambda self: self._absent[:self.n])
    stepped = property(lambda self: self._stepped[:self.n])
    state = property(lambda self: {k: v[:self.n] for k, v in self._state.items()})

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """The buffer positions of ``ids`` (all in the window)."""
        pos = np.searchsorted(self.sorted_ids, ids)
        if ids.size and (pos.max() >= self.sorted_ids.size or not np.array_equal(self.sorted_ids[pos], ids)):
            raise KeyError("rows asked for that this window never pulled")
        return self.order[pos]

    def append(self, new: np.ndarray, rows: torch.Tensor, state: dict[str, torch.Tensor], steps: torch.Tensor,
               absent: np.ndarray) -> None:
        """Rows not in the window yet (sorted-unique ``new``), as pulled, with their optimizer state."""
        n, k = self.n, len(new)
        if n + k > len(self._ids):
            self._grow(max(2 * len(self._ids), n + k, 256))
        self._ids[n:n + k] = new
        self._rows[n:n + k] = rows
        self._orig[n:n + k] = rows
        for key, v in state.items():
            self._state[key][n:n + k] = v
        self._t[n:n + k] = steps
        self._absent[n:n + k] = absent
        self._stepped[n:n + k] = False
        at = np.searchsorted(self.sorted_ids, new)
        self.sorted_ids = np.insert(self.sorted_ids, at, new)
        self.order = np.insert(self.order, at, np.arange(n, n + k, dtype=np.int64))
        self.n = n + k

    def in_id_order(self, mask: np.ndarray) -> np.ndarray:
        """Buffer positions in ascending id order, of the rows ``mask`` (in buffer order) picks."""
        return self.order[mask[self.order]]


class WindowRows:
    """The working copy of one window's rows, for every table."""

    def __init__(self, dims: dict[str, int], opt: RowOptConfig, ratio: float = 1.0, carry_cap: int = 1 << 18,
                 keep_state: bool = True):
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        self.dims = dict(dims)
        self.opt = opt
        self.ratio = ratio
        self.carry_cap = carry_cap  # rows per table the carried deltas may hold (the smallest go first)
        self.keep_state = keep_state
        # the row optimizer's state of the rows the last window touched, per table: (sorted ids,
        # their state tensors, their local step counts); a row pulled again starts from it
        self.kept: dict[str, tuple[np.ndarray, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.tables: dict[str, _Rows] = {}
        self.clear()
        # row deltas not pushed yet (--row-ratio < 1), per table: sorted ids and their deltas; they
        # survive clear() and join the row's next delta (error feedback on the rows)
        self.carry: dict[str, tuple[np.ndarray, torch.Tensor]] = {
            t: (np.zeros(0, np.int64), torch.zeros(0, d)) for t, d in self.dims.items()}
        self.dropped = 0  # carried rows dropped at the cap (their delta lost)

    def missing(self, want: dict[str, np.ndarray], in_flight: bool = True) -> dict[str, np.ndarray]:
        """The ids of ``want`` (sorted-unique per table) neither pulled this window nor claimed by a
        pull still in flight (``in_flight`` False: not pulled, whatever was claimed: once the
        window's pulls are over, a claim of a pull cancelled by a cut window is no row)."""
        out = {}
        for t, ids in want.items():
            for have in (self.tables[t].sorted_ids, self.inflight.get(t) if in_flight else None):
                if have is not None and have.size and ids.size:
                    ids = ids[~np.isin(ids, have, assume_unique=True)]
            out[t] = ids
        return out

    def claim(self, want: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """missing(want), now counted as in flight: a pull of several inner steps ahead
        (LocalSteps) asks for each row once, and a later step that needs a row claimed by an earlier
        step's pull waits for that pull (they complete in order) instead of pulling it again."""
        need = self.missing(want)
        for t, ids in need.items():
            if ids.size:
                cur = self.inflight.get(t)
                self.inflight[t] = ids if cur is None or not cur.size else np.union1d(cur, ids)
        return need

    def add(self, ids: dict[str, np.ndarray], rows: dict[str, torch.Tensor], absent: dict[str, np.ndarray]) -> None:
        """Rows just pulled (fp32 in ``ids`` order; ids not in the window yet); ``absent``: the ids
        the owners could not serve (their rows are zeros: used, never pushed)."""
        for t, new in ids.items():
            if not len(new):
                continue
            r = self.tables[t]
            if np.isin(new, r.sorted_ids, assume_unique=True).any():
                raise ValueError(f"table {t}: rows pulled twice in one window")
            fl = self.inflight.get(t)
            if fl is not None and fl.size:
                self.inflight[t] = fl[~np.isin(fl, new, assume_unique=True)]
            gone = np.isin(new, absent.get(t, new[:0]), assume_unique=True)
            state, steps = self._kept_state(t, new, r)
            r.append(new, rows[t].to(torch.float32), state, steps, gone)
            self.pulled += len(new)

    def _kept_state(self, table: str, new: np.ndarray, r: _Rows) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The optimizer state and step counts ``new``'s rows start this window with: the last
        window's where it touched them, zeros (a fresh optimizer) elsewhere."""
        state = {k: torch.zeros(state_shape(k, len(new), r.dim)) for k in r.keys}
        steps = torch.zeros(len(new), dtype=torch.int64)
        kept = self.kept.get(table)
        if kept is None or not kept[0].size:
            return state, steps
        ids, kstate, ksteps = kept
        pos = np.minimum(np.searchsorted(ids, new), ids.size - 1)
        hit = ids[pos] == new
        if hit.any():
            to, frm = torch.from_numpy(np.flatnonzero(hit)), torch.from_numpy(pos[hit])
            for k in r.keys:
                state[k].index_copy_(0, to, kstate[k].index_select(0, frm))
            steps.index_copy_(0, to, ksteps.index_select(0, frm))
        return state, steps

    @torch.no_grad()
    def add_progress(self, ids: dict[str, np.ndarray], progress: dict[str, torch.Tensor]) -> None:
        """Rows of this window (every id pulled) move by ``progress`` (fp32 in ``ids`` order: what an
        inner step taken on the last window's copies did to them, --early-step) and count as stepped,
        so the window's delta carries it; rows their owners could not serve stay zeros, as ever."""
        for t, want in ids.items():
            if not len(want):
                continue
            r = self.tables[t]
            pos = r.positions(want)
            served = ~r.absent[pos]
            if not served.any():
                continue
            keep = torch.from_numpy(np.flatnonzero(served))
            r.rows.index_add_(0, torch.from_numpy(pos[served]), progress[t].to(torch.float32).index_select(0, keep))
            r.stepped[pos[served]] = True

    def rows(self, want: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The working copy of ``want``'s rows (fp32, in ids order)."""
        return {t: r.rows.index_select(0, torch.from_numpy(r.positions(want[t]))) for t, r in self.tables.items()
                if t in want}

    @torch.no_grad()
    def update(self, row_grads: dict[str, tuple[np.ndarray, torch.Tensor]]) -> None:
        """An inner step's row gradients: one step of the row optimizer on the working copy (rows
        that were never served stay zeros)."""
        for t, (ids, g) in row_grads.items():
            if not len(ids):
                continue
            r = self.tables[t]
            pos = r.positions(ids)
            idx = torch.from_numpy(pos)
            step = r.t.index_select(0, idx) + 1
            r.t.index_copy_(0, idx, step)
            r.stepped[pos] = True
            row = r.rows.index_select(0, idx)
            unserved = r.absent[pos]
            before = row.clone() if unserved.any() else None
            state = {k: v.index_select(0, idx) for k, v in r.state.items()}
            row_step(self.opt, row, state, step, g.to(torch.float32))  # a primary's rule (tables/shard.py)
            if before is not None:
                row = torch.where(torch.from_numpy(unserved).unsqueeze(1), before, row)
            r.rows.index_copy_(0, idx, row)
            for k, v in state.items():
                r.state[k].index_copy_(0, idx, v)

    def pushes(self, scale: float = 1.0) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
        """The window's push: {table: (ids, deltas)}, each delta the row as pulled minus its working
        copy (the primary subtracts it), of the served rows it touched, plus what earlier windows
        carried. With ``ratio`` < 1 only that share of the rows goes, those of the largest L2 norm;
        the others are carried to the next window's push (called once per window: at its end, or
        --push-lead inner steps before it, then rebase() and, at the end, carry_tail())."""
        out = {}
        for t, r in self.tables.items():
            ids, deltas = self._deltas_and_carry(t, r, scale)
            k = ids.size if self.ratio >= 1 else max(1, int(np.ceil(self.ratio * ids.size)))
            out[t] = self._send_largest(t, ids, deltas, k)
        return out

    def _send_largest(self, t: str, ids: np.ndarray, deltas: torch.Tensor, k: int) -> tuple[np.ndarray, torch.Tensor]:
        """Of table ``t``'s row deltas (sorted ids), the ``k`` of the largest L2 norm go (returned,
        sorted); the rest become the carry, beyond ``carry_cap`` rows the smallest dropped and counted."""
        if k >= ids.size:
            self.carry[t] = (ids[:0], deltas[:0])
            return ids, deltas
        if k == 0 and ids.size <= self.carry_cap:
            self.carry[t] = (ids, deltas)
            return ids[:0], deltas[:0]
        order = torch.argsort(deltas.norm(dim=1), descending=True, stable=True)
        send = np.sort(order[:k].numpy())
        rest = np.sort(order[k:k + self.carry_cap].numpy())
        self.dropped += max(0, ids.size - k - self.carry_cap)
        self.carry[t] = (ids[rest], deltas[torch.from_numpy(rest)])
        return ids[send], deltas[torch.from_numpy(send)]

    def _deltas_and_carry(self, t: str, r: _Rows, scale: float) -> tuple[np.ndarray, torch.Tensor]:
        """Table ``t``'s deltas since the window's starting point (rows as pulled, or as of an early
        push), of the served rows stepped since, scaled, plus what earlier windows carried
        (sorted ids, one delta each)."""
        sel = r.in_id_order(r.stepped & ~r.absent)
        idx = torch.from_numpy(sel)
        ids, deltas = r.ids[sel], (r.orig.index_select(0, idx) - r.rows.index_select(0, idx)) * scale
        c_ids, c_deltas = self.carry[t]
        if not c_ids.size:
            return ids, deltas
        # both id lists are sorted-unique, so each lands by position: the carried deltas copied in,
        # the new ones added (no concatenated copy of both, no sort of it for the inverse)
        all_ids = np.union1d(ids, c_ids)
        merged = torch.zeros(len(all_ids), r.dim)
        merged.index_copy_(0, torch.from_numpy(np.searchsorted(all_ids, c_ids)), c_deltas)
        merged.index_add_(0, torch.from_numpy(np.searchsorted(all_ids, ids)), deltas)
        return all_ids, merged

    def rebase(self) -> None:
        """After an early push (--push-lead): the working copy as it is now becomes the window's
        starting point, so what the window's remaining inner steps do is a delta of its own
        (carry_tail), and no row's delta is counted twice. The rows stay as they are: the peer keeps
        training on its own progress."""
        for r in self.tables.values():
            r.orig.copy_(r.rows)
            r.stepped[:] = False

    def carry_tail(self, scale: float = 1.0) -> None:
        """The window ends after an early push: the deltas of its remaining inner steps (rows as of
        the push minus the working copy, scaled as a push is) join the carried deltas, to go with
        the rows' next push (error feedback, as the rows --row-ratio leaves out); the smallest
        beyond ``carry_cap`` rows are dropped and counted."""
        for t, r in self.tables.items():
            self._send_largest(t, *self._deltas_and_carry(t, r, scale), k=0)
        self.rebase()

    def clear(self) -> None:
        """A new window: nothing pulled yet. The row optimizer's state of the rows the ended window
        touched is kept for the next one (``keep_state``), as the task's optimizer keeps the dense
        parameters' across windows: a fresh Adam state makes every row's first step of each window
        a sign step of the full learning rate."""
        self.kept = {}
        if self.keep_state:
            for t, r in self.tables.items():
                touched = r.in_id_order((r.t > 0).numpy())  # the kept state is looked up by id
                if touched.size:
                    sel = torch.from_numpy(touched)
                    self.kept[t] = (r.ids[touched], {k: v.index_select(0, sel) for k, v in r.state.items()},
                                    r.t.index_select(0, sel))
        # the last window's buffers are reused (_Rows.reset): the kept state above is a copy
        old, self.tables = self.tables, {}
        for t, d in self.dims.items():
            r = old.get(t)
            if r is None:
                r = _Rows(d, state_keys(self.opt.kind))
            else:
                r.reset()
            self.tables[t] = r
        self.inflight: dict[str, np.ndarray] = {}  # claimed ids whose pull has not come back (sorted)
        self.pulled = 0  # rows pulled this window (each once)
