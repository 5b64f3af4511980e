"""A confidence for every translation and flags for its likely failures (issue 82, item 4;
:mod:`aiayn.decoding.quality`): each flag raised by a real case, the validation range recorded
with a run and loaded with its model, split lines combined, and the search's output
unchanged."""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest
import torch
from serving import TEXTS

from aiayn.checkpoint import save_checkpoint
from aiayn.config import DataConfig, DecodeConfig, load_config
from aiayn.data.vocab import EOS_ID, Vocabulary
from aiayn.decoding import Translation, translate_nbest
from aiayn.decoding.quality import (COPY, FLAGS, LENGTH_RATIO, NO_EOS, REPEAT, LengthRange,
                                    assess, copy_share, flag_counts, joined, length_ratio_range,
                                    repeated_ngram)
from aiayn.errors import UserError
from aiayn.model import Transformer
from aiayn.translator import Translator, join_parts

LINES = ["A man in a red shirt rides a bike.", "", "Two dogs play in the snow.",
         "Ein Mann fährt Fahrrad."]


@pytest.fixture(scope="module")
def tiny():
    """A random-weight 1+1-layer model (it rarely chooses EOS: its outputs run to the limit)."""
    vocab = Vocabulary.learn(TEXTS, 90)
    cfg = load_config("tiny")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, vocab_size=len(vocab), max_len=24, N=1))
    torch.manual_seed(0)
    return Transformer(cfg.model).eval(), vocab, cfg


def test_repeat_finds_a_loop_of_one_to_four_tokens():
    assert repeated_ngram([5, 6, 7, 7, 7, 7, 8]) == (2, 1, 4)
    assert repeated_ngram([5, 6, 7, 7, 7, 8]) is None  # one token thrice: ". . .", "1 0 0 0"
    assert repeated_ngram([9, *[1, 2, 3, 4] * 3, 9]) == (1, 4, 3)
    assert repeated_ngram([4, 5, 4, 5, 9, 4, 5]) is None  # twice in a row is no loop
    assert repeated_ngram([1, 2, 3, 4, 5] * 3) is None  # a 5-gram is longer than looked for
    assert repeated_ngram([7] * 5) == (0, 1, 5) and repeated_ngram([]) is None
    loop = [10, 11, 12] * 3 + [EOS_ID]
    got = assess(loop, -4.0, "x", "y", 5, 50, None)
    assert got["flags"] == (REPEAT,)
    assert assess([10, 11, 12, 10, 11, EOS_ID], -4.0, "x", "y", 5, 50, None)["flags"] == ()


def test_copy_flags_an_output_that_copies_its_source():
    source = "Two dogs play in the snow."
    assert copy_share(source, source) == 1.0
    assert assess([4, 5, 6, EOS_ID], -1.0, source, source, 7, 50, None)["flags"] == (COPY,)
    assert copy_share("Zwei Hunde spielen im Schnee.", source) == 0.0
    # a translation that keeps a name and the numbers is no copy; short outputs are not judged
    assert copy_share("Tom kauft 12 Äpfel für 3 Euro.", "Tom buys 12 apples for 3 euros.") \
        == pytest.approx(1 / 5)
    assert copy_share("12 345 678", "12 345 678") is None
    assert copy_share("Two dogs.", source) is None


def test_confidence_is_the_log_probability_per_token_eos_included():
    got = assess([4, 5, EOS_ID], -3.0, "a b", "c d", 2, 50, None)
    assert got["confidence"] == pytest.approx(-1.0)
    assert got["unchecked"] == (LENGTH_RATIO,)  # no validation range: not evaluated
    assert Translation("", 0.0, 0.0, []).confidence == 0.0
    assert Translation("", 0.0, 0.0, []).flags == () == Translation("", 0.0, 0.0, []).unchecked


@pytest.mark.parametrize("beam", [1, 3])
def test_no_eos_when_the_search_hits_the_maximum_length(tiny, beam):
    model, vocab, _ = tiny
    decode = DecodeConfig(beam_size=beam, max_len_a=0.0, max_len_b=3)
    out = translate_nbest(model, vocab, LINES, decode)
    for line, (t,) in zip(LINES, out):
        if not line:  # nothing searched: no confidence, no flags
            assert t.tokens == [] and t.confidence == 0.0 and t.flags == ()
            continue
        assert (NO_EOS in t.flags) == (len(t.tokens) - 1 == 3)
        assert t.confidence == pytest.approx(t.log_prob / len(t.tokens))
        assert t.unchecked == (LENGTH_RATIO,) and set(t.flags) <= set(FLAGS)
    assert flag_counts(t for (t,) in out)[NO_EOS] >= 1  # random weights run to the limit
    # no room at all: the first token is the forced EOS
    forced = translate_nbest(model, vocab, LINES[:1], dataclasses.replace(decode, max_len_b=0))
    assert forced[0][0].tokens == [EOS_ID] and forced[0][0].flags == (NO_EOS,)
    # a range changes the flags only: the search's text, tokens and scores stay as they were
    ranged = translate_nbest(model, vocab, LINES, decode, length_range=LengthRange(0.9, 1.1))
    for (a,), (b,) in zip(out, ranged):
        assert (a.text, a.tokens, a.score, a.log_prob) == (b.text, b.tokens, b.score, b.log_prob)
        assert b.unchecked == () or not b.tokens


