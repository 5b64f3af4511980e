"""Greedy, sampling and beam search (§6.1): a stub step function with hand-set probabilities,
and a real tiny Transformer for exhaustive search, cache equivalence and batching."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import load_config
from aiayn.data.vocab import BOS_ID, EOS_ID, UNK_ID, Vocabulary
from aiayn.decoding import (
    CachedStep,
    InputTooLongError,
    SamplingConfig,
    StepFunction,
    UncachedStep,
    beam_search,
    greedy_search,
    length_penalty,
)
from aiayn.model import Transformer
from aiayn.translator import Translator

A, B_ = 4, 5  # the two ordinary tokens of the stub vocabulary (V = 6)


class StubStep(StepFunction):
    """Step function whose next-token distribution is a hand-set table keyed by the prefix."""

    start_id = BOS_ID

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]], prefixes=None, n=1):
        self.table = table
        self.prefixes = prefixes if prefixes is not None else [() for _ in range(n)]

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        probs = torch.full((6,), 1e-6)
        for tok, p in self.table.get(prefix, {EOS_ID: 1.0}).items():
            probs[tok] = p
        return probs.log()

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        new = []
        for prefix, tok in zip(self.prefixes, tokens.tolist()):
            new.append(prefix + (tok,) if tok != BOS_ID else prefix)
        self.prefixes = new
        return torch.stack([self.logits(p) for p in new])

    def select(self, index: torch.Tensor) -> StubStep:
        return StubStep(self.table, [self.prefixes[i] for i in index.tolist()])

    def log_prob(self, tokens: list[int]) -> float:
        total, prefix = 0.0, ()
        for tok in tokens:
            total += float(F.log_softmax(self.logits(prefix), -1)[tok])
            prefix += (tok,)
        return total


# Greedy takes A (0.6) and then EOS (0.34): p = 0.204. The best sequence is B EOS: 0.4 * 0.9.
TABLE = {
    (): {A: 0.6, B_: 0.4},
    (A,): {EOS_ID: 0.34, A: 0.33, B_: 0.33},
    (B_,): {EOS_ID: 0.9, A: 0.05, B_: 0.05},
}


def test_length_penalty_is_wu_et_al():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(7, 0.6) == pytest.approx(2.0**0.6)
    assert length_penalty(10, 0.0) == 1.0


def test_stub_greedy_and_beam_hand_computed():
    lens = torch.tensor([5])
    (g,) = greedy_search(StubStep(TABLE), lens)
    assert g.tokens == [A, EOS_ID]
    assert g.log_prob == pytest.approx(math.log(0.6 * 0.34), abs=1e-4)
    (beam,) = beam_search(StubStep(TABLE), lens, beam_size=2, alpha=0.0, nbest=2)
    assert [h.tokens for h in beam] == [[B_, EOS_ID], [A, EOS_ID]]
    assert beam[0].log_prob == pytest.approx(math.log(0.4 * 0.9), abs=1e-4)
    assert beam[0].score == beam[0].log_prob


def test_stub_length_penalty_prefers_longer_output():
    # B EOS: p = 0.4 * 0.5 = 0.2 beats A A EOS: p = 0.6 * 0.8 * 0.4 = 0.192 at alpha 0; at
    # alpha 1, log(0.2) / lp(2) = -1.379 < log(0.192) / lp(3) = -1.238, and A A B EOS (0.144)
    # gives -1.292.
    table = {(): {A: 0.6, B_: 0.4}, (A,): {A: 0.8, EOS_ID: 0.2},
             (B_,): {EOS_ID: 0.5, A: 0.25, B_: 0.25}, (A, A): {EOS_ID: 0.4, B_: 0.3, A: 0.3}}
    lens = torch.tensor([4])
    (short,) = beam_search(StubStep(table), lens, beam_size=2, alpha=0.0)
    (long,) = beam_search(StubStep(table), lens, beam_size=2, alpha=1.0)
    assert short[0].tokens == [B_, EOS_ID]
    assert long[0].tokens == [A, A, EOS_ID]
    stub = StubStep(table)
    assert long[0].score == pytest.approx(stub.log_prob([A, A, EOS_ID]) / length_penalty(3, 1.0),
                                          abs=1e-4)


def test_stub_max_len_forces_eos_and_min_len_bans_it():
    table = {(): {A: 0.9}, (A,): {A: 0.9}, (A, A): {A: 0.9}, (A, A, A): {A: 0.9}}
    (g,) = greedy_search(StubStep(table), torch.tensor([2]))
    assert g.tokens == [A, A, EOS_ID]
    (b,) = beam_search(StubStep(table), torch.tensor([2]), beam_size=3)
    assert all(len(h.tokens) <= 3 and h.tokens[-1] == EOS_ID for h in b)
    (g,) = greedy_search(StubStep(TABLE), torch.tensor([5]), min_len=2)
    assert len(g.tokens) >= 3 and EOS_ID not in g.tokens[:2]


def test_stub_batch_of_sentences_finish_independently():
    steps = StubStep(TABLE, n=3)
    out = beam_search(steps, torch.tensor([5, 0, 1]), beam_size=2, alpha=0.0)
    assert out[0][0].tokens == [B_, EOS_ID]
    assert out[1][0].tokens == [EOS_ID]  # max length 0: only EOS
    assert out[2][0].tokens == [B_, EOS_ID]


# --- a real (tiny, random) Transformer ------------------------------------------------------


def tiny_model(vocab_size: int, seed: int = 0, **changes) -> Transformer:
    cfg = dataclasses.replace(load_config("tiny").model, vocab_size=vocab_size, **changes)
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def encode_src(model, src_ids: list[list[int]]):
    from aiayn.data.batching import pad_sources

    memory, mask = model.encode(pad_sources(src_ids))
    return memory, mask


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_large_beam_finds_exhaustive_best(alpha):
    """V = 6 (3 generable non-EOS tokens), at most 3 tokens: 40 sequences, all in the beam."""
    model = tiny_model(6, N=1, d_model=16, d_ff=32, h=2, d_k=8, d_v=8)
    with torch.no_grad():
        model.src_embed.weight.mul_(8.0)  # sharper distributions than a fresh init's
        memory, mask = encode_src(model, [[4, 5, 4, EOS_ID]])
        max_len = 3
        scored = []
        for n in range(max_len + 1):
            for body in itertools.product([UNK_ID, A, B_], repeat=n):
                seq = list(body) + [EOS_ID]
                logits = model.decode(torch.tensor([[BOS_ID] + seq[:-1]]), memory, mask)
                logp = F.log_softmax(logits.float(), -1)[0]
                lp = float(logp.gather(1, torch.tensor(seq)[:, None]).sum())
                scored.append((lp / length_penalty(len(seq), alpha), seq))
        scored.sort(key=lambda x: -x[0])
        (hyps,) = beam_search(CachedStep.start(model, memory, mask), torch.tensor([max_len]),
                              beam_size=40, alpha=alpha, nbest=5)
    assert hyps[0].tokens == scored[0][1]
    assert [h.score for h in hyps] == pytest.approx([s for s, _ in scored[:5]], abs=1e-4)
    assert scored[0][0] - scored[1][0] > 1e-3  # the optimum is not a float tie


def caption_vocab() -> Vocabulary:
    """An 80-token vocabulary of four short English and German captions (the real tiny
    models' tests share it)."""
    texts = ["a man is walking down the street with a dog",
             "two children play football in the park",
             "ein mann geht mit einem hund die straße entlang",
             "zwei kinder spielen fußball im park"] * 10
    return Vocabulary.learn(texts, 80)


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return caption_vocab()


@pytest.fixture(scope="module")
def model(vocab) -> Transformer:
    return tiny_model(len(vocab), seed=1)


SOURCES = [[5, 9, 12, 30, EOS_ID], [7, EOS_ID], [40, 41, 42, 43, 44, 45, 46, 47, 48, EOS_ID],
           [11, 11, EOS_ID]]


class RandomStep(StepFunction):
    """A step function with random but fixed next-token logits per prefix (seeded)."""

    start_id = BOS_ID

    def __init__(self, seed: int, V: int = 7, sharp: float = 3.0, prefixes=None):
        self.seed, self.V, self.sharp = seed, V, sharp
        self.prefixes = prefixes if prefixes is not None else [()]

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, prefix)) % (2**31))
        return torch.randn(self.V, generator=g) * self.sharp

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.prefixes = [p + (t,) if t != BOS_ID else p
                         for p, t in zip(self.prefixes, tokens.tolist())]
        return torch.stack([self.logits(p) for p in self.prefixes])

    def select(self, index: torch.Tensor) -> RandomStep:
        return RandomStep(self.seed, self.V, self.sharp, [self.prefixes[i] for i in index.tolist()])


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_beam_size_one_is_never_worse_than_greedy(alpha):
    """beam_search(beam_size=1) is beam search of width 1, not greedy search: like fairseq and
    tensor2tensor it looks at the 2K = 2 best extensions, so an EOS ranked second finishes a
    hypothesis while the live one continues. Its live path is the greedy path, so the greedy
    output is always among its candidates: it returns the greedy output or one that scores
    better under its length-penalised objective (``translate_*(beam_size=1)`` runs greedy)."""
    differs = 0
    for seed in range(60):
        lens = torch.tensor([6])
        (g,) = greedy_search(RandomStep(seed), lens)
        (b,) = beam_search(RandomStep(seed), lens, beam_size=1, alpha=alpha)
        g_score = g.log_prob / length_penalty(len(g.tokens), alpha)
        assert b[0].score >= g_score - 1e-5, seed
        if b[0].tokens != g.tokens:
            differs += 1
            assert b[0].score > g_score
            # a different output is the greedy prefix ended early (alpha=0) or continues
            # past a point where greedy stopped
            common = min(len(b[0].tokens), len(g.tokens)) - 1
            assert b[0].tokens[:common] == g.tokens[:common]
    assert differs > 0  # the two searches really are different


