#!/usr/bin/env python3
"""Payload bytes and codec time of each sparse value format, side by side, on one gradient stream.

For the built-in task's dense size (n = 476,416) by default, at --ratio, each mode compresses the
same --steps Gaussian gradients (error feedback on) and decodes them; printed per mode: median
payload bytes, bytes per kept entry, median compress and decode ms (one torch thread), and the
relative error of the decoded sum against the gradients' sum after the last step (what error
feedback has not delivered yet). The LAST stdout line is one JSON object.

    python3 bench/modes.py                     # n 476416, ratio 0.01, 20 steps
    python3 bench/modes.py --n 5000000 --ratio 0.003
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.codec import CodecConfig, Compressor, Manifest, ManifestEntry, decode_payload  # noqa: E402

MODES = ("topk", "topk-int8", "topk-int4", "topk-int2")


def run(mode: str, n: int, ratio: float, steps: int) -> dict:
    m = Manifest((ManifestEntry("w", (n,), "float32"),))
    comp = Compressor(m, CodecConfig(mode=mode, ratio=ratio), sender="bench")
    gen = torch.Generator().manual_seed(0)  # the same stream for every mode
    sizes, t_enc, t_dec = [], [], []
    total_g = torch.zeros(n, dtype=torch.float64)
    total_d = torch.zeros(n, dtype=torch.float64)
    for s in range(steps):
        g = torch.randn(n, generator=gen) + 0.01
        total_g += g.double()
        t0 = time.perf_counter()
        enc = comp.compress(g, s)
        t1 = time.perf_counter()
        dec = decode_payload(enc.blob, m, header_mode=enc.mode, max_ratio=ratio)
        dense = dec.to_dense()
        t2 = time.perf_counter()
        total_d += dense.double()
        sizes.append(len(enc.blob))
        t_enc.append((t1 - t0) * 1e3)
        t_dec.append((t2 - t1) * 1e3)
    k = enc.k
    rel = float((total_d - total_g).norm() / total_g.norm())
    return {"mode": mode, "k": k, "bytes": int(statistics.median(sizes)),
            "bytes_per_entry": round(statistics.median(sizes) / max(k, 1), 3),
            "compress_ms": round(statistics.median(t_enc), 2), "decode_ms": round(statistics.median(t_dec), 2),
            "undelivered_rel_l2": round(rel, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=476_416)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    if a.n < 1 or not 0 < a.ratio <= 0.5 or a.steps < 1:
        print("--n must be >= 1, --ratio in (0, 0.5], --steps >= 1", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    rows = [run(mode, a.n, a.ratio, a.steps) for mode in MODES]
    print(f"n={a.n} ratio={a.ratio} steps={a.steps} (medians; one torch thread)")
    print("| mode | k | bytes | bytes/entry | compress ms | decode ms | undelivered (rel L2) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['k']} | {r['bytes']} | {r['bytes_per_entry']} | {r['compress_ms']} | "
              f"{r['decode_ms']} | {r['undelivered_rel_l2']} |")
    print(json.dumps({"n": a.n, "ratio": a.ratio, "steps": a.steps, "modes": rows}))


if __name__ == "__main__":
    main()
