"""The run directory: every file and folder name a run holds, and the one rule for "which model
is this folder" (:func:`model_paths`). Nothing else in ``src/`` spells these names.

A checkpoint folder (:func:`is_checkpoint`)::

    CKPT/model.safetensors    weights (safetensors; tied matrices stored once)     WEIGHTS
    CKPT/config.json          the full resolved Config of the run                  CONFIG
    CKPT/tokenizer.json       the shared subword vocabulary                        TOKENIZER
    CKPT/meta.json            step, time, metrics, the vocabulary's fingerprint    META
    CKPT/training_state.pt    optimizer, schedule, RNGs, data position             TRAINING_STATE
                              (step checkpoints only)

A run directory ``RUN`` (:class:`RunDir`) of ``aiayn train``::

    RUN/config.json            every value that shaped the run
    RUN/tokenizer.json         the shared vocabulary
    RUN/metrics.jsonl          one JSON object per log line (train and valid)    METRICS
    RUN/tb/                    TensorBoard event files                           TENSORBOARD
    RUN/checkpoints/step-N     the last ``keep_last`` step checkpoints           CHECKPOINTS
    RUN/best/                  the best on validation so far                     BEST
    RUN/ema/                   the moving average of the weights (ema_decay > 0) EMA
    RUN/train_summary.json     written when training ends                        TRAIN_SUMMARY
    RUN/data.json              the prepared training data's fingerprint          DATA_RECORD

``aiayn average`` and the pipeline add::

    RUN/averaged/              the last K step checkpoints averaged (§6.1)       AVERAGED
    RUN/generation_config.json what decodes as the run's model (chosen on val)   GENERATION_CONFIG
    RUN/shape.json             the shape --ensemble auto chose (aiayn.budget)    SHAPE
    RUN/results.json           the pipeline's results                            RESULTS
    RUN/test.hyp.LANG          its test-set output (:meth:`RunDir.test_output`)
    RUN/curves.png             the training curves                               CURVES

An ensemble's run directory holds ``RUN/ensemble.json`` (``{"members": N}``, ENSEMBLE), the
shared ``config.json`` and ``tokenizer.json``, and each member's own run directory
``RUN/member-K/`` with its log ``RUN/member-K.log`` (:meth:`RunDir.members`).

This module sits at the bottom of the package: it imports :mod:`aiayn.config`,
:mod:`aiayn.errors` and :mod:`aiayn.fileio` only.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiayn.config import DECODE_PRECISIONS, DecodeConfig, read_json_object
from aiayn.errors import UserError
from aiayn.fileio import write_json_atomic

__all__ = ["WEIGHTS", "CONFIG", "TOKENIZER", "META", "TRAINING_STATE", "CHECKPOINTS", "AVERAGED",
           "BEST", "EMA", "TRAIN_SUMMARY", "DATA_RECORD", "SHAPE", "METRICS", "TENSORBOARD", "GENERATION_CONFIG",
           "GENERATION_FORMAT", "RESULTS", "CURVES", "ENSEMBLE", "NoModelError", "RunDir",
           "is_checkpoint",
           "list_checkpoints", "model_paths", "read_generation_config",
           "write_generation_config"]

# --- a checkpoint folder ---------------------------------------------------------------------
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
META = "meta.json"
TRAINING_STATE = "training_state.pt"

# --- a run directory ---------------------------------------------------------------------------
CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step-"
AVERAGED = "averaged"
BEST = "best"
EMA = "ema"
TRAIN_SUMMARY = "train_summary.json"
DATA_RECORD = "data.json"  # the fingerprint of the prepared data a run trains on
SHAPE = "shape.json"  # the shape --ensemble auto chose, and the probe's figures
METRICS = "metrics.jsonl"
TENSORBOARD = "tb"
GENERATION_CONFIG = "generation_config.json"
"""The file in a run directory that makes it a model: which checkpoints decode together and
with which search settings, as chosen on the validation set (after Hugging Face's
``generation_config.json``)."""
GENERATION_FORMAT = "aiayn-generation/1"
RESULTS = "results.json"
CURVES = "curves.png"
ENSEMBLE = "ensemble.json"
MEMBER_PREFIX = "member-"

class NoModelError(UserError):
    """A path that holds no model by :func:`model_paths`' rule."""


