"""Decoding scores only the tokens a model can produce (``Transformer.output_token_ids``,
the int8 copy's ``compact_token_ids``): on a model trained with a target-only output layer, the
searches find the same tokens as over the whole vocabulary, with the same scores within float
tolerance, alone and in an ensemble."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from aiayn.data.vocab import EOS_ID
from aiayn.decoding import translate_nbest
from aiayn.decoding.search import EnsembleStep, StepFunction, same_columns
from aiayn.model.quantize import quantize_int8
from aiayn.config import DecodeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from small_models import read_lines, train_small  # noqa: E402


@pytest.fixture(scope="module")
def trained(data_dir):
    model, vocab = train_small(data_dir, output_vocab="target")
    return model, vocab, read_lines(data_dir / "multi30k" / "test_2016_flickr.en.gz", 48)


def test_output_token_ids_keep_the_special_columns_and_the_producible_tokens(trained):
    model, vocab, _ = trained
    ids = model.output_token_ids(EOS_ID + 1)
    finite = torch.isfinite(model.final_logits_bias).nonzero().squeeze(1)
    assert ids[: EOS_ID + 1].tolist() == list(range(EOS_ID + 1))
    assert bool((ids[1:] > ids[:-1]).all())
    assert set(ids.tolist()) == set(finite.tolist()) | set(range(EOS_ID + 1))
    assert ids.numel() < len(vocab)  # the target side uses fewer tokens than the shared vocab


def test_a_model_without_a_banned_token_has_no_compact_map(trained):
    model, _, _ = trained
    full = dataclasses.replace(model.config, output_vocab="all")
    from aiayn.model import Transformer

    plain = Transformer(full)
    assert plain.output_token_ids(EOS_ID + 1) is None
    assert quantize_int8(plain, step_fixed_ids=EOS_ID + 1).compact_token_ids is None


@pytest.mark.parametrize("beam_size", [1, 4])
def test_compact_decoding_finds_the_tokens_of_the_full_map(trained, beam_size):
    model, vocab, lines = trained
    compact = quantize_int8(model, step_fixed_ids=EOS_ID + 1)
    full = quantize_int8(model)
    assert compact.compact_token_ids is not None and full.compact_token_ids is None
    decode = DecodeConfig(beam_size=beam_size, alpha=0.6, max_len_a=1.0, max_len_b=10)
    a = translate_nbest(compact, vocab, lines, decode)
    b = translate_nbest(full, vocab, lines, decode)
    assert len({len(r[0].tokens) for r in a}) > 3  # real, varied outputs
    assert [r[0].tokens for r in a] == [r[0].tokens for r in b]
    for x, y in zip(a, b):
        assert x[0].score == pytest.approx(y[0].score, abs=1e-4)
    # an ensemble of two compact copies decodes compact; beside a full copy it falls back
    pair = translate_nbest([compact, compact], vocab, lines, decode)
    mixed = translate_nbest([compact, full], vocab, lines, decode)
    assert [r[0].tokens for r in pair] == [r[0].tokens for r in a]
    assert [r[0].tokens for r in mixed] == [r[0].tokens for r in a]


def test_an_ensemble_step_refuses_members_scoring_different_columns():
    class Step(StepFunction):
        start_id = 1

        def __init__(self, ids):
            self.token_ids = ids

    assert same_columns(None, None) and not same_columns(torch.arange(5), None)
    EnsembleStep([Step(torch.arange(5)), Step(torch.arange(5))])
    with pytest.raises(ValueError, match="different token columns"):
        EnsembleStep([Step(torch.arange(5)), Step(None)])
