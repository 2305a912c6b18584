"""One AdamW step on the CPU, as an offloaded optimizer takes it: DeepSpeed's CPU Adam (offload.cpu_adam=deepspeed,
a C++ op built on first use) against PyTorch's fused AdamW (offload.cpu_adam=torch, nothing to build).

fp32 parameters, gradients and moments, weight decay on; each implementation in this process, same tensors' sizes,
one step to create the moments, then the median of --steps timed steps. Rows go to --out (keyed by implementation,
size and machine).

    python -m scripts.bench_cpu_adam --millions 100 300 --out benchmarks/cpu_adam.csv
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from pathlib import Path

import torch

from scripts.bench_common import ROOT, cpu_name, upsert_row

COLUMNS = ["implementation", "params_millions", "ms_per_step", "gb_per_s", "threads", "machine", "date", "command"]
BYTES_PER_PARAM_TOUCHED = 4 * 7  # read param, grad, two moments; write param, two moments (fp32)


def optimizer(name: str, param):
    if name == "deepspeed":
        # here: after main() chose DeepSpeed's CPU accelerator, which it reads at import; builds the op on first use
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    return torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)


def step_ms(name: str, elements: int, steps: int) -> float:
    param = torch.nn.Parameter(torch.randn(elements))
    param.grad = torch.randn(elements)
    opt = optimizer(name, param)
    opt.step()  # creates the moments
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--millions", type=int, nargs="+", default=[100])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "cpu_adam.csv")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the op is the same; no GPU needed
    machine = f"{cpu_name()}, {os.cpu_count()} cores, PyTorch {torch.__version__.split('+')[0]}"
    command = f"python -m scripts.bench_cpu_adam --millions {' '.join(map(str, args.millions))} --steps {args.steps}"
    for millions in args.millions:
        for name in ("deepspeed", "torch"):
            ms = step_ms(name, millions * 1_000_000, args.steps)
            row = {
                "implementation": name,
                "params_millions": str(millions),
                "ms_per_step": f"{ms:.1f}",
                "gb_per_s": f"{millions * 1e6 * BYTES_PER_PARAM_TOUCHED / ms / 1e6:.1f}",
                "threads": str(torch.get_num_threads()),
                "machine": machine,
                "date": dt.date.today().isoformat(),
                "command": command,
            }
            print(row, flush=True)
            upsert_row(
                args.out,
                row,
                COLUMNS,
                "One AdamW step on the CPU (ms)",
                keys=("implementation", "params_millions", "machine"),
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