_STEP = re.compile(rf"{re.escape(STEP_PREFIX)}(\d+)")
_DECODE_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeConfig))


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete checkpoint folder (weights, config, vocabulary)."""
    path = Path(path)
    return all((path / f).is_file() for f in (WEIGHTS, CONFIG, TOKENIZER))


def step_number(path: str | Path) -> int | None:
    """N of a ``step-N`` folder name, None for any other name."""
    m = _STEP.fullmatch(Path(path).name)
    return int(m[1]) if m else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete step checkpoints of a run, oldest first (``checkpoints/step-000123``)."""
    return RunDir(run_dir).steps()


class RunDir:
    """The folder of one run (or of an ensemble): where each of its files is.

    Args:
        path: the run directory (need not exist yet).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @classmethod
    def of(cls, path: str | Path) -> RunDir | None:
        """Whose run ``path`` is, the one rule for it: a run directory is its own run; a
        checkpoint a run keeps (``RUN/best``, ``RUN/ema``, ``RUN/averaged``,
        ``RUN/checkpoints/step-N``), or a file in one (``model.safetensors``), or a file of the
        run itself, is that run's. None for anything else (a checkpoint on its own, a
        converted model). An ensemble member's checkpoint is the member's run
        (``RUN/member-K``), whose own run directory it is.

        Raises:
            UserError: ``path`` does not exist.
        """
        path = Path(path)
        if not path.exists():
            raise UserError(f"{path}: no such file or directory")
        if path.is_file():
            path = path.parent
        if cls(path).is_run:
            return cls(path)
        if path.name in (AVERAGED, BEST, EMA) and cls(path.parent).is_run:
            return cls(path.parent)
        if step_number(path) is not None and path.parent.name == CHECKPOINTS \
                and cls(path.parent.parent).is_run:
            return cls(path.parent.parent)
        return None

    @property
    def is_run(self) -> bool:
        """This folder is a run directory: not a checkpoint, and holding what only a run does
        (``checkpoints/``, ``train_summary.json``, a generation or an ensemble record)."""
        return self.path.is_dir() and not is_checkpoint(self.path) and any(
            p.exists() for p in (self.checkpoints, self.train_summary, self.generation_config,
                                 self.ensemble_file))

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    # --- files and folders -------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def tokenizer(self) -> Path:
        return self.path / TOKENIZER

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def averaged(self) -> Path:
        return self.path / AVERAGED

    @property
    def best(self) -> Path:
        return self.path / BEST

    @property
    def ema(self) -> Path:
        return self.path / EMA

    @property
    def train_summary(self) -> Path:
        return self.path / TRAIN_SUMMARY

    @property
    def shape(self) -> Path:
        return self.path / SHAPE

    @property
    def data_record(self) -> Path:
        return self.path / DATA_RECORD

    @property
    def generation_config(self) -> Path:
        return self.path / GENERATION_CONFIG

    @property
    def results(self) -> Path:
        return self.path / RESULTS

    @property
    def curves(self) -> Path:
        return self.path / CURVES

    @property
    def ensemble_file(self) -> Path:
        return self.path / ENSEMBLE

    def test_output(self, lang: str) -> Path:
        """The pipeline's test-set translations, ``RUN/test.hyp.LANG``."""
        return self.path / f"test.hyp.{lang}"

    def step(self, n: int) -> Path:
        """The step checkpoint of update ``n``: ``RUN/checkpoints/step-0000000N``."""
        return self.checkpoints / f"{STEP_PREFIX}{n:08d}"

    def steps(self) -> list[Path]:
        """Complete step checkpoints, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = [p for p in self.checkpoints.iterdir()
                 if step_number(p) is not None and is_checkpoint(p)]
        return sorted(found, key=step_number)

    @property
    def finished(self) -> bool:
        """Training has ended (``train_summary.json`` written)."""
        return self.train_summary.is_file()

    # --- an ensemble -------------------------------------------------------------------------
    def member(self, k: int) -> RunDir:
        """Member ``k``'s own run directory, ``RUN/member-k`` (k from 1)."""
        return RunDir(self.path / f"{MEMBER_PREFIX}{k}")

    def member_log(self, k: int) -> Path:
        """What member ``k``'s ``aiayn train`` printed, ``RUN/member-k.log``."""
        return self.path / f"{MEMBER_PREFIX}{k}.log"

    def member_dirs(self, n: int) -> list[Path]:
        """``RUN/member-1`` … ``RUN/member-n``."""
        return [self.member(k).path for k in range(1, n + 1)]

    def members_found(self) -> int:
        """How many members the ensemble here has (``RUN/ensemble.json``); 0: not an
        ensemble's run directory.

        Raises:
            UserError: the file is not such a record.
        """
        path = self.ensemble_file
        if not path.is_file():
            return 0
        try:
            return int(json.loads(path.read_text(encoding="utf-8"))["members"])
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{path}: not an ensemble's record (want {{\"members\": N}})") \
                from None

    def write_members(self, n: int) -> None:
        """Record that this run directory holds an ensemble of ``n`` (atomically)."""
        write_json_atomic(self.ensemble_file, {"members": n})

    def runs(self) -> list[RunDir]:
        """The run directories that train: each member's, or this one alone."""
        n = self.members_found()
        return [self.member(k) for k in range(1, n + 1)] if n else [self]

    # --- the generation record ---------------------------------------------------------------
    def write_generation(self, members: Sequence[str | Path], decode: DecodeConfig,
                         **chosen: Any) -> Path:
        """Record what decodes as this run's model, atomically: see
        :func:`write_generation_config`."""
        return write_generation_config(self.path, members, decode, **chosen)

    def read_generation(self) -> dict[str, Any] | None:
        """This run's generation record, checked, or None: see
        :func:`read_generation_config`."""
        return read_generation_config(self.path)

    # --- which model ------------------------------------------------------------------------
    def model_paths(self, say: Callable[[str], None] | None = None
                    ) -> tuple[list[Path], dict[str, Any]]:
        """The checkpoint folders that decode as this run's model, and the generation record
        ({} without one). See :func:`model_paths` for the rule."""
        return model_paths(self.path, say)


