"""Damage done to checkpoints on purpose, shared by the tests that must catch it."""

from __future__ import annotations

import json
from pathlib import Path


def swap_two_tokens(ckpt: Path) -> None:
    """Make ``ckpt/tokenizer.json`` trade the ids of its two last tokens: the same size, so only
    the vocabulary's fingerprint can tell it from the one the model was trained with."""
    tok_file = ckpt / "tokenizer.json"
    tok = json.loads(tok_file.read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_file.write_text(json.dumps(tok), encoding="utf-8")
