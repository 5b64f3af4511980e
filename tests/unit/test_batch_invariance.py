"""A sentence translates the same alone, in a batch of 16 or within the whole set, in the
default precision of a finished run (int8): on a small model trained for a few seconds on
real Multi30k pairs, so that its next-token distributions are a trained model's, not flat."""

from __future__ import annotations

import dataclasses
import gzip

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import load_config
from aiayn.data.batching import pad_sources
from aiayn.data.vocab import BOS_ID, EOS_ID, PAD_ID, Vocabulary
from aiayn.model import Transformer
from aiayn.model import kernels
from aiayn.translator import Translator


def _read(path, n):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(n)]


@pytest.fixture(scope="module")
def trained(data_dir):
    """A 2+2-layer model trained for 150 steps on 600 Multi30k pairs, with its vocabulary and
    64 test sources of varied lengths."""
    m30k = data_dir / "multi30k"
    src, tgt = _read(m30k / "train.en.gz", 600), _read(m30k / "train.de.gz", 600)
    vocab = Vocabulary.learn(src + tgt, 400)
    cfg = dataclasses.replace(load_config("tiny").model, vocab_size=len(vocab), max_len=96)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    pairs = list(zip(vocab.encode_batch(src), vocab.encode_batch(tgt)))
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(150):
        batch = [pairs[i] for i in torch.randint(len(pairs), (32,), generator=gen).tolist()]
        s = pad_sources([a[:40] + [EOS_ID] for a, _ in batch])
        t = pad_sources([[BOS_ID] + b[:40] + [EOS_ID] for _, b in batch])
        logits = model(s, t[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1),
                               ignore_index=PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    lines = _read(m30k / "test_2016_flickr.en.gz", 64)
    return model, vocab, lines


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