@pytest.mark.parametrize("beam_size", [1, 4])
def test_cached_equals_uncached(model, beam_size):
    with torch.no_grad():
        memory, mask = encode_src(model, SOURCES)
        lens = torch.tensor([15, 6, 15, 10])
        out = []
        for step_cls in (CachedStep, UncachedStep):
            step = step_cls.start(model, memory, mask)
            out.append(beam_search(step, lens, beam_size=beam_size, alpha=0.6, nbest=beam_size))
    cached, uncached = out
    assert [[h.tokens for h in s] for s in cached] == [[h.tokens for h in s] for s in uncached]
    assert ([[h.score for h in s] for s in cached]
            == [pytest.approx([h.score for h in s], abs=1e-4) for s in uncached])


@pytest.mark.parametrize("beam_size", [1, 4])
def test_mixed_length_batch_equals_one_at_a_time(model, vocab, beam_size):
    lines = ["a man", "two children play football in the park with a dog down the street",
             "zwei kinder", "ein mann geht", "a", "the park"]
    translator = Translator(model, vocab, precision="fp32")
    batched = translator.generate(lines, beam_size=beam_size, batch_size=6,
                              max_len_b=8, nbest=beam_size)
    single = [translator.generate([x], beam_size=beam_size, max_len_b=8,
                              nbest=beam_size)[0] for x in lines]
    assert [[t.tokens for t in r] for r in batched] == [[t.tokens for t in r] for r in single]
    for r, s in zip(batched, single):
        assert [t.score for t in r] == pytest.approx([t.score for t in s], abs=1e-4)
        assert [t.score for t in r] == sorted((t.score for t in r), reverse=True)


