"""scripts/sample_host_memory.py: the machine-wide host memory a run takes, beside it (what RSS misses: CUDA unified
memory paged out to the host). Here a child process takes 2 GiB while the sampler runs; other processes of the
machine may take or free some meanwhile, so only half of it is asserted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from scripts.bench_common import ROOT
from scripts.sample_host_memory import used_bytes

MiB = 1024**2


def test_the_sampler_sees_memory_another_process_takes(tmp_path):
    out = tmp_path / "host.json"
    sampler = subprocess.Popen([sys.executable, "-m", "scripts.sample_host_memory", str(out)], cwd=ROOT)
    try:
        deadline = time.time() + 30
        while not out.exists() and time.time() < deadline:
            time.sleep(0.1)
        before = used_bytes()
        # 2 GiB written (so resident), held for 2 s, in another process
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import time; b = bytearray(2048 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); time.sleep(2)",
            ],
            check=True,
        )
    finally:
        sampler.send_signal(signal.SIGTERM)
        assert sampler.wait(timeout=30) == 0
    record = json.loads(out.read_text())
    assert record["peak_bytes"] - record["baseline_bytes"] == record["run_bytes"]
    assert record["peak_bytes"] - before >= 1024 * MiB
