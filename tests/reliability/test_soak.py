"""``bench/soak_serve.py`` run for half a minute, so that the soak script cannot rot: a real
``aiayn serve`` process under a steady loopback load, its RSS watched, then SIGTERM with long
requests in flight. The script's figures go to ``test-artifacts/soak_serve_short.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a live server under load for 30 s

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "soak_serve.py"


def test_short_soak_passes():
    pytest.importorskip("httpx")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: serving.py
    from serving import artifacts_dir

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--minutes", "0.3", "--warmup-s", "5", "--clients", "3",
         "--inflight", "6", "--json"],
        check=False, capture_output=True, text=True, timeout=150, env=env)
    (artifacts_dir() / "soak_serve_short.json").write_text(proc.stdout)
    assert proc.returncode == 0, f"the soak failed:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout)
    assert report["passed"] and not report["failures"]
    soak = report["load"]["soak"]
    assert soak["requests"] > 0 and soak["dropped"] == 0
    assert set(soak["statuses"]) <= {"200", "429"}
    assert set(soak["by_path"]) == {"/translate", "/attention"}  # both endpoints were loaded
    assert report["load"]["rss_mib"]["growth_max"] <= report["max_rss_growth_mib"]
    sigterm = report["sigterm"]
    assert sigterm["in_flight_at_signal"] >= 1
    assert sigterm["statuses_of_in_flight"] == {"200": sigterm["in_flight_at_signal"]}
    assert sigterm["exit_code"] == 0
