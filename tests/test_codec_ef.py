"""Property: error feedback loses nothing.

Over many steps, sum(decoded payloads) + final residual == sum(gradients) up to fp32
rounding, for every mode, with outliers, zeros, warm-up and skipped (non-finite) steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from swarm.codec import MODES, CodecConfig, Compressor, Manifest, ManifestEntry, decode_payload

torch.set_num_threads(1)
EPS32 = float(np.finfo(np.float32).eps)


def run_ef(n: int, mode: str, ratio: float, steps: int, seed: int, *, dense_dtype: str = "bf16",
           warmup: int = 0, outliers: bool = False, nan_every: int = 0, check_wire: bool = False,
           chunk: int = 0) -> None:
    m = Manifest((ManifestEntry("a", (n // 2,), "float32"), ManifestEntry("b", (n - n // 2,), "float32")))
    cfg = CodecConfig(mode=mode, ratio=ratio, dense_dtype=dense_dtype, warmup_steps=warmup,
                      warmup_start_ratio=max(ratio, 0.3), chunk=chunk)
    comp = Compressor(m, cfg, sender="ef")
    gen = np.random.default_rng(seed)
    total_g = np.zeros(n)
    cum_abs = np.zeros(n)
    total_d = torch.zeros(n, dtype=torch.float64)
    skipped = 0
    for s in range(steps):
        g = gen.standard_normal(n).astype(np.float32) * np.float32(10.0 ** gen.uniform(-4, 2))
        g[gen.random(n) < 0.2] = 0.0                              # sparse-ish gradients
        g += np.float32(1e-3)                                      # a small consistent direction
        if outliers:
            g[gen.integers(0, n, 3)] = gen.choice([1e5, -1e6, 3e4]).astype(np.float32)
        if nan_every and s % nan_every == nan_every - 1:
            g[gen.integers(0, n)] = np.nan
            enc = comp.compress(torch.from_numpy(g), s)
            assert enc.skipped and enc.k == 0
            skipped += 1
            continue
        total_g += g
        cum_abs += np.abs(g)
        enc = comp.compress(torch.from_numpy(g), s)
        dec = enc.decoded
        if check_wire:
            dec = decode_payload(enc.blob, m, header_mode=enc.mode, max_ratio=cfg.ratio_at(s))
        total_d += dec.to_dense().double()
    assert comp.skipped_steps == skipped
    assert torch.isfinite(comp.residual).all()
    err = np.abs(total_d.numpy() + comp.residual.double().numpy() - total_g)
    tol = 2 * EPS32 * steps * cum_abs + 1e-30
    worst = float(np.max(err - tol))
    assert worst <= 0, f"EF lost mass: max err {err.max():.3g}, tol at worst {tol[np.argmax(err - tol)]:.3g}"


@pytest.mark.parametrize("mode", MODES)
def test_ef_conserves_mass_each_mode(mode: str) -> None:
    run_ef(4000, mode, 0.01, 40, seed=MODES.index(mode), outliers=True, nan_every=7, check_wire=True)


@pytest.mark.parametrize("mode", ["topk-int8", "topk-int2"])
def test_ef_conserves_mass_chunk_wise(mode: str) -> None:
    run_ef(5000, mode, 0.01, 30, seed=3, outliers=True, nan_every=7, check_wire=True, chunk=64)


def test_ef_conserves_mass_fast_path_and_warmup() -> None:
    run_ef(200_000, "topk-int8", 0.01, 12, seed=11, warmup=5)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(mode=st.sampled_from(MODES), ratio=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
       n=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1), dense=st.sampled_from(["bf16", "fp32"]),
       warmup=st.integers(0, 5), outliers=st.booleans(), nan_every=st.sampled_from([0, 3]))
def test_ef_property(mode: str, ratio: float, n: int, seed: int, dense: str, warmup: int,
                     outliers: bool, nan_every: int) -> None:
    run_ef(n, mode, ratio, 15, seed, dense_dtype=dense, warmup=warmup, outliers=outliers,
           nan_every=nan_every)
