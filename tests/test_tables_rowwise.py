"""Row-wise optimizer state of the tables (--row-state rowwise): one second-moment value per row.

The rule against numbers worked out by hand and against a dense reference over several steps; the
state through replica updates, replays and hand-off (wire formats included); its size, O(rows)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from swarm import settings
from swarm.config import ROW_STATES, ConfigError, PeerConfig
from swarm.tables import TableSpec
from swarm.tables.formats import PushRequest, WireError, decode_replica, decode_slot, encode_replica, encode_slot
from swarm.tables.ownership import OwnershipMap
from swarm.tables.service import TableService
from swarm.tables.shard import ROW_STATES as SHARD_ROW_STATES
from swarm.tables.shard import RowOptConfig, ShardError, TableShard, row_kind, row_step, state_keys
from swarm.tables.window import WindowRows

torch.set_num_threads(1)
SPEC = TableSpec("ngram", 1000, 8)
OM = OwnershipMap([SPEC], ["a", "b", "c"], slots=64)
KINDS = ["rowwise-adam", "rowwise-adagrad"]


def full_shard(kind: str, lr: float = 0.05) -> TableShard:
    sh = TableShard(SPEC, OM, RowOptConfig(kind=kind, lr=lr))
    sh.create_slots(range(64))
    return sh


def test_the_rowwise_rules_by_hand():
    g = torch.tensor([[3.0, 4.0]])  # mean(g*g) = (9 + 16) / 2 = 12.5
    lr, eps, b1, b2 = 0.1, 1e-8, 0.9, 0.999
    # row-wise Adam, step 1: m = 0.1 g, v_row = 0.001 * 12.5; bias-corrected m = g, v = 12.5
    row, st = torch.zeros(1, 2), {"m": torch.zeros(1, 2), "v_row": torch.zeros(1)}
    row_step(RowOptConfig("rowwise-adam", lr, (b1, b2), eps), row, st, torch.tensor([1]), g)
    assert st["v_row"].shape == (1,)
    assert math.isclose(float(st["v_row"]), 0.0125, rel_tol=1e-6)
    assert torch.allclose(st["m"], torch.tensor([[0.3, 0.4]]))
    assert torch.allclose(row, -lr * g / math.sqrt(12.5), rtol=1e-6)
    # step 2 with g2 = [1, 1] (mean 1): m = 0.9 m + 0.1 g2, v = 0.999 v + 0.001; bc1 = 0.19, bc2 = 1 - 0.999^2
    before = row.clone()
    row_step(RowOptConfig("rowwise-adam", lr, (b1, b2), eps), row, st, torch.tensor([2]), torch.ones(1, 2))
    m = torch.tensor([[0.9 * 0.3 + 0.1, 0.9 * 0.4 + 0.1]])
    v = 0.999 * 0.0125 + 0.001 * 1.0
    want = before - lr * (m / 0.19) / (math.sqrt(v / (1 - 0.999 ** 2)) + eps)
    assert torch.allclose(row, want, rtol=1e-5) and math.isclose(float(st["v_row"]), v, rel_tol=1e-6)
    # row-wise Adagrad: acc_row = 12.5, row = -lr g / sqrt(12.5)
    row, st = torch.zeros(1, 2), {"acc_row": torch.zeros(1)}
    row_step(RowOptConfig("rowwise-adagrad", lr, eps=eps), row, st, torch.tensor([1]), g)
    assert math.isclose(float(st["acc_row"]), 12.5, rel_tol=1e-6)
    assert torch.allclose(row, -lr * g / math.sqrt(12.5), rtol=1e-6)
    # one value per row: a row whose gradient is all in one column moves every column's step
    # size by the row's mean, unlike per-value Adam (which would give the same step to each)
    row_full, row_rw = torch.zeros(1, 2), torch.zeros(1, 2)
    gs = torch.tensor([[1.0, 0.0]])
    row_step(RowOptConfig("adam", lr), row_full, {"m": torch.zeros(1, 2), "v": torch.zeros(1, 2)}, torch.tensor([1]), gs)
    row_step(RowOptConfig("rowwise-adam", lr), row_rw, {"m": torch.zeros(1, 2), "v_row": torch.zeros(1)},
             torch.tensor([1]), gs)
    assert torch.allclose(row_full, torch.tensor([[-lr, 0.0]]), rtol=1e-5)
    assert torch.allclose(row_rw, torch.tensor([[-lr * math.sqrt(2), 0.0]]), rtol=1e-5)


class DenseRowwiseRef:
    """Row-wise Adam / Adagrad on a whole dense table, masked to the touched rows (float64 bias
    corrections rounded to fp32, as the shard)."""

    def __init__(self, kind: str, rows: int, dim: int, lr: float):
        self.o = RowOptConfig(kind=kind, lr=lr)
        self.w, self.m = torch.zeros(rows, dim), torch.zeros(rows, dim)
        self.v = torch.zeros(rows)
        self.step = torch.zeros(rows, dtype=torch.int64)

    def apply(self, ids: np.ndarray, g_rows: torch.Tensor) -> None:
        o, i = self.o, torch.from_numpy(ids)
        g = torch.zeros_like(self.w)
        g[i] = g_rows
        mask = torch.zeros(self.w.shape[0], dtype=torch.bool)
        mask[i] = True
        step = torch.where(mask, self.step + 1, self.step)
        g2 = (g * g).mean(1)
        if o.kind == "rowwise-adam":
            b1, b2 = o.betas
            m = self.m * b1 + (1 - b1) * g
            v = self.v * b2 + (1 - b2) * g2
            t = step.clamp(min=1).to(torch.float64)
            bc1 = (1 - torch.pow(torch.tensor(b1, dtype=torch.float64), t)).float()
            bc2 = (1 - torch.pow(torch.tensor(b2, dtype=torch.float64), t)).float()
            w = self.w - o.lr * (m / bc1[:, None]) / (torch.sqrt(v / bc2)[:, None] + o.eps)
            self.m = torch.where(mask[:, None], m, self.m)
        else:
            v = self.v + g2
            w = self.w - o.lr * g / (torch.sqrt(v)[:, None] + o.eps)
        self.v = torch.where(mask, v, self.v)
        self.w = torch.where(mask[:, None], w, self.w)
        self.step = step


@pytest.mark.parametrize("kind", KINDS)
def test_apply_grads_matches_a_dense_reference(kind):
    sh, ref = full_shard(kind), DenseRowwiseRef(kind, SPEC.rows, SPEC.dim, 0.05)
    rng, gen = np.random.default_rng(1), torch.Generator().manual_seed(1)
    for it in range(6):
        ids = np.unique(rng.integers(0, 200 if it % 2 else SPEC.rows, 60))
        g = torch.randn(len(ids), SPEC.dim, generator=gen)
        upd = sh.apply_grads(ids, g)
        ref.apply(ids, g)
        assert torch.allclose(sh.read(np.arange(SPEC.rows)), ref.w, rtol=1e-5, atol=1e-7)
        vk = state_keys(kind)[-1]
        assert set(upd) == {"ids", "rows", "step", *state_keys(kind)} and upd[vk].shape == (len(ids),)
        assert torch.allclose(upd[vk], ref.v[torch.from_numpy(ids)], rtol=1e-6)
        assert torch.equal(upd["step"], ref.step[torch.from_numpy(ids)])


@pytest.mark.parametrize("kind", KINDS)
def test_replica_updates_replays_and_wire_carry_the_rowwise_state(kind):
    prim, rep = full_shard(kind), full_shard(kind)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        upd = prim.apply_grads(np.array([0, 3, 500, 999]), torch.randn(4, 8, generator=gen))
        table, out, _, _, _ = decode_replica(encode_replica("ngram", upd, OM.view, "k:1"), {"ngram": SPEC}, kind=kind)
        rep.apply_replica_update(out)
    assert all(prim.checksum(s) == rep.checksum(s) for s in range(64))
    # a state with the per-row tensor of the wrong shape, negative, or another kind's, is refused
    bad = dict(upd)
    vk = state_keys(kind)[-1]
    with pytest.raises(ShardError):
        rep.apply_replica_update({**bad, vk: bad[vk].unsqueeze(1).expand(-1, 8).contiguous()})
    with pytest.raises(ShardError):
        rep.apply_replica_update({**bad, vk: -bad[vk] - 1})
    with pytest.raises(WireError):
        decode_replica(encode_replica("ngram", upd, OM.view, "k:1"), {"ngram": SPEC}, kind="adam")
    full = TableShard(SPEC, OM, RowOptConfig(kind="adam"))
    full.create_slots(range(64))
    with pytest.raises(WireError):  # a full-state update does not decode as row-wise
        decode_replica(encode_replica("ngram", full.apply_grads(np.array([1]), torch.ones(1, 8)), OM.view, "k:2"),
                       {"ngram": SPEC}, kind=kind)


@pytest.mark.parametrize("kind", KINDS)
def test_hand_off_carries_the_rowwise_state(kind):
    a = full_shard(kind)
    a.apply_grads(np.arange(0, 1000, 3), torch.randn(334, 8, generator=torch.Generator().manual_seed(3)))
    b = TableShard(SPEC, OM, RowOptConfig(kind=kind, lr=0.05))
    for s in (0, 7, 63):
        blob = encode_slot("ngram", s, a.export_slot(s), OM.view)
        table, slot, t, _ = decode_slot(blob, {"ngram": SPEC}, OM, kind)
        assert t[state_keys(kind)[-1]].shape == (OM.slot_rows("ngram", s)[1] - OM.slot_rows("ngram", s)[0],)
        b.import_slot(slot, t)
        assert b.checksum(s) == a.checksum(s)
    # the copies keep stepping alike after the hand-off
    ids, g = np.array(sorted({OM.slot_rows("ngram", 7)[0], OM.slot_rows("ngram", 63)[0] + 1})), torch.ones(2, 8)
    a.apply_grads(ids, g)
    b.apply_grads(ids, g)
    assert b.checksum(7) == a.checksum(7) and b.checksum(63) == a.checksum(63)
    # churn and compaction keep the per-row state beside its rows
    for s in range(64):
        if s not in (0, 7, 63):
            b.import_slot(s, a.export_slot(s))
    for s in range(1, 60):
        b.drop_slot(s)
    assert b.rows_allocated() < 1000 and all(b.checksum(s) == a.checksum(s) for s in b.slots())
    # another kind's slot is refused, as a whole
    c = TableShard(SPEC, OM, RowOptConfig(kind="adam"))
    with pytest.raises(ShardError):
        c.import_slot(0, a.export_slot(0))
    assert not c.has_slot(0)


def test_the_service_hands_off_and_replays_rowwise_state():
    specs = [TableSpec("ngram", 256, 8)]
    opt = RowOptConfig(kind="rowwise-adam", lr=0.05)
    svcs = {p: TableService(p, specs, replicas=2, slots=32, opt=opt) for p in ("p-a", "p-b", "p-c")}
    for p, s in svcs.items():
        s.set_members(list(svcs), now=0.0)
        for mv in list(s.moving.values()):
            s.moving.pop((mv.table, mv.slot))
            s.shards[mv.table].create_slot(mv.slot)
    m = svcs["p-a"].map
    ids = np.arange(0, 256, 3)
    for step in range(2):
        for owner, sub in m.plan("ngram", ids).items():
            fwd = svcs[owner].apply_push(PushRequest(m.view, f"x:{step}", {"ngram": sub},
                                                     {"ngram": torch.full((len(sub), 8), 0.1 * (step + 1))}))
            for peer, replays in fwd.items():
                assert svcs[peer].apply_replays(replays).applied is True
    for slot in range(m.n_slots("ngram")):
        assert len({svcs[o].shards["ngram"].checksum(slot) for o in m.owners("ngram", slot)}) == 1
    # a new owner installs the newest copy (import_best decodes it as this swarm's row-wise state)
    new = TableService("p-d", specs, replicas=2, slots=32, opt=opt)
    moves = new.set_members([*svcs, "p-d"], now=1.0)
    mv = next(x for x in moves if x.table == "ngram")
    blob = svcs[mv.sources[0]].export_slot("ngram", mv.slot)
    assert new.import_best(mv, [blob])
    assert new.shards["ngram"].checksum(mv.slot) == svcs[mv.sources[0]].shards["ngram"].checksum(mv.slot)
    # a copy of another optimizer's state does not count as an offer
    full = TableService("p-e", specs, replicas=2, slots=32, opt=RowOptConfig(kind="adam", lr=0.05))
    full.set_members(["p-e"], now=0.0)
    for mv2 in list(full.moving.values()):
        full.moving.pop((mv2.table, mv2.slot))
        full.shards[mv2.table].create_slot(mv2.slot)
    full.shards["ngram"].apply_grads(np.array([0]), torch.ones(1, 8))
    new2 = TableService("p-f", specs, replicas=2, slots=32, opt=opt)
    mv3 = next(x for x in new2.set_members(["p-f", "p-e"], now=0.0) if x.table == "ngram")
    assert not new2.import_best(mv3, [full.export_slot("ngram", mv3.slot)])
    assert (mv3.table, mv3.slot) in new2.moving  # still awaited: another offer may come


def test_rowwise_state_is_o_rows_not_o_rows_times_dim():
    spec = TableSpec("t", 4096, 64)
    sizes = {}
    for kind in ("adam", "rowwise-adam", "adagrad", "rowwise-adagrad"):
        sh = TableShard(spec, 64, RowOptConfig(kind=kind))
        sh.create_slots(range(64))
        assert sh.rows_allocated() == 4096
        sizes[kind] = sh.nbytes()
        state = sh.export_slot(0)
        per_row = sum(v.numel() for k, v in state.items() if k not in ("rows", "step")) / state["step"].numel()
        assert per_row == {"adam": 128, "rowwise-adam": 65, "adagrad": 64, "rowwise-adagrad": 1}[kind]
    rows, step = 4096 * 64 * 4, 4096 * 8
    assert sizes["adam"] == 3 * rows + step
    assert sizes["rowwise-adam"] == 2 * rows + 4096 * 4 + step      # m per value, v per row
    assert sizes["rowwise-adagrad"] == rows + 4096 * 4 + step       # the state: 4 bytes a row
    # the state grows with the rows, not with their width
    wide = TableShard(TableSpec("w", 4096, 512), 64, RowOptConfig(kind="rowwise-adagrad"))
    wide.create_slots(range(64))
    assert wide.nbytes() - 4096 * 512 * 4 - step == sizes["rowwise-adagrad"] - rows - step


def test_a_window_steps_rowwise_rows_by_the_shards_rule():
    opt = RowOptConfig(kind="rowwise-adam", lr=0.1)
    w = WindowRows({"ngram": 8}, opt)
    ids = np.array([2, 5, 9])
    w.add({"ngram": ids}, {"ngram": torch.zeros(3, 8)}, {})
    sh = full_shard("rowwise-adam", lr=0.1)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        g = torch.randn(3, 8, generator=gen)
        w.update({"ngram": (ids, g)})
        sh.apply_grads(ids, g)
    assert torch.equal(w.rows({"ngram": ids})["ngram"], sh.read(ids))
    (push_ids, deltas), = w.pushes().values()
    assert np.array_equal(push_ids, ids) and torch.equal(deltas, -sh.read(ids))


def test_row_state_is_a_swarm_setting_with_a_default_for_old_peers():
    assert ROW_STATES == SHARD_ROW_STATES
    assert PeerConfig().row_state == "full"
    assert row_kind("adam", "rowwise") == "rowwise-adam" and row_kind("adam", "full") == "adam"
    with pytest.raises(ValueError):
        row_kind("adam", "sideways")
    with pytest.raises(ConfigError, match="--row-state"):
        PeerConfig(row_state="sideways").validate()
    assert "row_state" in settings.SWARM_WIDE
    old = {k: v for k, v in settings.of(PeerConfig()).items() if k != "row_state"}
    assert settings.parse(old)["row_state"] == "full"  # a peer or checkpoint from before the setting
    swarm = settings.of(PeerConfig(row_state="rowwise"))
    assert "--row-state" in settings.conflict(swarm, {"row_state": "full"})


@pytest.mark.timeout(180)
async def test_peers_with_rowwise_state_replicate_and_hand_off_it():
    from .test_tables_swarm import holders, push_random, settled, start_peers, until
    from swarm.node import Peer
    from .conftest import small_cfg

    peers = await start_peers(2, row_dtype="fp32", row_state="rowwise")
    try:
        await until(lambda: settled(peers), what="a shared view")
        assert all(p.tables.shards[t].opt.kind == "rowwise-adam" for p in peers for t in ("ngram", "value"))
        rng = np.random.default_rng(0)
        for i, p in enumerate(peers * 2):
            await push_random(p, rng, key=f"{p.id}:{i}")
        joiner = Peer(small_cfg(join=f"127.0.0.1:{peers[0].port}"), out=lambda line: None)  # adopts rowwise
        await joiner.start()
        peers.append(joiner)
        assert joiner.cfg.row_state == "rowwise"
        await until(lambda: settled(peers), what="the joiner's hand-off")
        omap = peers[0].tables.map
        moved = 0
        for t in ("ngram", "value"):
            for slot in range(omap.n_slots(t)):
                owners = holders(peers, t, slot)
                assert len({p.tables.shards[t].checksum(slot) for p in owners}) == 1, (t, slot)
                if joiner in owners and joiner.tables.shards[t].digest(slot)[0] > 0:
                    moved += 1
                    assert joiner.tables.shards[t].export_slot(slot)["v_row"].dim() == 1
        assert moved > 0  # trained slots reached the joiner with their row-wise state
    finally:
        for p in peers:
            await p.close()
