#!/usr/bin/env bash
# Set everything up and run the test suite (the README's second Quickstart command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export AIAYN_DATA_DIR="${AIAYN_DATA_DIR:-$(cd .. && pwd)/shared/data}"
.venv/bin/python -m pytest -q tests
