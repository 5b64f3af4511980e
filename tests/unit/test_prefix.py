"""Decoding from a prefix (aiayn.decoding.prefix): every output begins with its line's prefix
tokens exactly, a line without a prefix decodes as it does without the feature, a line
decodes the same alone and in a batch, with greedy and beam search, fp32 and int8, one model
and an ensemble; the alternatives after the prefix; the prefixes that are refused. On a small
model trained for a few seconds on real Multi30k pairs (an output layer limited to the target
side, so that the int8 copy scores a compact subset of the columns), and through the CLI and
the server on a tiny random-weight checkpoint."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import httpx
import pytest
import torch

from aiayn.data.vocab import EOS_ID
from aiayn.decoding.prefix import ForcePrefix, PrefixError
from aiayn.decoding.search import SearchState
from aiayn.model import kernels
from aiayn.translator import Translator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from small_models import read_lines, train_small  # noqa: E402

NEG_INF = float("-inf")
OPTIONS = dict(max_len_a=1.0, max_len_b=8, alpha=0.6)


@pytest.fixture(scope="module")
def trained(data_dir):
    """The model (target-side output layer), its vocabulary, 10 test sources, and prefixes:
    the first two words of the reference on even lines, none on odd ones."""
    model, vocab = train_small(data_dir, steps=80, output_vocab="target")
    m30k = data_dir / "multi30k"
    sources = read_lines(m30k / "test_2016_flickr.en.gz", 10)
    refs = read_lines(m30k / "test_2016_flickr.de.gz", 10)
    prefixes = [" ".join(r.split()[:2]) if n % 2 == 0 else None for n, r in enumerate(refs)]
    return model, vocab, sources, prefixes


def _check(translator, vocab, sources, prefixes, beam_size, batch_invariant=True):
    opts = dict(OPTIONS, beam_size=beam_size, batch_size=len(sources))
    plain = translator.generate(sources, **opts)
    forced = translator.generate(sources, target_prefix=prefixes, **opts)
    changed = 0
    for prefix, got, want in zip(prefixes, forced, plain):
        if prefix is None:  # untouched: the same tokens and numbers as with no prefix at all
            assert (got[0].text, got[0].tokens, got[0].score, got[0].log_prob) == \
                (want[0].text, want[0].tokens, want[0].score, want[0].log_prob)
            continue
        ids = vocab.encode(prefix)
        assert got[0].tokens[: len(ids)] == ids and got[0].tokens[-1] == EOS_ID
        assert got[0].text.startswith(prefix)
        changed += got[0].tokens != want[0].tokens
    assert changed > 0  # the prefixes are not what the model says anyway
    if batch_invariant:
        alone = [translator.generate([s], target_prefix=[p], **opts)[0]
                 for s, p in zip(sources, prefixes)]
        assert [a[0].tokens for a in alone] == [f[0].tokens for f in forced]
    return forced


@pytest.mark.parametrize("beam_size", [1, 4])
def test_fp32_outputs_begin_with_the_prefix_and_score_it(trained, beam_size):
    model, vocab, sources, prefixes = trained
    translator = Translator(model, vocab, precision="fp32")
    forced = _check(translator, vocab, sources, prefixes, beam_size)
    # a forced token keeps the model's log-probability: log_prob is the whole output's,
    # teacher-forced over the same tokens
    for n in (n for n, p in enumerate(prefixes) if p):
        tokens = forced[n][0].tokens
        src = torch.tensor([vocab.encode(sources[n]) + [EOS_ID]])
        tgt_in = torch.tensor([[model.config.decoder_start_id] + tokens[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(src, tgt_in).float(), dim=-1)[0]
        whole = float(logp.gather(1, torch.tensor(tokens)[:, None]).sum())
        assert forced[n][0].log_prob == pytest.approx(whole, abs=2e-3)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_int8_forces_the_prefix_through_its_compact_columns(trained, beam_size):
    model, vocab, sources, prefixes = trained
    translator = Translator(model, vocab, precision="int8")
    assert translator.decoding_models[0].compact_token_ids is not None  # a column subset
    _check(translator, vocab, sources, prefixes, beam_size, batch_invariant=kernels.AVAILABLE)


def test_an_ensemble_forces_the_prefix(trained):
    model, vocab, sources, prefixes = trained
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    _check(Translator([model, other], vocab, precision="fp32"), vocab, sources, prefixes, 4)


def test_nbest_and_the_alternatives_after_the_prefix(trained):
    model, vocab, sources, prefixes = trained
    translator = Translator(model, vocab, precision="fp32")
    lines, given = sources[:4], prefixes[:4]
    nbest = translator.generate(lines, target_prefix=given, beam_size=4, nbest=3, **OPTIONS)
    for prefix, outs in zip(given, nbest):
        ids = vocab.encode(prefix) if prefix else []
        assert len(outs) == 3 and all(o.tokens[: len(ids)] == ids for o in outs)
    alts = translator.generate(lines, target_prefix=given, alternatives=True, beam_size=1,
                               nbest=5, **OPTIONS)  # more alternatives than the beam
    greedy = translator.generate(lines, target_prefix=given, beam_size=1, **OPTIONS)
    for prefix, outs, best in zip(given, alts, greedy):
        P = len(vocab.encode(prefix)) if prefix else 0
        assert len(outs) == 5
        assert all(o.tokens[:P] == outs[0].tokens[:P] for o in outs)
        firsts = [o.tokens[P] for o in outs]
        assert len(set(firsts)) == 5 and EOS_ID not in firsts  # they differ right after it
        if best[0].tokens[P] != EOS_ID:  # the most likely token, continued greedily
            assert outs[0].tokens == best[0].tokens
    # the same alone as in the batch
    assert [o.tokens for o in translator.generate(
        lines[:1], target_prefix=given[:1], alternatives=True, beam_size=1, nbest=5,
        **OPTIONS)[0]] == [o.tokens for o in alts[0]]


def test_a_prefix_on_a_split_line_goes_to_its_first_part(trained):
    model, vocab, sources, _ = trained
    translator = Translator(model, vocab, precision="fp32")
    long = " ".join(sources * 2)  # over the model's max_len of 96 tokens
    result = translator.generate_text([long, sources[1]], target_prefix=["Ein Hund", None],
                                      beam_size=1, **OPTIONS)
    ids = vocab.encode("Ein Hund")
    assert result.parts[0] > 1 and result.translations[0][0].tokens[: len(ids)] == ids


def test_prefixes_that_cannot_be_forced_are_refused_in_one_line(trained):
    model, vocab, sources, _ = trained
    translator = Translator(model, vocab, precision="fp32")
    with pytest.raises(PrefixError, match="2 target prefixes for 3 lines"):
        translator.generate(sources[:3], target_prefix=["Ein", None])
    too_long = " ".join(["Hund"] * 120)
    with pytest.raises(PrefixError, match=r"line 2 has \d+ tokens, more than its translation"):
        translator.generate(sources[:2], target_prefix=[None, too_long], **OPTIONS)
    producible = set(model.output_token_ids(EOS_ID + 1).tolist())
    source_only = next(t for t in range(EOS_ID + 1, len(vocab)) if t not in producible
                       and vocab.encode(vocab.decode([t])) == [t])
    with pytest.raises(PrefixError, match="line 1 holds .* never produces"):
        translator.generate(sources[:1], target_prefix=[vocab.decode([source_only])])


def test_force_prefix_maps_tokens_to_the_steps_columns():
    """A step scoring tokens [0, 1, 2, 7, 9]: sentence 0's prefix token 9 is column 4, kept at
    its score; sentence 1 (no prefix) is untouched; past the prefix nothing changes."""
    logp = torch.log_softmax(torch.tensor([[1.0, 2, 3, 4, 5], [5.0, 4, 3, 2, 1]]), dim=-1)
    state = SearchState(0, torch.tensor([5, 5]), rows=torch.tensor([1, 0]),
                        token_ids=torch.tensor([0, 1, 2, 7, 9]))
    rule = ForcePrefix([[9], None])
    out = rule(logp.clone(), state)
    assert torch.equal(out[0], logp[0])  # row 0 is sentence 1: no prefix
    assert out[1, 4] == logp[1, 4] and torch.isinf(out[1, :4]).all()
    later = SearchState(1, state.max_lens, state.rows, token_ids=state.token_ids)
    assert torch.equal(rule(logp.clone(), later), logp)
    with pytest.raises(PrefixError, match="token 8"):
        ForcePrefix([[8], None])(logp.clone(), state)


# --- the CLI and the server, on a tiny random-weight checkpoint ---------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from serving import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("prefix") / "ckpt")


def test_cli_target_prefix_file(checkpoint, tmp_path, capsys):
    from aiayn.cli import main

    src, pre, out = tmp_path / "in.txt", tmp_path / "prefix.txt", tmp_path / "out.txt"
    src.write_text("A man rides a bike.\nTwo dogs play in the snow.\n", encoding="utf-8")
    pre.write_text("Ein Mann\n\n", encoding="utf-8")
    argv = ["translate", "--checkpoint", str(checkpoint), "-i", str(src), "-o", str(out),
            "--quiet", "--target-prefix", str(pre)]
    assert main(argv) == 0
    first, second = out.read_text(encoding="utf-8").splitlines()
    assert first.startswith("Ein Mann")
    assert main(argv[:-2]) == 0
    assert out.read_text(encoding="utf-8").splitlines()[1] == second  # no prefix: unchanged
    pre.write_text("Ein Mann\n", encoding="utf-8")
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(pre) in err[0] and str(src) in err[0]


def test_server_keeps_each_lines_prefix_with_it(checkpoint):
    from serving import serve_in_thread

    from aiayn.checkpoint import load_checkpoint
    from aiayn.serve import ServeLimits, create_app

    model, config, vocab = load_checkpoint(checkpoint)
    translator = Translator(model, vocab, config=config)
    lines = ["A man rides a bike.", "Two dogs play in the snow.", "A man rides a bike."]
    prefixes = [None, "Zwei", "Ein Mann"]
    direct = translator.generate(lines, target_prefix=prefixes)
    limits = ServeLimits(max_lines=4, max_batch_lines=8, max_wait_ms=50)
    with serve_in_thread(create_app(translator, limits)) as url:
        def post(body):
            return httpx.post(url + "/translate", json=body, timeout=30)

        r = post({"lines": lines, "target_prefix": prefixes})
        assert r.status_code == 200, r.text
        assert [t[0]["text"] for t in r.json()["translations"]] == [t[0].text for t in direct]
        bad = post({"lines": lines, "target_prefix": prefixes[:2]})
        assert bad.status_code == 422 and "2 target prefixes for 3 lines" in bad.text
        alts = post({"lines": lines[1:2], "target_prefix": ["Zwei"], "alternatives": True,
                     "nbest": 3, "beam": 1})
        assert alts.status_code == 200, alts.text
        texts = [t["text"] for t in alts.json()["translations"][0]]
        assert len(texts) == 3 and all(t.startswith("Zwei") for t in texts)



def test_a_prefix_wins_over_a_guard_that_bans_its_tokens(trained):
    """A prefix that says a token twice, decoded under no_repeat_ngram_size=1 (no token
    twice): the guard bans the second one, the prefix still forces it (at log-probability 0),
    and each output begins with the prefix's tokens, with a finite score."""
    model, vocab, sources, _ = trained
    translator = Translator(model, vocab, precision="fp32")
    word = sources[0].split()[0]
    prefixes = [f"{word} {word}"] * 2  # its tokens twice: the guard bans the second time
    for beam_size in (1, 4):
        got = translator.generate(sources[:2], target_prefix=prefixes, beam_size=beam_size,
                                  no_repeat_ngram_size=1, **OPTIONS)
        ids = vocab.encode(prefixes[0])
        for out in got:
            assert out[0].tokens[: len(ids)] == ids
            assert out[0].log_prob > NEG_INF

