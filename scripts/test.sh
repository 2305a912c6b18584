#!/usr/bin/env bash
# Install memtrain with its test dependencies into .venv and run the whole test suite
# (DeepSpeed really runs, on its CPU accelerator when there is no GPU).
#   bash scripts/test.sh            # everything, as CI does (~15 min on 2 cores)
#   bash scripts/test.sh -m "not slow"   # skip the end-to-end training runs
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
"$VENV/bin/pip" install -q -e ".[dev]"
exec "$VENV/bin/python" -m pytest "$@"
