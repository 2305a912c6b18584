#!/usr/bin/env bash
# Install memtrain with its test dependencies into .venv, check the import layers, lint and format, and run the whole
# test suite (DeepSpeed really runs, on its CPU accelerator when there is no GPU).
#   bash scripts/test.sh                 # everything, as CI does (~20-25 min on 2 cores with empty op caches)
#   bash scripts/test.sh -m "not slow"   # the unit tests only (what plain `pytest` runs)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
"$VENV/bin/pip" install -q -e ".[dev]"
"$VENV/bin/lint-imports" --no-cache   # the layers in pyproject.toml: a back-edge fails the build
"$VENV/bin/ruff" check .               # lint (pyproject.toml [tool.ruff])
"$VENV/bin/ruff" format --check .      # and the one format
exec "$VENV/bin/python" -m pytest -m "slow or not slow" "$@"
