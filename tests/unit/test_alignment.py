"""Word alignments (aiayn.decoding.alignment): subwords to words on hand-made attention, the
Pharaoh format, copied tokens aligned to their copies by a small real model, guided
alignment's loss (nothing when off; it pulls the supervised head towards IBM Model 1's links
when on), and the CLI's and the server's outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
from pathlib import Path

import httpx
import pytest
import torch

from aiayn.checkpoint import load_checkpoint
from aiayn.cli import main
from aiayn.config import Config, TrainConfig, load_config
from aiayn.data.batching import Batch, pad_sources
from aiayn.data.vocab import BOS_ID, EOS_ID, PAD_ID, Vocabulary
from aiayn.decoding.alignment import (
    Alignment,
    GuidedAlignment,
    alignment_head,
    hard_links,
    join_alignments,
    parse_pharaoh,
    subword_words,
    word_matrix,
)
from aiayn.decoding.shortlist import ibm_model1
from aiayn.errors import ConfigError
from aiayn.model import Transformer
from aiayn.serve import ServeLimits, create_app
from aiayn.training.update import batch_loss
from aiayn.translator import Translator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving import serve_in_thread, tiny_checkpoint  # noqa: E402
from small_models import read_lines, train_copy  # noqa: E402


# --- subwords to words, Pharaoh ----------------------------------------------------------------
def test_subwords_map_to_the_whitespace_words_they_spell():
    vocab = Vocabulary.learn(["a cat sat on the mat", "the dog ate", "cats and dogs"] * 3, 26)
    text = "the cats ate dogs"
    ids = vocab.encode(text) + [EOS_ID]
    words = subword_words(vocab, ids, text)
    assert words[-1] == -1  # </s> belongs to no word
    spelled = [""] * 4
    for i, w in zip(ids[:-1], words[:-1]):
        spelled[w] += vocab.tokenizer.id_to_token(i).lstrip("▁")
    assert spelled == text.split()
    assert len(ids) == 9  # split: ▁the ▁cat s ▁ at e ▁dog s, a bare ▁ among them


def test_word_matrix_sums_source_subwords_and_averages_target_subwords():
    # target subwords t0 t1 (word 0) t2 (word 1) </s>; source s0 (word 0) s1 s2 (word 1) </s>
    cross = torch.tensor([[0.6, 0.2, 0.1, 0.1],
                          [0.2, 0.4, 0.2, 0.2],
                          [0.1, 0.1, 0.1, 0.7],
                          [0.0, 0.0, 0.0, 1.0]])
    soft = word_matrix(cross, [0, 1, 1, -1], [0, 0, 1, -1], 2, 2)
    assert torch.allclose(soft, torch.tensor([[0.4, 0.45], [0.1, 0.2]]))
    assert hard_links(soft) == ((1, 0), (1, 1))
    assert hard_links(torch.zeros(2, 0)) == ()


def test_pharaoh_format_and_joined_parts():
    a = Alignment(((1, 0), (0, 1)), torch.eye(2), ("a", "b"), ("x", "y"))
    assert a.pharaoh() == "1-0 0-1" == str(a)
    assert parse_pharaoh("1-0 0-1") == [(1, 0), (0, 1)]
    b = Alignment(((0, 0),), torch.ones(1, 1), ("c",), ("z",))
    joined = join_alignments([a, b])
    assert joined.pharaoh() == "1-0 0-1 2-2"
    assert joined.source_words == ("a", "b", "c") and joined.soft.shape == (3, 3)
    assert join_alignments([a, None]) is None
    with pytest.raises(ValueError, match="Pharaoh"):
        parse_pharaoh("0-1 2:3")


def test_the_layer_read_is_stated_and_checked():
    cfg = load_config("tiny")
    assert alignment_head(cfg) == (cfg.model.N - 1, None)  # the last layer, as fairseq
    assert alignment_head(cfg, -2) == (cfg.model.N - 2, None)
    with pytest.raises(ValueError, match="not a decoder layer"):
        alignment_head(cfg, cfg.model.N)
    guided = cfg.replace(train=dataclasses.replace(cfg.train, guided_alignment_weight=0.05,
                                                   guided_alignment_head=1))
    assert alignment_head(guided) == ((-2) % cfg.model.N, 1)
    with pytest.raises(ConfigError, match="guided_alignment_layer"):
        cfg.replace(train=dataclasses.replace(cfg.train, guided_alignment_weight=0.05,
                                              guided_alignment_layer=cfg.model.N))


# --- copied tokens ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def copier(data_dir):
    """A model that copies, trained with guided alignment (IBM Model 1 on the copy pairs)."""
    model, vocab, config = train_copy(data_dir, guided_weight=0.5)
    return Translator(model, vocab, config=config, precision="fp32")


def test_copied_words_align_to_their_copies(copier):
    assert alignment_head(copier.config) == (copier.config.model.N - 1, 0)  # the guided head
    lines = ["A man in a blue shirt is standing on a ladder .",
             "Two young girls play with a dog in the park ."]
    out = copier.generate(lines, beam_size=1, alignments=True)
    forced = copier.align(lines, lines)  # each line forced as its own copy
    for line, (t,), a in zip(lines, out, forced):
        words = line.split()
        assert a.source_words == tuple(words) == a.target_words
        assert [j for _, j in a.pairs] == list(range(len(words)))  # one link per word
        once = [j for j, w in enumerate(words) if words.count(w) == 1]
        assert sum((j, j) in a.pairs for j in once) >= 0.8 * len(once), a.pharaoh()
        # the model's own output: each word it copied once aligns to that word's source
        got, links = t.alignment.target_words, dict((j, i) for i, j in t.alignment.pairs)
        copied = [j for j, w in enumerate(got) if words.count(w) == 1 and got.count(w) == 1]
        assert copied and sum(words[links[j]] == got[j] for j in copied) >= 0.8 * len(copied)


# --- guided alignment --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(data_dir):
    m30k = data_dir / "multi30k"
    src, tgt = read_lines(m30k / "train.en.gz", 600), read_lines(m30k / "train.de.gz", 600)
    vocab = Vocabulary.learn(src + tgt, 400)
    pairs = list(zip(vocab.encode_batch(src), vocab.encode_batch(tgt)))
    batches = []
    for lo in range(0, 160, 32):
        chunk = pairs[lo:lo + 32]
        batches.append(Batch(pad_sources([s[:30] + [EOS_ID] for s, _ in chunk]),
                             pad_sources([[BOS_ID] + t[:30] for _, t in chunk]),
                             pad_sources([t[:30] + [EOS_ID] for _, t in chunk]),
                             list(range(lo, lo + len(chunk)))))
    return vocab, pairs, batches


def tiny_model(vocab) -> Transformer:
    cfg = dataclasses.replace(load_config("tiny").model, vocab_size=len(vocab), max_len=64)
    torch.manual_seed(0)
    return Transformer(cfg)


def distance(model, guided, batch) -> float:
    """The guided head's cross-entropy to the reference links, per link."""
    with torch.no_grad(), guided.capture(model) as found:
        model(batch.src, batch.tgt_in)
    links = float(guided.references(batch.src, batch.tgt_out).sum())
    return float(guided.loss(found["log_attention"], batch.src, batch.tgt_out)) / links


