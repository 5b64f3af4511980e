"""Markup and placeholders carried through translation (aiayn.decoding.markup, issue 83 item 3):
parsing, putting back on hand-made alignments (every output well-formed, checked with the
standard library's XML parser), unbalanced tags, and the faces."""

from __future__ import annotations

import random
import re

import pytest

from aiayn.decoding.markup import (
    DEFAULT_PLACEHOLDERS,
    MarkupConfig,
    MarkupError,
    Placeholder,
    copyable,
    parse,
    parse_lines,
    restore,
    tags_of,
    well_formed,
)
from aiayn.errors import ConfigError

TAGS_ONLY = MarkupConfig(placeholders=())


def diagonal(n: int) -> list[tuple[int, int]]:
    return [(i, i) for i in range(n)]


def check(source: str, out: str) -> None:
    """``out`` is well-formed and holds exactly ``source``'s tags."""
    assert well_formed(out), out
    assert sorted(tags_of(out)) == sorted(tags_of(source)), out


# --- parsing -------------------------------------------------------------------------------

def test_paired_tag_spans_its_words():
    m = parse("A <b>big</b> dog.")
    assert m.plain == "A big dog."
    (b,) = m.items
    assert (b.kind, b.text, b.close, b.start, b.end, b.parent) == ("pair", "<b>", "</b>", 1, 2, -1)


def test_nested_tags_keep_their_parents():
    m = parse("<p>A <b>big <i>brown</i></b> dog</p>")
    assert m.plain == "A big brown dog"
    p, b, i = m.items
    assert [(t.start, t.end, t.parent) for t in (p, b, i)] == [(0, 4, -1), (1, 3, 0), (2, 3, 1)]


def test_self_closing_tags_with_attributes_and_comments_are_points():
    m = parse('Line one<br/>line <img src="a.png" alt="x > y"/> two <!-- a note -->', TAGS_ONLY)
    assert m.plain == "Line oneline two"
    assert [(t.kind, t.text, t.start) for t in m.items] == [
        ("point", "<br/>", 2), ("point", '<img src="a.png" alt="x > y"/>', 2),
        ("point", "<!-- a note -->", 3)]


def test_a_line_without_markup_is_given_as_it_is():
    line = "  Tom &amp; Jerry:  a < b and c > d  "
    m = parse(line)
    assert m.plain == line and m.items == ()
    assert restore(m, "Tom &amp; Jerry", diagonal(3)).text == "Tom &amp; Jerry"


def test_default_placeholders():
    line = ("Hi %s, {count} mails from bob@example.com at https://x.org/a?b=1, "
            "3.5 or 1,000 (not H2O)")
    m = parse(line)
    assert [(t.name, t.text) for t in m.items] == [
        ("printf", "%s"), ("braces", "{count}"), ("email", "bob@example.com"),
        ("url", "https://x.org/a?b=1"), ("number", "3.5"), ("number", "1,000")]
    assert m.plain == "Hi, mails from at, or (not H2O)"
    assert all(t.kind == "placeholder" and not t.kept for t in m.items)


def test_placeholders_inside_a_tag_are_part_of_the_tag():
    m = parse('See <a href="http://x.org/1">page 2</a>.')
    assert [(t.kind, t.text) for t in m.items] == [("pair", '<a href="http://x.org/1">'),
                                                     ("placeholder", "2")]
    assert m.items[1].parent == 0


def test_html_void_elements_need_no_slash():
    m = parse('a<br>b <img src="x.png"> c', TAGS_ONLY)
    assert [t.kind for t in m.items] == ["point", "point"] and not m.problems
    assert well_formed('a<br>b <img src="x.png"> c') and not well_formed("a <b>b")


def test_placeholder_patterns_are_checked():
    with pytest.raises(ConfigError, match=r"'\(': not a regular expression"):
        Placeholder("(")
    with pytest.raises(ConfigError, match="matches the empty string"):
        Placeholder("x*")
    with pytest.raises(ConfigError, match="malformed"):
        MarkupConfig(malformed="ignore")
    config = MarkupConfig(placeholders=(*DEFAULT_PLACEHOLDERS, r"\$\w+"))
    assert parse("Pay $AMOUNT now", config).plain == "Pay now"


# --- putting back ----------------------------------------------------------------------------

def test_paired_tag_around_its_aligned_word():
    m = parse("A <b>big</b> dog.")
    assert restore(m, "Ein großer Hund.", diagonal(3)).text == "Ein <b>großer</b> Hund."


