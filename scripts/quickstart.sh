#!/usr/bin/env bash
# Install memtrain into .venv and train the quickstart recipe: a tiny Llama on the bundled
# Shakespeare, on the GPU if there is one, else on the CPU (about 2-3 minutes of training on two cores, after the install).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
"$VENV/bin/pip" install -q -e .
exec "$VENV/bin/memtrain" run recipes/quickstart.yaml "$@"
