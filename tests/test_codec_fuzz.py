"""Fuzz: hostile payloads raise only CodecError and never write outside the output."""

from __future__ import annotations

import json
import struct

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from swarm.codec import CodecConfig, CodecError, Compressor, Manifest, ManifestEntry, decode_payload

torch.set_num_threads(1)
N = 3000
GUARD = 64
MANIFEST = Manifest((ManifestEntry("w", (N - 1000,), "float32"), ManifestEntry("b", (1000,), "float32")))


def _bases() -> list[bytes]:
    g = torch.randn(N, generator=torch.Generator().manual_seed(0))
    out = []
    for mode, dense, ratio, block in [("topk", "bf16", 0.05, 64), ("topk-int8", "bf16", 0.02, 64),
                                      ("topk-int4", "bf16", 0.1, 7), ("none", "bf16", 0.01, 64),
                                      ("none", "fp32", 0.01, 64), ("topk-int8", "bf16", 0.001, 1)]:
        c = Compressor(MANIFEST, CodecConfig(mode=mode, ratio=ratio, dense_dtype=dense, block_size=block), "f")
        out.append(c.compress(g, 3).blob)
    bad = g.clone()
    bad[5] = float("inf")
    out.append(Compressor(MANIFEST, CodecConfig(), "f").compress(bad, 4).blob)   # skipped, k=0
    return out


BASES = _bases()
FUZZ = settings(max_examples=500, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check(blob: bytes, **kw) -> None:
    """Decode; on success the result must be sane and add_to must stay inside its output."""
    try:
        d = decode_payload(blob, MANIFEST, **kw)
    except CodecError:
        return
    assert d.n == N
    assert torch.isfinite(d.values).all()
    if d.indices is None:
        assert d.values.shape == (N,)
    else:
        idx = d.indices
        assert idx.dtype == torch.int64 and d.values.shape == idx.shape
        if idx.numel():
            assert int(idx[0]) >= 0 and int(idx[-1]) < N and bool((idx[1:] > idx[:-1]).all())
    buf = torch.zeros(N + 2 * GUARD)
    d.add_to(buf[GUARD:GUARD + N])
    assert not buf[:GUARD].any() and not buf[GUARD + N:].any()


@FUZZ
@given(st.binary(max_size=4000))
def test_random_bytes(data: bytes) -> None:
    check(data)


@FUZZ
@given(base=st.sampled_from(range(len(BASES))),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 10**6)), tail=st.binary(max_size=16),
       hmode=st.sampled_from([None, "none", "topk", "topk-int8", "topk-int4", "x"]))
def test_mutated_bytes(base: int, edits: list, cut: int | None, tail: bytes, hmode: str | None) -> None:
    b = bytearray(BASES[base])
    for pos, val in edits:
        b[pos % len(b)] = val
    if cut is not None:
        b = b[:cut % (len(b) + 1)]
    check(bytes(b) + tail, header_mode=hmode, max_ratio=0.5)


VALUES = ["", "0", "1", "-1", "2", "7", "64", "65537", "3000", "2999", "1e3", " 1", "01", "99999999999999999999",
          "none", "topk", "topk-int8", "topk-int4", "fp16", "int8", "int4", "bf16", "fp32", "\u00e9", "x" * 300]


@FUZZ
@given(base=st.sampled_from(range(len(BASES))),
       changes=st.lists(st.tuples(st.sampled_from(["v", "h", "n", "k", "m", "f", "t", "s", "b", "zz"]),
                                  st.one_of(st.sampled_from(VALUES), st.text(max_size=12), st.none())),
                        min_size=1, max_size=3),
       body_edit=st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.integers(0, 255))),
       body_len=st.one_of(st.none(), st.integers(0, 7000)))
def test_mutated_metadata(base: int, changes: list, body_edit, body_len: int | None) -> None:
    """Rewrite the header (so offsets stay valid) to reach the semantic checks behind it."""
    blob = BASES[base]
    hlen = struct.unpack_from("<Q", blob)[0]
    header = json.loads(blob[8:8 + hlen])
    body = bytearray(blob[8 + hlen:])
    meta = header["__metadata__"]
    for key, val in changes:
        if val is None:
            meta.pop(key, None)
        else:
            meta[key] = val
    if body_len is not None:
        body = (body * (body_len // max(len(body), 1) + 1))[:body_len]
    if body_edit is not None and body:
        body[body_edit[0] % len(body)] = body_edit[1]
    header["p"]["shape"] = [len(body)]
    header["p"]["data_offsets"] = [0, len(body)]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    check(struct.pack("<Q", len(raw)) + raw + bytes(body))


def test_bases_decode() -> None:
    for blob in BASES:
        decode_payload(blob, MANIFEST)
