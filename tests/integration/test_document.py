"""Real text in, real text out (issue 82, items 1 and 2): documents cut into sentences and put
back, and lines longer than the model's max_len translated in parts, through the Python API,
``aiayn translate`` and ``aiayn serve``, on a tiny random-weight checkpoint (max_len 48,
outputs of at most 6 tokens)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from serving import TEXTS, tiny_checkpoint

from aiayn import Translator
from aiayn.cli import main
from aiayn.data.segment import segment
from aiayn.serve import ServeLimits, create_app

DOC = ("  Dr. Smith rides a bike. Two dogs play in the snow.\nA man reads.\n\n\n"
       "A woman reads a book.  \n")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("document") / "ckpt")


@pytest.fixture(scope="module")
def translator(checkpoint):
    return Translator.from_pretrained(checkpoint, precision="fp32", workers=1)


@pytest.fixture(scope="module")
def long_line(translator):
    """A line of 600 subword tokens (EOS not counted): 12x the model's max_len."""
    words = " ".join(TEXTS).split()
    out: list[str] = []
    while len(translator.vocab.encode(" ".join(out))) < 600:
        out.append(words[len(out) % len(words)])
    line = " ".join(out)
    while len(translator.vocab.encode(line)) > 600:
        line = line[:-1].rstrip()
    assert len(translator.vocab.encode(line)) == 600
    return line


def test_a_document_comes_back_laid_out_as_it_was(translator):
    result = translator.translate_document(DOC)
    doc = segment(DOC, "en")
    assert result.document.sentences == ["Dr. Smith rides a bike.", "Two dogs play in the snow.",
                                         "A man reads.", "A woman reads a book."]
    # the sentences are decoded as one batch, each as generate decodes it alone in a list
    direct = [ts[0].text for ts in translator.generate(doc.sentences)]
    assert result.translations == direct and all(direct)
    assert result.text == doc.rejoin(direct)
    assert result.text.startswith("  ") and result.text.endswith("  \n")
    assert result.text.count("\n\n\n") == 1 and result.text.count("\n") == 5
    assert result.parts == [1, 1, 1, 1] and result.split == []


def test_a_600_token_line_is_translated_in_parts_never_truncated(translator, long_line):
    notes: list[str] = []
    out = translator.generate_text(["A man reads.", long_line, ""], warn=notes.append)
    assert out.parts[0] == 1 and out.parts[2] == 1 and out.split == [2]
    parts = translator.split_long_lines([long_line])[0]
    assert len(parts) == out.parts[1] >= 600 // translator.max_source_tokens
    limit = translator.max_source_tokens
    assert all(len(translator.vocab.encode(p)) + 1 <= limit for p in parts)
    assert " ".join(parts).split() == long_line.split()  # every word is in one part
    by_part = translator.generate(parts)
    assert out.translations[1][0].text == " ".join(ts[0].text for ts in by_part if ts[0].text)
    assert out.translations[1][0].log_prob == pytest.approx(
        sum(ts[0].log_prob for ts in by_part), abs=1e-4)
    # its confidence: all its parts' tokens together; its flags: any part's
    assert out.translations[1][0].confidence == pytest.approx(
        sum(ts[0].log_prob for ts in by_part) / sum(len(ts[0].tokens) for ts in by_part),
        abs=1e-5)
    assert set(out.translations[1][0].flags) == {f for ts in by_part for f in ts[0].flags}
    assert any("translated in parts" in n and "line 2" in n for n in notes)
    # long_inputs="split" in generate gives the same, and truncation stays available
    assert [t[0].text for t in translator.generate([long_line], long_inputs="split")] == \
        [out.translations[1][0].text]


def test_cli_document_json_and_long_lines(checkpoint, translator, tmp_path, capsys,
                                          long_line):
    src, out = tmp_path / "doc.txt", tmp_path / "out.txt"
    src.write_bytes(DOC.encode())
    base = ["translate", "--checkpoint", str(checkpoint), "--workers", "1", "-i", str(src)]
    assert main([*base, "--document", "-o", str(out)]) == 0
    text = out.read_text()
    assert text == translator.translate_document(DOC).text
    assert text.startswith("  ") and "\n\n\n" in text and text.endswith("  \n")
    assert main([*base, "--document", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["text"] == text and obj["split"] == []
    assert [s["paragraph"] for s in obj["sentences"]] == [1, 1, 1, 2]
    best = translator.translate_document(DOC).best  # each sentence's confidence and flags
    assert [(s["confidence"], s["flags"]) for s in obj["sentences"]] == \
        [(pytest.approx(t.confidence, abs=1e-5), list(t.flags)) for t in best]
    src.write_text(f"A man reads.\n{long_line}\n")
    assert main([*base, "--json"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(x) for x in captured.out.splitlines()]
    assert [r["parts"] for r in rows][0] == 1 and rows[1]["parts"] > 1
    assert "line 2" in captured.err and "in parts" in captured.err
    assert main([*base, "--reject-long"]) == 2
    assert "line 2" in capsys.readouterr().err


def test_server_document_and_split_long(translator, long_line):
    limits = ServeLimits(max_lines=64, max_chars=4000, max_body_bytes=20_000)
    with TestClient(create_app(translator, limits)) as client:
        r = client.post("/document", json={"text": DOC})
        assert r.status_code == 200, r.text
        want = translator.translate_document(DOC)
        data = r.json()
        assert data["text"] == want.text and data["split"] == []
        assert [s["translation"] for s in data["sentences"]] == want.translations
        assert [s["flags"] for s in data["sentences"]] == [list(t.flags) for t in want.best]
        assert client.post("/document", json={"text": " \n\n"}).status_code == 422
        assert client.post("/translate", json={"lines": [long_line]}).status_code == 413
        r = client.post("/translate", json={"lines": ["A man reads.", long_line],
                                            "split_long": True})
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["parts"][0] == 1 and data["parts"][1] > 1
        assert data["translations"][1][0]["text"] == \
            translator.generate_text([long_line]).translations[0][0].text