def test_tag_follows_reordering_and_keeps_glued_punctuation_outside():
    m = parse("Click <b>Save</b>, then <i>close</i>.")
    assert m.plain == "Click Save, then close."
    out = restore(m, "Dann schließen, Speichern klicken.", [(0, 3), (1, 2), (2, 0), (3, 1)])
    assert out.text == "Dann <i>schließen</i>, <b>Speichern</b> klicken."
    assert (out.aligned, out.fallback) == (2, 0)


def test_nested_tags_stay_nested_when_alignments_cross():
    source = "<b>a <i>b</i></b> <u>c d</u>"
    m = parse(source)
    # i's word aligns outside b's first word, u's words across b's: clipped, kept apart
    out = restore(m, "w x y z", [(0, 2), (1, 0), (2, 1), (3, 3)])
    check(source, out.text)
    assert out.text == "<b><i>w</i> x y</b> <u>z</u>"


def test_self_closing_tag_and_placeholder_at_their_aligned_positions():
    m = parse("You have %d new messages<br/>")
    assert m.plain == "You have new messages"
    out = restore(m, "Sie haben neue Nachrichten", diagonal(4))
    assert out.text == "Sie haben %d neue Nachrichten<br/>"


def test_no_space_before_glued_punctuation_or_at_the_ends():
    m = parse("<x/> People <b>sit in <x/> chairs</b>.")
    assert restore(m, "Leute sitzen auf Stühlen.", [(0, 0), (1, 1), (2, 3)]).text == \
        "<x/> Leute <b>sitzen auf Stühlen <x/></b>."


def test_no_alignment_places_by_position():
    source = "<b>one two</b> three <i>four</i><br/>"
    m = parse(source)
    out = restore(m, "eins zwei drei vier", None)
    assert out.text == "<b>eins zwei</b> drei <i>vier</i><br/>"
    assert out.fallback == 3


def test_empty_translation_keeps_every_tag():
    source = "<p><b>x</b> y<br/></p>"
    out = restore(parse(source), "", [])
    assert out.text == "<p><b></b><br/></p>"
    check(source, out.text)


def test_unaligned_words_take_their_neighbours_place():
    m = parse("a <b>b</b> c")
    out = restore(m, "A X C", [(0, 0), (2, 2)])  # b unaligned: the word after a's
    assert out.text == "A <b>X</b> C" and out.fallback == 1


def test_kept_placeholders_are_put_back_only_where_missing():
    m = parse("Visit https://x.org today", keep_copies=True)
    assert m.plain == "Visit https://x.org today" and m.constraints == ["https://x.org"]
    assert restore(m, "Besuche heute https://x.org", diagonal(3)).text == \
        "Besuche heute https://x.org"
    assert restore(m, "Besuche heute x . org", [(0, 0), (1, 2), (2, 1)]).text == \
        "Besuche heute https://x.org x . org"


def test_random_lines_and_alignments_always_give_well_formed_output():
    rng = random.Random(0)
    words = "the a dog cat runs over green field , . 3 %s".split()
    tried = 0
    for _ in range(300):
        tokens = [rng.choice(words) for _ in range(rng.randint(0, 8))]
        source = _random_markup(rng, tokens)
        m = parse(source)
        target = [f"t{k}" for k in range(rng.randint(0, 9))]
        n = len(m.words)
        alignment = None if rng.random() < 0.2 else [
            (rng.randrange(n), rng.randrange(len(target)))
            for _ in range(rng.randint(0, 2 * n)) if n and target]
        out = restore(m, " ".join(target), alignment).text
        check(source, out)
        # the target's words in order, and the placeholders put back
        left = re.sub(r"<[^>]*>|%s|\b3\b", " ", out).split()
        assert left == target, (source, out)
        tried += 1
    assert tried == 300


def _random_markup(rng: random.Random, tokens: list[str], depth: int = 0) -> str:
    """``tokens`` with random nested pairs and self-closing tags, well-formed."""
    out, i = [], 0
    while i < len(tokens):
        r = rng.random()
        if r < 0.25 and depth < 3:
            k = rng.randint(0, len(tokens) - i)
            name = rng.choice(["b", "i", "span"])
            inner = _random_markup(rng, tokens[i:i + k], depth + 1)
            out.append(f"<{name}>{inner}</{name}>")
            i += k
            if k == 0:
                out.append(tokens[i])
                i += 1
        elif r < 0.35:
            out.append(rng.choice(["<br/>", '<x id="1"/>']))
        else:
            out.append(tokens[i])
            i += 1
    return " ".join(out)


# --- unbalanced tags -------------------------------------------------------------------------

