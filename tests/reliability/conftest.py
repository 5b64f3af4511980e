"""Fixtures of the reliability tests (helpers live in rel_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rel_helpers import quiet, small_config


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A finished 6-step run (checkpoints at steps 2, 4, 6, a best/ and an averaged/).
    Read-only for tests: copy it (:func:`copy_run`) before changing anything."""
    from aiayn.training.average import average_checkpoints
    from aiayn.checkpoint import list_checkpoints
    from aiayn.training.run import run_training

    root = tmp_path_factory.mktemp("trained")
    cfg = small_config(root / "data")
    run_dir = root / "run"
    run_training(cfg, run_dir, progress=False, log=quiet, device="cpu")
    average_checkpoints(list_checkpoints(run_dir), run_dir / "averaged")
    return run_dir


