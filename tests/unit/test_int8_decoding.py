"""int8 decoding (aiayn.model.quantize) and the decoder cache that every search uses
(aiayn.model.cache): close to float32 where the float model is sure, independent of the
batch, and the cache's data movement (cross keys once per sentence, reserved buffers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_search import SOURCES, encode_src, tiny_model  # tests/unit is on sys.path

from aiayn.decoding import CachedStep, StepFunction, UncachedStep, beam_search, greedy_search
from aiayn.model.quantize import Int8Linear, quantize_int8


@pytest.fixture(scope="module", params=["post", "pre"])
def model(request):
    m = tiny_model(60, seed=3)
    if request.param == "pre":
        from aiayn.model import Transformer

        torch.manual_seed(3)
        m = Transformer(dataclasses.replace(m.config, norm="pre")).eval()
    with torch.no_grad():
        m.tgt_embed.weight.mul_(4.0)  # peaked next-token distributions, as a trained model's
    return m


def test_int8_linear_is_close_to_float_and_row_independent():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(10, 64) * torch.logspace(-2, 2, 10)[:, None]  # rows of very different sizes
    q = Int8Linear.from_linear(linear)
    with torch.no_grad():
        ref, got = linear(x), q(x)
        rel = ((got - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
        assert rel < 0.03  # per-row scales: a small row keeps its precision beside a large one
        # no scale or sum mixes rows: each row alone gives the same numbers, bit for bit
        alone = torch.cat([q(x[i : i + 1]) for i in range(10)])
    assert torch.equal(alone, got)
    assert q(x[:3].view(3, 1, 64)).shape == (3, 1, 48)


def test_quantize_int8_copies_and_leaves_the_model(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    q = quantize_int8(model)
    assert model.training and not q.training
    model.eval()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    linears = [m for m in q.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []  # every linear map of both stacks is int8
    # encoder layer: W^QKV (one map), W^O, W_1, W_2; decoder layer: W^QKV, W^O, then
    # encoder-decoder attention's W^Q, W^K, W^V, W^O, and W_1, W_2; the output layer
    assert sum(isinstance(m, Int8Linear) for m in q.modules()) == (4 + 8) * model.config.N + 1


def test_int8_logits_stay_close_and_agree_where_the_model_is_sure(model):
    q = quantize_int8(model)
    tokens = torch.ones(4, dtype=torch.long)
    with torch.no_grad():
        ref = CachedStep.start(model, *encode_src(model, SOURCES))(tokens)
        got = CachedStep.start(q, *encode_src(q, SOURCES))(tokens)
    ok = torch.isfinite(ref)
    assert (got - ref)[ok].abs().max().item() < 0.1 * ref[ok].abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > 0.5
    assert sure.any()
    assert torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])


@pytest.mark.parametrize("beam_size", [1, 4])
def test_int8_outputs_do_not_depend_on_the_batch(model, beam_size):
    q = quantize_int8(model)
    lens = torch.tensor([7, 3, 12, 5])

    def search(sources, lens):
        with torch.no_grad():
            step = CachedStep.start(q, *encode_src(q, sources))
            if beam_size == 1:
                return [h.tokens for h in greedy_search(step, lens)]
            return [h[0].tokens for h in beam_search(step, lens, beam_size=beam_size)]

    together = search(SOURCES, lens)
    alone = [search([s], lens[i : i + 1])[0] for i, s in enumerate(SOURCES)]
    assert together == alone


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("window", [None, 2])
def test_the_cache_gives_the_uncached_models_outputs(beam_size, window):
    model = tiny_model(60, seed=3, attention_window=window)
    lens = torch.tensor([7, 3, 12, 5])
    with torch.no_grad():
        memory, mask = encode_src(model, SOURCES)
        steps = [CachedStep.start(model, memory, mask, int(lens.max()) + 1),
                 CachedStep.start(model, memory, mask),  # no reservation: the buffers grow
                 UncachedStep.start(model, memory, mask)]
        if beam_size == 1:
            outs = [[(h.tokens, h.score) for h in greedy_search(s, lens)] for s in steps]
        else:
            outs = [[(h.tokens, h.score) for hs in beam_search(s, lens, beam_size=beam_size,
                                                               nbest=beam_size) for h in hs]
                    for s in steps]
    for out in outs[1:]:
        assert [t for t, _ in out] == [t for t, _ in outs[0]]
        assert [s for _, s in out] == pytest.approx([s for _, s in outs[0]], abs=1e-4)


def test_beams_share_their_sentences_cross_keys_and_reorder_in_place():
    model = tiny_model(60, seed=3)
    with torch.no_grad():
        memory, mask = encode_src(model, SOURCES)
        step = CachedStep.start(model, memory, mask, 10)
        B, K = len(SOURCES), 3
        step = step.select(torch.arange(B).repeat_interleave(K))  # beam search's expansion
        cache = step.cache
        assert cache.group == K and cache.cross[0][0].shape[0] == B  # not copied per beam
        step(torch.ones(B * K, dtype=torch.long))
        buffer = cache._k[0].data_ptr()
        order = torch.arange(B * K).view(B, K).flip(1).reshape(-1)  # beams swap within sentences
        step2 = step.select(order)
        assert step2.cache._k[0].data_ptr() == buffer  # moved in place, no new buffer
        assert step2.cache.cross[0][0].shape[0] == B
        with pytest.raises(IndexError):
            step.cache.cached_len(0)  # the old cache is spent, loudly
        # two sentences finish: their cross keys leave with them
        step3 = step2.select(torch.tensor([0, 1, 2, 9, 10, 11]))
        assert step3.cache.group == K and step3.cache.cross[0][0].shape[0] == 2
        assert torch.equal(step3.cache.src_mask, mask[[0, 3]])


def test_the_int8_products_are_exact_on_this_cpu():
    """Without VNNI (the AVX2 class) oneDNN's int8 product saturates pair sums at int16 for
    full-range weights; Int8Linear then keeps its weights to 7 bits (weight_levels), so on
    either class the int32 sums are exact, as the row independence above needs."""
    from aiayn.model.quantize import _quantize_rows, weight_levels

    torch.manual_seed(0)
    q = Int8Linear.from_linear(torch.nn.Linear(256, 96))
    assert int(q.weight_int8.abs().max()) == weight_levels() in (63, 127)
    x8, _ = _quantize_rows(torch.randn(40, 256) * 5)  # full-range activations
    assert int(x8.abs().max()) == 127
    assert torch.equal(torch._int_mm(x8, q.weight_int8.t()),
                       x8.int() @ q.weight_int8.int().t())


@pytest.mark.parametrize("kind", ["onednn", "fbgemm", "u8s8"])
def test_a_packed_weight_gives_the_unpacked_maps_outputs_bit_for_bit(kind, monkeypatch,
                                                                    request):
    """Where this machine's oneDNN or FBGEMM gives exact sums over a prepacked int8 weight
    (quantize.product_times checks that before it times anything), or
    aiayn's u8s8 kernel can run (x86-64 with AVX2; its map made with 7-bit weights, as on a
    CPU without VNNI), the packed product's outputs equal ``torch._int_mm``'s bit for bit,
    with bias and relu, at 1, 17 and 300 rows, in a deep copy (which packs its own weight:
    the packed one does not copy), and for FBGEMM and u8s8 where a map takes it up to some
    row count and ``torch._int_mm`` above."""
    import copy

    from aiayn.model import kernels, quantize
    from aiayn.model.quantize import _PACK, _fbgemm_product, _packed_product, _quantize_rows

    if kind == "u8s8":
        if not kernels.u8s8_variants():
            pytest.skip("the u8s8 product needs x86-64 with AVX2")
        # the weights its slowest variant sums exactly (as a CPU without VNNI stores them)
        monkeypatch.setattr(quantize, "weight_levels",
                            lambda: kernels.U8S8_VARIANTS[kernels.u8s8_variants()[-1]][2])
        # the kernel runs only on one torch thread (Int8Linear._product)
        request.addfinalizer(lambda n=torch.get_num_threads(): torch.set_num_threads(n))
        torch.set_num_threads(1)
    torch.manual_seed(0)
    q = Int8Linear.from_linear(torch.nn.Linear(512, 200))
    x8, _ = _quantize_rows(torch.randn(8, 512) * 5)
    x8[0], x8[1] = 127, -127  # full-range rows against the full-range weight: saturation
    if kind == "onednn" and not hasattr(torch.ops.onednn, "qlinear_prepack"):
        pytest.skip("torch without oneDNN's int8 linear")
    if kind == "fbgemm" and "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch without FBGEMM")
    # where the op exists, its sums must be exact: a path that is not fails here
    packed = _PACK[kind](q.weight_int8)
    got = (_fbgemm_product(x8, packed) if kind == "fbgemm"
           else kernels.u8s8_product(x8, *packed).float() if kind == "u8s8"
           else _packed_product(x8, *packed))
    assert torch.equal(got, torch._int_mm(x8, q.weight_int8.t()).float()), kind
    for relu in (False, True):
        q.relu = relu
        with torch.inference_mode():
            q._set_packing(None)
            want = [q(torch.randn(m, 512, generator=torch.Generator().manual_seed(m)))
                    for m in (1, 17, 300)]
            # FBGEMM (u8s8) for every product (whatever is faster here), then up to 17 rows
            # only, torch._int_mm above: one map taking both paths by its row count
            for rows in ((1 << 62, 17) if kind in ("fbgemm", "u8s8") else (None,)):
                q._set_packing(kind, rows=rows)
                copied = copy.deepcopy(q)
                assert copied.packing == kind and copied._packs == {}
                for m, w in zip((1, 17, 300), want):
                    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
                    assert torch.equal(q(x), w) and torch.equal(copied(x), w)


def test_a_packed_product_far_slower_than_int_mm_is_screened_out_in_two_calls(monkeypatch):
    """Where oneDNN runs its reference code for the packed int8 product (the family-26 EPYC:
    thousands of times slower than ``torch._int_mm``), product_times leaves it out after
    one exactness call and one screening call, both on 4 rows: it never runs the 32- or
    256-row products nor the five rounds. Here the packed product is made slow by a sleep
    after the real one (the sums stay exact, so only the screen can reject it)."""
    import time

    from aiayn.model import quantize

    if not hasattr(torch.ops.onednn, "qlinear_prepack"):
        pytest.skip("torch without oneDNN's int8 linear")
    real, rows = quantize._packed_product, []

    def slow(x8, *packed):
        rows.append(x8.shape[0])
        out = real(x8, *packed)
        time.sleep(0.02)  # 20 ms: over 4x any 4 x 320 x 96 int8 product's time
        return out

    monkeypatch.setattr(quantize, "_packed_product", slow)
    quantize.product_times.cache_clear()
    try:
        times = quantize.product_times(320, 96)
    finally:
        quantize.product_times.cache_clear()
    assert "int_mm" in times["torch"] and "onednn" not in times["torch"], times
    assert "onednn" not in times["one_thread"]
    assert rows in ([4], [4, 4]), rows  # [4]: the exactness check itself failed here


def test_int8_linear_follows_its_buffers_when_they_change():
    """Int8Linear keeps numpy views of its scales and bias for the kernels (made once, not at
    every call): a reload in place, a replaced buffer and a deep copy each give the numbers
    that the torch path computes from the buffers as they are then, bit for bit."""
    import copy

    from aiayn.model import kernels

    torch.manual_seed(0)
    q = Int8Linear.from_linear(torch.nn.Linear(64, 48))
    x = torch.randn(5, 64)

    def both_paths(m):
        with torch.inference_mode():
            fast = m(x)
            kept = set(kernels.ENABLED)
            kernels.ENABLED.discard("int8")
            try:
                slow = m(x)
            finally:
                kernels.ENABLED.update(kept)
        return fast, slow

    before, _ = both_paths(q)
    state = {k: v.clone() for k, v in q.state_dict().items()}
    state["bias"] += 1.0
    q.load_state_dict(state)  # copied into the same tensors
    fast, slow = both_paths(q)
    assert torch.equal(fast, slow) and not torch.equal(fast, before)
    q.weight_scale = q.weight_scale * 2.0  # a new tensor for the buffer
    fast, slow = both_paths(q)
    assert torch.equal(fast, slow)
    copied = copy.deepcopy(q)
    copied.bias.zero_()  # the copy's own bias, not a view of the original's
    c_fast, c_slow = both_paths(copied)
    assert torch.equal(c_fast, c_slow) and torch.equal(both_paths(q)[0], fast)


def test_the_caches_lengths_follow_its_rows():
    """DecoderCache.source_lengths is computed once per source mask and kept across reorders
    that keep the sentences; when sentences leave, it is the remaining ones' lengths."""
    from aiayn.model.kernels import prefix_lengths

    model = tiny_model(60, seed=3)
    with torch.no_grad():
        memory, mask = encode_src(model, SOURCES)
        cache = CachedStep.start(model, memory, mask, 10).cache
        lengths = cache.source_lengths()
        assert torch.equal(lengths, mask.sum(dim=1)) and cache.source_lengths() is lengths
        B = len(SOURCES)
        same = cache.select_(torch.arange(B))
        assert same.source_lengths() is lengths  # the same mask: not recomputed
        fewer = same.select_(torch.tensor([0, 3]))
        assert torch.equal(fewer.source_lengths(), prefix_lengths(mask[[0, 3]]))
        assert torch.equal(fewer.self_lengths(2, 5), torch.tensor([5, 5]))


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("reserve", [True, False])
def test_the_fused_int8_step_gives_the_layers_numbers(model, beam_size, reserve):
    """FusedInt8Step runs the decoder stack in fewer Python-level operations: the same tokens
    and scores, bit for bit, as the layers' own modules, with beams reordered, sentences
    finishing at different lengths and (without a reservation) the cache's buffers growing."""
    q = quantize_int8(model)
    fused = q.fused_step
    assert fused is not None
    before = fused.steps
    got = _encode_and_search(q, beam_size, reserve)[2]
    assert fused.steps > before  # it ran
    q.fused_step = None  # the layers' own modules
    try:
        ref = _encode_and_search(q, beam_size, reserve)[2]
    finally:
        q.fused_step = fused
    assert got == ref


