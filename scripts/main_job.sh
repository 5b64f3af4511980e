#!/usr/bin/env bash
# Set everything up and run the main job (the README's first Quickstart command): learn a shared
# BPE vocabulary, time a few updates of each shape on this machine (--ensemble auto, aiayn.budget:
# two `multi30k-ensemble` members of one thread each where each still reaches 20 epochs in the
# budget, else one `multi30k` model on all cores, with less dropout where it is projected under
# 12 epochs, and a checkpoint every budget/30 s, at most 120), train that shape for 60 minutes
# on Multi30k en->de, average the last 5 or 10 checkpoints
# and choose the width and the length penalty alpha on the validation set (beam 4), translate
# test_2016_flickr once with the ensemble, print BLEU and chrF.
# Extra arguments go to `aiayn pipeline` and win over these (e.g. --tgt-lang fr,
# --time-budget-min 10, or --preset multi30k --ensemble 1 for the single v9 model, or
# --preset multi30k-ensemble --ensemble 2 for round 3's fixed shape).
# The precision is the machine's (train.precision = "auto"): bf16 weights on a CPU with native
# bf16, fp32 on one without (AVX2 only), as the job's first lines say.
# AIAYN_PYTHON=PATH: run with that Python's aiayn as it is, without the setup (bench/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${AIAYN_PYTHON:-}" ]; then
  bash scripts/setup.sh
  AIAYN_PYTHON=.venv/bin/python
fi
if [ -z "${AIAYN_DATA_DIR:-}" ] && [ -d ../shared/data/multi30k ]; then
  export AIAYN_DATA_DIR="$(cd ../shared/data && pwd)"
fi  # unset and no ../shared/data: Multi30k is downloaded and checked by sha256
exec "$AIAYN_PYTHON" -m aiayn pipeline --ensemble auto --alphas 0.6 1.0 1.4 \
  --average 5 10 "$@"
