"""Table wire formats: round trips, validation, and hostile bytes (only WireError comes out)."""
from __future__ import annotations

import json
import struct

import msgpack
import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.tables.ownership import OwnershipMap, TableSpec
from swarm.tables.shard import RowOptConfig, TableShard
from swarm.tables.formats import (PullRequest, PushRequest, Replay, WireError, decode_pull, decode_push, decode_rows_tagged,
                               decode_replays, decode_replica, decode_rows, decode_slot, encode_pull, encode_push,
                               encode_replays, encode_replica, encode_rows, encode_slot, quantize, roundtrip, row_tags,
                               pack_int4, unpack_int4)

torch.set_num_threads(1)
TABLES = {"ngram": TableSpec("ngram", 1000, 8), "value": TableSpec("value", 500, 8)}
DIMS = {t: s.dim for t, s in TABLES.items()}
OM = OwnershipMap(TABLES.values(), ["a", "b", "c"], slots=64)
VIEW = OM.view
IDS = {"ngram": np.array([0, 3, 17, 999]), "value": np.array([1, 499])}


def rows_for(ids: dict) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(t, torch.randn(len(i), 8, generator=g)) for t, i in ids.items()]


def shard_with_update(kind: str = "adam"):
    sh = TableShard(TABLES["ngram"], OM, RowOptConfig(kind=kind))
    for s in range(64):
        sh.create_slot(s)
    upd = sh.apply_grads(IDS["ngram"], torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
    return sh, upd


# ----------------------------------------------------------------------------- round trips

def test_pull_round_trip():
    req = PullRequest(VIEW, "bf16", {t: v.astype(np.uint32) for t, v in IDS.items()})
    data = encode_pull(req)
    assert len(data) == 58 + 4 * 6  # 58 bytes of framing for two tables, 4 bytes per id
    out = decode_pull(data, TABLES, max_ids=6)
    assert out.view == VIEW and out.dtype == "bf16"
    assert {t: v.tolist() for t, v in out.ids.items()} == {t: v.tolist() for t, v in IDS.items()}
    assert out.ids["ngram"].dtype == np.int64
    # the format is plain msgpack with uint32 LE bins
    raw = msgpack.unpackb(data)
    assert raw["v"] == 1 and raw["ids"]["value"] == struct.pack("<2I", 1, 499)
    with pytest.raises(WireError, match="max_ids"):
        decode_pull(data, TABLES, max_ids=5)
    assert decode_pull(encode_pull(PullRequest(VIEW, "fp32", {})), TABLES, 1).ids == {}


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8", "int4"])
def test_rows_round_trip(dtype):
    req = PullRequest(VIEW, dtype, {**IDS, "value": np.zeros(0, dtype=np.int64)})
    rows = rows_for(req.ids)
    out = decode_rows(encode_rows(rows, dtype), req, DIMS)
    for t, r in rows:
        assert out[t].dtype == torch.float32 and out[t].shape == r.shape
        assert torch.equal(out[t], roundtrip(r, dtype))  # what the group's collectives carry, too
        if dtype == "int8" and len(r):  # within half a step of the row's scale
            assert bool(((out[t] - r).abs() <= r.abs().amax(dim=1, keepdim=True) / 126).all())
    with pytest.raises(WireError):
        decode_rows(encode_rows(rows, "fp32" if dtype != "fp32" else "fp16"), req, DIMS)
    with pytest.raises(WireError):
        decode_rows(encode_rows(rows[:1], dtype), req, DIMS)
    with pytest.raises(WireError):  # not representable in fp16
        encode_rows([("ngram", torch.full((1, 8), 1e6))], "fp16") if dtype == "fp16" else decode_rows(b"", req, DIMS)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8", "int4"])
def test_push_round_trip(dtype):
    g = dict(rows_for(IDS))
    data = encode_push(PushRequest(VIEW, "peer-a:42", IDS, g), dtype)
    out = decode_push(data, TABLES, max_ids=6)
    assert out.view == VIEW and out.key == "peer-a:42"
    assert set(out.ids) == set(IDS) and all(np.array_equal(out.ids[t], IDS[t]) for t in IDS)
    tol = 0 if dtype == "fp32" else 1e-2
    for t in IDS:
        assert out.grads[t].dtype == torch.float32
        assert torch.equal(out.grads[t], roundtrip(g[t], dtype))
        if dtype not in ("int8", "int4"):
            assert torch.allclose(out.grads[t], g[t], atol=tol, rtol=tol)
        elif dtype == "int4" and len(g[t]):  # within half a step of the row's scale (max|row| / 7 at most)
            assert bool(((out.grads[t] - g[t]).abs() <= g[t].abs().amax(dim=1, keepdim=True) / 7).all())
    with pytest.raises(WireError):
        decode_push(data, TABLES, max_ids=5)
    with pytest.raises(WireError):
        decode_push(data, {"ngram": TABLES["ngram"]}, max_ids=6)
    for bad in (PushRequest(VIEW, "no-step", IDS, g), PushRequest("xyz", "a:1", IDS, g),
                PushRequest(VIEW, "a:1", {"ngram": np.array([3, 1])}, {"ngram": torch.zeros(2, 8)}),
                PushRequest(VIEW, "a:1", IDS, {**g, "value": torch.full((2, 8), float("nan"))})):
        with pytest.raises(WireError):
            encode_push(bad)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_replays_of_every_table_travel_in_one_message(dtype):
    g = {t: roundtrip(x, dtype) for t, x in rows_for(IDS)}  # what a flush applied: exact in dtype
    parts = [Replay(t, VIEW, "p-a.00ff/flush:3", IDS[t], g[t], torch.arange(len(IDS[t]), dtype=torch.int64) + 5)
             for t in IDS]
    data = encode_replays(parts, [dtype] * len(parts))
    out = decode_replays(data, TABLES, max_ids=6)
    assert [rp.table for rp in out] == list(IDS)
    for rp, want in zip(out, parts):
        assert (rp.view, rp.key) == (VIEW, "p-a.00ff/flush:3")
        assert np.array_equal(rp.ids, want.ids) and torch.equal(rp.pre_step, want.pre_step)
        assert torch.equal(rp.grads, want.grads)  # bit-exact: the replica takes the primary's step
    with pytest.raises(WireError):
        decode_replays(data, TABLES, max_ids=5)  # the bound is over all tables
    with pytest.raises(WireError):
        decode_replays(data, {"ngram": TABLES["ngram"]}, max_ids=6)  # an unknown table
    other_key = Replay("value", VIEW, "p-a.00ff/flush:4", IDS["value"], g["value"], parts[1].pre_step)
    for bad in ([], [parts[0], other_key], [parts[0], parts[0]],
                [Replay("ngram", VIEW, "k:1", IDS["ngram"], g["ngram"], parts[0].pre_step[:2])]):
        with pytest.raises(WireError):
            encode_replays(bad)
    # a table without its update counters, or with negative ones, is refused
    no_s = safetensors.torch.save({"ngram.ids": torch.tensor([1, 2], dtype=torch.int32),
                                   "ngram.g": torch.zeros(2, 8)}, metadata={"v": "1", "view": VIEW, "key": "k:1"})
    neg = safetensors.torch.save({"ngram.ids": torch.tensor([1, 2], dtype=torch.int32),
                                  "ngram.s": torch.tensor([0, -1], dtype=torch.int32),
                                  "ngram.g": torch.zeros(2, 8)}, metadata={"v": "1", "view": VIEW, "key": "k:1"})
    for blob in (no_s, neg):
        with pytest.raises(WireError):
            decode_replays(blob, TABLES, max_ids=6)


@pytest.mark.parametrize("kind", ["adam", "adagrad"])
def test_replica_round_trip_applies(kind):
    sh, upd = shard_with_update(kind)
    data = encode_replica("ngram", upd, VIEW, "a:7")
    table, out, view, key, mode = decode_replica(data, TABLES, kind=kind)
    assert (table, view, key, mode) == ("ngram", VIEW, "a:7", "heal")
    assert set(out) == set(upd) and all(torch.equal(out[k], upd[k]) for k in upd)
    rep = TableShard(TABLES["ngram"], OM, RowOptConfig(kind=kind))
    for s in range(64):
        rep.create_slot(s)
    rep.apply_replica_update(out)
    assert all(rep.checksum(s) == sh.checksum(s) for s in range(64))
    other = "adagrad" if kind == "adam" else "adam"
    with pytest.raises(WireError):
        decode_replica(data, TABLES, kind=other)


def test_a_replica_update_says_whether_it_heals_or_catches_up():
    _, upd = shard_with_update()
    assert decode_replica(encode_replica("ngram", upd, VIEW, "a:7", "catch-up"), TABLES)[4] == "catch-up"
    with pytest.raises(WireError, match="replica mode"):
        encode_replica("ngram", upd, VIEW, "a:7", "overwrite")
    # an update without a mode (a peer before modes) is a heal; an unknown mode or key is refused
    blob = encode_replica("ngram", upd, VIEW, "a:7")
    tensors = safetensors.torch.load(blob)
    meta = json.loads(blob[8:8 + struct.unpack("<Q", blob[:8])[0]])["__metadata__"]
    del meta["mode"]
    assert decode_replica(safetensors.torch.save(tensors, metadata=meta), TABLES)[4] == "heal"
    for bad in ({**meta, "mode": "overwrite"}, {**meta, "mode": "heal", "extra": "1"}):
        with pytest.raises(WireError):
            decode_replica(safetensors.torch.save(tensors, metadata=bad), TABLES)


def test_slot_round_trip():
    sh, _ = shard_with_update()
    data = encode_slot("ngram", 0, sh.export_slot(0), VIEW)
    table, slot, t, view = decode_slot(data, TABLES, OM)
    assert (table, slot, view) == ("ngram", 0, VIEW)
    b = TableShard(TABLES["ngram"], OM)
    b.import_slot(0, t)
    assert b.checksum(0) == sh.checksum(0)
    # wrong slot geometry: a different map where slot 0 is larger
    small = OwnershipMap(TABLES.values(), ["a"], slots=32)
    with pytest.raises(WireError):
        decode_slot(data, TABLES, small)
    with pytest.raises(WireError):
        decode_slot(encode_slot("ngram", 64, sh.export_slot(0), VIEW), TABLES, OM)


def test_pull_validation():
    def msg(**kw):
        base = {"v": 1, "view": VIEW, "dtype": "fp32", "ids": {"ngram": struct.pack("<2I", 1, 2)}}
        base.update(kw)
        return msgpack.packb(base, use_bin_type=True)

    assert decode_pull(msg(), TABLES, 10).ids["ngram"].tolist() == [1, 2]
    bad = [
        msg(v=2), msg(v=True), msg(view="ABCDEF0123456789"), msg(view=VIEW[:-1]), msg(dtype="int2"),
        msg(ids={"nope": b""}), msg(ids={"ngram": struct.pack("<2I", 2, 1)}),
        msg(ids={"ngram": struct.pack("<2I", 1, 1)}), msg(ids={"ngram": struct.pack("<I", 1000)}),
        msg(ids={"ngram": b"\x00\x00\x00"}), msg(ids={"ngram": [1, 2]}), msg(ids=[]), msg(extra=1),
        msgpack.packb([1, 2]), b"", b"\xc1", msg() + b"\x00",
    ]
    for b in bad:
        with pytest.raises(WireError):
            decode_pull(b, TABLES, 10)
    with pytest.raises(WireError):
        decode_pull("not bytes", TABLES, 10)


def _st(header: dict, body: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


def test_safetensors_container_validation():
    meta = {"v": "1", "table": "ngram", "slot": "0", "view": VIEW}
    n = OM.slot_rows("ngram", 0)[1]
    ok_hdr = {"__metadata__": meta,
              "rows": {"dtype": "F32", "shape": [n, 8], "data_offsets": [0, n * 32]},
              "acc": {"dtype": "F32", "shape": [n, 8], "data_offsets": [n * 32, n * 64]},
              "step": {"dtype": "I64", "shape": [n], "data_offsets": [n * 64, n * 72]}}
    body = bytes(n * 72)
    assert decode_slot(_st(ok_hdr, body), TABLES, OM)[1] == 0
    cases = [
        _st(ok_hdr, body + b"x"), _st(ok_hdr, body[:-1]),
        _st({**ok_hdr, "acc": {**ok_hdr["acc"], "data_offsets": [0, n * 32]}}, body),
        _st({**ok_hdr, "acc": {**ok_hdr["acc"], "dtype": "F64"}}, body),
        _st({**ok_hdr, "acc": {**ok_hdr["acc"], "shape": [n, 4, 2]}}, body),
        _st({**ok_hdr, "step": {**ok_hdr["step"], "dtype": "I32", "data_offsets": [n * 64, n * 68]}}, body[:n * 68]),
        _st({**ok_hdr, "__metadata__": {**meta, "slot": "01"}}, body),
        _st({**ok_hdr, "__metadata__": {**meta, "slot": "99"}}, body),
        _st({**ok_hdr, "__metadata__": {**meta, "x": "1"}}, body),
        _st({**ok_hdr, "__metadata__": {**meta, "table": "value"}}, body),
        _st({**ok_hdr, "__metadata__": {**meta, "v": "2"}}, body),
        _st({**ok_hdr, "rows": {**ok_hdr["rows"], "extra": 1}}, body),
        _st({**ok_hdr, "rows": {**ok_hdr["rows"], "shape": [n, 8.0]}}, body),
        _st({**ok_hdr, "m": ok_hdr["rows"]}, body),
        struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 10) + b"{}", b"\x02\0\0\0\0\0\0\0[]",
        b'\x0e\0\0\0\0\0\0\0{"a":1, "a":2}',
    ]
    nan_body = bytearray(body)
    nan_body[0:4] = struct.pack("<f", float("nan"))
    cases.append(_st(ok_hdr, bytes(nan_body)))
    neg_body = bytearray(body)
    neg_body[n * 32:n * 32 + 4] = struct.pack("<f", -1.0)
    cases.append(_st(ok_hdr, bytes(neg_body)))
    for c in cases:
        with pytest.raises(WireError):
            decode_slot(c, TABLES, OM)


# ----------------------------------------------------------------------------- fuzz

def _valid_blobs() -> dict[str, bytes]:
    sh, upd = shard_with_update()
    req = PullRequest(VIEW, "fp16", IDS)
    rp = Replay("ngram", VIEW, "a:1", IDS["ngram"], torch.randn(4, 8), torch.zeros(4, dtype=torch.int64))
    rp2 = Replay("value", VIEW, "a:1", IDS["value"], torch.randn(len(IDS["value"]), 8),
                 torch.arange(len(IDS["value"]), dtype=torch.int64))
    return {
        "pull": encode_pull(req),
        "rows": encode_rows(rows_for(IDS), "fp16"),
        "rows8": encode_rows(rows_for(IDS), "int8"),
        "push": encode_push(PushRequest(VIEW, "a:1", IDS, dict(rows_for(IDS))), "bf16"),
        "push8": encode_push(PushRequest(VIEW, "a:1", IDS, dict(rows_for(IDS))), "int8"),
        "replay8": encode_replays([rp], ["int8"]),
        "push4": encode_push(PushRequest(VIEW, "a:1", IDS, dict(rows_for(IDS))), "int4"),
        "replay4": encode_replays([rp, rp2], ["int4", "bf16"]),
        "replica": encode_replica("ngram", upd, VIEW, "a:1"),
        "slot": encode_slot("ngram", 3, sh.export_slot(3), VIEW),
    }


VALID = _valid_blobs()
REQ = PullRequest(VIEW, "fp16", IDS)
REQ8 = PullRequest(VIEW, "int8", IDS)
DECODERS = {
    "pull": lambda b: decode_pull(b, TABLES, 64),
    "rows": lambda b: decode_rows(b, REQ, DIMS),
    "rows8": lambda b: decode_rows(b, REQ8, DIMS),
    "push": lambda b: decode_push(b, TABLES, 64),
    "push8": lambda b: decode_push(b, TABLES, 64),
    "replay8": lambda b: decode_replays(b, TABLES, 64),
    "push4": lambda b: decode_push(b, TABLES, 64),
    "replay4": lambda b: decode_replays(b, TABLES, 64),
    "replica": lambda b: decode_replica(b, TABLES),
    "slot": lambda b: decode_slot(b, TABLES, OM),
}


def _only_wire_error(name: str, data: bytes) -> None:
    try:
        DECODERS[name](data)
    except WireError:
        pass


def test_valid_blobs_decode():
    for name, b in VALID.items():
        DECODERS[name](b)


FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(name=st.sampled_from(sorted(DECODERS)), data=st.binary(max_size=300))
def test_fuzz_random_bytes(name, data):
    _only_wire_error(name, data)


@FUZZ
@given(name=st.sampled_from(sorted(DECODERS)), src=st.sampled_from(sorted(VALID)),
       edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.integers(0, 1 << 20), mode=st.sampled_from(["flip", "cut", "both", "insert"]))
def test_fuzz_mutated_bytes(name, src, edits, cut, mode):
    b = bytearray(VALID[src])
    if mode in ("flip", "both"):
        for pos, val in edits:
            b[pos % len(b)] = val
    if mode in ("cut", "both"):
        b = b[:cut % (len(b) + 1)]
    if mode == "insert":
        pos, val = edits[0]
        b[pos % (len(b) + 1):pos % (len(b) + 1)] = bytes([val]) * (1 + edits[-1][1] % 9)
    _only_wire_error(name, bytes(b))


@FUZZ
@given(hdr=st.recursive(st.none() | st.booleans() | st.integers(-2, 1 << 41) | st.floats() | st.text(max_size=8),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                        max_leaves=20),
       name=st.sampled_from(["rows", "push", "replica", "slot"]), body=st.binary(max_size=64))
def test_fuzz_structured_headers(hdr, name, body):
    try:
        h = json.dumps(hdr).encode()
    except ValueError:
        return
    _only_wire_error(name, struct.pack("<Q", len(h)) + h + body)


@FUZZ
@given(obj=st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.binary(max_size=16)
                        | st.text(max_size=20),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), c, max_size=4),
                        max_leaves=20))
