"""The decoding kernels (aiayn.model.kernels): attention over each query's own keys equals eq. 1
(tests/reference.py) within float32 rounding, for cached self-attention, beams grouped over
one sentence's encoder output, causal queries and padded sources; the int8 rescale and the
fused W^QKV give today's int8 numbers bit for bit; the searches' argmax and top-k give torch's
answers."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import reference
import torch

from aiayn.model import MultiHeadAttention, kernels
from aiayn.model.quantize import Int8Linear

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="numba is not installed")


@contextlib.contextmanager
def _without(kind: str | None):
    """The block with kernel kind ``kind`` switched off (None: the kernels as they are), then
    ``kernels.ENABLED`` as it was before."""
    kept = set(kernels.ENABLED)
    kernels.ENABLED.discard(kind)
    try:
        yield
    finally:
        kernels.ENABLED.clear()
        kernels.ENABLED.update(kept)


def _eq1(q, k, v, lengths, group, causal_from):
    """Reference: q (N, Tq, h, d), k/v (R, h, Tk, d) -> (N, Tq, h, d_v), float64."""
    N, Tq, h, _ = q.shape
    Tk = k.shape[2]
    rows = []
    for r in range(N):
        kr = r // group
        allowed = torch.arange(Tk)[None, :] < lengths[kr]  # (1, Tk)
        if causal_from >= 0:
            allowed = allowed & (torch.arange(Tk)[None, :]
                                 <= causal_from + torch.arange(Tq)[:, None])
        out = reference.attention(q[r].transpose(0, 1), k[kr], v[kr], allowed)  # (h, Tq, d_v)
        rows.append(out.transpose(0, 1))
    return torch.stack(rows)


@pytest.mark.parametrize("group, Tq, causal_from, layout", [
    (1, 1, -1, "cache"),     # decoder self-attention: one new query per row, a cache buffer
    (4, 1, -1, "split"),     # 4 beams per sentence over its encoder keys, padded sources
    (1, 7, -1, "split"),     # encoder self-attention
    (1, 5, 3, "cache"),      # 5 new positions after 3 cached, causal
])
def test_attend_is_eq1_over_each_rows_own_keys(group, Tq, causal_from, layout):
    torch.manual_seed(0)
    R, h, d, Tk = 3, 4, 16, 9
    q = torch.randn(R * group, Tq, h, d)
    if layout == "cache":  # a (rows, h, capacity, d) buffer holding Tk positions
        k = torch.randn(R, h, Tk + 4, d)[:, :, :Tk]
        v = torch.randn(R, h, Tk + 4, d)[:, :, :Tk]
        lengths = torch.full((R,), Tk)
        if causal_from >= 0:
            lengths = torch.full((R,), causal_from + Tq)
    else:  # a projection (R, Tk, h * d) split into heads: (R, h, Tk, d) with strides
        k = torch.randn(R, Tk, h, d).transpose(1, 2)
        v = torch.randn(R, Tk, h, d).transpose(1, 2)
        lengths = torch.tensor([Tk, 4, 1])
    with torch.no_grad():
        got = kernels.attend(q, k, v, lengths, group=group, causal_from=causal_from)
    want = _eq1(q, k, v, lengths, group, causal_from)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    # the padding beyond a row's length is never read: garbage there changes nothing
    if layout == "split":
        k2, v2 = k.clone(), v.clone()
        for r, n in enumerate(lengths.tolist()):
            k2[r, :, n:] = 1e30
            v2[r, :, n:] = float("nan")
        with torch.no_grad():
            again = kernels.attend(q, k2, v2, lengths, group=group, causal_from=causal_from)
        assert torch.equal(again, got)


def test_attention_module_uses_the_kernel_and_matches_sdpa():
    from aiayn.model.engine import _attention  # the engine's pass over the module

    torch.manual_seed(1)
    mha = MultiHeadAttention(32, 4, 8, 8).eval()
    x, mem = torch.randn(6, 1, 32), torch.randn(2, 5, 32)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    with torch.no_grad():
        kv = mha.project_kv(mem)
        sdpa = mha(x, kv, mask[:, None, None, :], group=3)
        kernel = _attention(mha, x, kv, mask[:, None, None, :], group=3, key_len=mask.sum(1))
    torch.testing.assert_close(kernel, sdpa, atol=1e-5, rtol=1e-5)


def test_rescale_and_fused_qkv_are_todays_int8_bit_for_bit():
    torch.manual_seed(2)
    x = torch.randn(37, 64) * torch.logspace(-2, 2, 37)[:, None]
    maps = [torch.nn.Linear(64, 48) for _ in range(3)]
    with torch.no_grad():
        with _without("int8"):
            torch_path = [Int8Linear.from_linear(m)(x) for m in maps]
        one_pass = [Int8Linear.from_linear(m)(x) for m in maps]
        fused = Int8Linear(torch.cat([m.weight for m in maps]),
                           torch.cat([m.bias for m in maps]))(x)
    for a, b in zip(torch_path, one_pass):
        assert torch.equal(a, b)
    assert torch.equal(fused, torch.cat(torch_path, dim=1))


def test_prefix_lengths_only_for_right_padding():
    right = torch.tensor([[True, True, False], [True, True, True]])
    assert kernels.prefix_lengths(right).tolist() == [2, 3]
    assert kernels.prefix_lengths(torch.tensor([[False, True, True]])) is None


def test_quantize_rows_and_the_fused_relu_are_torchs_numbers():
    from aiayn.model.quantize import _quantize_rows

    torch.manual_seed(3)
    x = torch.randn(33, 96) * torch.logspace(-3, 3, 33)[:, None]
    x[0, :6] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127.0]) * (x[0].abs().max() / 127)
    x[1] = 0.0
    x[1, ::2] = -0.0
    x[2, 7] = -3.0 * x[2].abs().max()  # the largest magnitude is a negative value
    a8, a_scale = _quantize_rows(x)
    b8, b_scale = kernels.quantize_rows(x)
    assert torch.equal(a8, b8) and torch.equal(a_scale, b_scale)
    linear = Int8Linear.from_linear(torch.nn.Linear(96, 40))
    with torch.no_grad():
        plain = linear(x)
        linear.relu = True
        assert torch.equal(linear(x), plain.clamp(min=0.0))


def _held(buf):
    return torch.cat([buf[:4, :, 0].flatten(), buf[:, :, 1].flatten()])


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_gathering_cache_gives_the_same_numbers_and_moves_no_keys(beam_size):
    from test_search import SOURCES, encode_src, tiny_model  # tests/unit is on sys.path

    from aiayn.decoding import CachedStep, beam_search

    model = tiny_model(60, seed=3)
    lens = torch.tensor([9, 4, 12, 6])
    outs, buffers = [], []
    for gather in (True, False):
        with torch.no_grad():
            memory, mask = encode_src(model, SOURCES)
            step = CachedStep.start(model, memory, mask, 13)
            assert step.cache.gather  # the CPU kernels' default
            step.cache.gather = gather
            step(torch.ones(4, dtype=torch.long))
            step = step.select(torch.arange(4).repeat_interleave(2))
            step(torch.ones(8, dtype=torch.long))
            first = step.cache._k[0]
            # what the rows hold: position 0 in buffer rows 0-3 (one per sentence, step 0
            # ran on one row each), position 1 in rows 0-7 (the rest is never written)
            before = _held(first).clone()
            order = torch.tensor([1, 0, 3, 2, 4, 5, 7, 6])  # beams swap within sentences
            moved = step.select(order).cache
            # gathering: the buffers are untouched, only the table of rows changes
            if gather:
                buffers.append(moved._k[0] is first and torch.equal(_held(first), before)
                               and moved.key_rows[:, 1].tolist() == order.tolist())
            step = CachedStep.start(model, memory, mask, 13)
            step.cache.gather = gather
            outs.append(beam_search(step, lens, beam_size=beam_size, alpha=0.6,
                                    nbest=beam_size))
    assert buffers[0]
    gathered, moved = outs
    assert [[h.tokens for h in s] for s in gathered] == [[h.tokens for h in s] for s in moved]
    assert [[h.score for h in s] for s in gathered] == [[h.score for h in s] for s in moved]


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 130), (32, 8000)])
def test_row_argmax_is_torchs_argmax_ties_and_infinities_included(shape):
    """The first column of each row's maximum, as torch.argmax gives it: with -inf entries,
    rows of one repeated maximum, an all -inf row; a NaN anywhere hands the call back."""
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=gen) * 4
    x[0, 0] = float("-inf")
    if shape[0] > 2:
        x[1, shape[1] // 2:] = x[1].max()  # a tie: the first of them wins
        x[2] = float("-inf")
    assert torch.equal(kernels.row_argmax(x), x.argmax(dim=1))
    for nan in (float("nan"), -float("nan")):
        x[-1, -1] = nan
        assert kernels.row_argmax(x) is None


@pytest.mark.parametrize("n,G,V,k", [(1, 1, 5, 2), (3, 4, 7, 8), (5, 1, 300, 8),
                                     (8, 4, 2000, 8), (2, 6, 1000, 12)])
def test_beam_top_is_topk_over_the_summed_candidates(n, G, V, k):
    """The k best of live + logp over each sentence's G rows: the same float sums as torch's
    addition, in topk's order; banned (-inf) tokens and dead (-inf) beams included. Ties are
    avoided by the random draws, except among -inf candidates, whose order topk leaves open
    (their values are checked)."""
    gen = torch.Generator().manual_seed(V)
    logp = torch.log_softmax(torch.randn(n * G, V, generator=gen) * 3, dim=-1)
    logp[:, :2] = float("-inf")  # PAD and BOS
    live = torch.randn(n, G, generator=gen) * 5
    if G > 1:
        live[0, 1:] = float("-inf")  # one sentence with one live beam
    want = (live[:, :, None] + logp.view(n, G, V)).view(n, G * V).topk(k, dim=1)
    values, index = kernels.beam_top(logp, live, k)
    assert torch.equal(values, want.values)
    finite = values > float("-inf")
    assert torch.equal(index[finite], want.indices[finite])
    logp[-1, -1] = float("nan")
    assert kernels.beam_top(logp, live, k) is None


@pytest.mark.parametrize("beam_size", [1, 4])
def test_the_searches_find_the_same_hypotheses_with_the_search_kernels(beam_size):
    """Greedy and beam search (n-best, alpha > 0) over a small model: the same tokens and
    the same scores, bit for bit, with the search kernels and with torch's argmax and top-k."""
    from test_search import SOURCES, encode_src, tiny_model  # tests/unit is on sys.path

    from aiayn.decoding import CachedStep, beam_search, greedy_search

    model = tiny_model(60, seed=5)
    lens = torch.tensor([9, 4, 12, 6])
    outs = []
    for off in (None, "search"):
        with _without(off), torch.inference_mode():
            memory, mask = encode_src(model, SOURCES)
            step = CachedStep.start(model, memory, mask, 13)
            if beam_size == 1:
                hyps = [[h] for h in greedy_search(step, lens)]
            else:
                hyps = beam_search(step, lens, beam_size=beam_size, alpha=0.6,
                                   nbest=beam_size)
        outs.append([[(h.tokens, h.score) for h in s] for s in hyps])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 130), (32, 5852), (128, 8000)])
