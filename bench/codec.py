"""Benchmark of swarm.codec against the naive sketch, single-threaded.

Usage:  python3 bench/codec.py [--quick] [--repeats R]

For n in 1e6, 1e7 (and 5e7 unless --quick) at ratios 0.01 and 0.001, mode topk-int8:
wire bytes (all headers included) vs dense fp32 and vs the information bound
(log2 C(n,k) bits + 8 value bits per kept entry), and compress / decompress time
vs a naive reference (torch.topk, int64 indices, int8 values with one per-tensor
scale: the seed sketch's approach). "Compress" is the whole path for both: add
residual, select, quantize, update residual, encode indices, serialize.
Prints a table, then ONE JSON object as the last stdout line. Medians of R repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import safetensors.torch  # noqa: E402

from swarm.codec import CodecConfig, Compressor, Manifest, ManifestEntry, decode_payload  # noqa: E402
from swarm.codec.payload import subset_bound_bits  # noqa: E402


class NaiveCompressor:
    """The sketch's approach, for comparison only: topk + int64 idx + per-tensor int8 scale."""

    def __init__(self, n: int, ratio: float) -> None:
        self.residual = torch.zeros(n)
        self.k = max(1, min(n, int(n * ratio)))

    def compress(self, g: torch.Tensor) -> bytes:
        acc = g + self.residual
        _, idx = torch.topk(acc.abs(), self.k, sorted=False)
        vals = acc[idx]
        carry = acc.clone()
        carry[idx] = 0.0
        self.residual = carry
        peak = vals.abs().max()
        scale = (peak / 127.0) if peak > 0 else torch.tensor(1.0)
        q = torch.round(vals / scale).clamp_(-127, 127).to(torch.int8)
        return safetensors.torch.save({"w::val": q, "w::scale": scale.reshape(1).float(),
                                       "w::idx": idx.to(torch.int64)})


def naive_decompress(blob: bytes, n: int) -> torch.Tensor:
    p = safetensors.torch.load(blob)
    val = p["w::val"].to(torch.float32) * float(p["w::scale"][0])
    flat = torch.zeros(n, dtype=torch.float32)
    flat[p["w::idx"]] = val
    return flat


