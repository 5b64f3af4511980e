"""Shared fixtures. Real data comes from $AIAYN_DATA_DIR (CI points it at ../shared/data)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tiny test models run faster (and reproducibly) on one thread than on two.
torch.set_num_threads(1)


def _slow_files_first(items: list[pytest.Item]) -> None:
    """Orders ``items`` file by file: files with more tests marked ``slow`` (processes of their
    own, whole pipelines: 10-90 s each) first, the others after them, each file's tests in
    their own order. scripts/test.sh hands whole files to pytest-xdist's workers in this order
    (``--dist loadfile --no-loadscope-reorder``), so the long files start while many short
    ones are left to even out the workers' ends; xdist's own order (most tests first) handed
    out the long files, which hold few tests, last, and a worker ran the last of them alone."""
    slow: dict[str, int] = {}
    first: dict[str, int] = {}
    for n, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        first.setdefault(path, n)
        slow[path] = slow.get(path, 0) + ("slow" in item.keywords)

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return -slow[path], first[path]

    items.sort(key=key)  # stable: a file's tests keep their order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``whole_machine`` time the machine (a probe of every core), so they must
    not share it: pytest-xdist's workers skip them, and scripts/test.sh runs them alone after
    the parallel phase with AIAYN_WHOLE_MACHINE_ONLY=1, which selects only them. Under
    pytest-xdist, files with slow tests come first (:func:`_slow_files_first`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _slow_files_first(items)
    if os.environ.get("AIAYN_WHOLE_MACHINE_ONLY"):
        others = [item for item in items if "whole_machine" not in item.keywords]
        if others:
            config.hook.pytest_deselected(items=others)
            items[:] = [item for item in items if "whole_machine" in item.keywords]
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        skip = pytest.mark.skip(reason="times the machine: scripts/test.sh runs it alone after "
                                       "the parallel phase")
        for item in items:
            if "whole_machine" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Training prepares raw files into $AIAYN_CACHE_DIR/prepared (aiayn.data.prepared): in
    tests, a folder of the session rather than the user's ~/.cache."""
    if not os.environ.get("AIAYN_CACHE_DIR"):
        os.environ["AIAYN_CACHE_DIR"] = str(tmp_path_factory.mktemp("aiayn-cache"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared data folder; tests that need it skip, saying why, when it is not set."""
    value = os.environ.get("AIAYN_DATA_DIR")
    if not value:
        pytest.skip("AIAYN_DATA_DIR is not set: real-corpus tests need ../shared/data")
    path = Path(value)
    if not (path / "multi30k").is_dir():
        pytest.skip(f"AIAYN_DATA_DIR={value} holds no multi30k/ folder")
    return path
