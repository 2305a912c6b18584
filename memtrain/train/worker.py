"""Entry point of each process that torchrun starts: `python -m memtrain.train.worker RECIPE ...`."""
from __future__ import annotations

import sys

from memtrain.cli import app

if __name__ == "__main__":
    sys.exit(app(["run", *sys.argv[1:]]))
