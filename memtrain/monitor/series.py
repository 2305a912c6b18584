"""A run's metrics records as (steps, values) series, for the plots and the report's summary.

Apart from plots.py so that reading a run needs no matplotlib (a second to import): only drawing does.
"""

from __future__ import annotations


def series(records: list[dict], kind: str, field: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one field over the records of one kind, by step, newest record per step.

    Records without the field or with null are left out.
    """
    by_step: dict[int, float] = {}
    for record in records:
        if record.get("kind") != kind:
            continue
        value = record.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            by_step[int(record["step"])] = value
    steps = sorted(by_step)
    return steps, [by_step[step] for step in steps]


def tokens_are_targets(records: list[dict]) -> bool:
    """Whether these train records come from before the three token counts: they carry only `tokens`, and it
    counted target tokens. Since, `tokens` counts real input tokens (padding left out), `target_tokens` the
    loss's and `padded_tokens` the positions computed, padding included; all three cumulative."""
    return not any(record.get("kind") == "train" and "target_tokens" in record for record in records)


def target_field(records: list[dict]) -> str:
    """The records' field of cumulative target tokens: `target_tokens`, or `tokens` in older records."""
    return "tokens" if tokens_are_targets(records) else "target_tokens"


def throughput(records: list[dict], field: str = "tokens") -> tuple[list[int], list[float]]:
    """(steps, tokens/s) of a cumulative token count: for `tokens` the recorded tokens_per_s, else the step's new
    count over its step_time_s."""
    steps, speeds = series(records, "train", "tokens_per_s") if field == "tokens" else ([], [])
    if steps:
        return steps, speeds
    token_steps, tokens = series(records, "train", field)
    time_steps, step_times = series(records, "train", "step_time_s")
    seconds_at = dict(zip(time_steps, step_times))
    steps, speeds = [], []
    for (before, tokens_before), (step, tokens_now) in zip(zip(token_steps, tokens), zip(token_steps[1:], tokens[1:])):
        if step == before + 1 and seconds_at.get(step, 0) > 0:
            steps.append(step)
            speeds.append((tokens_now - tokens_before) / seconds_at[step])
    return steps, speeds


def is_start(record: dict) -> bool:
    """A run's start or resume record: the next step is that start's first."""
    return record.get("kind") == "run" and record.get("event") in ("start", "resume")


def steady_speeds(records: list[dict], field: str = "tokens") -> list[float]:
    """`throughput`'s speeds without the first step of each start, fresh or resumed, which carries that start's
    warm-up (compilation, the allocator's first growth, a checkpoint's state loading): what a median of the
    run's speed should be over. All of them when nothing else is left."""
    first_steps = {int(record["step"]) + 1 for record in records if is_start(record)}
    steps, speeds = throughput(records, field)
    steady = [speed for step, speed in zip(steps, speeds) if step not in first_steps]
    return steady or speeds
