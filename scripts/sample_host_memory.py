"""Sample the machine's used host memory (MemTotal - MemAvailable) until killed; write the baseline and the peak.

A process's RSS misses memory that is not mapped into it, such as CUDA unified memory the driver has paged out
to the host (bitsandbytes' paged optimizer states): the machine-wide figure counts it. Run one sampler beside
one run on an otherwise idle machine; the run's host memory is the peak minus the baseline.

    python scripts/sample_host_memory.py OUT.json &   # ... run ...; kill %1
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path


def used_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kib = {key: int(value.split()[0]) for key, value in fields.items() if key in ("MemTotal", "MemAvailable")}
    return (kib["MemTotal"] - kib["MemAvailable"]) * 1024


def main() -> int:
    out = Path(sys.argv[1])
    baseline = peak = used_bytes()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    while not stop:
        peak = max(peak, used_bytes())
        out.write_text(json.dumps({"baseline_bytes": baseline, "peak_bytes": peak, "run_bytes": peak - baseline}))
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
