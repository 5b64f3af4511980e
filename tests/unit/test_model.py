"""The model of §3 against the paper: masking, eq. 1, positions, tying, post-norm, the cache."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import reference
from aiayn.config import ModelConfig
from aiayn.model import (
    DecoderLayer,
    Dropout,
    EncoderLayer,
    MultiHeadAttention,
    PositionalEncoding,
    Transformer,
    count_parameters,
    sinusoid_table,
)

V = 50  # vocabulary of the tiny test model; id 0 is padding


def tiny(**overrides) -> ModelConfig:
    kwargs = dict(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, P_drop=0.0, vocab_size=V,
                  max_len=64)
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def make_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny(**overrides)).eval()


def tokens(B: int, L: int, vocab: int = V, seed: int = 1) -> torch.Tensor:
    """Random non-padding ids, (B, L)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (B, L), generator=g)


def record_stack_inputs(model: Transformer) -> dict[str, torch.Tensor]:
    """A dict that each forward fills with the inputs of the first encoder layer ("enc",
    (B, S, d_model)) and of the first decoder layer ("dec", (B, T, d_model))."""
    seen: dict[str, torch.Tensor] = {}
    model.encoder[0].register_forward_pre_hook(lambda m, args: seen.update(enc=args[0]))
    model.decoder[0].register_forward_pre_hook(lambda m, args: seen.update(dec=args[0]))
    return seen


def padded_source() -> tuple[torch.Tensor, torch.Tensor]:
    """A (3, 8) source whose rows have 8, 5 and 2 real tokens, right-padded with id 0."""
    src = tokens(3, 8)
    lengths = torch.tensor([8, 5, 2])
    mask = torch.arange(8)[None, :] < lengths[:, None]  # (B, S), True at real tokens
    return src.masked_fill(~mask, 0), mask


# --- shapes and masking (§3.1, §3.2.3) ------------------------------------------------------

def test_forward_shapes():
    model = make_model()
    src, _ = padded_source()
    tgt = tokens(3, 6, seed=2)
    memory, src_mask = model.encode(src)
    assert memory.shape == (3, 8, 32)
    assert src_mask.dtype == torch.bool and src_mask.tolist()[2] == [True] * 2 + [False] * 6
    assert model(src, tgt).shape == (3, 6, V)


def test_output_mask_projects_only_the_chosen_positions():
    model = make_model()
    src, _ = padded_source()
    tgt = tokens(3, 6, seed=2)
    keep = torch.tensor([[True] * 6, [True] * 3 + [False] * 3, [True] + [False] * 5])
    full = model(src, tgt)  # (3, 6, V)
    picked = model(src, tgt, output_mask=keep)  # (n, V)
    assert picked.shape == (10, V)
    assert torch.allclose(picked, full[keep], atol=1e-6)
    with pytest.raises(ValueError, match="output_mask must be bool"):
        model(src, tgt, output_mask=keep.long())


def test_dropout_keeps_1_minus_p_and_preserves_the_mean():
    torch.manual_seed(0)
    drop = Dropout(0.3)
    x = torch.ones(200_000)
    y = drop(x)
    kept = y != 0
    assert abs(float(kept.float().mean()) - 0.7) < 0.005
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.7), rtol=1e-4)
    assert abs(float(y.mean()) - 1.0) < 0.01  # inverted dropout: E[y] = x
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)  # torch's generator: seeded runs repeat
    assert not torch.equal(drop(x), y)  # and successive calls draw new masks
    z = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    assert drop(z).shape == z.shape and drop(z).dtype == torch.bfloat16
    assert torch.equal(drop.eval()(z), z)  # identity in eval mode
    assert torch.equal(Dropout(0.0).train()(z), z)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="P_drop"):
            Dropout(bad)