def test_log_softmax_kernel_is_torchs_within_rounding(shape):
    """The output layer's log-softmax kernel against F.log_softmax, row by row: within a few
    float32 ulp of the log-sum-exp, with -inf entries (they stay -inf), rows of one repeated
    value, logits spread over ±80 (exponentials near underflow); a row holding a NaN or an
    infinite maximum gets torch's answer."""
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=gen) * 20
    if shape[1] > 1:
        x[0, 0] = float("-inf")
    if shape[0] > 2:
        x[1] = 3.0  # uniform: log(1/V) exactly as torch has it, up to rounding
        x[2, :] = torch.linspace(-80, 80, shape[1])
    want = torch.log_softmax(x.double(), dim=-1)
    got = kernels.log_softmax(x)
    assert got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    tol = 4e-7 * (1.0 + want[finite].abs())
    assert bool(((got.double()[finite] - want[finite]).abs() <= tol).all())
    torch_f32 = torch.log_softmax(x, dim=-1)
    assert torch.allclose(got[finite], torch_f32[finite], rtol=1e-6, atol=1e-5)
    assert torch.equal(kernels.log_softmax(x[None]), got[None])  # any leading shape
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[-1, -1] = bad
        assert kernels._log_softmax(y.numpy())[1] is False
        assert torch.allclose(kernels.log_softmax(y), torch.log_softmax(y, dim=-1),
                              equal_nan=True)


