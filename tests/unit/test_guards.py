"""The guards of aiayn.decoding.guards (issue 82): each rule hand-computed on a stub step
function; then, on small random-weight Transformers (whose outputs loop, the failure the
guards are for), no repeated n-gram under greedy search, beam search, sampling, an ensemble
and int8, the same outputs in any batch, the settings' checks, the three faces, and no change
at all with the guards off."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from aiayn.config import DecodeConfig, load_config
from aiayn.data.vocab import BOS_ID, EOS_ID, Vocabulary
from aiayn.decoding import (
    SamplingConfig,
    SearchState,
    StepFunction,
    beam_search,
    greedy_search,
    max_output_lengths,
)
from aiayn.decoding.guards import (
    MinLength,
    NoRepeatNgram,
    RepetitionPenalty,
    column_map,
    guard_processors,
    has_repeated_ngram,
    max_length_cap,
)
from aiayn.errors import ConfigError, UserError
from aiayn.model import Transformer
from aiayn.translator import Translator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

A, B_ = 4, 5  # the stub vocabulary: PAD 0, BOS 1, EOS 2, UNK 3, A, B (V = 6)
NEG = float("-inf")


class LastTokenStep(StepFunction):
    """Next-token probabilities set by hand for each last token (BOS at the start); the other
    columns get 1e-9 (and a token off the table is followed by EOS). One stub for every rule
    below."""

    start_id = BOS_ID

    def __init__(self, table: dict[int, dict[int, float]], last=None, n: int = 1):
        self.table = table
        self.last = last if last is not None else [BOS_ID] * n

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.last = tokens.tolist()
        probs = torch.full((len(self.last), 6), 1e-9)
        for i, tok in enumerate(self.last):
            for col, p in self.table.get(tok, {EOS_ID: 1.0}).items():
                probs[i, col] = p
        return probs.log()

    def select(self, index: torch.Tensor) -> LastTokenStep:
        return LastTokenStep(self.table, [self.last[i] for i in index.tolist()])


def logp_of(ps: list[float]) -> float:
    return sum(math.log(p) for p in ps)


# greedy alone loops A B A B ... until the maximum
LOOP = {BOS_ID: {A: 0.7, B_: 0.2, EOS_ID: 0.1},
        A: {B_: 0.6, A: 0.3, EOS_ID: 0.1},
        B_: {A: 0.6, B_: 0.3, EOS_ID: 0.1}}


def greedy(table, max_len: int, decode: DecodeConfig, src_len: int = 4, n: int = 1):
    rules = guard_processors(decode, torch.full((n,), src_len))
    return greedy_search(LastTokenStep(table, n=n), torch.full((n,), max_len), processors=rules)


def test_no_repeat_ngram_hand_computed():
    off = greedy(LOOP, 6, DecodeConfig())[0]
    assert off.tokens == [A, B_, A, B_, A, B_, EOS_ID]  # the loop, EOS forced at 6
    # n = 2: t=3 ([A B A]) bans B (A was followed by B): A at 0.3; t=4 ([A B A A]) bans B and
    # A (A was followed by both): EOS
    got = greedy(LOOP, 6, DecodeConfig(no_repeat_ngram_size=2))[0]
    assert got.tokens == [A, B_, A, A, EOS_ID]
    assert got.log_prob == pytest.approx(logp_of([0.7, 0.6, 0.6, 0.3, 0.1]), abs=1e-6)
    # n = 1: no token twice
    assert greedy(LOOP, 6, DecodeConfig(no_repeat_ngram_size=1))[0].tokens == [A, B_, EOS_ID]
    # n = 3: t=3 ([A B A]): (B, A) never occurred before, so B; t=4 ([A B A B]): (A, B) was
    # followed by A: A is banned, B (0.3) is taken; t=5 ([.. B B]): A again
    got = greedy(LOOP, 6, DecodeConfig(no_repeat_ngram_size=3))[0]
    assert got.tokens == [A, B_, A, B_, B_, A, EOS_ID]


def test_no_repeat_ngram_bans_what_followed_each_earlier_occurrence():
    tokens = torch.tensor([[A, B_, A, B_], [A, A, A, B_], [B_, A, B_, A]])
    rows, ids = NoRepeatNgram(3).banned(tokens)
    # row 0: (A, B) at 0 followed by A; row 1: (A, B) never before; row 2: (B, A) -> B
    assert sorted(zip(rows.tolist(), ids.tolist())) == [(0, A), (2, B_)]
    rows, ids = NoRepeatNgram(1).banned(tokens[:1, :2])
    assert sorted(zip(rows.tolist(), ids.tolist())) == [(0, A), (0, B_)]
    assert NoRepeatNgram(3).banned(tokens[:, :2])[0].numel() == 0  # t < n: nothing yet


def test_guards_map_token_ids_to_the_steps_columns():
    """A step scoring a subset of the vocabulary (an int8 copy's compact output layer, a
    shortlist): ids are mapped to columns; an id the step does not score is skipped."""
    ids = torch.tensor([0, 1, 2, 7, A, 9])  # 6 columns; id B (5) not scored
    cols = column_map(ids)
    assert cols.tolist() == [0, 1, 2, -1, 4, -1, -1, 3, -1, 5]
    state = SearchState(3, torch.tensor([9]), torch.tensor([0]), torch.tensor([[7, A, 7]]))
    logp = torch.zeros(1, 6)
    NoRepeatNgram(2, cols)(logp, state)  # 7 was followed by A (id 4: column 4)
    assert logp.tolist() == [[0, 0, 0, 0, NEG, 0]]
    state = SearchState(2, torch.tensor([9]), torch.tensor([0]), torch.tensor([[B_, 9]]))
    out = RepetitionPenalty(2.0, cols)(torch.full((1, 6), -1.0), state)
    assert out.tolist() == [[-1, -1, -1, -1, -1, -2]]  # 9 is column 5; B is not scored


def test_repetition_penalty_hand_computed():
    table = {BOS_ID: {A: 0.5, B_: 0.4, EOS_ID: 0.1},
             A: {A: 0.5, B_: 0.3, EOS_ID: 0.2},
             B_: {EOS_ID: 0.9, A: 0.05, B_: 0.05}}
    assert greedy(table, 3, DecodeConfig())[0].tokens == [A, A, A, EOS_ID]
    # P = 2: A's 0.5 becomes 0.5 ** 2 = 0.25 < B's 0.3; EOS, never generated, keeps 0.9
    got = greedy(table, 3, DecodeConfig(repetition_penalty=2.0))[0]
    assert got.tokens == [A, B_, EOS_ID]
    assert got.log_prob == pytest.approx(logp_of([0.5, 0.3, 0.9]), abs=1e-6)
    # P = 1.5: 0.5 ** 1.5 = 0.354 > 0.3, A again; the row is not renormalized
    got = greedy(table, 2, DecodeConfig(repetition_penalty=1.5))[0]
    assert got.tokens == [A, A, EOS_ID]  # EOS forced at 2, at its own (unpenalized) 0.2
    assert got.log_prob == pytest.approx(logp_of([0.5, 0.5 ** 1.5, 0.2]), abs=1e-6)


def test_repetition_penalty_counts_a_token_once_whatever_its_count():
    state = SearchState(3, torch.tensor([9, 9]), torch.tensor([0, 1]),
                        torch.tensor([[A, A, A], [B_, A, B_]]))
    logp = torch.log(torch.tensor([[0.1, 0.1, 0.2, 0.1, 0.25, 0.25]] * 2))
    out = RepetitionPenalty(3.0)(logp.clone(), state)
    want = logp.clone()
    want[0, A] *= 3
    want[1, A] *= 3
    want[1, B_] *= 3
    assert torch.allclose(out, want)
    assert RepetitionPenalty(3.0)(logp.clone(), SearchState(0, torch.tensor([9, 9]),
                                  None, torch.empty(2, 0, dtype=torch.long))).equal(logp)


EARLY = {BOS_ID: {EOS_ID: 0.6, A: 0.4}, A: {EOS_ID: 0.7, A: 0.3}}


def test_min_length_ratio_hand_computed():
    assert greedy(EARLY, 9, DecodeConfig())[0].tokens == [EOS_ID]
    # 4 source tokens, ratio 0.5: at least 2 tokens before EOS
    got = greedy(EARLY, 9, DecodeConfig(min_length_ratio=0.5))[0]
    assert got.tokens == [A, A, EOS_ID]
    assert got.log_prob == pytest.approx(logp_of([0.4, 0.3, 0.7]), abs=1e-6)
    # ratio 0.3: ceil(1.2) = 2 tokens too; 0.25: exactly 1
    assert greedy(EARLY, 9, DecodeConfig(min_length_ratio=0.3))[0].tokens == [A, A, EOS_ID]
    assert greedy(EARLY, 9, DecodeConfig(min_length_ratio=0.25))[0].tokens == [A, EOS_ID]
    # the maximum wins: at max_lens = 1 the EOS is forced, whatever the minimum
    assert greedy(EARLY, 1, DecodeConfig(min_length_ratio=2.0))[0].tokens == [A, EOS_ID]


def test_min_length_is_per_sentence_through_rows():
    """Each live row finds its own sentence's minimum through ``state.rows``, also after
    other rows have left the batch."""
    rule = MinLength.from_ratio(torch.tensor([2, 10, 0]), 0.5)  # 1, 5, 0 tokens
    assert rule.min_lens.tolist() == [1, 5, 0]
    state = SearchState(2, torch.tensor([9, 9]), torch.tensor([2, 1]), None)
    logp = torch.zeros(2, 6)
    rule(logp, state)
    assert logp[:, EOS_ID].tolist() == [0.0, NEG]
    hyps = greedy_search(LastTokenStep(EARLY, n=3), torch.full((3,), 9), processors=(rule,))
    assert [len(h.tokens) - 1 for h in hyps] == [1, 5, 0]


def test_max_length_ratio_caps_the_one_maximum():
    src = torch.tensor([10, 3, 0, 200])
    assert max_output_lengths(src, 1.0, 50, 128).tolist() == [60, 53, 50, 127]
    cap = max_length_cap(DecodeConfig(max_length_ratio=1.5))
    assert max_output_lengths(src, 1.0, 50, 128, cap).tolist() == [15, 4, 0, 127]
    # the slack: 0.7 * 10 is 7 in decimal but 7.000000000000001 in float64 (ceil 8), and
    # 0.29 * 100 is 28.999999999999996 (floor 28); each gives the integer it means
    assert MinLength.from_ratio(torch.tensor([10]), 0.7).min_lens.tolist() == [7]
    cap = max_length_cap(DecodeConfig(max_length_ratio=0.29))
    assert max_output_lengths(torch.tensor([100]), 1.0, 50, 1024, cap).tolist() == [29]
    assert max_length_cap(DecodeConfig()) is None


def test_guards_with_beam_search_on_the_stub():
    """Every live hypothesis is guarded, not only the best (the forced EOS costs nothing under
    the "hf" rules, so the loop A B A B A B is the best output without the guard)."""
    loop = {BOS_ID: {A: 0.7, B_: 0.29, EOS_ID: 0.01},
            A: {B_: 0.6, A: 0.39, EOS_ID: 0.01},
            B_: {A: 0.6, B_: 0.39, EOS_ID: 0.01}}
    options = dict(beam_size=3, alpha=0.0, nbest=3, rules="hf")
    plain = beam_search(LastTokenStep(loop), torch.tensor([6]), **options)[0]
    assert plain[0].tokens == [A, B_, A, B_, A, B_, EOS_ID]
    rules = guard_processors(DecodeConfig(no_repeat_ngram_size=2), torch.tensor([4]))
    hyps = beam_search(LastTokenStep(loop), torch.tensor([6]), processors=rules, **options)[0]
    assert len(hyps) == 3 and not any(has_repeated_ngram(h.tokens, 2) for h in hyps)


@pytest.mark.parametrize("fields, names", [
    ({"no_repeat_ngram_size": -1}, ["no_repeat_ngram_size", "-1"]),
    ({"repetition_penalty": 0.0}, ["repetition_penalty", "0.0"]),
    ({"repetition_penalty": -2.0}, ["repetition_penalty", "-2.0"]),
    ({"repetition_penalty": float("nan")}, ["repetition_penalty", "nan"]),
    ({"min_length_ratio": -0.5}, ["min_length_ratio", "-0.5"]),
    ({"max_length_ratio": 0.0}, ["max_length_ratio", "0.0"]),
    ({"min_length_ratio": 2.0, "max_length_ratio": 1.5},
     ["min_length_ratio=2.0", "max_length_ratio=1.5"]),
])
def test_bad_guard_settings_name_the_value(fields, names):
    with pytest.raises(ConfigError) as err:
        DecodeConfig(**fields)
    assert all(name in str(err.value) for name in names), str(err.value)


def test_the_guards_are_off_by_default_and_add_no_processor():
    assert guard_processors(DecodeConfig(), torch.tensor([3, 4])) == ()
    assert guard_processors(load_config("base").decode, torch.tensor([3])) == ()
    on = guard_processors(DecodeConfig(no_repeat_ngram_size=3, repetition_penalty=1.2,
                                       min_length_ratio=0.5, max_length_ratio=2.0),
                          torch.tensor([3]))
    assert [type(p) for p in on] == [MinLength, NoRepeatNgram, RepetitionPenalty]


# --- real outputs of small models ------------------------------------------------------------

TEXTS = ["a man is walking down the street with a dog",
         "two children play football in the park",
         "ein mann geht mit einem hund die straße entlang",
         "zwei kinder spielen fußball im park"] * 10
LINES = ["a man", "two children play football in the park with a dog", "zwei kinder",
         "ein mann geht mit einem hund", "the park", "a dog is walking in the street",
         "children play", "zwei kinder spielen im park mit einem hund"]
OPTIONS = dict(max_len_a=1.0, max_len_b=16, alpha=0.6, preprocessed=True)


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.learn(TEXTS, 80)


def tiny_model(vocab: Vocabulary, seed: int) -> Transformer:
    cfg = dataclasses.replace(load_config("tiny").model, vocab_size=len(vocab))
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # peaked next-token distributions, as a trained model's
        model.tgt_embed.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def models(vocab) -> list[Transformer]:
    return [tiny_model(vocab, seed) for seed in (1, 2)]


def translator(models, vocab, kind: str) -> Translator:
    if kind == "ensemble":
        return Translator(models, vocab, precision="fp32")
    return Translator(models[0], vocab, precision="int8" if kind == "int8" else "fp32")


SEARCHES = {"greedy": dict(beam_size=1), "beam": dict(beam_size=4),
            "sampling": dict(beam_size=1, sampling=SamplingConfig(seed=3))}


@pytest.mark.parametrize("kind", ["one", "ensemble", "int8"])
@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_no_repeated_ngram_in_real_outputs(models, vocab, kind, search):
    t = translator(models, vocab, kind)
    options = {**OPTIONS, **SEARCHES[search]}
    plain = [r[0].tokens for r in t.generate(LINES, **options)]
    assert any(has_repeated_ngram(x, 2) for x in plain)  # the loops the guard is for
    got = [r[0].tokens for r in t.generate(LINES, no_repeat_ngram_size=2, **options)]
    assert not any(has_repeated_ngram(x, 2) for x in got), got
    assert all(x[-1] == EOS_ID for x in got)


def test_guards_are_batch_invariant(models, vocab):
    """Per-sentence rules find their sentence through the search's rows, whatever the batch
    (the batches are sorted by length, so a sentence's place differs)."""
    t = translator(models, vocab, "int8")
    guards = dict(no_repeat_ngram_size=2, repetition_penalty=1.3, min_length_ratio=0.8,
                  max_length_ratio=1.6)
    for search in ("greedy", "beam"):
        options = {**OPTIONS, **SEARCHES[search], **guards}
        together = t.generate(LINES, batch_size=len(LINES), **options)
        alone = [t.generate([line], batch_size=1, **options)[0] for line in LINES]
        assert [r[0].tokens for r in alone] == [r[0].tokens for r in together]
        assert [r[0].score for r in alone] == pytest.approx([r[0].score for r in together],
                                                            abs=1e-5)


def test_length_ratios_on_real_outputs(models, vocab):
    t = translator(models, vocab, "one")
    S = [len(vocab.encode(line)) for line in LINES]
    options = {**OPTIONS, "beam_size": 4}
    short = t.generate(LINES, max_length_ratio=0.5, **options)
    assert all(len(r[0].tokens) - 1 <= math.floor(0.5 * s) for r, s in zip(short, S))
    # the maximum ratio is the cap max_len_a/max_len_b would give with a = R, b = 0
    same = t.generate(LINES, **{**options, "max_len_a": 0.5, "max_len_b": 0})
    assert [r[0].tokens for r in short] == [r[0].tokens for r in same]
    long = t.generate(LINES, min_length_ratio=1.5, **options)
    assert all(len(r[0].tokens) - 1 >= min(math.ceil(1.5 * s), s + 16)
               for r, s in zip(long, S))


@pytest.mark.parametrize("kind", ["one", "int8"])
def test_with_the_guards_off_the_outputs_are_unchanged(models, vocab, kind):
    """Off (the defaults, or given as their off values) adds no processor, so each search
    takes the path it takes without the feature (the int8 greedy kernel included): the same
    tokens and the same log-probabilities, bit for bit."""
    t = translator(models, vocab, kind)
    off = dict(no_repeat_ngram_size=0, repetition_penalty=1.0, min_length_ratio=0.0)
    for search in ("greedy", "beam"):
        options = {**OPTIONS, **SEARCHES[search]}
        base = t.generate(LINES, **options)
        given = t.generate(LINES, **off, **options)
        assert [(r[0].tokens, r[0].log_prob) for r in given] == \
            [(r[0].tokens, r[0].log_prob) for r in base]


def test_the_cli_flags_reach_the_search_and_bad_values_name_the_flag():
    import argparse

    from aiayn.cli.translate import add_decode_arguments, check_decode_arguments, \
        decode_options

    p = argparse.ArgumentParser()
    add_decode_arguments(p, checkpoint_required=False)
    args = p.parse_args(["--no-repeat-ngram-size", "3", "--repetition-penalty", "1.2",
                         "--min-length-ratio", "0.5", "--max-length-ratio", "2"])
    check_decode_arguments(args)
    options = decode_options(args)
    assert {k: options[k] for k in ("no_repeat_ngram_size", "repetition_penalty",
                                    "min_length_ratio", "max_length_ratio")} == \
        dict(no_repeat_ngram_size=3, repetition_penalty=1.2, min_length_ratio=0.5,
             max_length_ratio=2.0)
    assert "no_repeat_ngram_size" not in decode_options(p.parse_args([]))
    for argv, words in ((["--no-repeat-ngram-size", "-1"], ["--no-repeat-ngram-size", "-1"]),
                        (["--repetition-penalty", "0"], ["--repetition-penalty", "0"]),
                        (["--min-length-ratio", "3", "--max-length-ratio", "2"],
                         ["--min-length-ratio=3.0", "--max-length-ratio=2.0"])):
        with pytest.raises(UserError) as err:
            check_decode_arguments(p.parse_args(argv))
        assert all(w in str(err.value) for w in words), str(err.value)


def test_the_server_takes_the_guards_and_never_batches_other_guards_together(tmp_path):
    import threading
    import time

    import httpx
    from serving import serve_in_thread, tiny_checkpoint

    from aiayn.checkpoint import load_checkpoint
    from aiayn.serve import ServeLimits, create_app

    model, config, vocab = load_checkpoint(tiny_checkpoint(tmp_path / "ckpt"))
    t = Translator(model, vocab, config=config, precision="fp32")
    # a batch starts when 4 lines wait (of any settings), or when its 60 s window closes
    app = create_app(t, ServeLimits(max_lines=2, max_batch_lines=4, max_wait_ms=60_000))
    lines = ["Two dogs play in the snow.", "A man rides a bike."]
    guarded = {"no_repeat_ngram_size": 1, "repetition_penalty": 1.5}
    answers: dict[str, httpx.Response] = {}

    def post(base, path, body, name=None):
        r = httpx.post(base + path, json=body, timeout=30)
        if name is not None:
            answers[name] = r
        return r

    with serve_in_thread(app) as base:
        assert httpx.get(base + "/info", timeout=30).json()["decode"]["repetition_penalty"] == 1
        bad = post(base, "/translate", {"lines": lines, "repetition_penalty": 0})
        assert bad.status_code == 422, bad.text
        assert "repetition_penalty must be positive, got 0" in bad.json()["detail"]
        bad = post(base, "/document", {"text": "A dog.", "min_length_ratio": 3,
                                       "max_length_ratio": 2})
        assert bad.status_code == 422 and "min_length_ratio=3.0" in bad.json()["detail"]
        first = threading.Thread(target=post, args=(base, "/translate", {"lines": lines},
                                                    "plain"))
        first.start()
        deadline = time.monotonic() + 30
        while httpx.get(base + "/info", timeout=30).json()["load"]["queued_lines"] < 2:
            assert time.monotonic() < deadline, "the first request never queued"
            time.sleep(0.02)
        # 4 lines now wait: one batch of 4 if the keys were equal; as they are not, the
        # first request's 2 lines run, and the second's wait for their window to close
        second = threading.Thread(target=post, args=(base, "/translate",
                                                     {"lines": lines, **guarded}, "guarded"))
        second.start()
        first.join(timeout=30)
        app.state.begin_shutdown()  # closes the second request's window
        second.join(timeout=30)
    got = [answers[name].json() for name in ("plain", "guarded")]
    assert [a["batch_lines"] for a in got] == [2, 2]
    want = [t.generate(lines, **extra) for extra in ({}, guarded)]
    for answer, direct in zip(got, want):
        assert [line[0]["text"] for line in answer["translations"]] == \
            [r[0].text for r in direct]
    assert not any(has_repeated_ngram(r[0].tokens, 1) for r in want[1])