def _encode_and_search(q, beam_size: int, reserve: bool = True):
    """SOURCES encoded and searched by ``q`` (greedy at beam 1, else the beam's n-best), with
    length limits that finish sentences at different steps: (memory, mask, [(tokens, score)])."""
    lens = torch.tensor([7, 3, 12, 5])
    with torch.no_grad():
        memory, mask = encode_src(q, SOURCES)
        step = CachedStep.start(q, memory, mask, int(lens.max()) + 1 if reserve else 0)
        if beam_size == 1:
            hyps = [(h.tokens, h.score) for h in greedy_search(step, lens)]
        else:
            hyps = [(h.tokens, h.score) for hs in beam_search(step, lens, beam_size=beam_size,
                                                              nbest=beam_size) for h in hs]
    return memory, mask, hyps


def test_the_fused_int8_step_leaves_recording_to_the_layers():
    """Recording attention weights needs the layers' modules: the fused step steps aside
    (the cache untouched) and the layers run and record."""
    q = quantize_int8(tiny_model(60, seed=3))
    attn = q.model.decoder[0].cross_attn
    with torch.no_grad():
        step = CachedStep.start(q, *encode_src(q, SOURCES), 4)
        step(torch.ones(4, dtype=torch.long))
        assert q.fused_step.steps == 1
        attn.record_weights = True
        try:
            step(torch.ones(4, dtype=torch.long))
        finally:
            attn.record_weights = False
    assert q.fused_step.steps == 1 and attn.weights is not None
    assert step.cache.length == 2