def test_the_exponential_is_exp_down_to_its_floor_and_keeps_weights_normal():
    """rows._exp_term, the exponential of attention's weights and of the log-softmax's sums:
    within 2 float32 ulp of exp on [-64, 0]; below, e^-64's value (at least 2^-93), so a
    weight there, scaled by 1/sum >= 2^-20 and times a value above 2^-13, stays a normal
    float32. With its old floor, e^-87 (2^-125.5), those products fell below 2^-126, where
    each vector instruction meeting one took a microcode assist (docs/kernels.md): this
    fails there."""
    from aiayn.model.kernels.rows import _EXP_FLOOR, _exp_term

    d = np.linspace(-64.0, 0.0, 2001).astype(np.float32)
    got = np.array([_exp_term(x) for x in d], dtype=np.float64)
    want = np.exp(d.astype(np.float64))
    assert np.all(np.abs(got - want) <= 2 * np.finfo(np.float32).eps * want)
    floor = _exp_term(_EXP_FLOOR)
    for x in (-64.5, -80.0, -87.0, -200.0, -3.0e38):
        assert _exp_term(np.float32(x)) == floor, x
    tiny = np.float32(floor) * np.float32(2.0**-20) * np.float32(2.0**-13)
    assert tiny >= np.finfo(np.float32).tiny  # normal, not subnormal


@pytest.mark.parametrize("bias, packed", [(True, False), (False, False), (True, True)])
def test_int8_output_layer_log_softmax_is_its_logits_log_softmax(bias, packed):
    """Int8Linear.log_softmax (one kernel from the product's sums) against log_softmax of the
    same map's logits: within float rounding, and the same argmax in every row whose top two
    logits are clearly apart (two float paths may order a near-tie differently)."""
    gen = torch.Generator().manual_seed(7)
    lin = Int8Linear(torch.randn(600, 64, generator=gen),
                     torch.randn(600, generator=gen) if bias else None)
    lin._set_packing("onednn" if packed else None)
    x = torch.randn(40, 64, generator=gen) * 3
    with torch.inference_mode():
        want = torch.log_softmax(lin(x), dim=-1)
        got = lin.log_softmax(x)
        assert torch.allclose(got, want, rtol=1e-6, atol=2e-6)
        top2 = want.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1e-4
        assert int(clear.sum()) > 30  # the check below covers most rows
        assert torch.equal(got.argmax(dim=-1)[clear], want.argmax(dim=-1)[clear])
        assert torch.equal(got, kernels.log_softmax(lin(x)))  # the same numbers as a float path
        with _without("softmax"):
            assert torch.equal(lin.log_softmax(x), want)  # torch's own, without the kernels