def write_generation_config(run_dir: str | Path, members: Sequence[str | Path],
                            decode: DecodeConfig, **chosen: Any) -> Path:
    """Record in ``run_dir`` what decodes as its model (atomically).

    Args:
        members: checkpoint directories inside ``run_dir`` (or relative to it).
        decode: the search settings chosen (beam size, alpha, lengths, rules).
        chosen: more to record, e.g. ``precision`` (the decoding precision, "fp32" for output
            that does not depend on how sentences are batched), ``weights`` (the averaging
            width or "ema"), ``valid_bleu`` and its ``valid_protocol``.

    Returns:
        The file written, ``run_dir / GENERATION_CONFIG``.

    Raises:
        ValueError: a member outside ``run_dir``.
    """
    run_dir = Path(run_dir)
    names = []
    for m in members:
        m = Path(m)
        try:  # a path inside run_dir (as given, or relative to it)
            names.append(str((m if m.exists() else run_dir / m).resolve()
                             .relative_to(run_dir.resolve())))
        except ValueError:
            raise ValueError(f"{m} is not inside {run_dir}: a run directory's model is made "
                             "of its own checkpoints") from None
    data = {"format": GENERATION_FORMAT, "members": names, "decode": dataclasses.asdict(decode),
            **chosen}
    path = run_dir / GENERATION_CONFIG
    write_json_atomic(path, data)
    return path