def test_the_fused_int8_encoder_gives_the_layers_numbers_at_every_real_position(model):
    """FusedInt8Encoder runs the encoder over the real tokens only: at every real position the
    memory is the layers' own, bit for bit, for sentences of different lengths (padding
    between them in the batch), and the searches' tokens and scores follow unchanged."""
    q = quantize_int8(model)
    fused = q.fused_encoder
    assert fused is not None
    before = fused.calls
    memory, mask, hyps = _encode_and_search(q, beam_size=3)
    assert fused.calls == before + 1  # it ran
    assert not mask.all()  # the batch holds padding
    assert torch.equal(memory[~mask], torch.zeros_like(memory[~mask]))
    q.fused_encoder = None  # the layers' own modules
    try:
        ref_memory, ref_mask, ref_hyps = _encode_and_search(q, beam_size=3)
    finally:
        q.fused_encoder = fused
    assert torch.equal(mask, ref_mask)
    assert torch.equal(memory[mask], ref_memory[mask])
    assert hyps == ref_hyps


def test_the_fused_int8_encoder_leaves_recording_to_the_layers():
    """Recording the encoder's attention weights needs the layers' modules: the fused
    encoder steps aside."""
    q = quantize_int8(tiny_model(60, seed=3))
    attn = q.model.encoder[0].self_attn
    attn.record_weights = True
    with torch.no_grad():
        encode_src(q, SOURCES)
    assert q.fused_encoder.calls == 0 and attn.weights is not None


