"""Hugging Face Marian <-> aiayn <-> CTranslate2, on tiny random-weight Marian models built here
(SentencePiece models trained on Multi30k lines; nothing is downloaded)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from interop_fixtures import make_marian, read_corpus  # noqa: E402

from aiayn.cli import main  # noqa: E402
from aiayn.data.batching import pad_sources  # noqa: E402
from aiayn.translator import Translator  # noqa: E402
from aiayn.interop.marian import import_hf  # noqa: E402

MAX_LENGTH = 40  # generate's max_length: the start token + at most 38 tokens + EOS


@pytest.fixture(scope="module")
def corpus(data_dir):
    return read_corpus(data_dir, "en", limit=1500), read_corpus(data_dir, "de", limit=1500)


@pytest.fixture(scope="module")
def sources(data_dir):
    return read_corpus(data_dir, "en", "test_2016_flickr", limit=48)


@pytest.fixture(scope="module", params=["shared", "separate"])
def marian(request, corpus, tmp_path_factory):
    """(directory, MarianMTModel, MarianTokenizer) of a random 2+2-layer Marian model."""
    from transformers import MarianMTModel, MarianTokenizer

    separate = request.param == "separate"
    d = make_marian(tmp_path_factory.mktemp(f"marian-{request.param}"), *corpus,
                    separate=separate, seed=1 if separate else 0)
    return d, MarianMTModel.from_pretrained(d).eval(), MarianTokenizer.from_pretrained(d)


def _marian_ids(vocab, ours: list[int], target: bool) -> list[int]:
    """Our ids -> Marian ids, through the pieces and the Marian vocab.json."""
    pieces = vocab.output_pieces if target else vocab.source_pieces
    return [pieces[i] for i in ours]


def _generate(hf, tok, lines, beams):
    batch = tok(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**batch, num_beams=beams, do_sample=False, max_length=MAX_LENGTH,
                          length_penalty=0.0, bad_words_ids=[[hf.config.pad_token_id]])
    return out, tok.batch_decode(out, skip_special_tokens=True)


def _pieces_of(tok, ids: list[int]) -> list[str]:
    """Target pieces of Marian ids (padding dropped)."""
    return [tok.decoder[i] for i in ids if i != tok.pad_token_id]


def test_import_computes_the_same_function(marian, sources):
    directory, hf, tok = marian
    model, config, vocab = import_hf(directory)
    assert config.model.ffn_activation == "swish"
    assert config.model.positional_layout == "halves"
    # the same pieces in
    batch = tok(sources, return_tensors="pt", padding=True)
    ours = [vocab.encode(s) + [vocab.eos_id] for s in sources]
    hf_src_pieces = [[{v: k for k, v in tok.encoder.items()}[i] for i in row if i != tok.pad_token_id]
                     for row in batch.input_ids.tolist()]
    assert [[vocab.source_pieces[i] for i in row] for row in ours] == hf_src_pieces
    with torch.no_grad():
        enc_hf = hf.model.encoder(**batch).last_hidden_state
        memory, src_mask = model.encode(pad_sources(ours))
        assert torch.equal(src_mask, batch.attention_mask.bool())
        # float32 rounding: aiayn's encoder attends in its CPU kernel (aiayn.model.kernels),
        # Hugging Face's in SDPA; after 6 layers they differ by up to ~1.2e-5
        torch.testing.assert_close(memory[src_mask], enc_hf[src_mask], atol=3e-5, rtol=0)
        # next-token logits along HF's greedy outputs, compared in HF's id order
        out, _ = _generate(hf, tok, sources, 1)
        logits_hf = hf(**batch, decoder_input_ids=out).logits
        ours_of_hf = {p: i for i, p in enumerate(vocab.output_pieces)}
        perm = torch.tensor([ours_of_hf[tok.decoder[i]] for i in range(len(tok.decoder))])
        logits = model.decode(perm[out], memory, src_mask)[:, :, perm]
        live = torch.ones_like(out, dtype=torch.bool)
        live[:, 1:] = out[:, 1:] != tok.pad_token_id
        torch.testing.assert_close(logits[live], logits_hf[live], atol=3e-5, rtol=0)


@pytest.mark.parametrize("beams", [1, 4])
def test_search_is_token_identical_to_generate(marian, sources, beams):
    directory, hf, tok = marian
    model, config, vocab = import_hf(directory)
    out, texts = _generate(hf, tok, sources, beams)
    got = Translator(model, vocab, precision="fp32").generate(
        sources, beam_size=beams, alpha=0.0, max_len_a=0.0, max_len_b=MAX_LENGTH - 2,
        batch_size=16, beam_rules=config.decode.beam_rules)
    for row, hf_text, mine in zip(out.tolist(), texts, got):
        assert _marian_ids(vocab, mine[0].tokens, True) == _pieces_of(tok, row[1:])
        assert mine[0].text == hf_text
    lengths = {len(t[0].tokens) for t in got}
    assert len(lengths) > 2 and len({t[0].text for t in got}) >= 5, \
        "the random model should give varied outputs"


def test_convert_translate_and_export_round_trip(marian, sources, tmp_path, capsys):
    from transformers import MarianMTModel, MarianTokenizer

    directory, hf, tok = marian
    ckpt, back = tmp_path / "ckpt", tmp_path / "hf"
    assert main(["convert", "--from", "hf", str(directory), "-o", str(ckpt)]) == 0
    src = tmp_path / "src.en"
    src.write_text("\n".join(sources) + "\n", encoding="utf-8")
    out_file = tmp_path / "out.de"
    assert main(["translate", "--checkpoint", str(ckpt), "-i", str(src), "-o", str(out_file),
                 "--beam", "4", "--max-len-b", str(MAX_LENGTH - 2), "--quiet"]) == 0
    _, texts = _generate(hf, tok, sources, 4)
    assert out_file.read_text(encoding="utf-8").splitlines() == texts
    # back to Hugging Face: the same weights at the same ids, the same outputs
    assert main(["convert", "--to", "hf", str(ckpt), "-o", str(back)]) == 0
    hf2, tok2 = MarianMTModel.from_pretrained(back).eval(), MarianTokenizer.from_pretrained(back)
    assert tok2.encoder == tok.encoder
    sd, sd2 = hf.state_dict(), hf2.state_dict()
    for key, value in sd.items():
        assert torch.equal(sd2[key], value), key
    assert _generate(hf2, tok2, sources, 4)[1] == texts


def test_ctranslate2_export_decodes_to_the_same_tokens(marian, sources, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    import sentencepiece as spm

    directory, hf, tok = marian
    ckpt, ct2 = tmp_path / "ckpt", tmp_path / "ct2"
    assert main(["convert", "--from", "hf", str(directory), "-o", str(ckpt)]) == 0
    assert main(["convert", "--to", "ctranslate2", str(ckpt), "-o", str(ct2)]) == 0
    sp = spm.SentencePieceProcessor(model_file=str(ct2 / "source.spm"))
    translator = ctranslate2.Translator(str(ct2), device="cpu", intra_threads=1)
    batch = [sp.encode(s, out_type=str) + ["</s>"] for s in sources]
    for beams in (1, 4):
        out, _ = _generate(hf, tok, sources, beams)
        # CTranslate2 bans an empty output unless min_decoding_length=0; its length limit
        # counts tokens before EOS
        results = translator.translate_batch(batch, beam_size=beams, length_penalty=0.0,
                                             min_decoding_length=0,
                                             max_decoding_length=MAX_LENGTH - 2)
        for row, r in zip(out.tolist(), results):
            want = [p for p in _pieces_of(tok, row[1:]) if p != "</s>"]
            assert r.hypotheses[0] == want


def test_fine_tuning_a_converted_marian_model(marian, corpus, sources, tmp_path):
    """``aiayn train --init-from`` a Hugging Face Marian directory: training starts from its
    weights, vocabulary and start token (pad), the loss falls, and the result exports back to
    Hugging Face, where ``generate`` gives the Translator's tokens."""
    from transformers import MarianMTModel, MarianTokenizer

    directory, hf, tok = marian
    src, tgt = corpus
    files = {}
    for name, lines in (("train.en", src[:400]), ("train.de", tgt[:400]),
                        ("valid.en", src[1400:1430]), ("valid.de", tgt[1400:1430])):
        files[name] = tmp_path / name
        files[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--init-from", str(directory), "--run-dir",
                 str(run), "--no-progress", "--set", "data.dataset=files",
                 "--set", f"data.train_src={files['train.en']}",
                 "--set", f"data.train_tgt={files['train.de']}",
                 "--set", f"data.valid_src={files['valid.en']}",
                 "--set", f"data.valid_tgt={files['valid.de']}",
                 "--set", "train.max_steps=60", "--set", "train.warmup_steps=20",
                 "--set", "train.checkpoint_every_steps=60",
                 "--set", "train.eval_every_steps=60",
                 "--set", "train.eval_bleu_sentences=0", "--set", "train.log_every_steps=5",
                 "--set", "model.P_drop=0.1"]) == 0
    saved = json.loads((run / "config.json").read_text(encoding="utf-8"))
    # the architecture, start token and search are the Marian model's; dropout is this run's
    assert saved["model"]["decoder_start_id"] == 0 and saved["model"]["d_model"] == 32
    assert saved["model"]["P_drop"] == 0.1 and saved["decode"]["beam_rules"] == "hf"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses

    translator = Translator.from_pretrained(run, precision="fp32")
    assert translator.decoder_start_id == 0
    ours = translator.generate(sources, beam_size=4, alpha=0.0, max_len_a=0.0,
                               max_len_b=MAX_LENGTH - 2, batch_size=16)
    back = tmp_path / "hf"
    assert main(["convert", "--to", "hf", translator.source[0], "-o", str(back)]) == 0
    hf2, tok2 = MarianMTModel.from_pretrained(back).eval(), MarianTokenizer.from_pretrained(back)
    out, texts = _generate(hf2, tok2, sources, 4)
    for row, hf_text, mine in zip(out.tolist(), texts, ours):
        assert _marian_ids(translator.vocab, mine[0].tokens, True) == _pieces_of(tok2, row[1:])
        assert mine[0].text == hf_text
    # fine-tuning changed the function: the original model answers otherwise somewhere
    assert texts != _generate(hf, tok, sources, 4)[1]


