"""Restricted self-attention, §4 (``attention_window = r``): the band mask against a dense
reference, locality of the encoder, and the flat-memory cache against the uncached decoder."""

from __future__ import annotations

import pytest
import reference
import torch
from test_model import decode_in_chunks  # tests/unit is on sys.path

from aiayn.config import ModelConfig
from aiayn.model import Transformer
from aiayn.model.transformer import band_mask

V = 50


def make_model(window: int | None, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    kwargs = dict(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, P_drop=0.0, vocab_size=V,
                  max_len=64, attention_window=window)
    kwargs.update(overrides)
    return Transformer(ModelConfig(**kwargs)).eval()


def tokens(B: int, L: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (B, L), generator=torch.Generator().manual_seed(seed))


def test_window_is_validated():
    with pytest.raises(ValueError, match="attention_window"):
        ModelConfig(attention_window=0)
    assert ModelConfig().attention_window is None


@pytest.mark.parametrize("r", [1, 2, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_band_mask_equals_a_dense_loop(r, causal):
    q_off, k_off = 3, 1
    got = band_mask(4, 7, r, causal=causal, q_offset=q_off, k_offset=k_off)
    want = torch.tensor([[abs((i + q_off) - (j + k_off)) <= r and
                          (not causal or j + k_off <= i + q_off) for j in range(7)]
                         for i in range(4)])
    assert torch.equal(got, want)
    assert torch.equal(band_mask(5, 5, None, causal=True), reference.causal_mask(5))


def test_restricted_layer_equals_reference_attention_with_the_band():
    model = make_model(2)
    mha = model.encoder[0].self_attn
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3))
    mask = band_mask(9, 9, 2, causal=False)
    with torch.no_grad():
        got = mha(x, mha.project_kv(x), mask)
    torch.testing.assert_close(got.double(), reference.multi_head(mha, x, x, mask),
                               rtol=1e-5, atol=1e-5)


def test_encoder_sees_only_r_positions_per_layer():
    """One layer with r = 2: changing source token 6 moves outputs 4..8 only."""
    model = make_model(2, N=1)
    src = tokens(1, 12)
    changed = src.clone()
    changed[0, 6] = (src[0, 6] % (V - 1)) + 1
    with torch.no_grad():
        a, _ = model.encode(src)
        b, _ = model.encode(changed)
    moved = (a - b).abs().amax(dim=-1)[0] > 1e-6
    assert moved.nonzero().squeeze(1).tolist() == [4, 5, 6, 7, 8]


def test_window_wider_than_the_input_changes_nothing():
    src, tgt = tokens(3, 8), tokens(3, 7, seed=2)
    src[1, 5:] = 0  # padding
    with torch.no_grad():
        torch.testing.assert_close(make_model(20)(src, tgt), make_model(None)(src, tgt))


def test_padding_far_from_tokens_stays_finite():
    src = tokens(2, 16)
    src[1, 2:] = 0  # 14 padding positions, most farther than r from any token
    with torch.no_grad():
        memory, _ = make_model(1).encode(src)
    assert torch.isfinite(memory).all()


@pytest.mark.parametrize("chunks", [[1] * 9, [3, 1, 4, 1]])
def test_restricted_cache_equals_uncached_decoder_and_stays_flat(chunks):
    r = 3
    model = make_model(r)
    src, tgt = tokens(2, 6), tokens(2, 9, seed=2)
    with torch.no_grad():
        full = model(src, tgt)
        cached = decode_in_chunks(model, src, tgt, chunks)  # asserts at most r positions held
        memory, mask = model.encode(src)
        assert model.start_cache(memory, mask).index_select(torch.tensor([1, 0])).window == r
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    # the band really restricts: the unrestricted model with the same weights differs
    unrestricted = make_model(None)
    with torch.no_grad():
        assert not torch.allclose(unrestricted(src, tgt), full, atol=1e-4)