def test_layer_norm_kernel_is_torchs_within_rounding_and_row_by_row():
    """kernels.layer_norm is F.layer_norm within float rounding; a row's output does not depend
    on the rows beside it; the post-norm sub-layer kernel (rescale, residual, LayerNorm in one
    pass) gives rescale + residual, then the LayerNorm kernel, bit for bit."""
    import numpy as np

    gen = torch.Generator().manual_seed(4)
    for d in (8, 256, 513):
        x = torch.randn(37, d, generator=gen) * 3 + 1
        w, b = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
        with torch.no_grad():
            got = kernels.layer_norm(x, w.numpy(), b.numpy(), 1e-6)
            want = torch.nn.functional.layer_norm(x.double(), (d,), w.double(), b.double(), 1e-6)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
            alone = torch.cat([kernels.layer_norm(x[i:i + 1], w.numpy(), b.numpy(), 1e-6)
                               for i in range(5)])
            assert torch.equal(alone, got[:5])
    acc = torch.randint(-3000, 3000, (6, 16), dtype=torch.int32, generator=gen).numpy()
    x_scale = torch.rand(6, 1, generator=gen).numpy()
    w_scale, bias = torch.rand(16, generator=gen).numpy(), torch.randn(16, generator=gen).numpy()
    resid = torch.randn(6, 16, generator=gen).numpy()
    g, beta = torch.randn(16, generator=gen).numpy(), torch.randn(16, generator=gen).numpy()
    eps = np.float32(1e-5)
    fused = kernels._rescale_add_norm(acc, x_scale, w_scale, bias, True, resid, g, beta, eps)
    two = kernels._layer_norm(kernels._rescale_add(acc, x_scale, w_scale, bias, True, resid),
                              g, beta, eps)
    assert np.array_equal(fused, two)


