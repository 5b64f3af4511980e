"""Model checkpoints: a directory with everything needed to translate.

::

    CKPT/model.safetensors    weights (safetensors; tied matrices stored once)
    CKPT/config.json          the full resolved Config of the run
    CKPT/tokenizer.json       the shared subword vocabulary
    CKPT/meta.json            step, time, metrics, the vocabulary's fingerprint
    CKPT/training_state.pt    optimizer, schedule, RNGs, data position (training checkpoints only;
                              tensors and plain containers, loaded with weights_only=True)

A checkpoint is written into ``CKPT.tmp-*`` and renamed into place, so a killed write never
leaves a partial directory under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model as _st_load_model
from safetensors.torch import save_model as _st_save_model

from aiayn.config import Config
from aiayn.data.vocab import Vocabulary
from aiayn.errors import UserError
from aiayn.model import Transformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
META = "meta.json"
STATE = "training_state.pt"


def write_json_atomic(path: Path, data: Any) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


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
        _st_save_model(model, str(tmp / WEIGHTS))
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
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def is_checkpoint(path: Path) -> bool:
    return all((path / f).is_file() for f in (WEIGHTS, CONFIG, "tokenizer.json"))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (then its ``averaged``, else ``best``, else
    newest checkpoint), or a ``model.safetensors`` file inside a checkpoint.

    Raises:
        FileNotFoundError: nothing usable there (the message says what was looked for).
    """
    path = Path(path)
    if path.is_file() and path.name == WEIGHTS:
        path = path.parent
    if path.is_dir() and is_checkpoint(path):
        return path
    if path.is_dir():
        for name in ("averaged", "best"):
            if is_checkpoint(path / name):
                return path / name
        found = list_checkpoints(path)
        if found:
            return found[-1]
    raise FileNotFoundError(
        f"no checkpoint at {path}: expected a directory with {WEIGHTS}, {CONFIG} and "
        "tokenizer.json, or a run directory holding checkpoints/")


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete step checkpoints of a run, oldest first (``checkpoints/step-000123``)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith("step-") and is_checkpoint(p)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Transformer, Config, Vocabulary]:
    """Load model (in eval mode), config and vocabulary from a checkpoint or run directory.

    Raises:
        FileNotFoundError: see :func:`resolve_checkpoint`.
        UserError: the vocabulary is not the one the model was trained with (size, or the
            fingerprint in ``meta.json``), or the weights do not fit the config.
    """
    path = resolve_checkpoint(path)
    config = Config.from_dict(json.loads((path / CONFIG).read_text(encoding="utf-8")),
                              source=str(path / CONFIG))
    vocab = Vocabulary.load(path)
    vocab.check_matches(config.model.vocab_size, read_meta(path).get("vocab_fingerprint"),
                        where=str(path))
    model = Transformer(config.model)
    try:
        missing, unexpected = _st_load_model(model, str(path / WEIGHTS), strict=False)
    except Exception as err:
        raise UserError(f"{path / WEIGHTS}: weights do not fit {path / CONFIG} ({err})") from None
    missing = [k for k in missing if not k.startswith("tgt_embed") or not
               config.model.share_embeddings]
    if missing or unexpected:
        raise UserError(f"{path / WEIGHTS}: weights do not fit the config (missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(device).eval(), config, vocab


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
    """The training state of a checkpoint, loaded with ``weights_only=True`` (no pickle code)."""
    return torch.load(Path(path) / STATE, map_location="cpu", weights_only=True)
