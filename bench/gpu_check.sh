#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): CUDA training in bf16 with resume, torchrun with NCCL,
# bench_train.py and bench_decode_peers.py on CUDA, a 5-minute main job; one line per check,
# under 8 minutes on one GPU. Arguments go to gpu_check.py (--device cpu --quick: the same
# checks, small, on a CPU; --only CHECK...; --json).
# Python: $PYTHON, else .venv/bin/python, else python3. It is used as it is (no setup: a GPU
# machine needs its own CUDA build of torch), and scripts/main_job.sh is told so (AIAYN_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -z "${AIAYN_DATA_DIR:-}" ] && [ -d ../shared/data ]; then
  export AIAYN_DATA_DIR="$(cd ../shared/data && pwd)"
fi
export AIAYN_PYTHON="$PY"
exec "$PY" bench/gpu_check.py --python "$PY" "$@"
