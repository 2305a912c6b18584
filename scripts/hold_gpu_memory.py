"""Make the GPU machine's card physically the size of a consumer card, for runs whose memory is not all PyTorch's.

`hardware.cap_memory` caps PyTorch's allocator (set_per_process_memory_fraction) and nothing else: CUDA's unified
memory (bitsandbytes' paged optimizer states) would still find the whole H200 free and never page. This process
holds all of the card's free memory but `--leave-gib` as plain device memory, which CUDA never evicts, so a run
started beside it has that much left for everything (its CUDA context, PyTorch's pool, unified memory), as on a
real 24 GB card. It prints one line when it holds the memory and keeps it until it is killed.

    python scripts/hold_gpu_memory.py --leave-gib 23.99 &
"""

from __future__ import annotations

import argparse
import signal
import sys

import torch

GiB = 1024**3
CONSUMER_CARD_GIB = 24564 / 1024  # what an RTX 3090 / 4090 reports as its total (24564 MiB)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leave-gib", type=float, default=CONSUMER_CARD_GIB, help="device memory left for others")
    args = parser.parse_args()
    free, total = torch.cuda.mem_get_info()  # after this process's own CUDA context
    hold = free - int(args.leave_gib * GiB)
    if hold <= 0:
        print(f"only {free / GiB:.2f} GiB free: nothing to hold", file=sys.stderr)
        return 2
    held = torch.empty(hold, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    left, _ = torch.cuda.mem_get_info()
    print(
        f"holding {held.numel() / GiB:.2f} GiB of {total / GiB:.2f}; {left / GiB:.2f} GiB left for other processes",
        flush=True,
    )
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    sys.exit(main())
