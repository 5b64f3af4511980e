"""The faster step function (aiayn.decoding.fast): the same outputs as the reference
CachedStep in fp32, and close ones in bf16 / int8, on a real tiny Transformer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_search import SOURCES, encode_src, tiny_model  # tests/unit is on sys.path

from aiayn.decoding import CachedStep, beam_search, greedy_search
from aiayn.decoding.fast import FastDecoder


@pytest.fixture(scope="module", params=["post", "pre"])
def model(request):
    m = tiny_model(60, seed=3)
    if request.param == "pre":
        from aiayn.model import Transformer

        torch.manual_seed(3)
        m = Transformer(dataclasses.replace(m.config, norm="pre")).eval()
    return m


@pytest.mark.parametrize("beam_size", [1, 4])
def test_fast_fp32_equals_reference(model, beam_size):
    lens = torch.tensor([7, 3, 12, 5])
    with torch.no_grad():
        memory, mask = encode_src(model, SOURCES)
        ref_step = CachedStep.start(model, memory, mask)
        fast_step = FastDecoder(model, "fp32").start(memory, mask, int(lens.max()) + 1)
        if beam_size == 1:
            ref, fast = greedy_search(ref_step, lens), greedy_search(fast_step, lens)
            pairs = list(zip(ref, fast))
        else:
            ref = beam_search(ref_step, lens, beam_size=beam_size, nbest=beam_size)
            fast = beam_search(fast_step, lens, beam_size=beam_size, nbest=beam_size)
            pairs = [p for r, f in zip(ref, fast) for p in zip(r, f, strict=True)]
    for r, f in pairs:
        assert r.tokens == f.tokens
        assert abs(r.score - f.score) < 1e-4


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_reduced_precision_logits_stay_close(model, dtype):
    with torch.no_grad():
        memory, mask = encode_src(model, SOURCES)
        ref = CachedStep.start(model, memory, mask)(torch.ones(4, dtype=torch.long))
        fast = FastDecoder(model, dtype).start(memory, mask, 4)(torch.ones(4, dtype=torch.long))
    assert fast.dtype == torch.float32
    ok = torch.isfinite(ref)
    err = (fast.float() - ref)[ok].abs().max().item()
    assert err < 0.1 * ref[ok].abs().max().item()
    assert torch.equal(fast.float().argmax(-1), ref.argmax(-1))


def test_unknown_dtype_raises(model):
    with pytest.raises(ValueError, match="dtype"):
        FastDecoder(model, "fp8")


def test_restricted_attention_is_refused():
    # FastStep keeps the whole prefix and no band mask: decoding a windowed model with it
    # would silently attend beyond r, so it must refuse
    with pytest.raises(ValueError, match="attention_window=3"):
        FastDecoder(tiny_model(60, seed=3, attention_window=3), "fp32")
