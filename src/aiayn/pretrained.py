"""Loading what :meth:`aiayn.Translator.from_pretrained` takes: a checkpoint, a run directory
(by :func:`aiayn.rundir.model_paths`, the one rule for which model a folder is), a list of
them (an ensemble) or a Hugging Face Marian directory. Below training, so that
``aiayn train --init-from`` loads a model the way the Translator does without importing it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aiayn.config import Config
from aiayn.errors import UserError
from aiayn.rundir import CHECKPOINTS, CONFIG, TOKENIZER, WEIGHTS, NoModelError, model_paths

__all__ = ["Pretrained", "load_pretrained"]


def _is_marian(path: Path) -> bool:
    if not (path / CONFIG).is_file() or (path / TOKENIZER).is_file():
        return False
    try:
        return json.loads((path / CONFIG).read_text("utf-8")).get("model_type") == "marian"
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def _resolve(path: Path, say: Callable[[str], None]) -> tuple[list[Path | str], dict]:
    """What ``path`` decodes as: (checkpoint folders, or ``"marian:DIR"``; the generation
    record or {}); a run directory by :func:`aiayn.rundir.model_paths`, the one rule.

    Raises:
        UserError: nothing loadable there.
    """
    if not path.exists():
        raise UserError(f"{path}: no such file or directory (expected a checkpoint, a run "
                        "directory or a Hugging Face Marian directory)")
    if path.is_dir() and _is_marian(path):
        return [f"marian:{path}"], {}
    try:
        return model_paths(path, say)
    except NoModelError:
        raise UserError(
            f"{path}: not a checkpoint, a run directory or a Hugging Face Marian directory "
            f"(expected {WEIGHTS}, {CONFIG} and {TOKENIZER}, or a run's {CHECKPOINTS}/ "
            f"folder, or a Marian {CONFIG} with source.spm)") from None


@dataclasses.dataclass
class Pretrained:
    """What :func:`load_pretrained` found: the models (eval mode, on the device), the first
    one's config, the shared vocabulary, where each came from, and the run's generation record
    ({} without one)."""

    models: list
    config: Config
    vocab: Any
    sources: list[str]
    record: dict


def load_pretrained(path: str | Path | Sequence[str | Path], device: torch.device,
                    warn: Callable[[str], None]) -> Pretrained:
    """Load what :meth:`Translator.from_pretrained` takes (see the module's docstring) onto
    ``device``; ``warn`` receives what loading has to say. Also the loader of
    ``aiayn train --init-from``.

    Raises:
        UserError: a path that is none of these (naming it and what was expected); ensemble
            members with different vocabularies or kinds of text (naming them); weights that
            do not fit their config.
    """
    from aiayn.checkpoint import load_checkpoint

    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        raise UserError("no model path given")
    found: list[Path | str] = []
    record: dict = {}
    for p in paths:
        members, rec = _resolve(Path(p), warn)
        found += members
        record = record or rec
    loaded = []
    for f in found:
        if isinstance(f, str) and f.startswith("marian:"):
            from aiayn.interop.marian import import_hf

            model, config, vocab = import_hf(f.removeprefix("marian:"))
            loaded.append((model.to(device), config, vocab))
        else:
            loaded.append(load_checkpoint(f, device=device))
    _, config, vocab = loaded[0]
    for f, (_, other, other_vocab) in zip(found[1:], loaded[1:]):
        if other_vocab.fingerprint != vocab.fingerprint:
            raise UserError(f"{f}: its vocabulary differs from {found[0]}'s; an ensemble "
                            "needs models trained on one vocabulary")
        if other.data.preprocess != config.data.preprocess:
            raise UserError(f"{f}: it reads data.preprocess = {other.data.preprocess!r} "
                            f"text, {found[0]} {config.data.preprocess!r}; an ensemble "
                            "needs one kind of text")
    return Pretrained([m for m, _, _ in loaded], config, vocab,
                      [str(f).removeprefix("marian:") for f in found], record)
