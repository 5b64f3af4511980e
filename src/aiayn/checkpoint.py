"""Model checkpoints: a folder with everything needed to translate (its files are named in
:mod:`aiayn.rundir`: weights, config, vocabulary, meta and, for step checkpoints, the training
state, loaded with ``weights_only=True``).

A checkpoint is written into ``.CKPT.tmp-*`` and renamed into place, so a killed write never
leaves a partial directory under the final name. Replacing an existing checkpoint (``best/``,
a re-saved step) renames the finished copy to ``.CKPT.new-*`` first, then the old one to
``.CKPT.old-*``, then the new one into place: a kill between the renames leaves a complete
checkpoint under a hidden name, and :func:`recover_run_dir` (run when training starts) puts it
back. Pruning renames ``step-N`` to ``.step-N.del-*`` before deleting it, so a kill during a
prune never leaves a half-deleted ``step-N``. The vocabulary's fingerprint is also stored in
the safetensors header, so it travels with the weights even without ``meta.json``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_model as _st_load_model
from safetensors.torch import save_model as _st_save_model

from aiayn.config import Config, read_json_object
from aiayn.data.vocab import Vocabulary
from aiayn.errors import UserError
from aiayn.fileio import fsync_dir, write_json_atomic
from aiayn.model import Transformer
from aiayn.rundir import (CONFIG, META, TOKENIZER, WEIGHTS, RunDir, is_checkpoint,
                          list_checkpoints, step_number)
from aiayn.rundir import TRAINING_STATE as STATE

__all__ = ["save_checkpoint", "load_checkpoint", "load_weights", "is_checkpoint",
           "list_checkpoints",
           "prune_checkpoints", "recover_run_dir", "read_meta", "load_training_state",
           "weights_fingerprint", "write_json_atomic"]


def save_checkpoint(
    path: str | Path,
    model: Transformer,
    config: Config,
    vocab: Vocabulary,
    meta: dict[str, Any] | None = None,
    training_state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory atomically (a temp dir, fsync, rename over any old one).

    ``meta.json`` gets ``meta`` plus ``vocab_fingerprint`` (:attr:`Vocabulary.fingerprint`), so
    that loading can tell a swapped ``tokenizer.json`` of the same size.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        try:
            _st_save_model(model, str(tmp / WEIGHTS),
                           metadata={"vocab_fingerprint": vocab.fingerprint})
        except Exception as err:  # safetensors' own error type, e.g. a full disk
            raise OSError(f"{path}: writing the weights failed ({err})") from None
        (tmp / CONFIG).write_text(config.to_json(), encoding="utf-8")
        vocab.save(tmp)
        meta = {**(meta or {}), "vocab_fingerprint": vocab.fingerprint}
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
        if training_state is not None:
            torch.save(training_state, tmp / STATE)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if path.exists():
            new = path.with_name(f".{path.name}.new-{os.getpid()}")
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(tmp, new)  # complete: recover_run_dir may use it from here on
            tmp = new
            os.replace(path, old)
            os.replace(new, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if tmp.exists() and tmp != path:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


_HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|new|old|del)-[^.]+$")


def recover_run_dir(run_dir: str | Path) -> list[str]:
    """Undo what kills can leave in a run directory (call before training starts).

    A checkpoint (``best``, ``averaged``, ``ema``, ``step-N``) missing under its name but
    complete under ``.NAME.new-*`` (preferred) or ``.NAME.old-*`` is renamed back. Then unfinished writes
    (``.NAME.tmp-*``), leftovers of swaps and prunes, and ``checkpoints/step-N`` folders that
    are not complete training checkpoints are deleted: all of them are names this module
    creates. Returns what was done, one line each.
    """
    done: list[str] = []
    run_dir = Path(run_dir)
    ckpts = RunDir(run_dir).checkpoints
    for folder in (run_dir, ckpts):
        if not folder.is_dir():
            continue
        hidden = sorted(p for p in folder.iterdir() if _HIDDEN.match(p.name))
        for kind in ("new", "old"):
            for p in hidden:
                m = _HIDDEN.match(p.name)
                target = folder / m["name"]
                if m["kind"] == kind and p.exists() and not target.exists() \
                        and is_checkpoint(p):
                    os.replace(p, target)
                    done.append(f"restored {target} from {p.name}")
        for p in hidden:
            if p.exists():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
                done.append(f"removed {p}")
    if ckpts.is_dir():
        for p in ckpts.iterdir():
            if step_number(p) is not None and not (is_checkpoint(p) and (p / STATE).is_file()):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
                done.append(f"removed the incomplete {p}")
    if done:
        fsync_dir(run_dir)
    return done


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` step checkpoints; each is first renamed to
    ``.step-N.del-PID`` so that no half-deleted ``step-N`` can be seen. Returns the pruned."""
    pruned = list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []
    for old in pruned:
        doomed = old.with_name(f".{old.name}.del-{os.getpid()}")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return pruned