def test_the_length_range_comes_from_validation_references(data_dir):
    m30k = data_dir / "multi30k"
    with gzip.open(m30k / "val.en.gz", "rt", encoding="utf-8") as f:
        src = [next(f).strip() for _ in range(300)]
    with gzip.open(m30k / "val.de.gz", "rt", encoding="utf-8") as f:
        tgt = [next(f).strip() for _ in range(300)]
    vocab = Vocabulary.learn(src + tgt, 300)
    got = length_ratio_range(vocab, src, tgt)
    ratios = [len(vocab.encode(t)) / len(vocab.encode(s)) for s, t in zip(src, tgt)]
    inside = sum(got.contains(r) for r in ratios) / len(ratios)
    assert 0.96 <= inside and got.sentences == 300  # the 1st-99th percentile
    assert LengthRange.from_record(got.to_record()) == dataclasses.replace(
        got, low=round(got.low, 4), high=round(got.high, 4))
    # an output far shorter than the range allows is flagged; one at the median is not
    median = sorted(ratios)[150]
    assert LENGTH_RATIO in assess([4, EOS_ID], -1.0, "a", "b", 40, 90, got)["flags"]
    body = list(range(10, 10 + round(median * 20)))
    assert assess(body + [EOS_ID], -1.0, "a", "b", 20, 90, got)["flags"] == ()
    with pytest.raises(ValueError, match="low <= high"):
        LengthRange(2.0, 1.0)


def test_a_run_records_its_range_and_its_model_loads_with_it(tiny, tmp_path):
    from aiayn.rundir import GENERATION_CONFIG
    from aiayn.selection import Choice, record_choice

    model, vocab, cfg = tiny
    run = tmp_path / "run"
    member = save_checkpoint(run / "averaged", model, cfg, vocab)
    choice = Choice(1, 0.6, [member], [member], {"1": {"0.6": 1.0}}, None)
    record_choice(run, choice, DecodeConfig(max_len_a=0.0, max_len_b=3), precision="fp32",
                  data=DataConfig(), length_range=LengthRange(0.5, 2.0, 100))
    translator = Translator.from_pretrained(run, workers=1)
    assert translator.length_range == LengthRange(0.5, 2.0, 100)
    got = translator.generate(LINES[:1])[0][0]
    ratio = (len(got.tokens) - 1) / len(vocab.encode(LINES[0]))
    assert got.unchecked == () and (LENGTH_RATIO in got.flags) == (not 0.5 <= ratio <= 2.0)
    # a bare checkpoint (outside any run) has none: the flag is unchecked, and says so
    bare = save_checkpoint(tmp_path / "bare", model, cfg, vocab)
    assert Translator.from_pretrained(bare).generate(LINES[:1])[0][0].unchecked == \
        (LENGTH_RATIO,)
    record = json.loads((run / GENERATION_CONFIG).read_text())
    record["length_ratio"]["low"] = 5.0
    (run / GENERATION_CONFIG).write_text(json.dumps(record))
    with pytest.raises(UserError, match="length_ratio"):
        Translator.from_pretrained(run)


def test_a_line_in_parts_joins_its_parts_confidence_and_flags():
    a = Translation("a", -2.0, -2.0, [4, 5, EOS_ID], -2 / 3, (NO_EOS,), (LENGTH_RATIO,))
    b = Translation("b", -1.0, -1.0, [6, EOS_ID], -0.5, (REPEAT,), (LENGTH_RATIO,))
    c = Translation("c", -0.5, -0.5, [7, EOS_ID], -0.25)
    (ab,), (alone,) = join_parts([[a], [b], [c]], [2, 1])
    assert ab.tokens == [4, 5, 6, EOS_ID] and ab.text == "a b"
    assert ab.confidence == pytest.approx(-3.0 / 5)  # all five tokens, both EOS counted
    assert ab.flags == (REPEAT, NO_EOS) and ab.unchecked == (LENGTH_RATIO,)
    assert alone is c
    assert joined([c])["confidence"] == c.confidence