def test_attend_does_not_depend_on_where_its_inputs_lie_in_memory():
    """Batch invariance needs more than a fixed order of sums: LLVM can give a loop that both
    stores and sums two compiled copies, picked at run time by the arrays' addresses, that
    round differently. The same queries, keys and values placed at other offsets, with the
    kernel's own scratch arrays landing elsewhere in the heap, give the same output bit for
    bit, for key counts that take every path (four-key passes and the rest, vector and scalar
    exponentials)."""
    import numpy as np

    torch.manual_seed(0)
    R, h, G = 3, 4, 2
    for Tk in (1, 3, 4, 5, 9, 16, 17, 25, 33):
        for d in (16, 64):
            q = torch.randn(R * G, 1, h, d)
            k, v = torch.randn(R, Tk, h, d), torch.randn(R, Tk, h, d)
            lengths = torch.tensor([Tk, max(1, Tk // 2), 1])
            with torch.no_grad():
                ref = kernels.attend(q, k.transpose(1, 2), v.transpose(1, 2), lengths, group=G)
                held = []  # small blocks kept alive, so the kernel's scratch lands elsewhere
                for offset in range(1, 40, 3):
                    def placed(t, offset=offset):
                        view = torch.empty(t.numel() + 64)[offset:offset + t.numel()]
                        return view.view(t.shape).copy_(t)

                    held += [np.empty(Tk + offset % 7, np.float32) for _ in range(offset % 5)]
                    got = kernels.attend(placed(q), placed(k).transpose(1, 2),
                                         placed(v).transpose(1, 2), lengths, group=G)
                    assert torch.equal(got, ref), (Tk, d, offset)


def test_attend_past_the_prefetch_size_gives_each_rows_numbers_alone():
    """A call that reads more keys and values than ``kernels.PREFETCH_BYTES`` (a core's
    level-2 cache) prefetches each next head's; that is a hint to the CPU and moves no number:
    every row is what it is attended alone (a call far under the size), bit for bit, and
    eq. 1 within float32 rounding, in a float32 and a bf16 cache."""
    torch.manual_seed(3)
    h, d, Tk, G = 8, 64, 40, 4
    R = kernels.PREFETCH_BYTES // (h * Tk * 2 * d * 2) + 2  # bf16: over the size
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(R * G, 1, h, d)
        k = torch.randn(R, h, Tk + 3, d).to(dtype)[:, :, :Tk]
        v = torch.randn(R, h, Tk + 3, d).to(dtype)[:, :, :Tk]
        lengths = torch.randint(1, Tk + 1, (R,))
        assert R * h * Tk * 2 * d * k.element_size() > kernels.PREFETCH_BYTES
        with torch.no_grad():
            got = kernels.attend(q, k, v, lengths, group=G)
            for r in range(R):
                alone = kernels.attend(q[r * G:(r + 1) * G], k[r:r + 1], v[r:r + 1],
                                       lengths[r:r + 1], group=G)
                assert torch.equal(got[r * G:(r + 1) * G], alone), (dtype, r)
        want = _eq1(q, k.float(), v.float(), lengths, G, -1)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_the_value_sums_held_in_registers_are_the_four_value_passes_bit_for_bit():
    """Where d_v is a multiple of 16, ``_attend`` sums a (row, head)'s weighted values in
    vector registers (``kernels._value_sum_intrinsic``), one query at a time or a beam
    group's 2-4 queries over the same value rows at once: the same chain of fused
    multiply-adds as the passes of four values it ran before (``kernels._axpy4``, then one
    value at a time), so the same bits, for float32 and bf16 values, blocks of 64 and of 16,
    and every key count from none to past three passes."""
    numba = pytest.importorskip("numba")
    if not kernels.AVAILABLE:
        pytest.skip("the kernels are switched off")
    f32 = kernels._f32
    sums = {1: kernels._value_sum1, 2: kernels._value_sum2, 3: kernels._value_sum3,
            4: kernels._value_sum4}

    @numba.njit(fastmath=True)
    def passes(out, oo, v, vo, w, n, inv, DV):
        ov = out[oo:oo + DV]
        ov[:] = np.float32(0.0)
        j = 0
        while j + 4 <= n:
            kernels._axpy4(ov, v, w[j] * inv, vo[j], w[j + 1] * inv, vo[j + 1],
                           w[j + 2] * inv, vo[j + 2], w[j + 3] * inv, vo[j + 3])
            j += 4
        while j < n:
            x = w[j] * inv
            vv = v[vo[j]:vo[j] + DV]
            for dd in range(DV):
                ov[dd] += x * f32(vv[dd])
            j += 1

    def registers(Q):
        value_sum = sums[Q]

        @numba.njit
        def run(out, oo, ostride, v, vo, w, wstride, n, inv, DV):
            value_sum(out, oo, ostride, v, vo, w, wstride, n, inv, DV)
        return run

    rng = np.random.default_rng(5)
    values = rng.standard_normal(4000).astype(np.float32)
    bf16 = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    for Q in (1, 2, 3, 4):
        run = registers(Q)
        for v in (values, bf16):
            for DV in (16, 48, 64, 80, 128):
                for n in (0, 1, 3, 4, 5, 8, 13, 29):
                    vo = rng.integers(0, v.size - DV, n).astype(np.int64)
                    w = rng.random((Q, 31)).astype(np.float32)  # each query's weights
                    inv = (np.float32(1.0) / (w[:, :n].sum(1) + 1)).astype(np.float32)
                    ostride = DV + 5
                    want = np.full(Q * ostride + 7, np.nan, np.float32)
                    got = want.copy()
                    for t in range(Q):
                        passes(want, 3 + t * ostride, v, vo, w[t], n, inv[t], DV)
                    run(got, 3, ostride, v, vo, w.reshape(-1), 31, n, inv, DV)
                    assert np.array_equal(got, want, equal_nan=True), (Q, v.dtype, DV, n)


@pytest.mark.parametrize("G", [2, 3, 4, 5, 8])
def test_a_beam_groups_queries_get_what_each_gets_alone(G):
    """One query a row over keys that a group of rows shares (a beam group's encoder-decoder
    attention) runs the group's value sums together, up to four queries a pass over each
    value row (``kernels._attend_groups``): every query's output is what it gets with the
    keys and values copied to its own row, bit for bit, and eq. 1 within float32 rounding,
    for float32 and bf16 keys and values and d_v of one and several 16-lane blocks."""
    torch.manual_seed(G)
    R, h, Tk = 3, 4, 11
    for d in (16, 48, 64, 80):
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(R * G, 1, h, d)
            k = torch.randn(R, h, Tk, d).to(dtype)
            v = torch.randn(R, h, Tk, d).to(dtype)
            lengths = torch.tensor([Tk, 5, 1])
            with torch.no_grad():
                got = kernels.attend(q, k, v, lengths, group=G)
                alone = kernels.attend(q, k.repeat_interleave(G, 0), v.repeat_interleave(G, 0),
                                       lengths.repeat_interleave(G), group=1)
            assert torch.equal(got, alone), (d, dtype)
            want = _eq1(q, k.float(), v.float(), lengths, G, -1)
            torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("d", [8, 16, 64])  # token by token; sentence by sentence (d % 16)
def test_the_encoders_attention_kernel_is_the_padded_batchs_bit_for_bit(d):
    """The int8 encoder's attention over a batch packed without padding
    (``kernels._encoder_attention``, which takes a sentence's tokens four a pass where d_v
    is a multiple of 16) gives each token what attention over the padded batch gives it
    (``kernels.attend``, every query on its own), quantized for W^O: the same int8 rows and
    scales."""
    rng = np.random.default_rng(d)
    H, lengths = 4, np.array([7, 1, 12, 5, 9])
    B, S, n = len(lengths), int(lengths.max()), int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sentence = np.repeat(np.arange(B), lengths)
    key_rows = (starts[sentence][:, None] + np.arange(S)[None, :]).astype(np.int64)
    width = 3 * H * d
    acc = rng.integers(-30000, 30000, (n, width)).astype(np.int32)
    x_scale = (rng.random((n, 1)) * 1e-3).astype(np.float32)
    w_scale, bias = rng.random(width).astype(np.float32), rng.standard_normal(width).astype(
        np.float32)
    got8, got_scale = kernels._encoder_attention(acc, x_scale, w_scale, bias, True, H, d, d,
                                                 key_rows, lengths[sentence].astype(np.int64),
                                                 np.float32(d**-0.5), 127)
    qkv = torch.from_numpy(kernels._rescale(acc, x_scale, w_scale, bias, True, False))
    q, k, v = torch.zeros(B, S, H, d), torch.zeros(B, H, S, d), torch.zeros(B, H, S, d)
    for b in range(B):
        rows = qkv[starts[b]:starts[b] + lengths[b]].view(-1, 3, H, d)
        q[b, :lengths[b]] = rows[:, 0]
        k[b, :, :lengths[b]] = rows[:, 1].transpose(0, 1)
        v[b, :, :lengths[b]] = rows[:, 2].transpose(0, 1)
    with torch.no_grad():
        att = kernels.attend(q, k, v, torch.from_numpy(lengths))  # (B, S, H, d)
    real = torch.cat([att[b, :lengths[b]] for b in range(B)]).reshape(n, H * d)
    want8, want_scale = kernels._quantize_rows(real.numpy(), 127)
    assert np.array_equal(got8, want8) and np.array_equal(got_scale, want_scale)


def test_the_prefetch_size_is_the_level2_cache_sysfs_states(tmp_path):
    """kernels.PREFETCH_BYTES comes from Linux's cache description: the level-2 entry's size
    (in K or M, whichever index it sits at), and 1 MiB where the folder is missing or its
    size cannot be read."""
    def cache(sizes):
        root = tmp_path / f"cache{len(list(tmp_path.iterdir()))}"
        for i, (level, size) in enumerate(sizes):
            (root / f"index{i}").mkdir(parents=True)
            (root / f"index{i}" / "level").write_text(f"{level}\n")
            (root / f"index{i}" / "size").write_text(f"{size}\n")
        return str(root)

    assert kernels._level2_bytes(cache([(1, "48K"), (1, "32K"), (2, "1024K"),
                                        (3, "32768K")])) == 1 << 20
    assert kernels._level2_bytes(cache([(1, "32K"), (2, "2M")])) == 2 << 20
    assert kernels._level2_bytes(cache([(1, "32K"), (2, "512K")])) == 512 << 10
    assert kernels._level2_bytes(cache([(2, "lots")])) == 1 << 20
    assert kernels._level2_bytes(cache([(1, "32K"), (3, "8M")])) == 1 << 20  # no level 2
    assert kernels._level2_bytes(str(tmp_path / "missing")) == 1 << 20


@pytest.mark.parametrize("D", [8, 16])  # element by element (_put), 16 lanes (_store_rows)
def test_a_bf16_cache_is_written_as_torch_rounds_and_read_exactly(D):
    """The self-attention step writes new keys into a bf16 cache as torch's .to(bfloat16)
    rounds them (to nearest, ties to even, up to infinity past bf16's largest; NaN stays
    NaN), and attention over bf16 keys and values gives what it gives over their float32
    widening, bit for bit."""
    import numpy as np

    gen = torch.Generator().manual_seed(8)
    n, H, C = 3, 2, 5
    width = 3 * H * D
    acc = torch.randint(-30000, 30000, (n, width), dtype=torch.int32, generator=gen).numpy()
    x_scale = (torch.rand(n, 1, generator=gen) * 1e-3).numpy()
    w_scale, bias = torch.rand(width, generator=gen).numpy(), torch.randn(width,
                                                                         generator=gen).numpy()
    rows = np.tile(np.arange(n)[:, None], (1, C)).astype(np.int64)
    kb16 = torch.zeros(n, H, C, D, dtype=torch.bfloat16)
    vb16 = torch.zeros(n, H, C, D, dtype=torch.bfloat16)
    for pos in range(3):
        kernels._self_attention_step(acc, x_scale, w_scale, bias, True, H, D, D,
                                     kernels.as_array(kb16), kernels.as_array(vb16), pos, rows,
                                     np.float32(D**-0.5), 127)
    qkv = torch.from_numpy(kernels._rescale(acc, x_scale, w_scale, bias, True, False))
    want_k = qkv[:, H * D:2 * H * D].view(n, H, D).to(torch.bfloat16)
    assert torch.equal(kb16[:, :, 0].view(torch.int16), want_k.view(torch.int16))
    # ties (1 + 2^-8 rounds down to even, 1 + 3 * 2^-8 up, a negative one), a subnormal, a
    # large value, one that rounds to -inf, -inf and a NaN, as new keys: with zero sums each
    # key is its bias exactly
    special = torch.tensor([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5e-39, 3e38, -3.4e38,
                            float("-inf"), -(1.0 + 2**-8), float("nan")])
    bias[H * D:H * D + special.numel()] = special.numpy()
    kb16.zero_()
    kernels._self_attention_step(np.zeros_like(acc), x_scale, w_scale, bias, True, H, D, D,
                                 kernels.as_array(kb16), kernels.as_array(vb16), 0, rows,
                                 np.float32(D**-0.5), 127)
    got16 = kb16[0, :, 0].reshape(-1)[:special.numel()]
    want16 = special.to(torch.bfloat16)
    assert torch.equal(got16[:-1].view(torch.int16), want16[:-1].view(torch.int16))
    assert got16[-1].isnan()
    q = torch.randn(4, 1, H, D, generator=gen)
    k16 = torch.randn(2, H, 6, D, generator=gen).to(torch.bfloat16)
    v16 = torch.randn(2, H, 6, D, generator=gen).to(torch.bfloat16)
    lengths = torch.tensor([6, 3])
    with torch.no_grad():
        got = kernels.attend(q, k16, v16, lengths, group=2)
        want = kernels.attend(q, k16.float(), v16.float(), lengths, group=2)
    assert torch.equal(got, want)


def test_the_greedy_kernel_is_log_softmax_then_the_length_rules_then_argmax():
    """kernels.rescale_greedy against the long way round: the output layer's log-probabilities
    (the same sums through _rescale_log_softmax), greedy search's own length rules
    (search.LengthRules), then argmax and gather. The same column and the same float32, bit
    for bit, on rows built to be hard: the maximum on a banned column, exact ties, near ties
    that the subtraction of the log-sum-exp rounds into ties (the first column must win
    there, not the larger logit), -inf entries, rows of nothing but -inf where they may
    choose, and every combination of EOS banned (t < min_len) and EOS forced (t at the
    limit). A NaN or an infinite maximum hands the row back (None)."""
    from aiayn.data.vocab import EOS_ID
    from aiayn.decoding.search import LengthRules, SearchState

    gen = torch.Generator().manual_seed(11)
    M, V = 64, 300
    acc = (torch.randn(M, V, generator=gen) * 4).numpy()  # float32 sums: y = acc exactly
    acc[0, 0] = acc[0].max() + 5  # PAD holds the maximum (banned)
    acc[1, [7, 40]] = acc[1].max() + 1  # an exact tie: column 7
    for r in range(2, 40):  # near ties: y[a] just below y[b] at a < b, in flat rows (a
        # log-sum-exp near log V, whose ulp is larger than the logits' near 0.5)
        acc[r] *= np.float32(0.01)
        a, b = sorted(torch.randperm(V - 3, generator=gen)[:2].tolist())
        top = np.float32(0.5)
        acc[r, b + 3] = top
        below = np.nextafter(top, np.float32(-np.inf), dtype=np.float32)  # 1 ulp under
        acc[r, a + 3] = below if r % 3 else top - np.float32(2e-7 * (r % 5))
    acc[40, 5:] = -np.inf  # -inf entries
    acc[41, 3:] = -np.inf  # only EOS (and the banned columns) finite
    acc[42, EOS_ID] = acc[42].max() + 1  # EOS the maximum
    acc[43, EOS_ID] = acc[43, 3:].max()  # EOS tied with an ordinary column: EOS
    ones = np.ones(V, np.float32)
    x_scale = np.ones((M, 1), np.float32)
    out, ok = kernels._rescale_log_softmax(acc, x_scale, ones, ones, False)
    assert ok
    checked = 0
    for banned in (False, True):
        for forced in (False, True):
            eos_banned = np.full(M, banned)
            eos_only = np.zeros(M, np.bool_)
            eos_only[::2] = forced
            column = np.zeros(M, np.int64)
            value = np.zeros(M, np.float32)
            assert kernels._rescale_greedy(acc, x_scale, ones, ones, False, EOS_ID, eos_banned,
                                           eos_only, column, value)
            t = 5
            state = SearchState(t, torch.where(torch.from_numpy(eos_only), t, t + 3))
            rules = LengthRules(t + 1 if banned else 0)
            assert all(np.array_equal(a, b) for a, b in
                       zip(rules.eos_masks(state), (np.full(M, bool(banned)), eos_only)))
            want = rules(torch.from_numpy(out.copy()), state)
            col = want.argmax(dim=1)
            assert torch.equal(torch.from_numpy(column), col)
            assert torch.equal(torch.from_numpy(value), want.gather(1, col[:, None])[:, 0])
            checked += 1
    near = out[2:40]
    # the near ties really are ties after rounding in some rows (the case the bisection is for)
    assert sum(float(r.max()) == float(np.sort(r)[-2]) for r in near) > 20
    for bad in (np.nan, np.inf):
        y = acc.copy()
        y[3, 9] = bad
        assert not kernels._rescale_greedy(y, x_scale, ones, ones, False, EOS_ID,
                                           np.zeros(M, np.bool_), np.zeros(M, np.bool_),
                                           np.zeros(M, np.int64), np.zeros(M, np.float32))
    assert checked == 4


def test_the_greedy_kernels_row_scans_agree_with_plain_ones():
    """The two passes the greedy and log-softmax kernels make in lanes, against plain numpy:
    the rescaling that also finds the row's largest and smallest order key (the same logits
    as _rescale_row, bit for bit, and _key_range's keys), and the chunked search for the
    first column whose key reaches a bound (every chunk edge, a bound no column reaches, and
    rows holding -inf, -0.0 and a NaN)."""
    rng = np.random.default_rng(5)
    V = 3 * 128 + 5
    for has_bias in (False, True):
        acc = rng.integers(-(2**20), 2**20, V).astype(np.int32)
        w_scale = rng.random(V).astype(np.float32)
        bias = rng.standard_normal(V).astype(np.float32)
        got = np.empty(V, np.float32)
        top, low = kernels._rescale_row_range(acc, np.float32(0.37), w_scale, bias, has_bias,
                                              got)
        want = (acc.astype(np.float32) * np.float32(0.37)) * w_scale
        if has_bias:
            want = want + bias
        assert np.array_equal(got.view(np.int32), want.view(np.int32))
        assert (top, low) == kernels._key_range(got.view(np.int32), 0, V)
    y = rng.standard_normal(V).astype(np.float32)
    y[[0, 50]] = -np.inf
    y[200] = -0.0
    y[300] = np.nan
    keys = np.array([kernels._order_key(b) for b in y.view(np.int32)], np.int64)
    finite = np.where(np.isfinite(y), keys, keys.min())
    chunk_tops = [int(finite[c:c + 128].max()) for c in range(0, V, 128)]  # the exact maxima
    for c0 in (0, 3, 127, 128, 129):
        for k in [int(keys[at]) for at in (c0, 127, 128, 255, 256, 257, V - 1)] + chunk_tops:
            want_c = next((c for c in range(c0, V) if keys[c] >= k), V)
            assert kernels._first_at_least(y.view(np.int32), c0, V, np.int32(k)) == want_c
    k = int(keys[np.isfinite(y)].max()) + 1  # above every number's key, under the NaN's
    assert kernels._first_at_least(y.view(np.int32), 0, 300, np.int32(k)) == 300  # none
    assert kernels._first_at_least(y.view(np.int32), 0, V, np.int32(k)) == 300  # the NaN


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_the_embedding_kernel_gives_torchs_numbers(positional):
    """A stack's input, scaled embeddings plus positions (§3.4-3.5), from the kernel and from
    torch's lookup, product and sum: the same float32 numbers, bit for bit, for a source batch
    and for a decoder step at an offset; a token outside the table still gets torch's
    IndexError (the kernel hands it back)."""
    from test_search import tiny_model  # tests/unit is on sys.path

    model = tiny_model(60, seed=2, positional=positional)
    tokens = torch.randint(0, 60, (3, 7), generator=torch.Generator().manual_seed(1))
    got = []
    for off in (None, "embed"):
        with _without(off), torch.inference_mode():
            got.append((model._embed(model.src_embed, tokens),
                        model._embed(model.tgt_embed, tokens[:, :1], offset=5)))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert got[0][1].shape == (3, 1, model.config.d_model)
    with torch.inference_mode(), pytest.raises(IndexError):
        model._embed(model.src_embed, torch.tensor([[3, 60]]))


@pytest.mark.parametrize("variant", ["avx2", "vnni"])
@pytest.mark.parametrize("M, K, N", [(1, 8, 16), (2, 12, 20), (3, 10, 7), (4, 256, 256),
                                     (5, 64, 40), (33, 512, 600), (130, 64, 48)])
def test_the_u8s8_product_gives_the_exact_integer_sums(variant, M, K, N):
    """aiayn's int8 product over a packed weight, in each variant this machine can run (tiles
    of 4, 3, 2 and 1 rows, a last panel of fewer columns, inputs not a multiple of 4), gives
    the exact integer sums (an int32 matrix product, not another int8 kernel) for the
    weights it takes (7 bits for "avx2", 8 for "vnni"), including full-range activation
    rows against full-range weight rows (where an int16 pair sum of wider weights would
    saturate), from contiguous and column-major inputs; it refuses wider weights."""
    if variant not in kernels.u8s8_variants():
        pytest.skip(f"numba's target here lacks the {variant} instructions")
    gen = torch.Generator().manual_seed(M * 1000 + N)
    levels = kernels.U8S8_VARIANTS[variant][2]
    w = torch.randint(-levels, levels + 1, (N, K), dtype=torch.int8, generator=gen)
    x = torch.randint(-127, 128, (M, K), dtype=torch.int8, generator=gen)
    w[0], w[-1], x[0], x[-1] = levels, -levels, 127, -127
    packed = kernels.pack_u8s8(w, variant)
    want = x.int() @ w.int().t()
    assert torch.equal(kernels.u8s8_product(x, *packed), want)
    assert torch.equal(kernels.u8s8_product(x.t().contiguous().t(), *packed), want)
    if levels < 127:
        w[0, 0] = levels + 1
        with pytest.raises(ValueError, match="saturate"):
            kernels.pack_u8s8(w, variant)