def test_changing_a_padded_source_token_changes_no_output():
    model = make_model()
    src, mask = padded_source()
    tgt = tokens(3, 6, seed=2)
    with torch.no_grad():
        memory, _ = model.encode(src, mask)
        logits = model(src, tgt, mask)
        other = torch.where(mask, src, tokens(3, 8, seed=3))  # new ids where padded only
        assert not torch.equal(other, src)
        memory2, _ = model.encode(other, mask)
        logits2 = model(other, tgt, mask)
    torch.testing.assert_close(memory2[mask], memory[mask], rtol=0, atol=1e-6)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=1e-6)


def test_padding_gives_the_same_output_as_no_padding():
    model = make_model()
    src, mask = padded_source()
    tgt = tokens(3, 6, seed=2)
    with torch.no_grad():
        batch = model(src, tgt)  # mask derived from pad_id
        for row, length in enumerate(mask.sum(1).tolist()):
            alone = model(src[row:row + 1, :length], tgt[row:row + 1])
            torch.testing.assert_close(batch[row:row + 1], alone, rtol=0, atol=1e-5)


def test_decoder_output_at_i_ignores_targets_after_i():
    model = make_model()
    src, mask = padded_source()
    tgt = tokens(3, 7, seed=2)
    with torch.no_grad():
        logits = model(src, tgt)
        for i in range(6):
            changed = tgt.clone()
            changed[:, i + 1:] = tokens(3, 6 - i, seed=10 + i)
            assert not torch.equal(changed, tgt)
            logits2 = model(src, changed)
            torch.testing.assert_close(logits2[:, :i + 1], logits[:, :i + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(logits2[:, i + 1:], logits[:, i + 1:])  # the change shows


def test_source_mask_must_be_bool_of_shape_b_s():
    # a 0/1 float mask would reach SDPA as an additive bias and mask nothing
    model = make_model()
    src, mask = padded_source()
    with pytest.raises(TypeError, match="bool"):
        model.encode(src, mask.float())
    with pytest.raises(ValueError, match="shape"):
        model.encode(src, mask[:, None, None, :])
    memory, _ = model.encode(src, mask)
    with pytest.raises(TypeError, match="bool"):
        model.decode(tokens(3, 2), memory, mask.long())


# --- attention, eq. 1 and §3.2.2 ---------------------------------------------------------------

def test_reference_attention_on_a_hand_computed_case():
    # equal logits average the values; a masked key takes no weight at all
    q = torch.zeros(1, 2, 4)
    k = torch.randn(1, 3, 4)
    v = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [4.0, 4.0]]])
    out = reference.attention(q, k, v, torch.tensor([[True, True, False]]))
    torch.testing.assert_close(out, torch.full((1, 2, 2), 0.5, dtype=torch.float64))
    # one key against another: weights softmax([s, 0]) with s = q.k / sqrt(d_k)
    q = torch.tensor([[[2.0, 0.0, 0.0, 0.0]]])
    k = torch.tensor([[[3.0, 0.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0]]])
    w = 1 / (1 + math.exp(-6.0 / 2))
    out = reference.attention(q, k, v[:, :2])
    torch.testing.assert_close(out, torch.tensor([[[w, 1 - w]]], dtype=torch.float64))