def test_translate_order_empty_lines_and_max_length(model, vocab):
    lines = ["a man is walking", "", "zwei kinder spielen fußball im park", "   ", "a"]
    translator = Translator(model, vocab, precision="fp32")
    out = translator.translate(lines, beam_size=4, max_len_a=0.0, max_len_b=3)
    assert len(out) == 5 and out[1] == "" and out[3] == ""
    for line, text in zip(lines, translator.generate(lines, max_len_a=1.0, max_len_b=2)):
        n_src = len(vocab.encode(line))
        assert len(text[0].tokens) <= n_src + 2 + 1  # input length + b tokens, then EOS
    model.train()  # as the training loop's validation calls it: decoding must not leave eval
    try:
        assert translator.translate(lines, beam_size=1, max_len_b=3) == \
            Translator(model.eval(), vocab, precision="fp32").translate(lines, beam_size=1,
                                                                       max_len_b=3)
        model.train()
        translator.translate(lines, beam_size=4, max_len_b=3)
        assert model.training
    finally:
        model.eval()


def test_long_input_truncated_with_warning_or_rejected(model, vocab, caplog):
    long = " ".join(["street"] * (model.config.max_len + 10))
    translator = Translator(model, vocab, precision="fp32")
    with caplog.at_level("WARNING", logger="aiayn"):
        out = translator.translate(["a", long], beam_size=1, max_len_a=0.0, max_len_b=2)
    assert len(out) == 2
    assert "line 2" in caplog.text and "truncated" in caplog.text
    with pytest.raises(InputTooLongError, match="line 2"):
        translator.generate(["a", long], beam_size=1, long_inputs="error")