def test_fuzz_msgpack_pull(obj):
    _only_wire_error("pull", msgpack.packb(obj, use_bin_type=True))
    if isinstance(obj, dict):
        base = {"v": 1, "view": VIEW, "dtype": "fp32", "ids": obj}
        _only_wire_error("pull", msgpack.packb(base, use_bin_type=True))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(rows=st.lists(st.lists(st.floats(-2.0 ** 100, 2.0 ** 100, width=32) | st.sampled_from([0.0, -0.0, 1e-38, 2.0 ** -140]),
                              min_size=3, max_size=3), min_size=1, max_size=6))
def test_int8_round_trip_is_a_fixed_point(rows):
    """Quantizing what was decoded gives back the same bytes: a primary replays an int8 (or int4)
    push to its replicas in that dtype and they apply exactly the primary's values."""
    x = torch.tensor(rows, dtype=torch.float32)
    for dtype, qmax in (("int8", 127), ("int4", 7)):
        once = roundtrip(x, dtype)
        assert torch.isfinite(once).all()
        q1, s1 = quantize(once, qmax)
        assert torch.equal(roundtrip(once, dtype), once)
        assert torch.equal(q1.float() * s1[:, None], once)
        assert int(q1.abs().max()) <= qmax
        amax = x.abs().amax(dim=1, keepdim=True)
        assert bool(((once - x).abs() <= amax / (qmax - 0.5) + 2.0 ** -126).all())