def weights_fingerprint(path: str | Path) -> str | None:
    """The vocabulary fingerprint stored in a ``model.safetensors`` header (None if absent).

    Raises:
        UserError: the file is not a readable safetensors file (truncated, corrupt).
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("vocab_fingerprint")
    except Exception as err:  # safetensors raises its own error type
        raise UserError(f"{path}: not a readable safetensors file ({err})") from None


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Transformer, Config, Vocabulary]:
    """Load model (in eval mode), config and vocabulary from a checkpoint folder (for a run
    directory, :func:`aiayn.rundir.model_paths` says which folders are its model).

    Raises:
        UserError: ``path`` is not a checkpoint folder; the vocabulary is not the one the
            model was trained with (size, or the fingerprint in ``meta.json``), or the
            weights do not fit the config.
    """
    path = Path(path)
    if not is_checkpoint(path):
        raise UserError(f"{path}: not a checkpoint folder (expected {WEIGHTS}, {CONFIG} and "
                        f"{TOKENIZER}); a run directory's model: aiayn.rundir.model_paths")

    config = Config.from_dict(read_json_object(path / CONFIG), source=str(path / CONFIG))
    vocab = Vocabulary.load(path)
    fingerprint = weights_fingerprint(path / WEIGHTS) or read_meta(path).get("vocab_fingerprint")
    vocab.check_matches(config.model.vocab_size, fingerprint, where=str(path))
    model = Transformer(config.model)
    load_weights(model, path)
    return model.to(device).eval(), config, vocab


def load_weights(model: Transformer, path: str | Path, device: str | torch.device = "cpu"
                 ) -> None:
    """Load the checkpoint ``path``'s weights into ``model`` (loading and resuming both do),
    checking that they fit: every parameter and buffer present (a tied target embedding is
    stored once), none unknown, every shape the model's.

    Raises:
        UserError: the weights do not fit ``model`` (naming the file and what is missing,
            unexpected or of another shape), or the file is not a readable safetensors file.
    """
    file = Path(path) / WEIGHTS
    try:
        missing, unexpected = _st_load_model(model, str(file), strict=False,
                                             device=str(device))
    except Exception as err:  # a shape mismatch (RuntimeError), a corrupt file
        raise UserError(f"{file}: weights do not fit the model's config ({err})") from None
    missing = [k for k in missing if not k.startswith("tgt_embed") or not
               model.config.share_embeddings]
    if missing or unexpected:
        raise UserError(f"{file}: weights do not fit the config (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json`` ({} when absent, as in checkpoints of older versions).

    Raises:
        UserError: the file is not a JSON object.
    """
    file = Path(path) / META
    if not file.is_file():
        return {}
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise UserError(f"{file}: expected a JSON object, found {type(meta).__name__}")
    return meta


def load_training_state(path: str | Path) -> dict[str, Any]:
    """The training state of a checkpoint, loaded with ``weights_only=True`` (no pickle code).

    Raises:
        UserError: the file is missing or unreadable (the message names it).
    """
    file = Path(path) / STATE
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, pickle errors, EOFError...
        raise UserError(f"{file}: cannot load the training state ({err})") from None
