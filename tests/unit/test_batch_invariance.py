"""A sentence translates the same alone, in a batch of 16 or within the whole set, in the
default precision of a finished run (int8): on a small model trained for a few seconds on
real Multi30k pairs, so that its next-token distributions are a trained model's, not flat."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aiayn.model import kernels
from aiayn.translator import Translator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from small_models import read_lines, train_small  # noqa: E402


@pytest.fixture(scope="module")
def trained(data_dir):
    """A 2+2-layer model trained for 150 steps on 600 Multi30k pairs, with its vocabulary and
    64 test sources of varied lengths."""
    model, vocab = train_small(data_dir)
    return model, vocab, read_lines(data_dir / "multi30k" / "test_2016_flickr.en.gz", 64)


@pytest.mark.skipif(not kernels.AVAILABLE, reason="batch invariance needs the numba kernels")
@pytest.mark.parametrize("beam_size", [1, 4])
def test_int8_translation_is_the_same_alone_in_16s_and_all_together(trained, beam_size):
    model, vocab, lines = trained
    translator = Translator(model, vocab, precision="int8")
    options = dict(beam_size=beam_size, alpha=0.6, max_len_a=1.0, max_len_b=10,
                   preprocessed=True)

    def tokens(batch_size, subset=lines):
        out = translator.generate(subset, batch_size=batch_size, **options)
        return [r[0].tokens for r in out]

    together = tokens(len(lines))
    in_16s = tokens(16)
    alone = [tokens(1, [line])[0] for line in lines]
    assert len({len(t) for t in together}) > 3  # real, varied outputs, not one fixed string
    assert in_16s == together
    assert alone == together


@pytest.mark.skipif(not kernels.AVAILABLE, reason="batch invariance needs the numba kernels")
@pytest.mark.parametrize("beam_size", [1, 4])
def test_two_worker_processes_translate_as_one_process_does(trained, beam_size):
    """Forked one-thread workers (aiayn.decoding.workers) give every sentence the tokens and
    score one process gives it, and the searches' work adds up to the same row-steps."""
    from aiayn.decoding import DecodeStats

    model, vocab, lines = trained
    translator = Translator(model, vocab, precision="int8")
    options = dict(beam_size=beam_size, alpha=0.6, max_len_a=1.0, max_len_b=10,
                   batch_size=8, preprocessed=True)
    one, two = DecodeStats(), DecodeStats()
    alone = translator.generate(lines, workers=1, stats=one, **options)
    forked = translator.generate(lines, workers=2, stats=two, **options)
    assert [r[0].tokens for r in forked] == [r[0].tokens for r in alone]
    assert [r[0].score for r in forked] == pytest.approx([r[0].score for r in alone], abs=1e-5)
    assert (two.calls, two.row_steps) == (one.calls, one.row_steps) and one.row_steps > 0