# train=True takes the explicit eq. 1 that CPU training runs, False the SDPA kernel
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("d_k, d_v", [(8, 8), (6, 10)])  # (6, 10): d_k, d_v free of d_model/h
def test_multi_head_attention_equals_eq1_in_float64(d_k, d_v, train):
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=32, h=4, d_k=d_k, d_v=d_v).train(train)
    for p in mha.parameters():  # nonzero biases, so that a lost bias would show
        nn.init.normal_(p, 0.0, 0.3)
    x, mem = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    src_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    with torch.no_grad():
        # encoder-decoder attention with a padding mask
        out = mha(x, mha.project_kv(mem), src_mask[:, None, None, :])
        ref = reference.multi_head(mha, x, mem, src_mask[:, None, :])
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        # self-attention, causal flag and explicit causal mask alike
        ref = reference.multi_head(mha, x, x, reference.causal_mask(5))
        out = mha(x, mha.project_kv(x), is_causal=True)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        out = mha(x, mha.project_kv(x), reference.causal_mask(5))
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_multi_head_attention_equals_torch_multihead_attention():
    torch.manual_seed(0)
    d_model, h = 32, 4
    ours = MultiHeadAttention(d_model, h, d_model // h, d_model // h).eval()
    for p in ours.parameters():
        nn.init.normal_(p, 0.0, 0.3)
    theirs = nn.MultiheadAttention(d_model, h, batch_first=True).eval()
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.W_q.bias, ours.W_k.bias, ours.W_v.bias]))
        theirs.out_proj.weight.copy_(ours.W_o.weight)
        theirs.out_proj.bias.copy_(ours.W_o.bias)
        x, mem = torch.randn(2, 5, d_model), torch.randn(2, 7, d_model)
        src_mask = torch.tensor([[True] * 7, [True] * 3 + [False] * 4])
        # torch's masks are the other way round: True = may NOT attend
        expected, _ = theirs(x, mem, mem, key_padding_mask=~src_mask, need_weights=False)
        got = ours(x, ours.project_kv(mem), src_mask[:, None, None, :])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        causal = reference.causal_mask(5)
        expected, _ = theirs(x, x, x, attn_mask=~causal, need_weights=False)
        got = ours(x, ours.project_kv(x), is_causal=True)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- positions and embeddings, §3.4-3.5 -------------------------------------------------------

@pytest.mark.parametrize("d_model", [32, 7])
def test_sinusoid_table_follows_section_3_5(d_model):
    table = sinusoid_table(60, d_model)
    assert table.shape == (60, d_model) and table.dtype == torch.float32
    expected = torch.tensor([[reference.sinusoid(pos, j, d_model) for j in range(d_model)]
                             for pos in range(60)])
    torch.testing.assert_close(table, expected, rtol=0, atol=1e-6)


def test_positional_encoding_offset_and_length_limit():
    pe = PositionalEncoding(16, max_len=10)
    torch.testing.assert_close(pe(3, offset=4), sinusoid_table(10, 16)[4:7])
    assert not any(True for _ in pe.parameters())  # sinusoids are not learned
    with pytest.raises(ValueError, match="max_len=10"):
        pe(5, offset=6)


def test_stack_inputs_are_scaled_embeddings_plus_positions():
    # §3.4: embedding weights multiplied by sqrt(d_model); §3.5: positional encodings added
    model = make_model()
    seen = record_stack_inputs(model)
    src, tgt = tokens(2, 6), tokens(2, 4, seed=2)
    W, pe = model.src_embed.weight, sinusoid_table(64, 32)
    with torch.no_grad():
        model(src, tgt)
        torch.testing.assert_close(seen["enc"], W[src] * math.sqrt(32) + pe[:6])
        torch.testing.assert_close(seen["dec"], W[tgt] * math.sqrt(32) + pe[:4])
        memory, mask = model.encode(src)
        cache = model.start_cache(memory, mask)
        model.decode_step(tgt[:, :3], cache)
        model.decode_step(tgt[:, 3:], cache)  # the fourth position gets PE row 3
        torch.testing.assert_close(seen["dec"], W[tgt[:, 3:]] * math.sqrt(32) + pe[3:4])


def test_learned_positions_are_trained_parameters():
    sinus, learned = make_model(), make_model(positional="learned")
    table = learned.positions.table
    assert isinstance(table, nn.Parameter) and table.shape == (64, 32)
    assert any(p is table for p in learned.parameters())
    assert count_parameters(learned) - count_parameters(sinus) == 64 * 32
    src, tgt = tokens(2, 6), tokens(2, 4, seed=2)
    learned.train()
    learned(src, tgt).logsumexp(-1).sum().backward()
    row_has_grad = table.grad.abs().sum(1) > 0
    assert row_has_grad[:6].all() and not row_has_grad[6:].any()  # positions used, and only those