def test_convert_exports_the_model_the_run_recorded(marian, corpus, sources, tmp_path):
    """When the moving average (``ema``) is the run's recorded choice, ``aiayn convert --to hf
    RUN`` exports ``RUN/ema`` (not ``RUN/averaged``, which the run also holds) with the run's
    search settings, and Hugging Face's greedy ``generate`` gives the run's own output: what
    ``Translator.from_pretrained(RUN)`` translates, as the pipeline's test output is made."""
    from safetensors.torch import load_file
    from transformers import MarianMTModel, MarianTokenizer

    from aiayn.rundir import RunDir

    directory, _, _ = marian
    src, tgt = corpus
    files = {}
    for name, lines in (("train.en", src[:300]), ("train.de", tgt[:300]),
                        ("valid.en", src[1400:1420]), ("valid.de", tgt[1400:1420])):
        files[name] = tmp_path / name
        files[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = RunDir(tmp_path / "run")
    assert main(["train", "--preset", "tiny", "--init-from", str(directory), "--run-dir",
                 str(run.path), "--no-progress", "--set", "data.dataset=files",
                 "--set", f"data.train_src={files['train.en']}",
                 "--set", f"data.train_tgt={files['train.de']}",
                 "--set", f"data.valid_src={files['valid.en']}",
                 "--set", f"data.valid_tgt={files['valid.de']}",
                 "--set", "train.max_steps=30", "--set", "train.warmup_steps=10",
                 "--set", "train.checkpoint_every_steps=10", "--set", "train.keep_last=2",
                 "--set", "train.eval_every_steps=30", "--set", "train.eval_bleu_sentences=0",
                 "--set", "train.ema_decay=0.9"]) == 0
    assert main(["average", str(run.path), "--last", "2"]) == 0
    assert run.finished and run.steps() and all(
        (p / "model.safetensors").is_file() for p in (run.ema, run.averaged))
    # the record the pipeline writes when ema wins on val: greedy, the HF search's lengths
    decode = Translator.from_pretrained(run.ema).decode_config
    greedy = dataclasses.replace(decode, beam_size=1, alpha=0.0, max_len_a=0.0,
                                 max_len_b=MAX_LENGTH - 2)
    run.write_generation([run.ema], greedy, weights="ema", precision="fp32")
    translator = Translator.from_pretrained(run.path, precision="fp32")
    assert translator.source == [str(run.ema)]
    ours = translator.translate(sources)  # the run's output, at its recorded settings

    back = tmp_path / "hf"
    assert main(["convert", "--to", "hf", str(run.path), "-o", str(back)]) == 0
    exported = load_file(back / "model.safetensors")
    ema_hf, avg_hf = tmp_path / "ema-hf", tmp_path / "avg-hf"
    assert main(["convert", "--to", "hf", str(run.ema), "-o", str(ema_hf)]) == 0
    assert main(["convert", "--to", "hf", str(run.averaged), "-o", str(avg_hf)]) == 0
    for name, want in load_file(ema_hf / "model.safetensors").items():
        assert torch.equal(exported[name], want), name
    averaged = load_file(avg_hf / "model.safetensors")
    assert any(not torch.equal(exported[k], v) for k, v in averaged.items()), \
        "ema and the average should differ, or the test shows nothing"
    gen = json.loads((back / "generation_config.json").read_text(encoding="utf-8"))
    assert gen["num_beams"] == 1 and gen["max_length"] == MAX_LENGTH
    hf, tok = MarianMTModel.from_pretrained(back).eval(), MarianTokenizer.from_pretrained(back)
    batch = tok(sources, return_tensors="pt", padding=True)
    with torch.no_grad():  # the exported generation_config.json's search: greedy
        out = hf.generate(**batch, do_sample=False)
    assert tok.batch_decode(out, skip_special_tokens=True) == ours


def test_ctranslate2_export_of_a_native_model(data_dir, tmp_path):
    """A model with aiayn's own BPE vocabulary, the paper's interleaved positions, a ``<s>``
    start and a target-only output layer (the main job's kind) exports through CTranslate2's
    model specification: CTranslate2 fp32 scores aiayn's own translations with aiayn's
    log-probabilities, and its greedy search finds the same tokens."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from aiayn.checkpoint import save_checkpoint
    from aiayn.config import Config

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from small_models import read_lines, train_small

    model, vocab = train_small(data_dir, output_vocab="target")
    config = dataclasses.replace(Config(), model=model.config)
    ckpt, ct2 = tmp_path / "ckpt", tmp_path / "ct2"
    save_checkpoint(ckpt, model, config, vocab)
    assert main(["convert", "--to", "ctranslate2", str(ckpt), "-o", str(ct2)]) == 0
    target = json.loads((ct2 / "target_vocabulary.json").read_text(encoding="utf-8"))
    allowed = int(torch.isfinite(model.final_logits_bias).sum())
    assert allowed < len(target) + 3 and len(target) <= allowed + 3 < len(vocab)
    lines = read_lines(data_dir / "multi30k" / "test_2016_flickr.en.gz", 48)
    ours = Translator(model, vocab, precision="fp32").generate(
        lines, beam_size=1, alpha=0.0, max_len_a=0.0, max_len_b=30, preprocessed=True)
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(ct2 / "tokenizer.json"))  # copied beside it
    pieces = [tok.encode(s, add_special_tokens=False).tokens for s in lines]
    assert pieces == [vocab.tokens(s) for s in lines]
    hyps = [[vocab.tokenizer.id_to_token(i) for i in r[0].tokens if i != vocab.eos_id]
            for r in ours]
    translator = ctranslate2.Translator(str(ct2), device="cpu", intra_threads=1)
    scored = translator.score_batch(pieces, hyps)
    for r, s in zip(ours, scored):
        assert sum(s.log_probs) == pytest.approx(r[0].log_prob, abs=1e-3)
    found = translator.translate_batch(pieces, beam_size=1, min_decoding_length=0,
                                       max_decoding_length=30)
    same = sum(f.hypotheses[0] == h for f, h in zip(found, hyps))
    assert same >= 0.9 * len(lines)


def test_ctranslate2_reads_aiayn_shortlist_as_its_vmap(data_dir, tmp_path):
    """``aiayn shortlist``'s file is CTranslate2's vmap: exported with ``--vmap``, a sentence
    decoded alone (where CTranslate2's batch union is the sentence's own list) gets the tokens
    aiayn's shortlisted greedy search gives it."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from aiayn.checkpoint import save_checkpoint
    from aiayn.config import Config
    from aiayn.decoding.shortlist import Shortlist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from small_models import read_lines, train_small

    model, vocab = train_small(data_dir, output_vocab="target")
    m30k = data_dir / "multi30k"
    src, tgt = read_lines(m30k / "train.en.gz", 600), read_lines(m30k / "train.de.gz", 600)
    shortlist = Shortlist.build(zip(vocab.encode_batch(src), vocab.encode_batch(tgt)),
                                len(vocab), first=20, best=10)
    vmap = shortlist.save(tmp_path / "vmap.txt", vocab)
    ckpt, ct2 = tmp_path / "ckpt", tmp_path / "ct2"
    save_checkpoint(ckpt, model, dataclasses.replace(Config(), model=model.config), vocab)
    assert main(["convert", "--to", "ctranslate2", str(ckpt), "-o", str(ct2), "--vmap",
                 str(vmap)]) == 0
    assert (ct2 / "vmap.txt").is_file()
    lines = read_lines(m30k / "test_2016_flickr.en.gz", 24)
    ours = Translator(model, vocab, precision="fp32", shortlist=shortlist).generate(
        lines, beam_size=1, alpha=0.0, max_len_a=0.0, max_len_b=30, preprocessed=True)
    free = Translator(model, vocab, precision="fp32").generate(
        lines, beam_size=1, alpha=0.0, max_len_a=0.0, max_len_b=30, preprocessed=True)
    hyps = [[vocab.tokenizer.id_to_token(i) for i in r[0].tokens if i != vocab.eos_id]
            for r in ours]
    assert hyps != [[vocab.tokenizer.id_to_token(i) for i in r[0].tokens if i != vocab.eos_id]
                    for r in free]  # the lists change some outputs
    translator = ctranslate2.Translator(str(ct2), device="cpu", intra_threads=1)
    found = [translator.translate_batch([vocab.tokens(s)], beam_size=1, use_vmap=True,
                                        min_decoding_length=0, max_decoding_length=30)[0]
             for s in lines]
    same = sum(f.hypotheses[0] == h for f, h in zip(found, hyps))
    assert same >= 0.9 * len(lines)
    bad = tmp_path / "other.txt"
    bad.write_text("\tno-such-token\n", encoding="utf-8")
    assert main(["convert", "--to", "ctranslate2", str(ckpt), "-o", str(tmp_path / "x"),
                 "--vmap", str(bad)]) == 2
