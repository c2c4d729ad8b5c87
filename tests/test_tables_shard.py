"""TableShard: held slots, the row-wise optimizer against a dense reference, replicas, hand-off."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from swarm.tables.ownership import OwnershipMap, TableSpec
from swarm.tables.shard import RowOptConfig, ShardError, TableShard

torch.set_num_threads(1)
SPEC = TableSpec("ngram", 1000, 8)


def omap(slots: int = 64) -> OwnershipMap:
    return OwnershipMap([SPEC, TableSpec("value", 500, 8)], ["a", "b", "c"], slots=slots)


def full_shard(opt: RowOptConfig | None = None, slots: int = 64) -> TableShard:
    sh = TableShard(SPEC, omap(slots), opt or RowOptConfig())
    for s in range(slots):
        sh.create_slot(s)
    return sh


class DenseRef:
    """The same row-wise optimizer on whole dense tensors, masked to the touched rows."""

    def __init__(self, rows: int, dim: int, opt: RowOptConfig):
        self.opt = opt
        self.w = torch.zeros(rows, dim)
        self.step = torch.zeros(rows, dtype=torch.int64)
        self.m, self.v, self.acc = torch.zeros(rows, dim), torch.zeros(rows, dim), torch.zeros(rows, dim)

    def apply(self, ids: np.ndarray, g_rows: torch.Tensor) -> None:
        g = torch.zeros_like(self.w)
        g[torch.from_numpy(ids)] = g_rows
        mask = torch.zeros(self.w.shape[0], dtype=torch.bool)
        mask[torch.from_numpy(ids)] = True
        o = self.opt
        step = torch.where(mask, self.step + 1, self.step)
        if o.kind == "adam":
            b1, b2 = o.betas
            m = self.m.mul(b1).add(g, alpha=1.0 - b1)
            v = self.v.mul(b2).addcmul(g, g, value=1.0 - b2)
            t = step.clamp(min=1).to(torch.float64)
            bc1 = (1.0 - torch.pow(torch.tensor(b1, dtype=torch.float64), t)).float().unsqueeze(1)
            bc2 = (1.0 - torch.pow(torch.tensor(b2, dtype=torch.float64), t)).float().unsqueeze(1)
            w = self.w.sub((m / bc1) / (torch.sqrt(v / bc2) + o.eps), alpha=o.lr)
            mk = mask.unsqueeze(1)
            self.m, self.v = torch.where(mk, m, self.m), torch.where(mk, v, self.v)
        else:
            acc = self.acc + g * g
            w = self.w - o.lr * g / (torch.sqrt(acc) + o.eps)
            mk = mask.unsqueeze(1)
            self.acc = torch.where(mk, acc, self.acc)
        self.w = torch.where(mk, w, self.w)
        self.step = step


def test_read_after_create_is_zero_and_only_held_slots_read():
    om = omap()
    sh = TableShard(SPEC, om, RowOptConfig())
    assert sh.slots() == []
    sh.create_slot(3)
    sh.create_slot(10)
    assert sh.slots() == [3, 10] and sh.has_slot(3) and not sh.has_slot(4)
    lo3, hi3 = om.slot_rows("ngram", 3)
    lo10, hi10 = om.slot_rows("ngram", 10)
    ids = np.array([hi10 - 1, lo3, lo10])
    out = sh.read(ids)
    assert out.dtype == torch.float32 and out.shape == (3, 8) and not out.any()
    assert sh.rows_held() == (hi3 - lo3) + (hi10 - lo10)
    with pytest.raises(ShardError):
        sh.read(np.array([lo3, hi3]))          # hi3 is in slot 4, not held
    with pytest.raises(ShardError):
        sh.create_slot(64)
    with pytest.raises(ShardError):
        sh.export_slot(5)
    with pytest.raises(ShardError):
        sh.drop_slot(5)


@pytest.mark.parametrize("kind", ["adam", "adagrad"])
def test_apply_grads_matches_dense_reference(kind):
    opt = RowOptConfig(kind=kind, lr=0.05)
    sh = full_shard(opt)
    ref = DenseRef(SPEC.rows, SPEC.dim, opt)
    rng = np.random.default_rng(1)
    gen = torch.Generator().manual_seed(1)
    for it in range(6):
        ids = np.unique(rng.integers(0, 200 if it % 2 else SPEC.rows, 60))
        g = torch.randn(len(ids), SPEC.dim, generator=gen)
        before = {s: sh.export_slot(s) for s in sh.slots()}
        upd = sh.apply_grads(ids, g)
        ref.apply(ids, g)
        allids = np.arange(SPEC.rows)
        assert torch.equal(sh.read(allids), ref.w)
        # the returned replica update covers exactly those rows
        assert np.array_equal(upd["ids"].numpy(), ids)
        assert torch.equal(upd["rows"], ref.w[torch.from_numpy(ids)])
        assert torch.equal(upd["step"], ref.step[torch.from_numpy(ids)])
        keys = ("m", "v") if kind == "adam" else ("acc",)
        assert set(upd) == {"ids", "rows", "step", *keys}
        for k in keys:
            assert torch.equal(upd[k], getattr(ref, k)[torch.from_numpy(ids)])
        # untouched rows and their state are bit-identical to before
        touched = set(ids.tolist())
        for s, old in before.items():
            lo, hi = omap().slot_rows(SPEC.name, s)  # the map full_shard built
            keep = torch.tensor([r not in touched for r in range(lo, hi)])
            new = sh.export_slot(s)
            for k in old:
                assert torch.equal(new[k][keep], old[k][keep])


def test_read_is_in_ids_order():
    sh = full_shard()
    ids = np.array([5, 17, 900])
    sh.apply_grads(ids, torch.tensor([[1.0] * 8, [-1.0] * 8, [2.0] * 8]))
    a = sh.read(np.array([900, 5, 17, 5]))
    assert torch.equal(a[0], sh.read(np.array([900]))[0]) and torch.equal(a[1], a[3])
    assert a[0, 0] < 0 and a[2, 0] > 0


def test_replica_update_makes_checksums_equal():
    om = omap()
    prim, rep = TableShard(SPEC, om), TableShard(SPEC, om)
    for s in (0, 1, 2, 40):
        prim.create_slot(s)
        rep.create_slot(s)
    lo0, _ = om.slot_rows("ngram", 0)
    lo40, hi40 = om.slot_rows("ngram", 40)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = np.array([lo0, lo0 + 3, lo40, hi40 - 1])
        upd = prim.apply_grads(ids, torch.randn(4, 8, generator=gen))
        rep.apply_replica_update(upd)
        rep.apply_replica_update(upd)  # idempotent
    for s in (0, 1, 2, 40):
        assert prim.checksum(s) == rep.checksum(s)
    prim.apply_grads(np.array([lo0]), torch.ones(1, 8))
    assert prim.checksum(0) != rep.checksum(0)
    # read_state is the same as what apply_grads returns
    st = prim.read_state(np.array([lo0, lo40]))
    rep.apply_replica_update(st)
    assert prim.checksum(0) == rep.checksum(0)
    with pytest.raises(ShardError):
        rep.apply_replica_update({**upd, "rows": upd["rows"][:1]})
    with pytest.raises(ShardError):
        rep.apply_replica_update({k: v for k, v in upd.items() if k != "m"})
    bad = dict(upd)
    bad["v"] = -bad["v"] - 1
    with pytest.raises(ShardError):
        rep.apply_replica_update(bad)


def test_export_import_round_trip_and_drop():
    om = omap()
    a = full_shard()
    a.apply_grads(np.arange(0, 1000, 3), torch.randn(334, 8, generator=torch.Generator().manual_seed(3)))
    b = TableShard(SPEC, om)
    for s in (5, 63, 0):
        b.import_slot(s, a.export_slot(s))
        assert b.checksum(s) == a.checksum(s)
    lo, hi = om.slot_rows("ngram", 63)
    assert torch.equal(b.read(np.arange(lo, hi)), a.read(np.arange(lo, hi)))
    # exports are copies
    t = b.export_slot(5)
    t["rows"].fill_(7)
    assert b.checksum(5) == a.checksum(5)
    b.drop_slot(5)
    assert b.slots() == [0, 63]
    with pytest.raises(ShardError):
        b.read(np.array([om.slot_rows("ngram", 5)[0]]))
    # churn: import/drop many times keeps data intact and memory bounded
    for rnd in range(5):
        for s in range(64):
            if s % 5 == rnd:
                if b.has_slot(s):
                    b.drop_slot(s)
            else:
                b.import_slot(s, a.export_slot(s))
    for s in b.slots():
        assert b.checksum(s) == a.checksum(s)
    assert b.rows_allocated() <= 2 * max(b.rows_held(), 64) + 64
    # reserve() pre-sizes exactly for a known slot set
    c = TableShard(SPEC, om)
    c.reserve(sum(om.slot_rows("ngram", s)[1] - om.slot_rows("ngram", s)[0] for s in range(10, 30)))
    cap = c.rows_allocated()
    for s in range(10, 30):
        c.import_slot(s, a.export_slot(s))
    assert c.rows_allocated() == cap == c.rows_held()
    assert all(c.checksum(s) == a.checksum(s) for s in range(10, 30))


def test_import_validation():
    om = omap()
    a = full_shard()
    b = TableShard(SPEC, om)
    good = a.export_slot(2)
    bad_cases = [
        {k: v for k, v in good.items() if k != "v"},
        {**good, "extra": good["rows"]},
        {**good, "rows": good["rows"][:-1]},
        {**good, "rows": good["rows"].double()},
        {**good, "step": good["step"].int()},
        {**good, "m": torch.full_like(good["m"], float("nan"))},
        {**good, "v": torch.full_like(good["v"], -1.0)},
        {**good, "step": good["step"] - 1},
    ]
    for t in bad_cases:
        with pytest.raises(ShardError):
            b.import_slot(2, t)
        assert not b.has_slot(2)
    with pytest.raises(ShardError):
        b.import_slot(3, {**good, "rows": torch.zeros(1, 8)})
    with pytest.raises(ShardError):
        b.import_slot(99, good)
    # adagrad shard wants "acc", not m/v
    c = TableShard(SPEC, om, RowOptConfig(kind="adagrad"))
    with pytest.raises(ShardError):
        c.import_slot(2, good)


def test_apply_grads_errors_change_nothing():
    sh = TableShard(SPEC, omap())
    sh.create_slot(0)
    sh.create_slot(1)
    ids = np.array([0, 1, 2])
    before = sh.checksum(0)
    cases = [
        (ids, torch.tensor([[float("inf")] * 8] * 3)),
        (ids, torch.tensor([[float("nan")] * 8] * 3)),
        (ids, torch.ones(2, 8)),
        (ids, torch.ones(3, 7)),
        (ids, torch.ones(3, 8, dtype=torch.float64)),
        (np.array([2, 1, 0]), torch.ones(3, 8)),
        (np.array([1, 1, 2]), torch.ones(3, 8)),
        (np.array([0, 1, 999]), torch.ones(3, 8)),         # row 999: slot not held
        (np.array([0.0, 1.0, 2.0]), torch.ones(3, 8)),
        (ids, torch.full((3, 8), 3e38)),                   # g*g overflows: result not finite
    ]
    for i, g in cases:
        with pytest.raises(ShardError):
            sh.apply_grads(i, g)
        assert sh.checksum(0) == before
    out = sh.apply_grads(np.zeros(0, dtype=np.int64), torch.zeros(0, 8))
    assert out["ids"].numel() == 0 and sh.checksum(0) == before


def test_layout_as_slot_count_or_callable():
    a = TableShard(SPEC, 64)
    b = TableShard(SPEC, lambda s: omap().slot_rows("ngram", s))
    for sh in (a, b):
        sh.create_slot(7)
        assert sh.export_slot(7)["rows"].shape == (omap().slot_rows("ngram", 7)[1] - omap().slot_rows("ngram", 7)[0], 8)
        with pytest.raises(ShardError):
            sh.create_slot(64)
    with pytest.raises(ValueError):
        RowOptConfig(kind="sgd")


def test_held_mask_follows_the_held_slots():
    sh = TableShard(SPEC, omap(64), RowOptConfig())
    assert not sh.held_mask(64).any()
    sh.create_slots([3, 5, 60])
    m = sh.held_mask(64)
    assert m.shape == (64,) and np.flatnonzero(m).tolist() == [3, 5, 60]
    with pytest.raises(ValueError):
        m[0] = True  # a cached view: callers cannot corrupt it
    sh.drop_slot(5)
    assert np.flatnonzero(sh.held_mask(64)).tolist() == [3, 60]


def test_checked_grads_apply_once_checked_and_go_stale_when_slots_change():
    a, b = full_shard(), full_shard()
    ids = np.array([1, 2, 40, 700])
    g = torch.randn(4, 8)
    checked = a.check_grads(ids, g)
    a.apply_checked(checked)
    b.apply_grads(ids, g)  # the one-call form: the same update
    assert torch.equal(a.read(ids), b.read(ids)) and torch.equal(a.steps(ids), b.steps(ids))
    # a slot change between the check and the apply: pool positions may have moved
    stale = a.check_grads(ids, g)
    a.drop_slot(63)
    a.read(ids)  # re-indexes the pool
    before = a.read(ids).clone()
    with pytest.raises(ShardError, match="stale"):
        a.apply_checked(stale)
    assert torch.equal(a.read(ids), before)
    with pytest.raises(ShardError, match="stale"):
        b.apply_checked(a.check_grads(ids, g))  # checked by another shard


def _rss_anon_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_slots_never_written_take_no_memory():
    spec = TableSpec("big", 65536, 128)   # 96 MiB of rows and Adam state
    sh = TableShard(spec, 4096, RowOptConfig())
    before = _rss_anon_mb()
    sh.create_slots(range(4096))
    assert sh.rows_held() == 65536 and sh.rows_allocated() == 65536
    assert not sh.read(np.arange(0, 65536, 7)).any()
    created = _rss_anon_mb() - before
    assert created < 24, created       # zero rows are not written: the pool is still unmapped
    ids = np.arange(0, 65536, 2)
    sh.apply_grads(ids, torch.full((len(ids), 128), 0.5))
    written = _rss_anon_mb() - before
    assert written > 60, written       # every other row written: every page of the pool is mapped
    assert torch.equal(sh.read(np.array([1, 2])), torch.cat([torch.zeros(1, 128), sh.read(np.array([2]))]))
    # a few rows written far apart map a few pages, not the pool (no transparent huge pages: one
    # written row would map 2 MiB)
    sparse = TableShard(spec, 4096, RowOptConfig())
    sparse.create_slots(range(4096))
    before = _rss_anon_mb()
    ids = np.arange(0, 65536, 1400)   # a row's values and Adam state are 1.5 KiB: ~2 MiB apart
    sparse.apply_grads(ids, torch.ones(len(ids), 128))
    assert _rss_anon_mb() - before < 12, _rss_anon_mb() - before


def test_a_slot_created_where_rows_were_written_reads_zeros():
    om = omap()
    sh = TableShard(SPEC, om, RowOptConfig())
    sh.create_slots([0, 1])
    lo0, hi0 = om.slot_rows("ngram", 0)
    sh.apply_grads(np.arange(lo0, hi0), torch.ones(hi0 - lo0, 8))
    sh.drop_slot(0)
    sh.drop_slot(1)      # nothing held: the pool is reused from its start
    sh.create_slot(1)
    lo1, hi1 = om.slot_rows("ngram", 1)
    assert not sh.read(np.arange(lo1, hi1)).any() and not sh.steps(np.arange(lo1, hi1)).any()
    assert sh.untouched(1)
    sh.create_slot(0)    # overwrite: a held slot is reset to zeros
    sh.apply_grads(np.array([lo0]), torch.ones(1, 8))
    sh.create_slot(0)
    assert not sh.read(np.arange(lo0, hi0)).any() and sh.untouched(0)
    # growing and compacting the pool keep written rows and zero rows alike
    for s in range(2, 64):
        sh.create_slot(s)
    sh.apply_grads(np.array([lo0, 999]), torch.ones(2, 8))
    keep = sh.read(np.arange(1000)).clone()
    for s in range(2, 60):
        sh.drop_slot(s)
    assert torch.equal(sh.read(np.arange(lo0, hi1)), keep[lo0:hi1])
    assert torch.equal(sh.read(np.arange(960, 1000)), keep[960:1000])