def read_generation_config(run_dir: str | Path) -> dict[str, Any] | None:
    """``run_dir``'s :data:`GENERATION_CONFIG`, checked (None when there is none); its
    ``decode`` as a :class:`~aiayn.config.DecodeConfig`.

    Raises:
        UserError: the file is not such a record, or names a member that is not a checkpoint.
    """
    path = Path(run_dir) / GENERATION_CONFIG
    if not path.is_file():
        return None
    data = read_json_object(path)
    if data.get("format") != GENERATION_FORMAT:
        raise UserError(f"{path}: not an aiayn generation record (format "
                        f"{data.get('format')!r}, want {GENERATION_FORMAT!r})")
    members = data.get("members")
    if not isinstance(members, list) or not members or \
            not all(isinstance(m, str) for m in members):
        raise UserError(f"{path}: 'members' must be a non-empty list of checkpoint folders")
    for m in members:
        if not is_checkpoint(Path(run_dir) / m):
            raise UserError(f"{path}: member {m!r} is not a checkpoint in {run_dir}")
    decode = data.get("decode", {})
    unknown = sorted(set(decode) - set(_DECODE_FIELDS)) if isinstance(decode, dict) else None
    if unknown is None or unknown:
        raise UserError(f"{path}: 'decode' must be an object of {', '.join(_DECODE_FIELDS)}"
                        + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    try:
        data["decode"] = DecodeConfig(**decode)
    except (TypeError, ValueError) as err:
        raise UserError(f"{path}: {err}") from None
    if data.get("precision", "fp32") not in DECODE_PRECISIONS:
        raise UserError(f"{path}: precision {data['precision']!r} is not one of "
                        f"{', '.join(DECODE_PRECISIONS)}")
    return data


def model_paths(path: str | Path, say: Callable[[str], None] | None = None
                ) -> tuple[list[Path], dict[str, Any]]:
    """The one rule for which model a folder is: (its checkpoint folders, its generation
    record or {}). Every command that loads a model from a path goes through it.

    1. A checkpoint folder (or the ``model.safetensors`` file in one) is itself.
    2. A run directory with a :data:`GENERATION_CONFIG` is the members it records (the
       pipeline's choice on the validation set: averaged, ``ema``, an ensemble's members).
    3. Otherwise each run (the run directory, or each ensemble member's) is its ``averaged``,
       else ``best``, checkpoint once training has finished (``train_summary.json``); before
       that, its newest step checkpoint (``say`` is told), else ``averaged`` or ``best``.

    Args:
        say: receives what the caller should hear (a run whose training has not finished,
            an ensemble without a record); default: nothing.

    Raises:
        UserError: ``path`` does not exist; a bad generation or ensemble record.
        NoModelError: ``path`` holds no checkpoint by these rules (a UserError).
    """
    say = say or (lambda _msg: None)
    path = Path(path)
    if path.is_file() and path.name == WEIGHTS:
        path = path.parent
    if not path.exists():
        raise UserError(f"{path}: no such file or directory (expected a checkpoint or a run "
                        "directory)")
    if is_checkpoint(path):
        return [path], {}
    if not path.is_dir():
        raise NoModelError(f"{path}: not a checkpoint folder or a run directory")
    run = RunDir(path)
    record = run.read_generation()
    if record is not None:
        return [path / m for m in record["members"]], record
    n = run.members_found()
    found: list[Path] = []
    for each in run.runs():
        named = [p for p in (each.averaged, each.best) if is_checkpoint(p)]
        steps = each.steps()
        if each.finished and named:
            found.append(named[0])
        elif steps:
            found.append(steps[-1])
            say(f"{each.path}: " + ("training has not finished" if not each.finished else
                                    f"no {AVERAGED} or {BEST} checkpoint") +
                f"; loading its newest checkpoint, {steps[-1].name}")
        elif named:
            found.append(named[0])
        else:
            raise NoModelError(
                f"{path}: not a checkpoint or a run directory (expected {WEIGHTS}, {CONFIG} "
                f"and {TOKENIZER}, or a run's {CHECKPOINTS}/ folder)")
    if n:
        say(f"{path}: no {GENERATION_CONFIG} (the pipeline writes it when it has chosen on "
            f"the validation set); decoding its {n} members as found, with their config's "
            "search settings")
    return found, {}
