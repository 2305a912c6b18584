# Sourced by quickstart.sh and test.sh: a virtual environment in .venv with PyTorch installed first,
# so DeepSpeed's install does not pull a second, larger torch build as its dependency.
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q "torch==${MEMTRAIN_TORCH:-2.13.0}"