def test_embeddings_and_softmax_share_one_parameter_and_its_gradient():
    """§3.4: one matrix for source embedding, target embedding and pre-softmax projection;
    its .grad is the sum of the three uses' gradients."""
    model = make_model()
    W = model.src_embed.weight
    assert model.tgt_embed.weight is W
    assert sum(p is W for p in model.parameters()) == 1
    names = [n for n, p in model.named_parameters() if p is W]
    assert names == ["src_embed.weight"]  # counted once

    lookups, hidden = [], {}

    def keep_lookup(module, args, out):
        out.retain_grad()
        lookups.append((args[0], out))

    model.src_embed.register_forward_hook(keep_lookup)  # fires for the source, then the target
    model.decoder[-1].register_forward_hook(lambda m, a, out: hidden.update(x=out))
    src, tgt_in, tgt_out = tokens(2, 6), tokens(2, 5, seed=2), tokens(2, 5, seed=3)
    logits = model(src, tgt_in)
    logits.retain_grad()
    F.cross_entropy(logits.reshape(-1, V), tgt_out.reshape(-1)).backward()

    (src_ids, src_rows), (tgt_ids, tgt_rows) = lookups
    assert torch.equal(src_ids, src) and torch.equal(tgt_ids, tgt_in)
    d = W.shape[1]
    from_src = torch.zeros_like(W).index_add_(0, src.reshape(-1), src_rows.grad.reshape(-1, d))
    from_tgt = torch.zeros_like(W).index_add_(0, tgt_in.reshape(-1), tgt_rows.grad.reshape(-1, d))
    from_softmax = logits.grad.reshape(-1, V).T @ hidden["x"].detach().reshape(-1, d)
    for part in (from_src, from_tgt, from_softmax):
        assert part.abs().sum() > 0
    torch.testing.assert_close(W.grad, from_src + from_tgt + from_softmax, rtol=1e-4, atol=1e-7)

    # the tie survives loading a state dict, and one storage serves all three uses
    fresh = Transformer(model.config)
    fresh.load_state_dict(model.state_dict())
    assert fresh.tgt_embed.weight is fresh.src_embed.weight
    with torch.no_grad():
        fresh.src_embed.weight.zero_()
        assert fresh(src, tgt_in).abs().max() == 0  # projection reads the zeroed matrix too


def test_untied_embeddings_with_a_separate_target_vocabulary():
    tied = make_model()
    model = make_model(share_embeddings=False, tgt_vocab_size=70)
    assert model.src_embed.weight.shape == (V, 32)
    assert model.tgt_embed.weight.shape == (70, 32)
    assert model.tgt_embed.weight.data_ptr() != model.src_embed.weight.data_ptr()
    assert count_parameters(model) - count_parameters(tied) == 70 * 32
    src, tgt = tokens(2, 6), tokens(2, 5, vocab=70, seed=2)
    logits = model(src, tgt)
    assert logits.shape == (2, 5, 70)
    logits.logsumexp(-1).sum().backward()
    assert model.src_embed.weight.grad.abs().sum() > 0
    assert model.tgt_embed.weight.grad.abs().sum() > 0


# --- incremental decoding -------------------------------------------------------------------