@settings(max_examples=100, deadline=None, derandomize=True)
@given(q=st.lists(st.lists(st.integers(-8, 7), min_size=1, max_size=9).map(tuple), min_size=1, max_size=5)
       .filter(lambda rows: len({len(r) for r in rows}) == 1))
def test_int4_packing_is_exact(q):
    t = torch.tensor(q, dtype=torch.int8)
    p = pack_int4(t)
    assert p.dtype == torch.uint8 and p.shape == (t.shape[0], (t.shape[1] + 1) // 2)
    assert torch.equal(unpack_int4(p.to(torch.int64), t.shape[1]), t)


def test_int4_blobs_with_a_wrong_shape_or_no_scale_are_refused():
    import safetensors.torch

    req = PullRequest(VIEW, "int4", {"ngram": np.array([1, 2])})
    ok = {"ngram": torch.zeros(2, 4, dtype=torch.uint8), "ngram.scale": torch.ones(2)}
    assert decode_rows(safetensors.torch.save(ok, metadata={"v": "1"}), req, DIMS)["ngram"].shape == (2, 8)
    for bad in ({"ngram": torch.zeros(2, 8, dtype=torch.uint8), "ngram.scale": torch.ones(2)},
                {"ngram": torch.zeros(2, 4, dtype=torch.uint8)},
                {"ngram": torch.zeros(2, 4, dtype=torch.int8), "ngram.scale": torch.ones(2)}):
        with pytest.raises(WireError):
            decode_rows(safetensors.torch.save(bad, metadata={"v": "1"}), req, DIMS)


def test_int8_blobs_with_bad_scales_are_refused():
    import safetensors.torch

    req = PullRequest(VIEW, "int8", {"ngram": np.array([1, 2])})
    q = torch.full((2, 8), 127, dtype=torch.int8)  # x 3e38 overflows
    for scale in (torch.tensor([1.0, -1.0]), torch.tensor([0.0, 1.0]), torch.tensor([float("nan"), 1.0]),
                  torch.tensor([3e38, 1.0])):
        blob = safetensors.torch.save({"ngram": q, "ngram.scale": scale}, metadata={"v": "1"})
        with pytest.raises(WireError):
            decode_rows(blob, req, DIMS)
    with pytest.raises(WireError, match="scale"):  # no scale
        decode_rows(safetensors.torch.save({"ngram": q}, metadata={"v": "1"}), req, DIMS)
    push = safetensors.torch.save({"ngram.ids": torch.tensor([1], dtype=torch.int32),
                                   "ngram.g": torch.ones(1, 8, dtype=torch.int8)},
                                  metadata={"v": "1", "view": VIEW, "key": "a:1"})
    with pytest.raises(WireError, match="scale"):
        decode_push(push, TABLES, 64)


# ----------------------------------------------------------------------------- conditional pulls

@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8", "int4"])
def test_row_tags_of_decoded_rows_are_the_owners_and_change_with_the_row(dtype):
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(64, 8, generator=g)
    tags = row_tags(rows, dtype)
    assert tags.dtype == np.uint32 and tags.shape == (64,) and (tags != 0).all()
    assert len(set(tags.tolist())) == 64  # distinct rows, distinct tags
    # the asker only has the decoded rows: their tags are the stored rows'
    assert np.array_equal(row_tags(roundtrip(rows, dtype), dtype), tags)
    assert np.array_equal(row_tags(torch.zeros(3, 8), dtype), row_tags(torch.zeros(3, 8), dtype))
    # any change the wire can carry changes the tag: one value moved by a few quanta
    moved = roundtrip(rows, dtype).clone()
    moved[:, 5] += moved.abs().amax(dim=1) / 2
    changed = ~torch.equal(roundtrip(moved, dtype), roundtrip(rows, dtype))
    assert changed and (row_tags(moved, dtype) != tags).all()


def test_a_tagged_pull_leaves_out_the_rows_the_asker_holds_unchanged():
    dtype = "int4"
    rows = dict(rows_for(IDS))
    held = {t: roundtrip(r, dtype) for t, r in rows.items()}  # what the asker pulled last time
    now = {t: r.clone() for t, r in rows.items()}
    now["ngram"][1] += 1.0  # the owner's row 3 moved since
    tags = {"ngram": row_tags(held["ngram"], dtype)}
    tags["ngram"][3] = 0  # row 999: the asker holds none
    req = PullRequest(VIEW, dtype, IDS, tags)
    back = decode_pull(encode_pull(req), TABLES, max_ids=6)
    assert set(back.tags) == {"ngram"} and np.array_equal(back.tags["ngram"], tags["ngram"])
    reply = encode_rows(list(now.items()), dtype, back.tags)
    out = decode_rows(reply, req, DIMS, held={"ngram": held["ngram"]})
    for t in IDS:
        assert torch.equal(out[t], roundtrip(now[t], dtype)), t  # as if every row had been sent
    # which rows came: the moved one and the one not held; ids 0 and 17 were left out
    blob = safetensors.torch.load(reply)
    assert blob["ngram"].shape[0] == 2 and blob["ngram.same"].tolist() == [0b0101]
    # without any tag the request and the reply are as before
    assert "tags" not in msgpack.unpackb(encode_pull(PullRequest(VIEW, dtype, IDS, {"ngram": np.zeros(4, np.uint32)})))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8", "int4"])
def test_tags_of_a_decoded_reply_are_row_tags_of_its_rows(dtype):
    """The asker hashes a fresh row's bytes as they came instead of quantizing the decoded row again:
    the same tags, for rows sent and rows marked same, tagged tables and untagged ones; and the
    owner's reply is the same bytes either way."""
    g = torch.Generator().manual_seed(5)
    ids = {"ngram": np.arange(0, 40, 2), "value": np.arange(7)}
    held = {"ngram": roundtrip(torch.randn(20, 8, generator=g), dtype)}
    now = {"ngram": held["ngram"].clone(), "value": torch.randn(7, 8, generator=g)}
    now["ngram"][::3] += torch.randn(7, 8, generator=g)  # some rows moved, the rest are the held ones
    tags = {"ngram": row_tags(held["ngram"], dtype)}
    tags["ngram"][5] = 0  # one row the asker holds none of
    req = PullRequest(VIEW, dtype, ids, tags)
    reply = encode_rows(list(now.items()), dtype, tags)
    blob = safetensors.torch.load(reply)
    assert 0 < blob["ngram"].shape[0] < 20  # some rows left out, some sent
    out, got = decode_rows_tagged(reply, req, DIMS, held=held)
    plain = decode_rows(reply, req, DIMS, held=held)
    assert set(got) == set(out) == set(plain) == set(ids)
    for t in ids:
        assert torch.equal(out[t], plain[t]) and torch.equal(out[t], roundtrip(now[t], dtype))
        assert got[t].dtype == np.uint32 and np.array_equal(got[t], row_tags(out[t], dtype)), t
    # every row of a tagged table unchanged: the reply carries none of them, and none is hashed
    tags = {"ngram": row_tags(held["ngram"], dtype)}
    reply = encode_rows([("ngram", held["ngram"]), ("value", now["value"])], dtype, tags)
    assert safetensors.torch.load(reply)["ngram"].shape[0] == 0
    out, got = decode_rows_tagged(reply, PullRequest(VIEW, dtype, ids, tags), DIMS, held=held)
    assert torch.equal(out["ngram"], held["ngram"]) and np.array_equal(got["ngram"], tags["ngram"])


def test_tagged_pulls_refuse_what_does_not_fit():
    ids = {"ngram": np.array([0, 3])}
    raw = msgpack.unpackb(encode_pull(PullRequest(VIEW, "int4", ids)))
    for tags, why in [({"value": b"\0" * 8}, "asks no rows"), ({"ngram": b"\1" * 4}, "one uint32 per id"),
                      ({"ngram": 7}, "one uint32 per id"), ({"ngram": [1, 2]}, "max_array_len"), (5, "map")]:
        with pytest.raises(WireError, match=why):
            decode_pull(msgpack.packb({**raw, "tags": tags}), TABLES, max_ids=6)
    with pytest.raises(WireError, match="one integer per id"):
        encode_pull(PullRequest(VIEW, "int4", ids, {"ngram": np.ones(3, np.uint32)}))
    held = torch.zeros(2, 8)
    req = PullRequest(VIEW, "int4", ids, {"ngram": np.array([0, 7], np.uint32)})
    rows = roundtrip(torch.randn(2, 8), "int4")

    def reply(same_bits: int, n_rows: int, with_same: bool = True) -> bytes:
        q, scale = quantize(rows[:n_rows], 7)
        t = {"ngram": pack_int4(q), "ngram.scale": scale}
        if with_same:
            t["ngram.same"] = torch.tensor([same_bits], dtype=torch.uint8)
        return safetensors.torch.save(t, metadata={"v": "1"})

    assert decode_rows(reply(0b10, 1), req, DIMS, held={"ngram": held})["ngram"][1].abs().sum() == 0
    for data, why in [(reply(0b01, 1), "held none of"), (reply(0b110, 1), "past the 2 rows"),
                      (reply(0b10, 2), "shape"), (reply(0, 2, with_same=False), "tensors must be")]:
        with pytest.raises(WireError, match=why):
            decode_rows(data, req, DIMS, held={"ngram": held})