def test_sampling(model):
    with torch.no_grad():
        memory, mask = encode_src(model, SOURCES)
        lens = torch.tensor([10, 10, 10, 10])
        greedy = greedy_search(CachedStep.start(model, memory, mask), lens)

        def sample(**kw):
            step = CachedStep.start(model, memory, mask)
            return [h.tokens for h in greedy_search(step, lens, sampling=SamplingConfig(**kw))]

        assert sample(top_k=1) == [h.tokens for h in greedy]
        assert sample(top_p=1e-6) == [h.tokens for h in greedy]
        assert sample(temperature=1e-4) == [h.tokens for h in greedy]
        assert sample(seed=3, temperature=2.0) == sample(seed=3, temperature=2.0)
        assert sample(seed=3, temperature=5.0) != [h.tokens for h in greedy]
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="nbest"):
        beam_search(StubStep(TABLE), torch.tensor([3]), beam_size=2, nbest=3)
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(StubStep(TABLE), torch.tensor([3]), beam_size=0)


class _Recorder:
    """A score processor that changes nothing and keeps what each step showed it."""

    def __init__(self):
        self.states = []

    def __call__(self, logp, state):
        self.states.append((state.t, state.rows.clone(), state.tokens.clone(), logp.shape[0]))
        return logp


@pytest.mark.parametrize("beam_size", [1, 3])
def test_processors_see_each_rows_sentence_and_tokens(beam_size):
    """SearchState.rows names each live row's sentence and SearchState.tokens its tokens so
    far: every row's tokens are a prefix of a hypothesis its sentence could return, and
    greedy's rows are the finished outputs' prefixes exactly."""
    lens = torch.tensor([5, 2, 6])
    seeds = [3, 4, 5]
    recorder = _Recorder()

    class Batch(StepFunction):  # three RandomSteps of different seeds as one batch
        start_id = BOS_ID

        def __init__(self, steps):
            self.steps = steps

        def __call__(self, tokens):
            return torch.cat([s(t[None]) for s, t in zip(self.steps, tokens)])

        def select(self, index):
            return Batch([self.steps[i].select(torch.tensor([0])) for i in index.tolist()])

    step = Batch([RandomStep(s) for s in seeds])
    if beam_size == 1:
        out = [[h] for h in greedy_search(step, lens, processors=[recorder])]
    else:
        out = beam_search(step, lens, beam_size=beam_size, nbest=1, processors=[recorder])
    for t, rows, tokens, n in recorder.states:
        assert rows.shape == (n,) and tokens.shape == (n, t)
        assert set(rows.tolist()) <= {0, 1, 2}
        if beam_size == 1:  # greedy: each row is its sentence's output so far
            for r, toks in zip(rows.tolist(), tokens.tolist()):
                assert out[r][0].tokens[:t] == toks
    assert recorder.states[0][1].tolist() == [0, 1, 2]


def test_translate_processors_per_line(model, vocab):
    """A processor from translate_nbest's factory finds each row's line through chunk[rows]:
    banning a token on one line changes that line alone, whatever the batching."""
    from aiayn.decoding import translate_nbest
    from aiayn.config import DecodeConfig

    lines = ["a man", "zwei kinder spielen", "ein mann geht", "the park"]
    decode = DecodeConfig(beam_size=3, max_len_b=6, batch_size=2)
    plain = translate_nbest(model, vocab, lines, decode)
    banned = plain[2][0].tokens[0]  # line 2's first token

    def factory(chunk):
        def ban(logp, state):
            on_line = torch.tensor([chunk[r] == 2 for r in state.rows.tolist()])
            logp[on_line, banned] = float("-inf")
            return logp
        return [ban]

    for batch_size in (1, 4):
        got = translate_nbest(model, vocab, lines,
                              dataclasses.replace(decode, batch_size=batch_size),
                              processors=factory)
        assert [g[0].tokens for i, g in enumerate(got) if i != 2] == \
            [p[0].tokens for i, p in enumerate(plain) if i != 2]
        assert banned not in got[2][0].tokens