def test_ibm_model1_links_most_target_tokens_and_copies_to_copies(corpus):
    vocab, pairs, batches = corpus
    guided = GuidedAlignment(ibm_model1(pairs, len(vocab)), 1.0, -2, 0)
    b = batches[0]
    ref = guided.references(b.src, b.tgt_out)  # (B, T, S)
    real = b.tgt_out != PAD_ID
    assert torch.all(ref.sum(dim=2)[real] <= 1.0) and torch.all(ref.sum(dim=2)[~real] == 0)
    assert float(ref.sum()) > 0.5 * int(real.sum())
    eos_t, eos_s = (b.tgt_out == EOS_ID).nonzero(), (b.src == EOS_ID).nonzero()
    assert torch.all(ref[eos_t[:, 0], eos_t[:, 1], eos_s[:, 1]] == 1.0)  # </s> to </s>


def test_guided_loss_costs_nothing_when_off_and_adds_its_term_when_on(corpus):
    vocab, pairs, batches = corpus
    assert TrainConfig().guided_alignment_weight == 0.0
    model = tiny_model(vocab).eval()  # no dropout: the two passes are the same
    guided = GuidedAlignment(ibm_model1(pairs, len(vocab)), 0.5, -2, 1)
    b = batches[0]
    kw = dict(epsilon_ls=0.1, pad_id=PAD_ID, autocast=contextlib.nullcontext())
    plain, nll, n = batch_loss(model, b, **kw)
    with_term, nll2, n2 = batch_loss(model, b, guided=guided, **kw)
    assert not any(m._forward_hooks for m in model.modules())  # the hook is gone after
    assert float(nll2) == float(nll) and n2 == n
    extra = distance(model, guided, b) * float(guided.references(b.src, b.tgt_out).sum())
    assert float(with_term.detach()) == pytest.approx(float(plain.detach()) + extra, rel=1e-5)


