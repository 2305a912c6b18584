"""Seconds to pin host memory the way DeepSpeed's offloaded optimizer does (`tensor.pin_memory()` of a CPU tensor),
under PyTorch's pinned-allocator settings: its default (one cudaHostAlloc, pages faulted by one thread) against
`pinned_use_cuda_host_register` (malloc, pages faulted by several threads, then cudaHostRegister).

Each setting runs in a fresh process (PyTorch reads its allocator settings once). Needs a CUDA GPU.

    python -m scripts.bench_pinned --gib 4 --out benchmarks/pinned.csv
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from scripts.bench_common import machine_name, upsert_row

COLUMNS = ["setting", "gib", "pin_memory_s", "empty_pinned_s", "h2d_gbps", "machine", "date", "command"]
SETTINGS = (
    "",
    "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    "pinned_use_cuda_host_register:True,pinned_num_register_threads:16",
)

CHILD = """
import json, sys, time, torch
n = int(float(sys.argv[1]) * 2**30) // 4
torch.cuda.init(); torch.zeros(1, device="cuda")
source = torch.ones(n, dtype=torch.float32)
start = time.perf_counter(); pinned = source.pin_memory(); pin_s = time.perf_counter() - start
start = time.perf_counter(); empty = torch.empty(n, dtype=torch.float32, pin_memory=True)
empty_s = time.perf_counter() - start
gpu = torch.empty(n, dtype=torch.float32, device="cuda")
start = time.perf_counter(); gpu.copy_(pinned, non_blocking=True); torch.cuda.synchronize()
h2d_s = time.perf_counter() - start
print(json.dumps({"pin_memory_s": pin_s, "empty_pinned_s": empty_s, "h2d_gbps": n * 4 / h2d_s / 1e9}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="size of each pinned tensor")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    machine = f"{machine_name()}, {os.cpu_count()} CPU cores, PyTorch {torch.__version__.split('+')[0]}"
    for setting in SETTINGS:
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": setting} if setting else dict(os.environ)
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(args.gib)], env=env, capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            print(f"{setting or 'default'}: exit {done.returncode}\n{done.stderr[-2000:]}")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        row = {
            "setting": setting or "default",
            "gib": str(args.gib),
            **{k: f"{v:.2f}" for k, v in result.items()},
            "machine": machine,
            "date": dt.date.today().isoformat(),
            "command": f"python -m scripts.bench_pinned --gib {args.gib:g} --out {args.out}",
        }
        print(row)
        upsert_row(
            args.out,
            row,
            COLUMNS,
            "Seconds to pin host memory, per PyTorch pinned-allocator setting",
            keys=("setting", "gib", "machine"),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
