"""scripts/memory_segments.py's summary of an allocator snapshot: per-stream peaks, init told apart from training."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


@pytest.fixture(scope="module")
def segments():
    spec = importlib.util.spec_from_file_location("memory_segments", ROOT / "scripts" / "memory_segments.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(action, size_mib, stream=0):
    return {"action": action, "size": size_mib * MiB, "stream": stream}


def test_peaks_per_stream_and_during_training(segments):
    side = 7
    trace = [
        _event("segment_map", 300), _event("alloc", 300), _event("free_completed", 300),  # initialisation
        _event("alloc", 100), _event("segment_map", 200, side), _event("alloc", 200, side),  # training from index 3
        _event("alloc", 50), _event("free_completed", 200, side), _event("free_completed", 150),
    ]
    snapshot = {"segments": [{"stream": 0, "total_size": 300 * MiB}, {"stream": side, "total_size": 200 * MiB}],
                "device_traces": [trace]}
    summary = segments.summarise(snapshot, train_from=3)
    by_stream = {s["stream"]: s for s in summary["streams"]}
    GiB = 1024
    assert by_stream[0]["peak_allocated_gib_in_trace"] == pytest.approx(300 / GiB)
    assert by_stream[0]["peak_allocated_gib_in_training"] == pytest.approx(150 / GiB)
    assert by_stream[0]["peak_mapped_gib_in_trace"] == pytest.approx(300 / GiB)
    assert by_stream[side]["peak_allocated_gib_in_training"] == pytest.approx(200 / GiB)
    # the overall peak (350 MiB) is the moment both streams are live: 150 on the default, 200 beside it
    assert summary["overall_peak_allocated_gib_in_trace"] == pytest.approx(350 / GiB)
    assert by_stream[0]["allocated_gib_at_overall_peak"] == pytest.approx(150 / GiB)
    assert by_stream[side]["allocated_gib_at_overall_peak"] == pytest.approx(200 / GiB)
    assert by_stream[0]["largest_allocations_mib"][:3] == [300.0, 100.0, 50.0]
    assert summary["training_starts_at_event"] == 3
