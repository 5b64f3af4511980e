"""Attention weights recorded from the model's own forward pass, on a tiny random model: they
sum to 1 over the keys, masked decoder weights are zero above the diagonal, padding gets no
weight, recording does not change the model's output, and ``aiayn attention`` writes the
figures and the JSON."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import sys
from pathlib import Path as _Path

sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))
from figures import assert_drawn  # noqa: E402

from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.config import load_config
from aiayn.data.vocab import PAD_ID, Vocabulary
from aiayn.model import Transformer
from aiayn.viz import record_attention

TEXTS = ["A man in a red shirt rides a bike.", "Two dogs play in the snow.",
         "Ein Mann in einem roten Hemd fährt Fahrrad.", "Zwei Hunde spielen im Schnee."] * 10


def tiny_model(**overrides) -> Transformer:
    cfg = load_config("tiny").model
    cfg = dataclasses.replace(cfg, vocab_size=50, max_len=32, **overrides)
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def padded_batch():
    src = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 2, PAD_ID, PAD_ID, PAD_ID]])  # (2, 6)
    tgt_in = torch.tensor([[1, 12, 13, 14, 15], [1, 16, 17, PAD_ID, PAD_ID]])  # (2, 5)
    return src, tgt_in


def test_weights_are_distributions_causal_and_ignore_padding():
    model = tiny_model()
    src, tgt_in = padded_batch()
    with torch.no_grad(), record_attention(model) as rec:
        model(src, tgt_in)
    N, h = model.config.N, model.config.h
    for kind, (Tq, Tk) in {"encoder": (6, 6), "decoder": (5, 5), "cross": (5, 6)}.items():
        ws = rec.weights(kind)
        assert len(ws) == N
        for w in ws:
            assert w.shape == (2, h, Tq, Tk)
            assert w.min() >= 0
            torch.testing.assert_close(w.sum(-1), torch.ones(2, h, Tq))
    for w in rec.weights("decoder"):
        above = torch.ones(5, 5, dtype=torch.bool).triu(1)
        assert (w[..., above] == 0).all()
        assert (w[..., ~above] > 0).all()  # softmax gives every allowed key some weight
    # the second source has 3 pad positions: no query, in any layer or head, attends to them
    for kind in ("encoder", "cross"):
        for w in rec.weights(kind):
            assert (w[1, :, :, 3:] == 0).all()
            assert (w[1, :, :, :3] > 0).all()


def test_recorded_weights_are_eq1_of_the_layer_and_leave_the_output_unchanged():
    model = tiny_model()
    src, tgt_in = padded_batch()
    with torch.no_grad():
        plain = model(src, tgt_in)
        with record_attention(model) as rec:
            recorded = model(src, tgt_in)
        after = model(src, tgt_in)
    torch.testing.assert_close(recorded, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(after, plain)  # back on the fused path, bit for bit
    assert all(not m.record_weights and m.weights is None for m in model.modules()
               if hasattr(m, "record_weights"))
    # the first encoder layer's weights recomputed from its own projections, in float64
    mha = model.encoder[0].self_attn
    x = model._embed(model.src_embed, src)
    q = mha._split(mha.W_q(x), mha.d_k).double()
    k, _ = mha.project_kv(x)
    mask = (src != PAD_ID)[:, None, None, :]
    logits = (q @ k.double().transpose(-2, -1) / mha.d_k**0.5).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(rec.weights("encoder")[0].double(), logits.softmax(-1),
                               atol=1e-5, rtol=1e-4)


def test_record_without_forward_pass_is_a_clear_error():
    model = tiny_model()
    with record_attention(model) as rec:
        pass
    with pytest.raises(ValueError, match="no encoder attention was recorded"):
        rec.weights("encoder")
    with pytest.raises(ValueError, match="kind must be one of"):
        rec.weights("self")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    vocab = Vocabulary.learn(TEXTS, 90)
    cfg = load_config("tiny")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, vocab_size=len(vocab), max_len=24))
    cfg = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, max_len_b=6))
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "ckpt"
    save_checkpoint(path, Transformer(cfg.model), cfg, vocab)
    return path


def test_attention_maps_of_the_beam_output_and_of_a_forced_target(checkpoint):
    from aiayn.translator import Translator

    translator = Translator.from_pretrained(checkpoint, precision="fp32")
    own = translator.attention("Two dogs play.", max_len_b=6)
    best = translator.generate(["Two dogs play."], max_len_b=6)[0][0]
    assert not own.forced and own.target_text == best.text and own.score == best.score
    T = len(best.tokens)
    assert own.cross.shape == (2, 4, T, len(own.source_tokens))
    assert own.target_inputs[0] == "<s>" and own.target_outputs[-1] == "</s>"
    assert own.source_tokens[-1] == "</s>"
    forced = translator.attention("Two dogs play.", "Zwei Hunde spielen.")
    assert forced.forced and forced.target_text == "Zwei Hunde spielen."
    assert forced.target_outputs[:-1] == translator.vocab.tokens("Zwei Hunde spielen.")
    assert torch.equal(forced.encoder, own.encoder)  # the encoder does not see the target
    with pytest.raises(ValueError, match="source sentence is empty"):
        translator.attention("  ")


def test_cli_draws_both_styles_and_writes_json(checkpoint, tmp_path, capsys):
    lines_png = tmp_path / "lines.png"
    rc = main(["attention", "--checkpoint", str(checkpoint), "--text", "Two dogs play.",
               "--target", "Zwei Hunde spielen.", "--kind", "cross", "--layer", "1",
               "-o", str(lines_png), "--json"])
    assert rc == 0
    assert_drawn(lines_png)
    data = json.loads(capsys.readouterr().out)
    att = data["attention"]["cross"]
    assert att["shape"] == [2, 4, len(data["target_outputs"]), len(data["source_tokens"])]
    assert att["queries"] == data["target_outputs"] and att["keys"] == data["source_tokens"]
    for layer in att["weights"]:
        for head in layer:
            for row in head:
                assert abs(sum(row) - 1) < 1e-3
    src = tmp_path / "in.txt"
    src.write_text("A man rides a bike.\nTwo dogs play in the snow.\n", encoding="utf-8")
    heat = tmp_path / "heat.png"
    rc = main(["attention", "--checkpoint", str(checkpoint), "-i", str(src), "--line", "2",
               "--kind", "decoder", "--head", "2", "--style", "heatmap", "-o", str(heat)])
    assert rc == 0 and heat.stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--head", "5"], "--head 5 does not exist: the model has h=4 heads"),
    (["--layer", "3"], "--layer 3 does not exist: the model has N=2 layers"),
    (["--head", "x"], "--head must be a number from 1 to 4 or 'all'"),
    (["-o", "out.jpg"], "name it \\*.png"),
])
def test_cli_errors_name_the_bad_value(checkpoint, tmp_path, capsys, args, message):
    rc = main(["attention", "--checkpoint", str(checkpoint), "--text", "Two dogs.",
               *(args if "-o" in args else [*args, "-o", str(tmp_path / "a.png")])])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("aiayn attention: error:")
    assert re.search(message, err), err
