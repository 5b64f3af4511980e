"""Table 1 (§4) measurement helpers: the exponent fit, the windowed restricted attention."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from aiayn.experiments.table1 import (
    LAYERS,
    fit_exponent,
    local_attention,
    measure,
    sequential_operations,
    summarize,
)
from aiayn.model.transformer import band_mask


@pytest.mark.parametrize("exponent", [1.0, 2.0, 0.5, 3.0])
def test_fit_recovers_known_exponents_on_synthetic_timings(exponent):
    rng = random.Random(0)
    ns = [2**i for i in range(4, 13)]
    times = [1e-6 * n**exponent * math.exp(rng.uniform(-0.05, 0.05)) for n in ns]
    assert fit_exponent(ns, times) == pytest.approx(exponent, abs=0.05)


def test_fit_uses_the_largest_n_where_fixed_costs_no_longer_hide_growth():
    ns = [2**i for i in range(4, 13)]
    times = [1e-5 + 1e-9 * n**2 for n in ns]  # a constant overhead dominates small n
    assert fit_exponent(ns, times, top=3) == pytest.approx(2.0, abs=0.15)
    assert fit_exponent(ns, times, top=len(ns)) < 1.5
    with pytest.raises(ValueError):
        fit_exponent([16], [1.0])
    with pytest.raises(ValueError):
        fit_exponent([16, 32], [1.0, 0.0])


@pytest.mark.parametrize("n,r", [(9, 2), (5, 7), (16, 1)])
def test_windowed_attention_equals_the_band_mask(n, r):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(n, n, r, causal=False))
    torch.testing.assert_close(local_attention(q, k, v, r), want, rtol=1e-5, atol=1e-5)


def test_measure_and_summary_on_small_n():
    records = [measure(kind, n, 16, h=2, r=2, k=3, repeats=1) for kind in LAYERS
               for n in (8, 16)]
    assert all(rec["time_s"] > 0 and rec["saved_bytes"] > 0 for rec in records)
    assert sequential_operations("recurrent", 16) == 16
    assert sequential_operations("self-attention", 16) == 1
    rows = summarize(records)
    assert [r["kind"] for r in rows] == list(LAYERS)
    assert all(math.isfinite(r["time_exponent"]) for r in rows)
