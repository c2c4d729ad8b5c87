"""Unit tests for swarm.codec: manifest, config, selection, index coding, values, wire."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import safetensors.numpy
import torch

from swarm.codec import (HEADER, MODES, CodecConfig, CodecError, Compressor, Decoded, Encoded, Manifest,
                         ManifestEntry, decode_payload)
from swarm.codec import indexcode, quant
from swarm.codec.select import select_topk, topk_exact, topk_fast
from swarm.codec.config import MAX_SPARSE_RATIO
from swarm.codec.payload import subset_bound_bits

torch.set_num_threads(1)


def flat_manifest(n: int) -> Manifest:
    return Manifest((ManifestEntry("w", (n,), "float32"),))


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2, bias=False)
        self.frozen = torch.nn.Parameter(torch.zeros(5), requires_grad=False)


# -- API surface ---------------------------------------------------------------------------
def test_constants() -> None:
    assert HEADER == "X-Compression"
    assert MODES == ("none", "topk", "topk-int8", "topk-int4", "topk-int2")
    assert issubclass(CodecError, ValueError)


# -- manifest ------------------------------------------------------------------------------
def test_manifest_from_module_order_and_hash() -> None:
    m = Manifest.from_module(Tiny())
    assert [e.name for e in m.entries] == ["a.weight", "a.bias", "b.weight"]
    assert m.entries[0] == ManifestEntry("a.weight", (3, 4), "float32")
    assert m.numel == 12 + 3 + 6
    assert len(m.hash) == 16 and int(m.hash, 16) >= 0
    assert m.hash == Manifest.from_module(Tiny()).hash
    other = Manifest(m.entries[:2] + (ManifestEntry("b.weight", (3, 2), "float32"),))
    assert other.hash != m.hash
    assert Manifest(m.entries[:2] + (ManifestEntry("b.weight", (2, 3), "float16"),)).hash != m.hash


def test_manifest_flatten_unflatten_roundtrip() -> None:
    mod = Tiny()
    m = Manifest.from_module(mod)
    params = {n: p.detach() for n, p in mod.named_parameters() if p.requires_grad}
    flat = m.flatten(params)
    assert flat.dtype == torch.float32 and flat.shape == (m.numel,)
    back = m.unflatten(flat)
    for name, t in params.items():
        assert torch.equal(back[name], t)
    back["a.bias"].fill_(7.0)                 # views write through
    assert torch.all(flat[12:15] == 7.0)
    with pytest.raises(KeyError):
        m.flatten({k: v for k, v in params.items() if k != "a.bias"})
    with pytest.raises(ValueError):
        m.flatten({**params, "a.bias": torch.zeros(4)})
    with pytest.raises(ValueError):
        m.flatten({**params, "extra": torch.zeros(1)})
    with pytest.raises(ValueError):
        m.unflatten(torch.zeros(m.numel + 1))


def test_flatten_grads_zeros_where_none() -> None:
    mod = Tiny()
    m = Manifest.from_module(mod)
    mod.a.weight.grad = torch.ones(3, 4)
    g = m.flatten_grads(mod)
    assert torch.equal(g[:12], torch.ones(12)) and torch.equal(g[12:], torch.zeros(9))


# -- config --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(mode="topk-int3"), dict(ratio=0.0), dict(ratio=1.5), dict(block_size=0),
    dict(dense_dtype="fp16"), dict(warmup_steps=-1), dict(warmup_start_ratio=0.0),
    dict(warmup_steps=10, warmup_start_ratio=0.001, ratio=0.01), dict(clip_norm=-1.0),
    dict(clip_norm=float("nan")),
])
def test_config_validate_rejects(bad: dict) -> None:
    with pytest.raises(ValueError):
        CodecConfig(**bad).validate()


def test_ratio_at_warmup_schedule() -> None:
    cfg = CodecConfig(ratio=0.01, warmup_steps=10, warmup_start_ratio=0.25)
    cfg.validate()
    rs = [cfg.ratio_at(s) for s in range(15)]
    assert rs[0] == pytest.approx(0.25)
    assert all(a >= b for a, b in zip(rs, rs[1:]))
    assert rs[5] == pytest.approx(math.sqrt(0.25 * 0.01))        # exponential: geometric mean halfway
    assert all(r == 0.01 for r in rs[10:])
    assert CodecConfig(ratio=0.02).ratio_at(0) == 0.02


# -- selection -----------------------------------------------------------------------------
@pytest.mark.parametrize("n,ratio", [(200_000, 0.01), (300_000, 0.001), (100_000, 0.05)])
def test_fast_topk_equals_exact(n: int, ratio: float) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(n) * np.repeat(np.logspace(-3, 1, 10), n // 10)).astype(np.float32)
    k = int(round(ratio * n))
    fast = topk_fast(x, k, np.random.default_rng(2))
    assert fast is not None, "fast path should not need its fallback on smooth data"
    exact = topk_exact(x, k)
    assert fast.dtype == np.int64 and np.all(np.diff(fast) > 0)
    np.testing.assert_array_equal(fast, exact)


def test_select_with_zeros_ties_and_fallback() -> None:
    n = 100_000
    x = np.zeros(n, dtype=np.float32)
    x[::1000] = np.arange(1, 101, dtype=np.float32)         # only 100 non-zeros, k = 1000
    out = select_topk(x, 1000, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(out, np.flatnonzero(x))
    y = np.ones(n, dtype=np.float32)                          # all ties: lowest indices win
    out = select_topk(y, 500, rng=np.random.default_rng(0))
    assert out.size == 500 and np.all(np.diff(out) > 0)
    np.testing.assert_array_equal(topk_exact(x, 50), np.flatnonzero(x)[-50:])


# -- index coding --------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(1, 1), (10, 10), (1000, 1), (1000, 999), (12345, 77), (1 << 20, 5000)])
def test_elias_fano_roundtrip(n: int, k: int) -> None:
    rng = np.random.default_rng(n + k)
    idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
    buf = np.frombuffer(indexcode.encode(idx, n), dtype=np.uint8)
    assert buf.size == indexcode.encoded_size(n, k)
    np.testing.assert_array_equal(indexcode.decode(buf, n, k), idx)


def test_elias_fano_near_bound() -> None:
    n, k = 1_000_000, 10_000
    bits = 8 * indexcode.encoded_size(n, k) / k
    assert bits <= 9.0
    assert subset_bound_bits(n, k) / k == pytest.approx(8.1, abs=0.1)


# -- values --------------------------------------------------------------------------------
def test_int8_blockwise_survives_outlier() -> None:
    rng = np.random.default_rng(0)
    v = rng.standard_normal(4096).astype(np.float32)
    v[17] = 1e4
    body, deq = quant.quantize_sparse(v, "int8", 64)
    back = quant.dequantize_sparse(body, "int8", v.size, 64)
    assert np.array_equal(back, deq)
    mask = np.arange(v.size) >= 64                            # blocks without the outlier
    rel = np.abs(deq - v)[mask].sum() / np.abs(v[mask]).sum()
    assert rel < 0.01
    assert np.count_nonzero(deq[mask] == 0) < 0.02 * mask.sum()


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4", "int2"])
def test_sparse_value_roundtrip_and_clamp(fmt: str) -> None:
    v = np.array([1e9, -1e9, 3.0, -0.5, 1e-12, 0.25, 7.0], dtype=np.float32)
    body, deq = quant.quantize_sparse(v, fmt, 4)
    assert body.size == quant.value_bytes(fmt, v.size, 4)
    assert np.isfinite(deq).all()
    assert np.array_equal(quant.dequantize_sparse(body, fmt, v.size, 4), deq)


def test_int2_is_ternary_with_each_blocks_absmax_and_refuses_code_3() -> None:
    v = np.array([3.0, -3.0, 1.6, -1.4, 2.1, 0.01, 6.0, -6.0, 2.0], dtype=np.float32)
    body, deq = quant.quantize_sparse(v, "int2", 4)
    assert body.size == 2 * 3 + 3  # three fp16 scales, nine 2-bit codes in three bytes
    # block 1: absmax 3 -> -3, 0, 3; block 2: absmax 6; block 3: 2.0 alone (exact)
    assert deq.tolist() == [3.0, -3.0, 3.0, 0.0, 0.0, 0.0, 6.0, -6.0, 2.0]
    assert np.array_equal(quant.dequantize_sparse(body, "int2", v.size, 4), deq)
    bad = body.copy()
    bad[-1] |= 0xC0  # code 3 in the padding of the last byte
    with pytest.raises(CodecError, match="code 3"):
        quant.dequantize_sparse(bad, "int2", v.size, 4)


def test_int2_error_feedback_keeps_the_rounding_in_the_residual() -> None:
    """sum of what was sent + the residual == sum of the gradients (fp32 rounding aside): the
    2-bit rounding is not lost, it is sent later."""
    n = 20_000
    m = flat_manifest(n)
    c = Compressor(m, CodecConfig(mode="topk-int2", ratio=0.02), sender="peer-1")
    gen = torch.Generator().manual_seed(5)
    total_g = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    for step in range(20):
        g = torch.randn(n, generator=gen)
        total_g += g.double()
        enc = c.compress(g, step)
        assert enc.mode == "topk-int2"
        total_sent += enc.decoded.to_dense().double()
    residual = c.state_dict()["residual"].double()
    assert torch.allclose(total_sent + residual, total_g, atol=1e-3)
    int8 = Compressor(m, CodecConfig(mode="topk-int8", ratio=0.02), sender="peer-1").compress(torch.randn(n), 0)
    assert enc.wire_bytes < 0.75 * int8.wire_bytes  # 2 bits a value instead of 8 (the indices stay)


# -- compressor + wire ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_encoded_decoded_bit_identical(mode: str) -> None:
    n = 50_000
    m = flat_manifest(n)
    c = Compressor(m, CodecConfig(mode=mode, ratio=0.02), sender="peer-1")
    g = torch.randn(n, generator=torch.Generator().manual_seed(3))
    for step in range(3):
        enc = c.compress(g, step)
        assert isinstance(enc, Encoded) and enc.mode == mode and enc.step == step and not enc.skipped
        d = decode_payload(enc.blob, m, header_mode=enc.mode, max_ratio=0.02)
        assert isinstance(d, Decoded) and d.sender == "peer-1" and d.step == step and d.mode == mode
        assert d.k == enc.k == enc.decoded.k
        assert torch.equal(d.values, enc.decoded.values)
        if mode == "none":
            assert d.indices is None and d.values.shape == (n,)
        else:
            assert torch.equal(d.indices, enc.decoded.indices) and enc.k == 1000
        assert torch.equal(d.to_dense(), enc.decoded.to_dense())


def test_payload_180x_smaller_int8_1pct() -> None:
    n = 1_000_000
    m = flat_manifest(n)
    c = Compressor(m, CodecConfig(mode="topk-int8", ratio=0.01), sender="s")
    enc = c.compress(torch.randn(n, generator=torch.Generator().manual_seed(0)), 0)
    assert enc.k == 10_000
    assert enc.dense_bytes / enc.wire_bytes >= 180
    hlen = struct.unpack_from("<Q", enc.blob)[0]
    assert hlen <= 256                                        # header stays small


def test_dense_fallback_only_where_sparse_is_larger() -> None:
    m = Manifest.from_module(Tiny())
    enc = Compressor(m, CodecConfig(mode="topk", ratio=0.95), "s").compress(torch.randn(m.numel), 0)
    assert enc.mode == "none" and enc.decoded.indices is None and enc.k == m.numel
    n = 10_000
    m2 = flat_manifest(n)
    c = Compressor(m2, CodecConfig(mode="topk", ratio=1.0), "s")
    enc = c.compress(torch.randn(n), 0)
    assert enc.mode == "none" and enc.wire_bytes < 2 * n + 300 and c.fallback_steps == 1
    assert decode_payload(enc.blob, m2, header_mode="none").indices is None
    # int4 at k = n would be smaller than bf16 dense, but receivers refuse a sparse payload of more
    # than MAX_SPARSE_RATIO of the entries: it goes dense (a small model under --min-payload did
    # exactly this, and every one of its payloads was refused)
    enc = Compressor(m2, CodecConfig(mode="topk-int4", ratio=1.0), "s").compress(torch.randn(n), 0)
    assert enc.mode == "none"
    decode_payload(enc.blob, m2, header_mode="none", max_ratio=MAX_SPARSE_RATIO)
    enc = Compressor(m2, CodecConfig(mode="topk-int4", ratio=0.5), "s").compress(torch.randn(n), 0)
    assert enc.mode == "topk-int4" and enc.wire_bytes < n
    decode_payload(enc.blob, m2, header_mode="topk-int4", max_ratio=MAX_SPARSE_RATIO)
    # a small model whose --min-payload floor covers every entry: dense, and accepted
    small = flat_manifest(99)
    enc = Compressor(small, CodecConfig(mode="topk-int8", ratio=0.01, min_bytes=32768), "s").compress(torch.randn(99), 0)
    assert enc.mode == "none"
    decode_payload(enc.blob, small, header_mode="none", max_ratio=MAX_SPARSE_RATIO)


def test_nonfinite_step_skipped_and_residual_untouched() -> None:
    n = 10_000
    m = flat_manifest(n)
    c = Compressor(m, CodecConfig(ratio=0.01), "s")
    c.compress(torch.randn(n), 0)
    before = c.residual.clone()
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = torch.randn(n)
        g[123] = bad
        enc = c.compress(g, 1)
        assert enc.skipped and enc.k == 0 and enc.decoded.k == 0
        assert torch.equal(c.residual, before)
        d = decode_payload(enc.blob, m, header_mode=enc.mode)
        assert d.k == 0 and torch.count_nonzero(d.to_dense()) == 0
    assert c.skipped_steps == 3
    huge = torch.full((n,), 3e38)                              # finite but its fp32 sum overflows
    assert not c.compress(huge, 2).skipped


def test_clipping_scales_before_accumulation() -> None:
    n = 1000
    m = flat_manifest(n)
    c = Compressor(m, CodecConfig(mode="none", dense_dtype="fp32", clip_norm=1.0), "s")
    g = torch.randn(n) * 100
    enc = c.compress(g, 0)
    total = enc.decoded.to_dense() + c.residual
    assert float(total.norm()) == pytest.approx(1.0, rel=1e-5)
    assert torch.allclose(total, g * (1.0 / float(g.norm())), atol=1e-6)


def test_warmup_sends_denser_then_target() -> None:
    n = 100_000
    m = flat_manifest(n)
    cfg = CodecConfig(mode="topk-int8", ratio=0.001, warmup_steps=4, warmup_start_ratio=0.1)
    c = Compressor(m, cfg, "s")
    ks = [c.compress(torch.randn(n), s).k for s in range(6)]
    assert ks[0] == 10_000 and ks[4] == ks[5] == 100
    assert all(a > b for a, b in zip(ks[:5], ks[1:5]))


def test_state_dict_roundtrip() -> None:
    n = 5000
    m = flat_manifest(n)
    c = Compressor(m, CodecConfig(), "s")
    c.compress(torch.randn(n), 0)
    g = torch.randn(n)
    g[0] = float("nan")
    c.compress(g, 1)
    c2 = Compressor(m, CodecConfig(), "s")
    c2.load_state_dict(c.state_dict())
    assert torch.equal(c2.residual, c.residual) and c2.skipped_steps == 1
    with pytest.raises(CodecError):
        c2.load_state_dict({"residual": torch.zeros(n + 1)})


# -- hostile decoder: targeted cases ---------------------------------------------------------
def _valid(n: int = 1000, mode: str = "topk-int8", ratio: float = 0.05) -> tuple[Manifest, bytes]:
    m = flat_manifest(n)
    enc = Compressor(m, CodecConfig(mode=mode, ratio=ratio), "s").compress(
        torch.randn(n, generator=torch.Generator().manual_seed(5)), 7)
    return m, enc.blob


def _parts(blob: bytes) -> tuple[dict, np.ndarray]:
    hlen = struct.unpack_from("<Q", blob)[0]
    meta = json.loads(blob[8:8 + hlen])["__metadata__"]
    return meta, np.frombuffer(blob[8 + hlen:], dtype=np.uint8).copy()


def _rebuild(meta: dict, body: np.ndarray) -> bytes:
    return safetensors.numpy.save({"p": body}, metadata=meta)


@pytest.mark.parametrize("change,match", [
    (dict(v="2"), "version"), (dict(h="0" * 16), "manifest hash"), (dict(n="999"), "n=999"),
    (dict(m="topk"), "format"), (dict(m="zip"), "unknown mode"), (dict(f="int4"), "format"),
    (dict(k="-1"), "decimal"), (dict(k="51"), "shape"), (dict(k="1000000"), "cap"),
    (dict(b="0"), "block size"), (dict(t="1.5"), "decimal"), (dict(extra="x"), "extra"),
])
def test_decoder_rejects_bad_metadata(change: dict, match: str) -> None:
    m, blob = _valid()
    meta, body = _parts(blob)
    meta.update(change)
    with pytest.raises(CodecError, match=match):
        decode_payload(_rebuild(meta, body), m)


def test_decoder_rejects_structural_problems() -> None:
    m, blob = _valid()
    meta, body = _parts(blob)
    with pytest.raises(CodecError, match="header"):
        decode_payload(blob, m, header_mode="topk")
    with pytest.raises(CodecError, match="cap"):
        decode_payload(blob, m, max_ratio=0.01)
    with pytest.raises(CodecError, match="exceeds the limit"):
        decode_payload(blob, m, max_bytes=100)
    with pytest.raises(CodecError, match="manifest hash"):
        decode_payload(blob, Manifest((ManifestEntry("v", (1000,), "float32"),)))
    with pytest.raises(CodecError):
        decode_payload(blob[:-3], m)                          # truncated data
    with pytest.raises(CodecError):
        decode_payload(blob[:20], m)                          # truncated header
    with pytest.raises(CodecError):
        decode_payload(b"", m)
    with pytest.raises(CodecError, match="missing"):
        decode_payload(_rebuild({k: v for k, v in meta.items() if k != "s"}, body), m)
    with pytest.raises(CodecError, match="exactly"):
        decode_payload(safetensors.numpy.save({"p": body, "q": body}, metadata=meta), m)
    with pytest.raises(CodecError, match="U8"):
        decode_payload(safetensors.numpy.save({"p": body.view(np.int8)}, metadata=meta), m)
    bad = body.copy()
    bad[0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)   # first block scale = inf
    with pytest.raises(CodecError, match="scale"):
        decode_payload(_rebuild(meta, bad), m)
    bad[0:2] = np.frombuffer(np.float16(-1.0).tobytes(), np.uint8)
    with pytest.raises(CodecError, match="scale"):
        decode_payload(_rebuild(meta, bad), m)


def test_decoder_rejects_bad_indices() -> None:
    n, k = 1000, 3
    m = flat_manifest(n)
    meta = {"v": "1", "h": m.hash, "n": str(n), "k": str(k), "m": "topk", "f": "fp16", "t": "0", "s": "x"}
    vals = np.ones(k, np.float16).view(np.uint8)
    for idx, match in [([5, 5, 9], "strictly"), ([9, 5, 7], "strictly")]:
        body = np.concatenate([vals, np.frombuffer(indexcode.encode(np.array(idx), n), np.uint8)])
        with pytest.raises(CodecError, match=match):
            decode_payload(_rebuild(meta, body), m)
    # out of range: encode against a larger universe with the same section sizes
    ell = indexcode.low_bits(n, k)
    good = np.frombuffer(indexcode.encode(np.array([1, 2, 3]), n), np.uint8).copy()
    hb, _ = indexcode.sizes(n, k)
    bits = np.zeros(hb * 8, bool)
    bits[[0, 1, indexcode.high_len(n, k) - 1]] = True          # last high part = (n-1)>>l, low = max
    good[:hb] = np.packbits(bits, bitorder="little")
    good[hb:] = 0xFF
    body = np.concatenate([vals, good])
    with pytest.raises(CodecError, match="out of range|strictly"):
        decode_payload(_rebuild(meta, body), m)
    assert ell > 0


@pytest.mark.parametrize("mode", ["topk", "topk-int8", "topk-int4", "topk-int2"])
def test_min_bytes_is_a_floor_on_the_payload_not_a_ceiling(mode):
    """A small model's payload is filled up to min_bytes (more entries than the ratio asks); a model
    whose ratio already gives more is unaffected; entries never exceed n (then it goes dense)."""
    g = torch.randn(200_000, generator=torch.Generator().manual_seed(3))
    plain = Compressor(flat_manifest(g.numel()), CodecConfig(mode=mode, ratio=0.01), "a").compress(g.clone(), 0)
    floored = Compressor(flat_manifest(g.numel()), CodecConfig(mode=mode, ratio=0.01, min_bytes=32768), "a")
    enc = floored.compress(g.clone(), 0)
    assert plain.k == 2000 and enc.k == floored.k_floor > 2000
    assert 32768 <= len(enc.blob) <= 32768 + 1024  # the body fills the floor; the header is extra
    dec = decode_payload(enc.blob, flat_manifest(g.numel()), header_mode=mode)
    assert dec.indices.numel() == enc.k
    ratio = 0.4 if mode == "topk-int2" else 0.2  # (2-bit values: 40,000 entries are under the floor)
    big = Compressor(flat_manifest(g.numel()), CodecConfig(mode=mode, ratio=ratio, min_bytes=32768), "a")
    assert big.compress(g.clone(), 0).k == int(ratio * 200_000)  # ratio above the floor: unchanged
    tiny = Compressor(flat_manifest(1000), CodecConfig(mode=mode, ratio=0.01, min_bytes=1 << 20), "a")
    small = tiny.compress(torch.randn(1000), 0)  # the floor exceeds the whole model: every entry goes
    assert small.k == 1000 and tiny.k_floor == 1000  # (sparse when that is still smaller than dense)
    with pytest.raises(ValueError, match="min_bytes"):
        CodecConfig(min_bytes=-1).validate()


@pytest.mark.parametrize("mode", ["topk-int8", "topk-int2"])
def test_a_share_sends_its_part_of_the_entries_and_the_byte_floor_and_keeps_the_rest(mode):
    """compress(share=k) (a window's payload when more peers contribute than the cap): 1/k of the
    entries the ratio asks for, or of the byte floor where that is larger; the error feedback still
    holds everything unsent, so the payloads over several windows lose nothing; share 1 is the plain
    payload, bit for bit."""
    n = 200_000
    gs = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    cfg = CodecConfig(mode=mode, ratio=0.2)
    plain, shared = Compressor(flat_manifest(n), cfg, "a"), Compressor(flat_manifest(n), cfg, "a")
    assert shared.compress(gs[0].clone(), 0, share=4).k == 10_000 and plain.compress(gs[0].clone(), 0).k == 40_000
    floored = Compressor(flat_manifest(n), CodecConfig(mode=mode, ratio=0.01, min_bytes=32768), "a")
    enc = floored.compress(gs[0].clone(), 0, share=2)
    assert 16384 <= len(enc.blob) <= 16384 + 1024 and enc.k < floored.k_floor / 2  # half the floor's bytes
    one = Compressor(flat_manifest(n), cfg, "a").compress(gs[0].clone(), 0, share=1).decoded
    none = Compressor(flat_manifest(n), cfg, "a").compress(gs[0].clone(), 0).decoded
    assert torch.equal(one.indices, none.indices) and torch.equal(one.values, none.values)
    ef = Compressor(flat_manifest(n), cfg, "a")
    sent = torch.zeros(n, dtype=torch.float64)
    for w, g in enumerate(gs):
        dense = torch.zeros(n)
        ef.compress(g.clone(), w, share=3).decoded.add_to(dense)
        sent += dense.double()
    total = sum(g.double() for g in gs)
    assert float((sent + ef.residual.double() - total).abs().max()) <= 1e-5 * float(total.abs().max())
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="share"):
            ef.compress(gs[0].clone(), 3, share=bad)


# -- chunk-wise selection ------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,chunk", [(1000, 10, 64), (4096, 41, 4096), (10_000, 100, 300), (130, 130, 64),
                                       (70, 3, 64)])
def test_chunked_selection_keeps_each_chunks_share_of_its_largest(n, k, chunk) -> None:
    from swarm.codec.select import chunk_quotas, select_chunked

    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    x[::7] = 0.0  # zeros are never sent
    quota = chunk_quotas(n, k, chunk)
    assert quota.sum() == k and quota.size == -(-n // chunk) and (quota >= 0).all()
    idx = select_chunked(x, k, chunk)
    assert np.all(np.diff(idx) > 0) and np.all(x[idx] != 0)
    for c, q in enumerate(quota.tolist()):  # reference: per chunk, its q largest non-zero |x|
        part = np.abs(x[c * chunk:(c + 1) * chunk])
        want = np.sort(np.argsort(-part, kind="stable")[:q]) + c * chunk
        want = want[x[want] != 0]
        got = idx[(idx >= c * chunk) & (idx < (c + 1) * chunk)]
        assert np.array_equal(got, want), c


def test_chunked_payload_roundtrips_and_spreads_over_the_vector() -> None:
    n = 100_000
    m = flat_manifest(n)
    g = torch.randn(n, generator=torch.Generator().manual_seed(1))
    g[:1000] *= 100.0  # one "layer" with far larger gradients takes nearly every global Top-K entry
    glob = Compressor(m, CodecConfig(mode="topk-int8", ratio=0.01), "s").compress(g.clone(), 0)
    chunked = Compressor(m, CodecConfig(mode="topk-int8", ratio=0.01, chunk=1000), "s").compress(g.clone(), 0)
    assert glob.k == chunked.k == 1000
    assert int((glob.decoded.indices < 1000).sum()) > 900
    assert int((chunked.decoded.indices < 1000).sum()) == 10  # 10 per chunk of 1000, 99 other chunks
    d = decode_payload(chunked.blob, m, header_mode="topk-int8", max_ratio=0.01)
    assert torch.equal(d.to_dense(), chunked.decoded.to_dense())
    for bad in (1, 63, True, 1 << 25):
        with pytest.raises(ValueError, match="chunk"):
            CodecConfig(chunk=bad).validate()
