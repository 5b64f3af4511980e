"""``aiayn translate`` and ``aiayn evaluate`` end to end on a tiny random-weight checkpoint:
line alignment (empty, whitespace-only and over-long lines), errors, n-best and JSON output,
and scores that agree with sacreBLEU called directly."""

from __future__ import annotations

import dataclasses
import io
import json
import sys

import pytest
import sacrebleu
import torch

from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.config import load_config
from aiayn.data.vocab import Vocabulary
from aiayn.model import Transformer
from aiayn.translator import Translator

TEXTS = ["A man in a red shirt rides a bike.", "Two dogs play in the snow.",
         "Ein Mann in einem roten Hemd fährt Fahrrad.", "Zwei Hunde spielen im Schnee."] * 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    vocab = Vocabulary.learn(TEXTS, 90)
    cfg = load_config("tiny")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, vocab_size=len(vocab), max_len=24, N=1))
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "ckpt"
    save_checkpoint(path, Transformer(cfg.model), cfg, vocab)
    return path


FAST = ["--max-len-b", "4", "--max-len-a", "0.5"]


def translate(checkpoint, tmp_path, lines_bytes: bytes, *extra: str):
    src = tmp_path / "in.txt"
    src.write_bytes(lines_bytes)
    out = tmp_path / "out.txt"
    rc = main(["translate", "--checkpoint", str(checkpoint), "-i", str(src), "-o", str(out),
               *FAST, *extra])
    return rc, (out.read_bytes().decode() if out.exists() else None)


def test_one_output_line_per_input_line(checkpoint, tmp_path, capsys):
    long = " ".join(["snow"] * 60)  # far beyond max_len = 24 tokens
    lines = ["A man rides a bike.", "", "Two dogs.", "   ", long, "", "Zwei Hunde."]
    rc, out = translate(checkpoint, tmp_path, "\n".join(lines).encode())  # no final newline
    assert rc == 0
    got = out.split("\n")
    assert got[-1] == "" and len(got) - 1 == len(lines)
    assert [got[i] for i in (1, 3, 5)] == ["", "", ""]
    assert all(got[i] for i in (0, 2, 4, 6))
    assert "line 5" in capsys.readouterr().err  # the truncation warning names the line
    rc, greedy = translate(checkpoint, tmp_path, "\n".join(lines).encode(), "--beam", "1")
    assert rc == 0 and greedy.count("\n") == len(lines)


def test_reject_long_and_invalid_utf8_are_clear_errors(checkpoint, tmp_path, capsys):
    long = " ".join(["snow"] * 60)
    rc, _ = translate(checkpoint, tmp_path, f"a\n{long}\n".encode(), "--reject-long")
    assert rc == 2 and "line 2" in capsys.readouterr().err
    rc, _ = translate(checkpoint, tmp_path, b"ok\nfine\nbad \xc3\x28 byte\n")
    err = capsys.readouterr().err
    assert rc == 2 and "line 3: invalid UTF-8" in err


def test_stdin_stdout_nbest_and_json(checkpoint, monkeypatch, capsysbinary):
    data = b"A man rides a bike.\n\nTwo dogs play.\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["translate", "--checkpoint", str(checkpoint), *FAST, "--nbest", "3"]) == 0
    rows = capsysbinary.readouterr().out.decode().splitlines()
    ids = [int(r.split(" ||| ")[0]) for r in rows]
    assert ids == [0, 0, 0, 1, 2, 2, 2]
    scores = [float(r.split(" ||| ")[2]) for r in rows if r.startswith("0 ")]
    assert scores == sorted(scores, reverse=True)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["translate", "--checkpoint", str(checkpoint), *FAST, "--json"]) == 0
    objs = [json.loads(x) for x in capsysbinary.readouterr().out.decode().splitlines()]
    assert [o["line"] for o in objs] == [1, 2, 3]
    assert objs[1]["translations"][0]["text"] == ""
    assert objs[0]["translations"][0]["log_prob"] < 0
    # each carries its confidence and flags, as the Translator gives them (issue 82)
    direct = Translator.from_pretrained(checkpoint, workers=1).generate(
        data.decode().splitlines(), max_len_a=0.5, max_len_b=4)
    for obj, (want, *_) in zip(objs, direct):
        got = obj["translations"][0]
        assert got["confidence"] == pytest.approx(want.confidence, abs=1e-5)
        assert got["flags"] == list(want.flags) and got["unchecked"] == list(want.unchecked)
    assert objs[0]["translations"][0]["unchecked"] == ["length_ratio"]  # a bare checkpoint
    assert objs[1]["translations"][0]["confidence"] == 0.0


