"""Terminology constraints by dynamic beam allocation (aiayn.decoding.constraints): the
constraint states and the banks on a stub step function with hand-set probabilities, then a
real tiny Transformer through the Translator (several phrases, multi-token ones, batching,
int8, an ensemble, greedy), and the faces' inputs (files, glossary, the server)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_search import A, B_, RandomStep, StubStep, caption_vocab, tiny_model  # tests/unit is on sys.path

from aiayn.data.vocab import EOS_ID, UNK_ID, Vocabulary
from aiayn.decoding import beam_search
from aiayn.decoding.constraints import (
    ConstraintError,
    Constraints,
    ConstraintState,
    constrained_beam_search,
    glossary_constraints,
    merge_constraints,
    placed,
    read_constraints,
    read_glossary,
)
from aiayn.errors import DataError
from aiayn.model import kernels
from aiayn.translator import Translator


# --- the states and the banks, by hand ------------------------------------------------------


def test_states_advance_break_and_count():
    c = Constraints(((4, 5), (6,)))
    s = ConstraintState()
    assert c.total == 3 and c.next_tokens(s) == [4, 6]
    s = c.advance(s, 4)  # phrase 0 started
    assert s == ConstraintState(0, 0, 1, 1) and c.next_tokens(s) == [5]
    s = c.advance(s, 7)  # broken off: its token no longer counts
    assert s == ConstraintState(0, -1, 0, 0)
    s = c.advance(c.advance(s, 4), 5)  # phrase 0 produced
    assert s == ConstraintState(0b01, -1, 0, 2) and c.next_tokens(s) == [6]
    s = c.advance(s, 4)  # a produced phrase does not start again
    assert s.count == 2
    s = c.advance(s, 6)
    assert s.count == 3 and s.met == 0b11 and c.next_tokens(s) == []
    # breaking a phrase with the first token of another starts that one
    d = Constraints(((4, 5), (7, 8)))
    assert d.advance(d.advance(ConstraintState(), 4), 7) == ConstraintState(0, 1, 1, 1)


# Unconstrained, a beam of 2 keeps A (0.5) and UNK (0.3); the constraint B (0.2) takes bank 1.
BANKS = {
    (): {A: 0.5, UNK_ID: 0.3, B_: 0.2},
    (A,): {EOS_ID: 0.9, A: 0.04, UNK_ID: 0.03, B_: 0.03},
    (UNK_ID,): {EOS_ID: 0.9, A: 0.05, B_: 0.05},
    (B_,): {EOS_ID: 0.8, A: 0.1, UNK_ID: 0.1},
}


class _Beams:
    """A score processor that records each step's live hypotheses (state.tokens)."""

    def __init__(self):
        self.seen: list[list[list[int]]] = []

    def __call__(self, logp, state):
        self.seen.append(state.tokens.tolist())
        return logp


def test_banks_on_a_stub_hand_checked():
    lens = torch.tensor([4])
    beams = _Beams()
    (plain,) = beam_search(StubStep(BANKS), lens, beam_size=2, alpha=0.0, processors=[beams])
    assert beams.seen[1] == [[A], [UNK_ID]]
    assert plain[0].tokens == [A, EOS_ID]
    beams = _Beams()
    (hyps,) = constrained_beam_search(StubStep(BANKS), lens, [[[B_]]], beam_size=2, alpha=0.0,
                                      nbest=2, processors=[beams])
    # step 1: bank 1's best (B) first, then bank 0's best (A); UNK is pruned
    assert beams.seen[1] == [[B_], [A]]
    # A may not end (its constraint is unmet), so A continues; B ends at once
    assert hyps[0].tokens == [B_, EOS_ID]
    assert hyps[0].log_prob == pytest.approx(math.log(0.2 * 0.8), abs=1e-4)
    assert len(hyps) == 2 and all(B_ in h.tokens for h in hyps)


@pytest.mark.parametrize("beam_size", [1, 2, 4])
def test_every_finished_output_holds_every_phrase(beam_size):
    """EOS never comes before all constraints are met: every output returned (the n-best)
    holds each phrase, on random step functions, unless the length limit forced its EOS
    (the fallback, ranked below every complete one); the best always holds them."""
    phrases = [[5, 6], [4]]
    for seed in range(20):
        (hyps,) = constrained_beam_search(RandomStep(seed), torch.tensor([8]), [phrases],
                                          beam_size=beam_size, nbest=beam_size)
        assert hyps and all(placed(phrases, hyps[0].tokens)), seed
        complete = [all(placed(phrases, h.tokens)) for h in hyps]
        assert complete == sorted(complete, reverse=True), seed
        for h, ok in zip(hyps, complete):
            assert ok or len(h.tokens) == 8 + 1, (seed, h.tokens)
            assert h.tokens.count(EOS_ID) == 1 and h.tokens[-1] == EOS_ID
        done = [h for h, ok in zip(hyps, complete) if ok]
        assert [h.score for h in done] == sorted((h.score for h in done), reverse=True)