@pytest.mark.parametrize("line,problem", [
    ("a <b>b c", "tag <b> at character 3 is never closed"),
    ("a b</i> c", "closing tag </i> at character 4 has no opening <i>"),
    ("<b><i>x</b></i>", "tag <i> at character 4 is not closed before </b>"),
])
def test_unbalanced_tags_are_carried_as_written_with_one_warning(line, problem):
    said: list[str] = []
    marked = parse_lines(["fine", line], warn=said.append)
    assert marked[0].plain == "fine"
    assert len(said) == 1 and f"line 2: {problem}" in said[0], said
    m = marked[1]
    out = restore(m, " ".join(f"t{k}" for k in range(len(m.words))), diagonal(len(m.words)))
    assert sorted(tags_of(out.text)) == sorted(tags_of(line))  # nothing lost


def test_unbalanced_tags_can_be_refused():
    with pytest.raises(MarkupError, match=r"^line 2: tag <b> at character 1 is never closed"):
        parse_lines(["ok", "<b>x"], MarkupConfig(malformed="error"))


# --- the faces, on a small trained model -----------------------------------------------------

LINES = ["A <b>man</b> in a <i>red</i> shirt rides a bike.<br/>",
         "Two dogs play in the snow.",
         "<p>A <b>dog</b> runs <i>on <u>the</u> beach</i>.</p>",
         "A man <b>rides a bike."]
FAST = dict(beam_size=2, max_len_a=1.0, max_len_b=4)


@pytest.fixture(scope="module")
def small(data_dir):
    """A 2+2-layer model trained for 150 steps on 600 Multi30k pairs (tests/small_models.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from small_models import train_small

    from aiayn import Translator

    model, vocab = train_small(data_dir)
    return Translator(model, vocab)


def stripped(text: str) -> str:
    return " ".join(re.sub(r"<[^>]*>", "", text).split())


def test_translator_carries_tags_and_warns_about_the_unbalanced_line(small):
    said: list[str] = []
    out = small.translate(LINES, markup=True, warn=said.append, **FAST)
    plain = small.translate([parse(line).plain for line in LINES], **FAST)
    for source, marked, text in zip(LINES, out, plain):
        assert sorted(tags_of(marked)) == sorted(tags_of(source))
        assert stripped(marked) == " ".join(text.split())  # the same words, in order
    assert all(well_formed(t) for t in out[:3])
    assert out[1] == plain[1]  # no markup: as without the option
    assert len(said) == 1 and "line 4: tag <b> at character 7 is never closed" in said[0]
    with pytest.raises(MarkupError, match="^line 4: "):
        small.translate(LINES, markup=MarkupConfig(malformed="error"), **FAST)


def test_placeholders_to_copy_become_constraints(small):
    line = "Two dogs play with 3 balls and %s ."
    marked = parse(line, keep_copies=copyable(small))
    assert marked.constraints == ["3"]  # kept in the text; %s is taken out
    (out,) = small.translate([line], markup=True, **FAST)
    assert out.count("3") >= 1 and out.count("%s") == 1


def test_cli_and_server_give_the_api_answer(small, tmp_path, capsys):
    from fastapi.testclient import TestClient

    from aiayn.checkpoint import save_checkpoint
    from aiayn.cli import main
    from aiayn.serve import create_app

    want = small.translate(LINES[:3], markup=True, **FAST)
    path = tmp_path / "ckpt"
    save_checkpoint(path, small.models[0], small.config, small.vocab)
    src, dst = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(LINES[:3]) + "\n", encoding="utf-8")
    options = ["--beam", "2", "--max-len-a", "1.0", "--max-len-b", "4", "--workers", "1"]
    rc = main(["translate", "--checkpoint", str(path), "-i", str(src), "-o", str(dst),
               "--quiet", "--markup", *options])
    assert rc == 0 and dst.read_text(encoding="utf-8").splitlines() == want
    rc = main(["translate", "--checkpoint", str(path), "-i", str(src), "--markup",
               "--placeholder", "(", *options])
    assert rc == 2 and "'(': not a regular expression" in capsys.readouterr().err
    rc = main(["translate", "--checkpoint", str(path), "-i", str(src), "--placeholder", "x"])
    assert rc == 2 and "--placeholder needs --markup" in capsys.readouterr().err
    with TestClient(create_app(small)) as client:
        lines = [*LINES, "Two dogs play with 3 balls."]
        r = client.post("/translate", json={"lines": lines, "markup": True, "beam": 2})
        assert r.status_code == 200, r.text
        data = r.json()
    got = [ts[0]["text"] for ts in data["translations"]]
    assert got[:3] + got[4:] == small.translate(lines[:3] + lines[4:], markup=True,
                                                beam_size=2)
    assert len(data["warnings"]) == 1 and "line 4" in data["warnings"][0]