def decode_in_chunks(model: Transformer, src, tgt, chunks: list[int]) -> torch.Tensor:
    """Cached decoding of ``tgt`` fed ``chunks`` positions at a time; checks after each chunk
    that the cache counts every position and holds at most ``attention_window`` of them."""
    memory, mask = model.encode(src)
    cache = model.start_cache(memory, mask)
    window = model.config.attention_window
    outs, pos = [], 0
    for c in chunks:
        outs.append(model.decode_step(tgt[:, pos:pos + c], cache))
        pos += c
        assert cache.length == pos
        held = pos if window is None else min(pos, window)
        assert all(k.shape[2] == held for k, _ in cache.self_kv)  # flat memory under §4
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("options", [
    {},
    {"norm": "pre"},
    {"positional": "learned"},
    {"share_embeddings": False, "tgt_vocab_size": 70},
])
@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 2, 1], [7]])
def test_cached_decoding_equals_the_full_forward_pass(options, chunks):
    model = make_model(**options)
    src, _ = padded_source()
    tgt = tokens(3, 7, vocab=model.config.target_vocab_size, seed=2)
    with torch.no_grad():
        full = model(src, tgt)
        stepped = decode_in_chunks(model, src, tgt, chunks)
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)


def test_cache_index_select_reorders_rows():
    model = make_model()
    src, _ = padded_source()
    tgt = tokens(3, 6, seed=2)
    index = torch.tensor([2, 0, 0, 1])  # beam-style: reorder, duplicate, drop nothing
    with torch.no_grad():
        memory, mask = model.encode(src)
        cache = model.start_cache(memory, mask)
        model.decode_step(tgt[:, :3], cache)
        picked = cache.index_select(index)
        assert picked.batch_size == 4 and picked.length == 3 and cache.batch_size == 3
        assert torch.equal(picked.src_mask, mask[index])
        for (k, v), (k0, v0) in zip(picked.self_kv, cache.self_kv):
            assert torch.equal(k, k0[index]) and torch.equal(v, v0[index])
        got = torch.cat([model.decode_step(tgt[index, t:t + 1], picked) for t in range(3, 6)], 1)
        torch.testing.assert_close(got, model(src[index], tgt[index])[:, 3:], rtol=1e-5, atol=1e-5)
        # the original cache is untouched by the reordered one's growth
        assert cache.length == 3 and cache.self_kv[0][0].shape[2] == 3
        rest = model.decode_step(tgt[:, 3:], cache)
        torch.testing.assert_close(rest, model(src, tgt)[:, 3:], rtol=1e-5, atol=1e-5)


# --- residual blocks, §3.1 and §5.4 ---------------------------------------------------------

def run_layer(layer, x, mem=None):
    if isinstance(layer, EncoderLayer):
        return layer(x, None)
    return layer(x, layer.cross_attn.project_kv(mem), None)


@pytest.mark.parametrize("layer_cls", [EncoderLayer, DecoderLayer])
@pytest.mark.parametrize("train", [False, True])
def test_post_norm_output_is_layer_normalised_at_every_position(layer_cls, train):
    # LayerNorm(x + Dropout(Sublayer(x))): the LayerNorm comes last, dropout or not
    torch.manual_seed(0)
    layer = layer_cls(tiny(P_drop=0.5 if train else 0.0)).train(train)
    x, mem = torch.randn(2, 5, 32) * 3 + 1, torch.randn(2, 4, 32)
    out = run_layer(layer, x, mem)
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 5), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.var(-1, unbiased=False), torch.ones(2, 5), rtol=0, atol=1e-3)
    if train:  # dropout is really on
        assert not torch.allclose(out, run_layer(layer.eval(), x, mem))


def test_encoder_layer_composition_post_and_pre_norm():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32) * 2
    post = EncoderLayer(tiny()).eval()
    with torch.no_grad():
        attn = lambda layer, y: layer.self_attn(y, layer.self_attn.project_kv(y))  # noqa: E731
        ln1, ln2 = post.res_attn.norm, post.res_ffn.norm
        y = ln1(x + attn(post, x))
        torch.testing.assert_close(post(x, None), ln2(y + post.ffn(y)))

        pre = EncoderLayer(tiny(norm="pre")).eval()
        ln1, ln2 = pre.res_attn.norm, pre.res_ffn.norm
        y = x + attn(pre, ln1(x))
        out = pre(x, None)
        torch.testing.assert_close(out, y + pre.ffn(ln2(y)))
        assert out.var(-1, unbiased=False).sub(1).abs().max() > 0.1  # not normalised


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_model_fits_a_small_copy_batch(norm):
    model = make_model(norm=norm).train()
    if norm == "pre":
        assert model.encoder_norm is not None and model.decoder_norm is not None
    src = tokens(8, 6, seed=5)
    tgt_in = torch.cat([torch.ones(8, 1, dtype=torch.long), src[:, :-1]], 1)  # shifted right
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), src.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0]