def test_greedy_search_chooses_as_before_through_the_greedy_kernel(model, monkeypatch):
    """Greedy search over an int8 copy, with the output layer's greedy kernel (each row's
    choice from the sums, no row of log-probabilities written) and without it (the
    log-probabilities, the length rules, argmax): the same tokens and the same log-probability
    sums, bit for bit, with EOS banned early (min_len) and forced at short limits."""
    from aiayn.model import kernels

    if not kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    q = quantize_int8(model)

    class LogProbsOnly(StepFunction):  # the same step with the protocol's default greedy
        def __init__(self, step):
            self.step, self.start_id, self.token_ids = step, step.start_id, step.token_ids

        def log_probs(self, tokens):
            return self.step.log_probs(tokens)

        def __call__(self, tokens):
            return self.step(tokens)

        def select(self, index):
            return LogProbsOnly(self.step.select(index))

    real, ran = kernels.rescale_greedy, []

    def counted(*args):
        found = real(*args)
        ran.append(found is not None)
        return found

    monkeypatch.setattr(kernels, "rescale_greedy", counted)
    outs = []
    for wrap in (False, True):
        for min_len, lens in ((0, [9, 4, 12, 6]), (3, [9, 3, 12, 4])):
            with torch.no_grad():
                step = CachedStep.start(q, *encode_src(q, SOURCES), 13)
                hyps = greedy_search(LogProbsOnly(step) if wrap else step,
                                     torch.tensor(lens), min_len=min_len)
            outs.append([(h.tokens, h.log_prob) for h in hyps])
    assert outs[:2] == outs[2:]
    assert ran and all(ran)  # the kernel chose every step of the first two searches
    lengths = [len(tokens) for tokens, _ in outs[1]]
    assert min(lengths) >= 4 and lengths[1] == 4  # EOS banned before t = 3, forced at 3
