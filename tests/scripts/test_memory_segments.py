"""scripts/memory_segments.py's summary of an allocator snapshot: per-stream peaks, init told apart from training."""

import pytest

from scripts import memory_segments as segments

MiB = 2**20


def _event(action, size_mib, stream=0):
    return {"action": action, "size": size_mib * MiB, "stream": stream}


def test_peaks_per_stream_and_during_training():
    side = 7
    trace = [
        _event("segment_map", 300),
        _event("alloc", 300),
        _event("free_completed", 300),  # initialisation
        _event("alloc", 100),
        _event("segment_map", 200, side),
        _event("alloc", 200, side),  # training from index 3
        _event("alloc", 50),
        _event("free_completed", 200, side),
        _event("free_completed", 150),
    ]
    snapshot = {
        "segments": [{"stream": 0, "total_size": 300 * MiB}, {"stream": side, "total_size": 200 * MiB}],
        "device_traces": [trace],
    }
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


def _at(action, size_mib, addr, filename="", line=0):
    frames = (
        [
            {"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": filename, "line": line, "name": "forward"},
        ]
        if filename
        else []
    )
    return {"action": action, "size": size_mib * MiB, "stream": 0, "addr": addr, "frames": frames}


def test_live_at_training_peak_groups_blocks_by_who_allocated_them():
    layer = "/venv/site-packages/transformers/models/llama/modeling_llama.py"
    trace = [
        _at("alloc", 500, 1, layer, 10),
        _at("free_completed", 500, 1, layer, 10),  # initialisation, larger
        _at("alloc", 40, 2, layer, 10),
        _at("alloc", 30, 3, layer, 10),  # training from index 2
        _at("alloc", 100, 4, "/repo/memtrain/model/loss.py", 7),
        _at("free_completed", 30, 3, layer, 10),  # peak was before this free: 170 MiB
        _at("alloc", 5, 5),
    ]
    composition = segments.live_at_training_peak({"device_traces": [trace]}, train_from=2)
    assert composition["event"] == 4
    assert composition["allocated_gib"] == pytest.approx(170 / 1024)
    assert [{k: site[k] for k in ("site", "mib", "blocks")} for site in composition["sites"]] == [
        {"site": "memtrain/model/loss.py:7 forward", "mib": 100.0, "blocks": 1},
        {"site": "transformers/models/llama/modeling_llama.py:10 forward", "mib": 70.0, "blocks": 2},
    ]
    assert composition["sites"][1]["stack"] == ["functional.py:1 linear", "modeling_llama.py:10 forward"]