def test_evaluate_agrees_with_sacrebleu(checkpoint, tmp_path, capsys):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyps = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Ein roter Hund."]
    refs = ["Ein Mann fährt ein Fahrrad.", "Zwei Hunde spielen im Schnee.", "Ein Hund rennt."]
    hyp.write_text("\n".join(hyps) + "\n", encoding="utf-8")
    ref.write_text("\n".join(refs) + "\n", encoding="utf-8")
    assert main(["evaluate", "--hyp", str(hyp), "--ref", str(ref), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)["scores"]
    assert scores["sacrebleu"]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert scores["sacrebleu"]["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    assert "tok:13a" in scores["sacrebleu"]["bleu_signature"]
    assert "paper" in scores["paper"]["protocol"]
    assert main(["evaluate", "--hyp", str(hyp), "--ref", str(ref)]) == 0
    text = capsys.readouterr().out
    assert "sacreBLEU" in text and "paper-style tokenized" in text


def test_evaluate_translates_with_checkpoint(checkpoint, tmp_path, capsys):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("A man rides a bike.\n\nTwo dogs play.\n", encoding="utf-8")
    ref.write_text("Ein Mann fährt Rad.\n\nZwei Hunde spielen.\n", encoding="utf-8")
    out = tmp_path / "hyp.txt"
    assert main(["evaluate", "--checkpoint", str(checkpoint), "--src", str(src), "--ref",
                 str(ref), "--output", str(out), "--json", *FAST]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 3 and result["lang"] == "de"
    assert result["decode"]["beam_size"] == 4 and result["decode"]["alpha"] == 0.6
    rc, translated = translate(checkpoint, tmp_path, src.read_bytes())
    assert out.read_text(encoding="utf-8") == translated
    assert main(["evaluate", "--hyp", str(out), "--ref", str(ref)]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--src", str(src), "--ref", str(ref)]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_evaluate_multi30k_protocol(data_dir, tmp_path, capsys):
    raw = data_dir / "multi30k" / "test_2016_flickr.de.gz"
    tok = data_dir / "multi30k" / "tok" / "test_2016_flickr.lc.norm.tok.de.gz"
    assert main(["evaluate", "--hyp", str(raw), "--ref", str(raw), "--ref-tok", str(tok),
                 "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)["scores"]
    assert scores["multi30k"]["bleu"] == pytest.approx(100.0)
    assert "Multi30k" in scores["multi30k"]["protocol"]


def test_translate_and_evaluate_with_an_ensemble(checkpoint, tmp_path, capsys):
    """Several --checkpoint paths decode as an ensemble, the same as a Translator on the
    list of models; a member with another vocabulary is refused, naming it."""
    from aiayn.checkpoint import load_checkpoint
    from aiayn.translator import Translator

    _, cfg, vocab = load_checkpoint(checkpoint)
    torch.manual_seed(1)
    second = tmp_path / "second"
    save_checkpoint(second, Transformer(cfg.model), cfg, vocab)
    lines = ["A man rides a bike.", "", "Two dogs play in the snow."]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    assert main(["translate", "--checkpoint", str(checkpoint), str(second), "-i", str(src),
                 "-o", str(out), *FAST]) == 0
    models = [load_checkpoint(p)[0] for p in (checkpoint, second)]
    want = Translator(models, vocab, precision="fp32").generate(lines, max_len_a=0.5,
                                                                max_len_b=4)
    assert out.read_text(encoding="utf-8").splitlines() == [t[0].text for t in want]
    alone = [Translator(m, vocab, precision="fp32").generate(lines, max_len_a=0.5, max_len_b=4)
             for m in models]
    assert [t[0].tokens for t in want] not in [[t[0].tokens for t in a] for a in alone]

    ref = tmp_path / "ref.txt"
    ref.write_text("Ein Mann fährt Rad.\n\nZwei Hunde spielen im Schnee.\n", encoding="utf-8")
    assert main(["evaluate", "--checkpoint", str(checkpoint), str(second), "--src", str(src),
                 "--ref", str(ref), "--json", *FAST]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["checkpoint"] == str(checkpoint)
    assert result["ensemble"] == [str(checkpoint), str(second)]

    other_vocab = Vocabulary.learn(TEXTS[:2] * 10, 60)
    other_cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, vocab_size=len(other_vocab)))
    other = tmp_path / "other"
    save_checkpoint(other, Transformer(other_cfg.model), other_cfg, other_vocab)
    assert main(["translate", "--checkpoint", str(checkpoint), str(other), "-i", str(src),
                 *FAST]) == 2
    err = capsys.readouterr().err
    assert f"{other}: its vocabulary differs from {checkpoint}'s" in err


def test_shortlist_command_and_translate_with_it(checkpoint, data_dir, tmp_path, capsys):
    """``aiayn shortlist`` learns a vmap file from the checkpoint's training data (the first
    300 Multi30k pairs here); ``translate --shortlist`` reads it; a bad file is one line."""
    vmap = tmp_path / "vmap.txt"
    assert main(["shortlist", "--checkpoint", str(checkpoint), "-o", str(vmap),
                 "--max-sentences", "300", "--first", "10", "--best", "5", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["always"] == 10 and 0 < summary["targets_per_source_token"] <= 6
    assert vmap.read_text(encoding="utf-8").startswith("\t")
    rc, out = translate(checkpoint, tmp_path, b"Two dogs play in the snow.\n\nA man.\n",
                        "--shortlist", str(vmap))
    assert rc == 0 and len(out.splitlines()) == 3 and out.splitlines()[1] == ""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\tno-such-token\n")
    rc, _ = translate(checkpoint, tmp_path, b"Two dogs.\n", "--shortlist", str(bad))
    err = capsys.readouterr().err
    assert rc == 2 and f"{bad}:1: target token 'no-such-token'" in err
    assert "Traceback" not in err