def test_guided_loss_pulls_the_head_towards_the_reference_links(corpus):
    vocab, pairs, batches = corpus
    guided = GuidedAlignment(ibm_model1(pairs, len(vocab)), 1.0, -2, 0)
    b = batches[0]

    def trained(use: GuidedAlignment | None) -> Transformer:
        """8 updates on one batch from the same initial weights."""
        model = tiny_model(vocab).train()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(8):
            opt.zero_grad()
            value, _, _ = batch_loss(model, b, epsilon_ls=0.1, pad_id=PAD_ID,
                                     autocast=contextlib.nullcontext(),
                                     grad_scale=1.0 / b.tgt_tokens, guided=use)
            value.backward()
            opt.step()
        return model.eval()

    on, off = distance(trained(guided), guided, b), distance(trained(None), guided, b)
    assert on < 0.85 * off, (on, off)  # measured: about 2.4 against 3.3 nats a link


# --- the CLI and the server --------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("align") / "ckpt")


def check_links(links: str, source: str, target: str) -> None:
    pairs = parse_pharaoh(links)
    assert [j for _, j in pairs] == list(range(len(target.split())))
    assert all(0 <= i < len(source.split()) for i, _ in pairs)


def test_cli_writes_links_after_the_text_and_in_json(checkpoint, monkeypatch, capsysbinary):
    lines = ["A man rides a bike.", "", "Two dogs play in the snow."]
    data = ("\n".join(lines) + "\n").encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["translate", "--checkpoint", str(checkpoint), "--alignments"]) == 0
    rows = capsysbinary.readouterr().out.decode().splitlines()
    assert len(rows) == 3 and rows[1] == " ||| "
    for line, row in zip(lines, rows):
        text, links = row.split(" ||| ")
        check_links(links, line, text)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["translate", "--checkpoint", str(checkpoint), "--alignments", "--json"]) == 0
    objs = [json.loads(x) for x in capsysbinary.readouterr().out.decode().splitlines()]
    for line, obj, row in zip(lines, objs, rows):
        t = obj["translations"][0]
        assert f"{t['text']} ||| {t['alignment']}" == row
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["translate", "--checkpoint", str(checkpoint), "--json"]) == 0
    plain = json.loads(capsysbinary.readouterr().out.decode().splitlines()[0])
    assert "alignment" not in plain["translations"][0]  # only when asked


def test_server_answers_the_alignments_the_translator_gives(checkpoint):
    model, config, vocab = load_checkpoint(checkpoint)
    translator = Translator(model, vocab, config=config)
    lines = ["Two dogs play in the snow.", "A man rides a bike."]
    direct = translator.generate(lines, alignments=True)
    with serve_in_thread(create_app(translator, ServeLimits(max_wait_ms=5))) as url:
        got = httpx.post(url + "/translate", json={"lines": lines, "alignments": True},
                         timeout=60).json()
        plain = httpx.post(url + "/translate", json={"lines": lines}, timeout=60).json()
    for line, want, answer in zip(lines, direct, got["translations"]):
        assert answer[0]["alignment"] == want[0].alignment.pharaoh()
        check_links(answer[0]["alignment"], line, answer[0]["text"])
    assert "alignment" not in plain["translations"][0][0]


def test_config_round_trips_the_guided_fields():
    cfg = Config().with_overrides(["train.guided_alignment_weight=0.05",
                                   "train.guided_alignment_head=2"])
    assert Config.from_dict(json.loads(cfg.to_json())).train == cfg.train


def test_a_line_translated_in_parts_gets_its_parts_alignments_joined(checkpoint):
    model, config, vocab = load_checkpoint(checkpoint)
    translator = Translator(model, vocab, config=config)
    line = " ".join(["Two dogs play in the snow."] * 12)  # over max_len = 48 tokens
    result = translator.generate_text([line], alignments=True)
    assert result.parts[0] > 1
    t = result.translations[0][0]
    assert t.alignment.source_words == tuple(line.split())
    assert t.alignment.target_words == tuple(t.text.split())
    check_links(t.alignment.pharaoh(), line, t.text)
