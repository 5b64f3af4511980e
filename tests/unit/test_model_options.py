"""The ModelConfig options that express Marian / OPUS-MT models (§3 deviations, each off by
default), and the Hugging Face beam rules of the search."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_search import B_, A, StubStep  # tests/unit is on sys.path (rootdir-relative)

from aiayn.config import Config, ModelConfig
from aiayn.data.vocab import EOS_ID
from aiayn.decoding import beam_search
from aiayn.model import PositionwiseFeedForward, Transformer, sinusoid_table

TINY = ModelConfig(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, vocab_size=50, max_len=64)


def test_defaults_are_the_papers_and_old_configs_load():
    cfg = ModelConfig()
    assert (cfg.ffn_activation, cfg.positional_layout) == ("relu", "interleaved")
    assert (cfg.final_logits_bias, cfg.decoder_start_id) == (False, 1)
    old = Config().to_dict()  # a config.json written before these fields existed
    for name in ("ffn_activation", "positional_layout", "final_logits_bias", "decoder_start_id"):
        del old["model"][name]
    del old["decode"]["beam_rules"]
    assert Config.from_dict(old) == Config()
    with pytest.raises(ValueError, match="ffn_activation"):
        ModelConfig(ffn_activation="gelu")
    with pytest.raises(ValueError, match="decoder_start_id"):
        dataclasses.replace(TINY, decoder_start_id=50)


def test_paper_model_state_dict_names_are_unchanged():
    names = set(Transformer(TINY).state_dict())
    assert "final_logits_bias" not in names
    assert "encoder.0.self_attn.W_q.weight" in names and "decoder.1.ffn.W_2.bias" in names
    with_bias = Transformer(dataclasses.replace(TINY, final_logits_bias=True))
    assert set(with_bias.state_dict()) == names | {"final_logits_bias"}


def test_halves_layout_holds_the_same_sines_and_cosines():
    inter, halves = sinusoid_table(20, 16), sinusoid_table(20, 16, "halves")
    torch.testing.assert_close(halves[:, :8], inter[:, 0::2], rtol=0, atol=0)
    torch.testing.assert_close(halves[:, 8:], inter[:, 1::2], rtol=0, atol=0)
    with pytest.raises(ValueError, match="layout"):
        sinusoid_table(4, 4, "blocks")


def test_swish_ffn_and_final_logits_bias():
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(8, 16, "swish")
    x = torch.randn(2, 3, 8)
    h = ffn.W_1(x)
    torch.testing.assert_close(ffn(x), ffn.W_2(h * torch.sigmoid(h)))
    model = Transformer(dataclasses.replace(TINY, final_logits_bias=True)).eval()
    x = torch.randn(2, 32)
    before = model.project(x)
    model.final_logits_bias[7] = 3.0
    torch.testing.assert_close(model.project(x)[:, 7], before[:, 7] + 3.0)


# root: A .5, B .3, EOS .2 (EOS ranked third: below the K=2 best); then every continuation
# of A or B has EOS .3, and the best three-token output has probability .5 * .36 = .18 < .2
TABLE = {(): {A: 0.5, B_: 0.3, EOS_ID: 0.2}, (A,): {A: 0.36, B_: 0.34, EOS_ID: 0.3},
         (B_,): {A: 0.36, B_: 0.34, EOS_ID: 0.3}}


def test_beam_rules_t2t_and_hf():
    lens = torch.tensor([5])
    t2t = beam_search(StubStep(TABLE), lens, beam_size=2, alpha=0.0, rules="t2t")[0][0]
    assert t2t.tokens == [EOS_ID]  # tensor2tensor finishes every EOS among the 2K best
    hf = beam_search(StubStep(TABLE), lens, beam_size=2, alpha=0.0, rules="hf")[0][0]
    assert hf.tokens == [A, A, EOS_ID]  # generate/fairseq only those among the K best
    assert math.isclose(hf.log_prob, math.log(0.5 * 0.36), rel_tol=1e-4)
    # at the length limit the forced EOS costs nothing under the hf rules
    forced = beam_search(StubStep(TABLE), torch.tensor([1]), beam_size=2, alpha=0.0,
                         rules="hf")[0][0]
    assert forced.tokens == [A, EOS_ID]
    assert math.isclose(forced.log_prob, math.log(0.5), rel_tol=1e-4)
    with pytest.raises(ValueError, match="rules"):
        beam_search(StubStep(TABLE), lens, rules="marian")


def test_set_dropout_active_switches_every_dropout_of_training_mode():
    cfg = dataclasses.replace(TINY, P_drop=0.3, attention_dropout=0.3, word_dropout=0.3)
    torch.manual_seed(0)
    model = Transformer(cfg)
    src = torch.randint(4, 50, (3, 9))
    tgt = torch.randint(4, 50, (3, 7))
    with torch.no_grad():
        reference = model.eval()(src, tgt)
        model.train()
        dropped = model(src, tgt)
        model.set_dropout_active(False)
        kept = [model(src, tgt) for _ in range(2)]
        model.set_dropout_active(True)
        dropped_again = model(src, tgt)
    assert not torch.allclose(dropped, reference, atol=1e-3)
    assert not torch.allclose(dropped_again, reference, atol=1e-3)
    torch.testing.assert_close(kept[0], reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(kept[1], reference, rtol=0, atol=1e-5)
    # each kind alone (the others at 0), so that none is left out of the switch
    for name in ("P_drop", "attention_dropout", "word_dropout"):
        alone = dict(P_drop=0.0, attention_dropout=0.0, word_dropout=0.0) | {name: 0.5}
        only = Transformer(dataclasses.replace(TINY, **alone)).train()
        with torch.no_grad():
            only.set_dropout_active(False)
            off = only(src, tgt)
            only.set_dropout_active(True)
            on = only(src, tgt)
            torch.testing.assert_close(off, only.eval()(src, tgt), rtol=0, atol=1e-5)
        assert not torch.allclose(on, off, atol=1e-3), name