def test_no_constraints_is_beam_search_on_random_steps():
    """With no phrase there is one bank, and the search is the plain beam search."""
    for seed in range(20):
        (plain,) = beam_search(RandomStep(seed), torch.tensor([6]), beam_size=3, nbest=3)
        (got,) = constrained_beam_search(RandomStep(seed), torch.tensor([6]), [[]],
                                         beam_size=3, nbest=3)
        assert [h.tokens for h in got] == [h.tokens for h in plain], seed


def test_the_length_limit_is_the_fallback():
    """Constraints longer than the limit are refused; ones that fit exactly are placed."""
    with pytest.raises(ValueError, match="need 3 tokens"):
        constrained_beam_search(RandomStep(0), torch.tensor([2]), [[[4, 5, 6]]])
    (hyps,) = constrained_beam_search(RandomStep(0), torch.tensor([3]), [[[4, 5, 6]]])
    assert hyps[0].tokens == [4, 5, 6, EOS_ID]


# --- a real tiny Transformer through the Translator -----------------------------------------


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return caption_vocab()


@pytest.fixture(scope="module")
def model(vocab):
    m = tiny_model(len(vocab), seed=1)
    with torch.no_grad():
        m.tgt_embed.weight.mul_(4.0)  # peaked next-token distributions, as a trained model's
    return m


LINES = ["a man is walking", "two children play", "", "zwei kinder spielen fußball im park",
         "the park", "a dog"]
CONS = [["hund"], None, None, ["ein mann", "im park", "straße"], None, ["zwei kinder"]]
OPTS = dict(beam_size=4, max_len_b=8, preprocessed=True)


def _ids(vocab, cons):
    return [None if c is None else [vocab.encode(p) for p in c] for c in cons]


def test_constraints_appear_and_other_lines_are_unchanged(model, vocab):
    translator = Translator(model, vocab, precision="fp32")
    plain = translator.generate(LINES, **OPTS)
    got = translator.generate(LINES, constraints=CONS, **OPTS)
    for i, (phrases, ids) in enumerate(zip(CONS, _ids(vocab, CONS))):
        if phrases is None:  # decoded as without the option, in batches without the others
            assert got[i][0].text == plain[i][0].text and got[i][0].tokens == plain[i][0].tokens
            assert got[i][0].score == pytest.approx(plain[i][0].score, abs=1e-5)
        else:
            assert all(placed(ids, got[i][0].tokens)), (i, got[i][0].text)
            assert all(p in got[i][0].text for p in phrases)
    assert len(_ids(vocab, CONS)[3][0]) > 1  # a multi-token phrase among them


def test_batched_equals_one_at_a_time_and_greedy(model, vocab):
    translator = Translator(model, vocab, precision="fp32")
    together = translator.generate(LINES, constraints=CONS, batch_size=4, **OPTS)
    alone = [translator.generate([x], constraints=[c], **OPTS)[0]
             for x, c in zip(LINES, CONS)]
    assert [r[0].tokens for r in together] == [r[0].tokens for r in alone]
    greedy = translator.generate(LINES, constraints=CONS, **{**OPTS, "beam_size": 1})
    for out, ids in zip(greedy, _ids(vocab, CONS)):
        if ids:
            assert all(placed(ids, out[0].tokens))


def test_int8_and_an_ensemble(model, vocab):
    """Placed with int8 and with an ensemble; with int8 (batch-invariant kernels), the lines
    without constraints keep their text, tokens and score exactly."""
    other = tiny_model(len(vocab), seed=2)
    for translator in (Translator(model, vocab, precision="int8"),
                       Translator([model, other], vocab, precision="fp32")):
        got = translator.generate(LINES, constraints=CONS, **OPTS)
        for out, ids in zip(got, _ids(vocab, CONS)):
            if ids:
                assert all(placed(ids, out[0].tokens))
        if translator.precision.uses_int8 and kernels.AVAILABLE:
            plain = translator.generate(LINES, **OPTS)
            assert [got[i][0] for i, c in enumerate(CONS) if c is None] == \
                [plain[i][0] for i, c in enumerate(CONS) if c is None]


