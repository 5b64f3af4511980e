#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): CUDA training in bf16 with resume, torchrun with NCCL,
# bench_train.py and bench_decode_peers.py on CUDA, a 5-minute main job (those eight under
# 8 minutes on one GPU); then fp16 with its loss scale against fp32 and what auto picks by
# the compute capability, and base's throughput over 2,000 updates from a prepared WMT-shaped
# corpus (NCCL over every GPU when there are two or more). Those two have not yet run on a
# GPU: give them a command of their own first (--only fp16 throughput; --throughput-updates N
# shortens the second). One line per check; a check that fails says so and the others still
# run. Arguments go to gpu_check.py (--device cpu --quick: the same checks, small, on a CPU;
# --only CHECK...; --json).
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
