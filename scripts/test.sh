#!/usr/bin/env bash
# Set everything up and run the test suite (the README's second Quickstart command). Extra
# arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast lane.
# AIAYN_SETUP_DONE=1 skips the setup (.ci/run has just run it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${AIAYN_SETUP_DONE:-}" ]; then
  bash scripts/setup.sh
fi
export AIAYN_DATA_DIR="${AIAYN_DATA_DIR:-$(cd .. && pwd)/shared/data}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tiny test models: one thread is fastest
# one pytest worker a core (pytest-xdist), each test file kept in one worker so its module
# fixtures are built once, the files handed out in tests/conftest.py's order (files with slow
# tests first: --no-loadscope-reorder keeps it); AIAYN_TEST_WORKERS=0 runs in one process
workers="${AIAYN_TEST_WORKERS:-logical}"
# the numba kernels compiled once, before the workers start: in a fresh clone each worker (and
# each child it starts) would otherwise compile the ones it meets first, several at once, about
# 50 CPU-s each (docs/kernels.md#compiling-ahead); nothing to do where they are cached already,
# where numba is missing or AIAYN_NO_KERNELS=1
.venv/bin/python -c "from aiayn.model.quantize import warm_up; warm_up()"
.venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder tests "$@"
# then the tests that time the machine (marked whole_machine, skipped by the workers), alone,
# from the files that mention the mark (collecting all of tests/ again took ~20 CPU-s);
# exit 5 is "none selected" (a -k or -m that leaves none of them)
if [ "$workers" != 0 ]; then
  mapfile -t machine < <(grep -rl --include='test_*.py' whole_machine tests | sort)
  AIAYN_WHOLE_MACHINE_ONLY=1 .venv/bin/python -m pytest -q -p no:xdist "${machine[@]:-tests}" \
    "$@" || [ $? = 5 ]
fi
