#!/usr/bin/env bash
# Set everything up and run the test suite (the README's second Quickstart command). Extra
# arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast lane.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export AIAYN_DATA_DIR="${AIAYN_DATA_DIR:-$(cd .. && pwd)/shared/data}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tiny test models: one thread is fastest
.venv/bin/python -m pytest -q tests "$@"
