"""The vocabulary shortlist (aiayn.decoding.shortlist): built by IBM Model 1 from real
Multi30k pairs, written and read as CTranslate2's vmap file, and used by decoding per
sentence, so that a sentence translates the same alone or in any batch, produces only its
own list's tokens, and translates exactly as without a shortlist when the list holds every
token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from aiayn.data.vocab import EOS_ID, Vocabulary
from aiayn.decoding.shortlist import Shortlist
from aiayn.errors import DataError
from aiayn.model import kernels
from aiayn.translator import Translator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from small_models import read_lines, train_small  # noqa: E402


@pytest.fixture(scope="module")
def pairs(data_dir):
    """A 2,000-pair vocabulary and shortlist, and 200 validation pairs to test it on."""
    m30k = data_dir / "multi30k"
    src, tgt = read_lines(m30k / "train.en.gz", 2000), read_lines(m30k / "train.de.gz", 2000)
    vocab = Vocabulary.learn(src + tgt, 1000)
    shortlist = Shortlist.build(zip(vocab.encode_batch(src), vocab.encode_batch(tgt)),
                                len(vocab), first=50, best=20)
    val = (read_lines(m30k / "val.en.gz", 200), read_lines(m30k / "val.de.gz", 200))
    return vocab, shortlist, val


def coverage(lists: torch.Tensor, refs: list[list[int]]) -> float:
    """Share of the reference tokens that their sentence's list (bool (B, V)) holds."""
    hit = sum(int(lists[b, torch.tensor(r)].sum()) for b, r in enumerate(refs))
    return hit / sum(len(r) for r in refs)


def test_the_lists_hold_more_of_the_references_than_as_many_frequent_tokens(pairs):
    vocab, shortlist, (src, tgt) = pairs
    V = len(vocab)
    ids, allowed = shortlist.candidates([s + [EOS_ID] for s in vocab.encode_batch(src)],
                                        EOS_ID + 1, V)
    lists = torch.zeros(len(src), V, dtype=torch.bool)
    lists[:, ids] = allowed
    refs = vocab.encode_batch(tgt)
    size = int(lists.sum(dim=1).float().mean())
    assert 50 < size < V / 2  # more than the frequent tokens, far less than everything
    # the baseline: the same number of tokens for every sentence, the most frequent ones
    counts = torch.bincount(torch.tensor([i for r in refs for i in r]), minlength=V)
    frequent = torch.zeros(len(src), V, dtype=torch.bool)
    frequent[:, counts.argsort(descending=True)[:size]] = True
    assert coverage(lists, refs) > coverage(frequent, refs) + 0.05
    assert ids[: EOS_ID + 1].tolist() == list(range(EOS_ID + 1))
    assert bool(torch.all(ids[1:] > ids[:-1]))


def test_a_sentence_gets_the_same_list_alone_or_in_a_batch(pairs):
    vocab, shortlist, (src, _) = pairs
    sources = [s + [EOS_ID] for s in vocab.encode_batch(src[:20])]
    ids, allowed = shortlist.candidates(sources, EOS_ID + 1, len(vocab))
    for b in (0, 7, 19):
        alone_ids, alone = shortlist.candidates([sources[b]], EOS_ID + 1, len(vocab))
        assert ids[allowed[b]].tolist() == alone_ids[alone[0]].tolist()
    assert len(ids) > int(allowed.sum(dim=1).max())  # the union is wider than any one list


def test_the_vmap_file_round_trips_and_bad_files_name_their_line(pairs, tmp_path):
    vocab, shortlist, _ = pairs
    path = shortlist.save(tmp_path / "vmap.txt", vocab)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("\t") and all("\t" in line for line in lines)
    again = Shortlist.load(path, vocab)
    for a, b in ((shortlist.always, again.always), (shortlist.offsets, again.offsets),
                 (shortlist.targets, again.targets)):
        assert torch.equal(a, b)
    piece = vocab.tokenizer.id_to_token(EOS_ID + 10)
    for text, says in ((f"\t{piece}\nno-tab-here\n", ":2: no tab"),
                       ("\tnot-a-token-xyz\n", ":1: target token .* not in the model's"),
                       (f"{piece} {piece}\t{piece}\n", ":1: source n-gram")):
        bad = tmp_path / "bad.txt"
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(DataError, match=says):
            Shortlist.load(bad, vocab)
    (tmp_path / "empty.txt").write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="no entries"):
        Shortlist.load(tmp_path / "empty.txt", vocab)
    with pytest.raises(DataError, match="cannot read"):
        Shortlist.load(tmp_path / "missing.txt", vocab)


@pytest.fixture(scope="module")
def trained(data_dir):
    """A 2+2-layer model trained for 150 steps on 600 pairs (a target-only output layer),
    its shortlist from those pairs, and 48 test sources."""
    model, vocab = train_small(data_dir, output_vocab="target")
    m30k = data_dir / "multi30k"
    src, tgt = read_lines(m30k / "train.en.gz", 600), read_lines(m30k / "train.de.gz", 600)
    shortlist = Shortlist.build(zip(vocab.encode_batch(src), vocab.encode_batch(tgt)),
                                len(vocab), first=20, best=10)
    return model, vocab, shortlist, read_lines(m30k / "test_2016_flickr.en.gz", 48)


OPTIONS = dict(alpha=0.6, max_len_a=1.0, max_len_b=10, preprocessed=True)


@pytest.mark.skipif(not kernels.AVAILABLE, reason="batch invariance needs the numba kernels")
@pytest.mark.parametrize("beam_size", [1, 4])
def test_shortlisted_translation_is_the_same_alone_and_together_and_keeps_to_its_list(
        trained, beam_size):
    model, vocab, shortlist, lines = trained
    translator = Translator(model, vocab, precision="int8", shortlist=shortlist)

    def tokens(batch_size, subset=lines):
        out = translator.generate(subset, batch_size=batch_size, beam_size=beam_size,
                                  **OPTIONS)
        return [r[0].tokens for r in out]

    together = tokens(len(lines))
    assert tokens(16) == together
    assert [tokens(1, [line])[0] for line in lines] == together
    free = Translator(model, vocab, precision="int8").generate(
        lines, batch_size=len(lines), beam_size=beam_size, **OPTIONS)
    assert [r[0].tokens for r in free] != together  # the lists are short enough to bite
    ids, allowed = shortlist.candidates([s + [EOS_ID] for s in vocab.encode_batch(lines)],
                                        EOS_ID + 1, len(vocab))
    for b, out in enumerate(together):
        assert set(out) <= set(ids[allowed[b]].tolist())


@pytest.mark.parametrize("precision", ["int8", "fp32"])
def test_a_shortlist_of_every_token_translates_as_none_does(trained, precision):
    model, vocab, _, lines = trained
    if precision == "int8" and not kernels.AVAILABLE:
        pytest.skip("int8 decoding needs the numba kernels here")
    V = len(vocab)
    everything = Shortlist(torch.arange(V), torch.zeros(V + 1, dtype=torch.long),
                           torch.zeros(0, dtype=torch.long))
    plain = Translator(model, vocab, precision=precision)
    listed = Translator(model, vocab, precision=precision, shortlist=everything)
    for beam_size in (1, 4):
        a = plain.generate(lines, batch_size=16, beam_size=beam_size, **OPTIONS)
        b = listed.generate(lines, batch_size=16, beam_size=beam_size, **OPTIONS)
        assert [r[0].tokens for r in a] == [r[0].tokens for r in b]
        if precision == "int8":  # the same int8 rows and scales: the same logits
            assert [r[0].score for r in a] == [r[0].score for r in b]
