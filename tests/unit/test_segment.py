"""aiayn.data.segment: documents cut into sentences and put back byte for byte around them,
and over-long lines cut at the best boundary there is."""

from __future__ import annotations

import pytest

from aiayn.data.segment import segment, split_long

LAYOUTS = [
    "",
    "   \n\n\t\n",
    "One sentence without a final newline",
    "Dr. Smith arrived. He sat down.\n\nThe end.\n",
    "\n\n  Leading space. And a second one!  \r\n\r\n\r\nA Windows paragraph?\r\n",
    "A file of one sentence a line.\nThe second line.\nThe third line\n",
    "Trailing spaces and blank lines.   \n \n\t\n",
]


@pytest.mark.parametrize("text", LAYOUTS)
def test_rejoining_the_sentences_gives_the_text_back_byte_for_byte(text):
    doc = segment(text, "en")
    assert doc.rejoin(doc.sentences) == text
    assert "".join(doc.gaps).strip() == ""  # nothing but whitespace lies between sentences


def test_abbreviations_of_the_source_language_do_not_end_sentences():
    en = segment("Dr. Smith went to Washington D.C. on Jan. 5. The U.S. economy grew 3.5 "
                 "percent, e.g. in Ohio. He left.", "en")
    assert en.sentences == ["Dr. Smith went to Washington D.C. on Jan. 5.",
                            "The U.S. economy grew 3.5 percent, e.g. in Ohio.", "He left."]
    de = segment("Herr Dr. Müller kam am 3. Oktober. Er sagte z.B. nichts. Ende.", "de")
    assert de.sentences == ["Herr Dr. Müller kam am 3. Oktober.", "Er sagte z.B. nichts.",
                            "Ende."]


def test_paragraphs_line_breaks_and_wrapped_lines():
    text = "  First one. Second\none wraps.\nThird.\n\n\n\tNew paragraph.  \n"
    doc = segment(text, "en")
    assert doc.sentences == ["First one.", "Second one wraps.", "Third.", "New paragraph."]
    assert doc.paragraphs == (0, 0, 0, 1)
    assert doc.gaps == ["  ", " ", "\n", "\n\n\n\t", "  \n"]
    assert doc.rejoin(["A.", "B.", "C.", "D."]) == "  A. B.\nC.\n\n\n\tD.  \n"


def test_rejoin_wants_one_translation_per_sentence_and_adds_no_paragraph():
    doc = segment("One. Two.\n", "en")
    with pytest.raises(ValueError, match="1 translations for 2 sentences"):
        doc.rejoin(["x"])
    assert doc.rejoin(["a\nb", "c\r\n"]) == "a b c  \n"
    empty = segment("\n\n", "en")
    assert empty.sentences == [] and empty.rejoin([]) == "\n\n"


def words_fit(n: int):
    return lambda part: len(part.split()) <= n


def test_a_line_that_fits_is_one_part():
    assert split_long("Short line here.", "en", words_fit(5)) == ["Short line here."]
    assert split_long("   ", "en", words_fit(5)) == [""]


def test_split_long_prefers_sentences_then_clauses_then_commas_then_words():
    line = "One two three. Four five six seven; eight nine, ten eleven twelve thirteen."
    parts = split_long(line, "en", words_fit(4))
    assert parts == ["One two three.", "Four five six seven;", "eight nine,",
                     "ten eleven twelve thirteen."]
    assert split_long("a b c d e f g", "en", words_fit(3)) == ["a b c", "d e f", "g"]
    # clause punctuation before commas: both fit here, so the ';' cut wins
    assert split_long("a b, c; d e", "en", words_fit(3)) == ["a b, c;", "d e"]


def test_split_long_drops_nothing_and_every_part_fits():
    line = ("The committee, which met on Tuesday, agreed: the budget rises; the plan, long "
            "delayed, starts now and runs until the end of the year without a break ") * 6
    fits = lambda part: len(part) <= 60  # noqa: E731
    parts = split_long(line, "en", fits)
    assert len(parts) > 1 and all(fits(p) for p in parts)
    assert " ".join(parts).split() == line.split()


def test_a_word_longer_than_the_limit_is_cut_into_characters():
    assert split_long("x" * 10, "en", lambda part: len(part) <= 4) == ["xxxx", "xxxx", "xx"]
    with pytest.raises(ValueError, match="single character"):
        split_long("ab", "en", lambda part: False)