def test_dropout_is_active_in_training_only():
    model = make_model(P_drop=0.3)
    src, tgt = tokens(2, 6), tokens(2, 5, seed=2)
    with torch.no_grad():
        assert torch.equal(model(src, tgt), model(src, tgt))
        model.train()
        assert not torch.equal(model(src, tgt), model(src, tgt))


def test_source_word_dropout_zeroes_whole_source_tokens_in_training_only():
    # each dropped source token's input to the encoder is its position alone; the kept ones are
    # scaled by 1 / (1 - p); the decoder's inputs are untouched
    p = 0.5
    model = make_model(word_dropout=p)
    seen = record_stack_inputs(model)
    src, tgt = tokens(4, 16), tokens(4, 5, seed=2)
    W, pe = model.src_embed.weight, sinusoid_table(64, 32)
    with torch.no_grad():
        model(src, tgt)
        torch.testing.assert_close(seen["enc"], W[src] * math.sqrt(32) + pe[:16])
        model.train()
        torch.manual_seed(0)
        model(src, tgt)
    dropped = torch.isclose(seen["enc"], pe[:16].expand(4, 16, 32), atol=1e-6).all(-1)  # (B, S)
    kept = torch.isclose(seen["enc"], W[src] * math.sqrt(32) / (1 - p) + pe[:16]).all(-1)
    assert torch.equal(dropped | kept, torch.ones(4, 16, dtype=torch.bool))
    assert 16 <= int(dropped.sum()) <= 48  # about half of 64 tokens (p < 1e-4 outside)
    torch.testing.assert_close(seen["dec"], W[tgt] * math.sqrt(32) + pe[:5])


# --- mixed precision ------------------------------------------------------------------------

def test_bf16_autocast_on_cpu_runs_and_stays_close_to_fp32():
    model = make_model().train()  # P_drop = 0: train mode, yet deterministic
    src, _ = padded_source()
    tgt_in, tgt_out = tokens(3, 6, seed=2), tokens(3, 6, seed=3)
    with torch.no_grad():
        ref = model(src, tgt_in)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt_in)
        assert logits.dtype == torch.bfloat16  # autocast did take over
        loss = F.cross_entropy(logits.float().reshape(-1, V), tgt_out.reshape(-1))
    loss.backward()
    rel = (logits.float() - ref).norm() / ref.norm()
    assert rel < 0.03, f"bf16 logits differ from fp32 by {rel:.3%}"
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name


def test_bf16_weights_sum_embedding_gradients_in_float32():
    # train.bf16_weights trains a bf16 copy of the model: a token seen 3,000 times must get
    # the sum of its 3,000 gradient rows, not a bf16 running sum that stops growing
    model = make_model().train()
    src = torch.full((60, 50), 5, dtype=torch.long)  # token 5, 3,000 times
    tgt_in = tokens(60, 4, seed=2)
    model.zero_grad()
    model(src, tgt_in).float().square().mean().backward()
    want = model.src_embed.weight.grad[5].clone()
    half = make_model().to(torch.bfloat16).train()
    half(src, tgt_in).float().square().mean().backward()
    got = half.src_embed.weight.grad[5].float()
    assert half.src_embed.weight.grad.dtype == torch.bfloat16
    assert (got - want).norm() / want.norm() < 0.05
