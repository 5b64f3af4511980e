#!/usr/bin/env bash
# Set everything up and run the main job (the README's first Quickstart command): learn a shared
# BPE vocabulary, train the `multi30k` preset for 60 minutes on Multi30k en->de, average the last
# checkpoints, translate test_2016_flickr with beam 4 / alpha 0.6, print BLEU and chrF.
# Extra arguments go to `aiayn pipeline` (e.g. --tgt-lang fr, --time-budget-min 10).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${AIAYN_DATA_DIR:-}" ] && [ -d ../shared/data/multi30k ]; then
  export AIAYN_DATA_DIR="$(cd ../shared/data && pwd)"
fi  # unset and no ../shared/data: Multi30k is downloaded and checked by sha256
exec .venv/bin/aiayn pipeline --preset multi30k "$@"
