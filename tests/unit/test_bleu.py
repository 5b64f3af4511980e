"""BLEU protocols: sacreBLEU as called directly, the paper's tokenized BLEU, and the Multi30k
literature's protocol reproduced against the shared tokenized references."""

from __future__ import annotations

import dataclasses

import pytest
import sacrebleu

from aiayn.errors import DataError
from aiayn.config import load_config
from aiayn.evaluation import (
    corpus_bleu,
    decode_lines,
    multi30k_tok_bleu,
    multi30k_tokenize,
    paper_tok_bleu,
    paper_tokenize,
    read_lines,
    sacrebleu_scores,
    split_compounds,
)

HYPS = ["Ein Mann in einem roten Hemd fährt Fahrrad.", "Zwei Hunde spielen im Schnee.",
        "Eine Frau liest ein Buch im Park-Café."]
REFS = ["Ein Mann mit rotem Hemd fährt Rad.", "Zwei Hunde spielen im Schnee.",
        "Eine Frau liest im Park-Café ein Buch."]


def test_sacrebleu_scores_match_sacrebleu_directly():
    s = sacrebleu_scores(HYPS, REFS)
    assert s["bleu"] == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score)
    assert s["chrf"] == pytest.approx(sacrebleu.corpus_chrf(HYPS, [REFS]).score)
    assert s["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert "nc:6" in s["chrf_signature"]
    assert sacrebleu_scores(REFS, REFS)["bleu"] == pytest.approx(100.0)


def test_corpus_bleu_names_the_protocol_a_corpus_reports():
    data = load_config("multi30k").data  # trained on the Multi30k protocol's text
    tok_h = [multi30k_tokenize(h, "de") for h in HYPS]
    tok_r = [multi30k_tokenize(r, "de") for r in REFS]
    direct = multi30k_tok_bleu(tok_h, tok_r, "de", pretokenized=True)
    got = corpus_bleu(tok_h, tok_r, data)
    assert got["protocol"] == "multi30k" and got["bleu"] == pytest.approx(direct)
    # cased Multi30k text is put into the protocol's form first: the same score
    cased = dataclasses.replace(data, preprocess="none")
    assert corpus_bleu(HYPS, REFS, cased)["bleu"] == pytest.approx(direct)
    # any other corpus: sacreBLEU, cased and detokenized, with its signature
    files = dataclasses.replace(cased, dataset="files")
    lower = [h.lower() for h in HYPS]
    got = corpus_bleu(lower, REFS, files)
    assert got["protocol"] == "sacrebleu"
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(lower, [REFS]).score)
    assert got["signature"].startswith("nrefs:1|case:mixed")
    # the protocols differ: sacreBLEU counts case, the Multi30k protocol lowercases
    assert got["bleu"] < corpus_bleu(lower, REFS, cased)["bleu"] == pytest.approx(direct)


def test_unaligned_inputs_raise():
    with pytest.raises(DataError, match="2 hypotheses but 3 references"):
        sacrebleu_scores(HYPS[:2], REFS)
    with pytest.raises(DataError, match="line-aligned"):
        multi30k_tok_bleu(HYPS, REFS[:1], "de")


def test_compound_splitting_like_get_ende_bleu():
    assert split_compounds("rich-text format") == "rich ##AT##-##AT## text format"
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"  # Perl s///g: no overlapping
    assert split_compounds("Park-Café - gut") == "Park ##AT##-##AT## Café - gut"
    assert paper_tokenize("Im Park-Café & mehr.", "de") == \
        "Im Park ##AT##-##AT## Café &amp; mehr ."
    assert paper_tokenize("A well-known fact.", "en") == "A well-known fact ."


def test_paper_tok_bleu_scores_tokens():
    assert paper_tok_bleu(REFS, REFS, "de") == pytest.approx(100.0)
    tok_h = [paper_tokenize(h, "de") for h in HYPS]
    tok_r = [paper_tokenize(r, "de") for r in REFS]
    direct = sacrebleu.corpus_bleu(tok_h, [tok_r], tokenize="none", force=True).score
    assert paper_tok_bleu(HYPS, REFS, "de") == pytest.approx(direct)
    # splitting compounds gives credit for the matched parts of "Park-Café"
    assert paper_tok_bleu(HYPS, REFS, "de") != pytest.approx(sacrebleu_scores(HYPS, REFS)["bleu"])


def test_multi30k_tokenize():
    assert multi30k_tokenize("Ein Mann „lacht“ & springt.", "de") == \
        'ein mann &quot; lacht &quot; &amp; springt .'


def test_multi30k_protocol_reproduces_shared_references(data_dir):
    raw = read_lines(data_dir / "multi30k" / "test_2016_flickr.de.gz")
    ref_tok = data_dir / "multi30k" / "tok" / "test_2016_flickr.lc.norm.tok.de.gz"
    tok = read_lines(ref_tok)
    assert [multi30k_tokenize(line, "de") for line in raw] == tok
    assert multi30k_tok_bleu(raw, ref_tok, "de") == pytest.approx(100.0)
    shuffled = raw[1:] + raw[:1]
    assert multi30k_tok_bleu(shuffled, tok, "de") < 5.0


def test_decode_lines_splits_on_newline_only():
    data = "eins\r\nzwei\u2028drei\n\nvier".encode()
    assert decode_lines(data, "x") == ["eins", "zwei\u2028drei", "", "vier"]
    assert decode_lines(b"a\n", "x") == ["a"]
    assert decode_lines(b"", "x") == []
    with pytest.raises(DataError, match=r"x, line 3: invalid UTF-8"):
        decode_lines(b"a\nb\nc\xffd\n", "x")


def test_read_lines_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        read_lines(tmp_path / "nope.txt")