def make_grad(n: int, seed: int) -> torch.Tensor:
    """Gaussian gradient with per-"layer" scales spanning 3 decades (more realistic than iid)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen)
    chunks = 16
    scales = torch.logspace(-3, 0, chunks)
    for i, s in enumerate(scales):
        g[i * n // chunks:(i + 1) * n // chunks] *= s
    return g


def timed(fn, repeats: int) -> tuple[float, object]:
    ts, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def bench_case(n: int, ratio: float, repeats: int) -> dict:
    m = Manifest((ManifestEntry("w", (n,), "float32"),))
    g = make_grad(n, seed=n % 9973)
    comp = Compressor(m, CodecConfig(mode="topk-int8", ratio=ratio), sender="bench")
    naive = NaiveCompressor(n, ratio)
    comp.compress(g, 0)          # warm-up (allocations, residual non-zero from here on)
    naive.compress(g)
    t_ours, enc = timed(lambda: comp.compress(g, 1), repeats)
    t_naive, nblob = timed(lambda: naive.compress(g), repeats)
    d_ours, dense = timed(lambda: decode_payload(enc.blob, m, header_mode=enc.mode,
                                                 max_ratio=ratio).to_dense(), repeats)
    d_naive, _ = timed(lambda: naive_decompress(nblob, n), repeats)
    k = enc.k
    bound_bytes = (subset_bound_bits(n, k) + 8 * k) / 8
    del dense
    return {
        "n": n, "ratio": ratio, "k": k, "wire": enc.wire_bytes, "naive_wire": len(nblob),
        "x_dense": 4 * n / enc.wire_bytes, "x_dense_naive": 4 * n / len(nblob),
        "vs_bound": enc.wire_bytes / bound_bytes,
        "idx_bits": 8 * (enc.wire_bytes - k - 2 * ((k + 63) // 64)) / k,  # header counted here too
        "bound_idx_bits": subset_bound_bits(n, k) / k,
        "c_ms": 1e3 * t_ours, "c_naive_ms": 1e3 * t_naive, "c_speedup": t_naive / t_ours,
        "d_ms": 1e3 * d_ours, "d_naive_ms": 1e3 * d_naive, "d_speedup": d_naive / d_ours,
    }


def ef_mass_error(n: int = 1_000_000, steps: int = 40, ratio: float = 0.01) -> float:
    """max |sum(decoded) + residual - sum(grads)| / max |sum(grads)| (float64 bookkeeping)."""
    m = Manifest((ManifestEntry("w", (n,), "float32"),))
    comp = Compressor(m, CodecConfig(mode="topk-int8", ratio=ratio), sender="ef")
    total_g = torch.zeros(n, dtype=torch.float64)
    total_d = torch.zeros(n, dtype=torch.float64)
    for s in range(steps):
        g = make_grad(n, seed=1000 + s) + 0.01   # a small consistent direction
        total_g += g
        enc = comp.compress(g, s)
        total_d += enc.decoded.to_dense()
    err = (total_d + comp.residual.double() - total_g).abs().max()
    return float(err / total_g.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip n=5e7")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [1_000_000, 10_000_000] + ([] if args.quick else [50_000_000])
    rows = []
    print(f"swarm.codec bench: torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"mode=topk-int8 (block 64), medians of {args.repeats}")
    hdr = (f"{'n':>10} {'ratio':>6} {'k':>8} {'wire B':>9} {'x dense':>8} {'/bound':>6} "
           f"{'idx b/k':>7} {'naive B':>9} {'x naive':>7} | {'comp ms':>8} {'naive':>8} {'speedup':>7} | "
           f"{'dec ms':>7} {'naive':>7} {'speedup':>7}")
    print(hdr)
    print("-" * len(hdr))
    for n in sizes:
        for ratio in (0.01, 0.001):
            r = bench_case(n, ratio, args.repeats)
            rows.append(r)
            print(f"{r['n']:>10} {r['ratio']:>6} {r['k']:>8} {r['wire']:>9} {r['x_dense']:>8.1f} "
                  f"{r['vs_bound']:>6.3f} {r['idx_bits']:>7.2f} {r['naive_wire']:>9} "
                  f"{r['x_dense_naive']:>7.1f} | {r['c_ms']:>8.2f} {r['c_naive_ms']:>8.2f} "
                  f"{r['c_speedup']:>7.1f} | {r['d_ms']:>7.2f} {r['d_naive_ms']:>7.2f} {r['d_speedup']:>7.1f}",
                  flush=True)
    ef = ef_mass_error()
    print(f"error feedback: max |sum(decoded)+residual-sum(grads)| / max|sum(grads)| = {ef:.3g} "
          f"(n=1e6, 40 steps, int8)")
    at = {(r["n"], r["ratio"]): r for r in rows}
    r7 = at[(10_000_000, 0.01)]
    out = {
        "ratio_vs_dense_1pct": round(r7["x_dense"], 2),
        "bound_ratio_1pct": round(r7["vs_bound"], 4),
        "compress_speedup_vs_naive_1e7": round(r7["c_speedup"], 2),
        "decompress_speedup_vs_naive_1e7": round(r7["d_speedup"], 2),
        "ef_mass_error": ef,
        "ratio_vs_dense_0.1pct": round(at[(10_000_000, 0.001)]["x_dense"], 2),
        "compress_speedup_vs_naive_1e7_0.1pct": round(at[(10_000_000, 0.001)]["c_speedup"], 2),
        "compress_ms_1e7": round(r7["c_ms"], 2),
        "naive_compress_ms_1e7": round(r7["c_naive_ms"], 2),
        "wire_bytes_1e7_1pct": r7["wire"],
    }
    if (50_000_000, 0.01) in at:
        out["compress_speedup_vs_naive_5e7"] = round(at[(50_000_000, 0.01)]["c_speedup"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
