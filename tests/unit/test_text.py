"""model_text: the text a checkpoint reads, in the language of the side it is asked for."""

from __future__ import annotations

import pytest

from aiayn.config import DataConfig
from aiayn.data.text import is_protocol_text, model_text

LINE = "It's the man's dog, isn't it? L'homme & co."


def test_model_text_tokenizes_with_the_sides_language() -> None:
    data = DataConfig(preprocess="lc-norm-tok", src_lang="en", tgt_lang="fr")
    # Moses splits English clitics before the apostrophe and French ones after it
    assert model_text([LINE], data, "src") == [
        "it &apos;s the man &apos;s dog , isn &apos;t it ? l &apos;homme &amp; co ."]
    assert model_text([LINE], data, "tgt") == [
        "it&apos; s the man&apos; s dog , isn&apos; t it ? l&apos; homme &amp; co ."]
    assert model_text([LINE], data) == model_text([LINE], data, "src")


def test_model_text_leaves_cased_text_alone() -> None:
    data = DataConfig(preprocess="none")
    lines = [LINE, ""]
    out = model_text(lines, data, "tgt")
    assert out == lines and out is not lines


def test_model_text_names_a_bad_side() -> None:
    with pytest.raises(ValueError, match="'source'"):
        model_text([LINE], DataConfig(), "source")


def test_only_the_literature_text_is_scored_as_it_is() -> None:
    assert is_protocol_text("lc-norm-tok") and not is_protocol_text("none")


def test_model_text_warns_of_input_tokenized_already() -> None:
    """Text that holds Moses escapes was tokenized already: a lc-norm-tok model tokenizes it
    again (``&apos;`` becomes ``&amp; apos ;``), so the callers that pass ``warn`` hear of it,
    with the first such line; raw text, and a model that reads cased text, raise nothing."""
    data = DataConfig(preprocess="lc-norm-tok", src_lang="en", tgt_lang="fr")
    tokenized = model_text([LINE], data)[0]
    heard: list[str] = []
    again = model_text([LINE, tokenized, "a dog ."], data, warn=heard.append)
    assert "&amp; apos ;" in again[1]  # what the warning is about
    assert len(heard) == 1 and "1 of 3 input lines (line 2 first)" in heard[0]
    model_text([LINE, "a dog & a cat ."], data, warn=heard.append)
    model_text([tokenized], DataConfig(preprocess="none"), warn=heard.append)
    assert len(heard) == 1
