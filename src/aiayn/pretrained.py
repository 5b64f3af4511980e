"""The one loader of "the model at this path" (after fairseq's
``checkpoint_utils.load_model_ensemble``): a checkpoint, a run directory (by
:func:`aiayn.rundir.model_paths`, the one rule for which model a folder is), a list of them (an
ensemble) or a Hugging Face Marian directory. :meth:`aiayn.Translator.from_pretrained` (and
through it ``aiayn translate``, ``evaluate``, ``serve`` and the pipeline), ``aiayn convert``,
``aiayn parse eval`` and ``aiayn train --init-from`` all load through :func:`load_pretrained`.
It sits below training, so that ``--init-from`` loads a model the way the Translator does
without importing it.

What a run chose on the validation set travels with its model: the loaded config's ``decode``
is the run's generation record's (:data:`aiayn.rundir.GENERATION_CONFIG`: beam size, alpha,
lengths), for the run directory and for any checkpoint the run keeps (``RUN/best``,
``RUN/checkpoints/step-N``: :meth:`aiayn.rundir.RunDir.of` says whose run it is), and
:attr:`Pretrained.precision` is the precision the run recorded for the model it chose.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aiayn.config import Config
from aiayn.errors import UserError
from aiayn.rundir import (CHECKPOINTS, CONFIG, TOKENIZER, WEIGHTS, NoModelError, RunDir,
                          model_paths)

__all__ = ["Pretrained", "load_pretrained"]


def _is_marian(path: Path) -> bool:
    if not (path / CONFIG).is_file() or (path / TOKENIZER).is_file():
        return False
    try:
        return json.loads((path / CONFIG).read_text("utf-8")).get("model_type") == "marian"
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def _resolve(path: Path, say: Callable[[str], None]
             ) -> tuple[list[Path | str], dict, bool]:
    """What ``path`` decodes as: (checkpoint folders, or ``"marian:DIR"``; the generation
    record that applies to it, or {}; whether that record's model is exactly these folders).

    The record is the run's (:func:`aiayn.rundir.model_paths`) for a run directory, and for a
    checkpoint the run's whose checkpoint it is (:meth:`RunDir.of`): its search settings were
    chosen for the run on the validation set.

    Raises:
        UserError: nothing loadable there; a bad generation record.
    """
    if not path.exists():
        raise UserError(f"{path}: no such file or directory (expected a checkpoint, a run "
                        "directory or a Hugging Face Marian directory)")
    if path.is_dir() and _is_marian(path):
        return [f"marian:{path}"], {}, False
    try:
        members, record = model_paths(path, say)
    except NoModelError:
        raise UserError(
            f"{path}: not a checkpoint, a run directory or a Hugging Face Marian directory "
            f"(expected {WEIGHTS}, {CONFIG} and {TOKENIZER}, or a run's {CHECKPOINTS}/ "
            f"folder, or a Marian {CONFIG} with source.spm)") from None
    if record:
        return list(members), record, True
    run = RunDir.of(path)
    record = (run.read_generation() if run is not None else None) or {}
    if not record:
        return list(members), {}, False
    chosen = {(run.path / m).resolve() for m in record["members"]}
    return list(members), record, {Path(m).resolve() for m in members} == chosen


@dataclasses.dataclass
class Pretrained:
    """What :func:`load_pretrained` found.

    Attributes:
        models: the models (eval mode, on the device); several: an ensemble.
        config: the first one's config; its ``decode`` is the run's choice on val where a
            generation record applies (see the module's docstring), else the checkpoint's.
        vocab: the shared vocabulary.
        sources: where each model came from (checkpoint folders, Marian directories).
        record: the run's generation record ({} without one).
        precision: the decoding precision by default on this device
            (:func:`aiayn.precision.default_decoding_precision`): what the run recorded for the
            model it chose (int8 where it kept val BLEU within 0.2 of fp32), else fp32; a
            checkpoint of the run other than the chosen one was not checked: fp32.
    """

    models: list
    config: Config
    vocab: Any
    sources: list[str]
    record: dict
    precision: str = "fp32"


def load_pretrained(path: str | Path | Sequence[str | Path], device: torch.device | str,
                    warn: Callable[[str], None]) -> Pretrained:
    """Load what the module's docstring lists onto ``device``; ``warn`` receives what loading
    has to say (a run whose training has not finished loads its newest checkpoint).

    Args:
        path: one path, or several (an ensemble: their next-token probabilities averaged;
            the first one's config and record give the defaults).

    Raises:
        UserError: a path that is none of these (naming it and what was expected); ensemble
            members with different vocabularies, kinds of text, output layers or start tokens
            (naming them); weights that do not fit their config; a bad generation record.
    """
    from aiayn.checkpoint import load_checkpoint
    from aiayn.decoding import check_ensemble
    from aiayn.precision import default_decoding_precision

    device = torch.device(device)
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        raise UserError("no model path given")
    found: list[Path | str] = []
    record: dict = {}
    recorded_precision = None
    for p in paths:
        members, rec, whole = _resolve(Path(p), warn)
        found += members
        if rec and not record:
            record = rec
            recorded_precision = rec.get("precision") if whole else None
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
    models = [m for m, _, _ in loaded]
    try:
        check_ensemble(models)
    except ValueError as err:
        raise UserError(f"{', '.join(map(str, paths))}: {err}") from None
    if record:  # the run's search settings, chosen on val, travel with its model
        config = config.replace(decode=record["decode"])
    return Pretrained(models, config, vocab, [str(f).removeprefix("marian:") for f in found],
                      record, default_decoding_precision(recorded_precision, device))