def test_a_shortlist_lets_the_constraint_tokens_in(model, vocab):
    """A sentence's shortlist (here: ids 0-9 alone) gains its constraints' tokens."""
    from aiayn.decoding.shortlist import Shortlist

    tiny = Shortlist(torch.arange(10), torch.zeros(len(vocab) + 1, dtype=torch.long),
                     torch.zeros(0, dtype=torch.long))
    translator = Translator(model, vocab, precision="fp32", shortlist=tiny)
    hund = vocab.encode("hund")
    assert max(hund) >= 10
    out = translator.generate(["a dog", "the park"], constraints=[["hund"], None], **OPTS)
    assert all(placed([hund], out[0][0].tokens))
    assert set(out[0][0].tokens) <= set(range(10)) | set(hund)
    assert set(out[1][0].tokens) <= set(range(10))


def test_a_token_the_model_never_produces_is_refused(model, vocab):
    """An int8 copy of a target-only model scores only its producible tokens (compact
    columns): a constraint off them is refused with one line naming the line and token;
    one on them is placed through the column map."""
    m = tiny_model(len(vocab), seed=1, output_vocab="target")
    hund = vocab.encode("hund")
    keep = sorted(set(range(EOS_ID + 1)) | set(range(3, len(vocab))) - set(hund))
    m.limit_output_vocab(torch.tensor(keep))
    translator = Translator(m, vocab, precision="int8")
    with pytest.raises(ConstraintError, match="line 1: constraint 'hund'.*never produces"):
        translator.generate(["a dog"], constraints=[["hund"]], **OPTS)
    ok = vocab.encode("park")
    out = translator.generate(["a dog"], constraints=[["park"]], **OPTS)
    assert all(placed([ok], out[0][0].tokens))


def test_bad_constraints_are_one_clear_line(model, vocab):
    translator = Translator(model, vocab, precision="fp32")
    with pytest.raises(ConstraintError, match="line 1: the constraints need"):
        translator.generate(["a"], constraints=[["ein mann geht mit einem hund"]],
                            **{**OPTS, "max_len_b": 1})
    with pytest.raises(ConstraintError, match="for 1 lines but there are 2"):
        translator.generate(["a", "b"], constraints=[["x"]], **OPTS)
    with pytest.raises(ConstraintError, match="not sampling"):
        from aiayn.decoding import SamplingConfig

        translator.generate(["a"], constraints=[["hund"]], sampling=SamplingConfig(seed=0),
                            **OPTS)


# --- files, glossary, server ----------------------------------------------------------------


def test_constraint_files_and_glossary(tmp_path):
    tsv = tmp_path / "c.tsv"
    tsv.write_text("hund\tein mann\n\nim park\n", encoding="utf-8")
    assert read_constraints(tsv, 3) == [["hund", "ein mann"], None, ["im park"]]
    with pytest.raises(DataError, match=r"c\.tsv: 3 lines of constraints for 2 input lines"):
        read_constraints(tsv, 2)
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"constraints": ["hund"]}\n\n{"constraints": [oops\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl, line 3: bad JSON"):
        read_constraints(jl, 3)
    jl.write_text(json.dumps({"constraints": ["hund"]}) + "\n{}\n[1]\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 3: expected"):
        read_constraints(jl, 3)
    jl.write_text(json.dumps({"constraints": ["hund"]}) + "\n{}\n", encoding="utf-8")
    assert read_constraints(jl, 2) == [["hund"], None]
    gl = tmp_path / "g.tsv"
    gl.write_text("# terms\ndog\thund\npark\tpark\n", encoding="utf-8")
    glossary = read_glossary(gl)
    found = glossary_constraints(glossary, ["a dog in the park", "a dogma", "none"])
    assert found == [["hund", "park"], None, None]
    assert merge_constraints([["park"], None, None], found) == [["park", "hund"], None, None]
    gl.write_text("dog hund\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"g\.tsv, line 1"):
        read_glossary(gl)


def test_server_takes_constraints(model, vocab):
    from fastapi.testclient import TestClient

    from aiayn.serve.app import create_app

    translator = Translator(model, vocab, precision="fp32")
    with TestClient(create_app(translator)) as client:
        r = client.post("/translate", json={"lines": ["a dog", "the park"],
                                            "constraints": [["hund"], []]})
        assert r.status_code == 200, r.text
        texts = [t[0]["text"] for t in r.json()["translations"]]
        assert "hund" in texts[0]
        assert texts[1] == translator.translate(["the park"])[0]
        bad = client.post("/translate", json={"lines": ["a"], "constraints": [
            [" ".join(["hund"] * 80)]]})
        assert bad.status_code == 422 and "line 1: the constraints need" in bad.text
