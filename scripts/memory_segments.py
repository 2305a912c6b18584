"""Where a run's reserved GPU memory sits: segments and allocations per CUDA stream (GPU).

Runs a recipe in this process for a few steps with the allocator's history recorded, then writes a
JSON summary: for each stream, the bytes its segments hold at the end and the peak of its live
allocations over the run, plus the ten largest allocations per stream. Reserved memory beyond the
peak allocated usually means blocks cached by one stream that another could not reuse; this shows
which stream, and how big its blocks are, so the planner's terms can be checked against it.

    python -m scripts.memory_segments recipes/llama2-7b-nvme-24gb.yaml model.preset=tinyllama-1.1b \\
        train.steps=3 --out /tmp/segments.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

GiB = 2**30
HISTORY_ENTRIES = 2_000_000  # alloc/free events kept: enough for a few steps of a 7B model
SITE_PACKAGES = ("memtrain/", "transformers/", "deepspeed/", "peft/")  # frames that name who allocated


def summarise(snapshot: dict, train_from: int = 0) -> dict:
    """Per stream: bytes in segments now, the high-water mark of its mapped segments, peak live allocated
    bytes and largest allocations over the trace, and the same peaks over the training steps alone
    (events from index `train_from` of the trace on: the run's initialisation comes before)."""
    segment_bytes: dict[int, int] = defaultdict(int)
    for segment in snapshot["segments"]:
        segment_bytes[segment["stream"]] += segment["total_size"]
    live: dict[int, int] = defaultdict(int)
    peak: dict[int, int] = defaultdict(int)
    train_peak: dict[int, int] = defaultdict(int)
    mapped: dict[int, int] = defaultdict(int)
    peak_mapped: dict[int, int] = defaultdict(int)
    largest: dict[int, list[int]] = defaultdict(list)
    total_live, total_peak, stream_live_at_total_peak = 0, 0, {}
    for trace in snapshot["device_traces"]:
        for index, event in enumerate(trace):
            stream, size, action = event.get("stream", 0), event["size"], event["action"]
            if action == "alloc":
                live[stream] += size
                total_live += size
                largest[stream] = sorted(largest[stream] + [size], reverse=True)[:10]
            elif action == "free_completed":
                live[stream] -= size
                total_live -= size
            elif action in ("segment_alloc", "segment_map"):
                mapped[stream] += size
            elif action in ("segment_free", "segment_unmap"):
                mapped[stream] -= size
            peak[stream] = max(peak[stream], live[stream])
            if index >= train_from:
                train_peak[stream] = max(train_peak[stream], live[stream])
            peak_mapped[stream] = max(peak_mapped[stream], mapped[stream])
            if total_live > total_peak:
                total_peak, stream_live_at_total_peak = total_live, dict(live)
    streams = sorted(set(segment_bytes) | set(peak))
    return {
        "streams": [
            {
                "stream": s,
                "segment_gib_at_end": segment_bytes[s] / GiB,
                "peak_mapped_gib_in_trace": peak_mapped[s] / GiB,
                "peak_allocated_gib_in_trace": peak[s] / GiB,
                "peak_allocated_gib_in_training": train_peak[s] / GiB,
                "allocated_gib_at_overall_peak": stream_live_at_total_peak.get(s, 0) / GiB,
                "largest_allocations_mib": [round(b / 2**20, 1) for b in largest[s]],
            }
            for s in streams
        ],
        "overall_peak_allocated_gib_in_trace": total_peak / GiB,
        "training_starts_at_event": train_from,
        "live_at_training_peak": live_at_training_peak(snapshot, train_from),
    }


def _site(event: dict) -> str:
    """Who allocated: the innermost frame in memtrain, transformers, DeepSpeed or PEFT (else the innermost)."""
    frames = event.get("frames") or []
    for frame in frames:
        name = frame.get("filename", "")
        for package in SITE_PACKAGES:
            if package in name:
                return f"{package}{name.split(package, 1)[1]}:{frame.get('line')} {frame.get('name')}"
    return f"{frames[0].get('filename')}:{frames[0].get('line')}" if frames else "unknown (no stack recorded)"


def live_at_training_peak(snapshot: dict, train_from: int = 0, top: int = 20) -> dict:
    """What is allocated on the first device at the moment the training steps' live bytes peak, grouped by
    allocation site, largest first: the composition the planner's phase peak has to match."""
    trace = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    peak_index, peak_bytes, total = None, -1, 0
    for index, event in enumerate(trace):
        total += {"alloc": event["size"], "free_completed": -event["size"]}.get(event["action"], 0)
        if index >= train_from and total > peak_bytes:
            peak_index, peak_bytes = index, total
    if peak_index is None:
        return {}
    live: dict[int, dict] = {}
    for index, event in enumerate(trace[: peak_index + 1]):
        if event["action"] == "alloc":
            live[event.get("addr", index)] = event
        elif event["action"] == "free_completed":
            live.pop(event.get("addr", index), None)
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    largest: dict[str, dict] = {}
    for event in live.values():
        site = _site(event)
        sites[site][0] += event["size"]
        sites[site][1] += 1
        if event["size"] > largest.get(site, {"size": -1})["size"]:
            largest[site] = event
    ranked = sorted(sites.items(), key=lambda item: -item[1][0])[:top]
    return {
        "event": peak_index,
        "allocated_gib": peak_bytes / GiB,
        "sites": [
            {"site": site, "mib": round(size / 2**20, 1), "blocks": count, "stack": _stack(largest[site])}
            for site, (size, count) in ranked
        ],
    }


def _stack(event: dict, depth: int = 14) -> list[str]:
    """The innermost frames of a block's allocation, so a site shared by two callers (a forward and its
    recomputation in backward) can be told apart."""
    return [
        f"{f.get('filename', '').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
        for f in (event.get("frames") or [])[:depth]
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch  # here and below: summarise() above is read (and tested) without a run's imports

    if not torch.cuda.is_available():
        print("memory_segments.py reads CUDA allocator segments; this machine has no GPU", file=sys.stderr)
        return 2
    import memtrain.train.setup as setup
    from memtrain.commands.run import run_command
    from memtrain.train.resolve import RunOptions

    # record from before the model is built (the run itself starts recording only for its training
    # steps); where it would start, note how many events came before, so initialisation can be told apart
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, context="alloc", stacks="python")
    train_from = []
    setup.start_memory_history = lambda device: train_from.append(
        len(torch.cuda.memory._snapshot()["device_traces"][0])
    )
    code = run_command(args.recipe, args.overrides, RunOptions(resume=False, save=False))
    stats = torch.cuda.memory_stats()
    summary = {
        "exit_code": code,
        "peak_reserved_gib": stats["reserved_bytes.all.peak"] / GiB,
        "peak_allocated_gib": stats["allocated_bytes.all.peak"] / GiB,
        "alloc_retries": stats["num_alloc_retries"],
        **summarise(torch.cuda.memory._snapshot(), train_from[0] if train_from else 0),
    }
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
