"""Instruction and chat data through `memtrain run` on the CPU (real DeepSpeed): mixed datasets packed into
rows, response-only targets, the template's markers added to the tokenizer, and exact resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memtrain.commands.run import run_command
from memtrain.data.rows.loader import packed_micro_batches, packed_rows, sample_order
from memtrain.errors import UserError
from memtrain.recipe.load import load_recipe
from memtrain.train.resolve import RunOptions
from memtrain.train.setup import build_data
from tests.conftest import read_records, train_losses
from tests.train.test_run import run_in_child

pytestmark = pytest.mark.slow

INSTRUCTIONS = [
    {"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)} for a in range(12) for b in range(12)
]


def chat_recipe(tmp_path: Path, steps: int = 8) -> dict:
    """The bundled chat data mixed with an alpaca file (weight 0.5), packed, on the Shakespeare tokenizer,
    to which the ChatML markers are added."""
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps(r) + "\n" for r in INSTRUCTIONS))
    return {
        "model": {"preset": "micro", "tokenizer": "builtin:shakespeare"},
        "data": {
            "train": [
                {"path": "builtin:chat", "type": "chat"},
                {"path": str(alpaca), "type": "instruction", "weight": 0.5},
            ],
            "validation": [{"path": "builtin:chat/validation", "type": "chat"}],
            "seq_len": 64,
            "template": "chatml",
            "add_special_tokens": True,
            "packing": True,
        },
        "train": {"steps": steps, "save_every": steps // 2, "eval_every": 100},
    }


def test_a_mixed_packed_chat_run_resumed_mid_epoch_equals_the_straight_run(write_recipe, tmp_path):
    extra = chat_recipe(tmp_path)
    straight = write_recipe("straight", extra)
    assert run_command(straight, []) == 0
    halves = write_recipe("halves", extra)
    assert run_command(halves, [], RunOptions(max_steps=4)) == 0
    assert run_command(halves, []) == 0
    a, b = train_losses(tmp_path / "runs" / "straight"), train_losses(tmp_path / "runs" / "halves")
    assert sorted(b) == list(range(1, 9))
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-5), step
    weights_a = load_file(tmp_path / "runs" / "straight" / "final" / "model.safetensors")
    weights_b = load_file(tmp_path / "runs" / "halves" / "final" / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.allclose(weights_a[k], weights_b[k], atol=1e-6) for k in weights_a)
    # the tokenizer grew by the two markers and the model with it; the run says what the data became
    assert weights_a["model.embed_tokens.weight"].shape[0] == 4098
    start = read_records(tmp_path / "runs" / "straight", "run")[0]
    assert start["data"]["target_tokens"] < start["data"]["tokens"] < start["data"]["rows"] * 64
    # targets per step are the rows' target tokens (responses only), not every token of the rows; tokens are the
    # rows' real tokens; the positions computed are the whole rows (packed rows are not cut): 8 steps of 8 rows
    records = read_records(tmp_path / "runs" / "straight", "train")
    last = records[-1]
    assert last["target_tokens"] < 8 * 8 * 63 * 0.5
    assert last["target_tokens"] < last["tokens"] < last["padded_tokens"] == 8 * 8 * 64
    assert all(r["tokens_per_s"] > 0 for r in records)
    # the counts go through the checkpoint: the resumed run ends where the straight one does
    resumed = read_records(tmp_path / "runs" / "halves", "train")[-1]
    assert [resumed[k] for k in ("tokens", "target_tokens", "padded_tokens")] == [
        last[k] for k in ("tokens", "target_tokens", "padded_tokens")
    ]
    # packed rows are seq_len wide as computed: the start record's padding share is the rows'
    assert start["data"]["padding_share"] == pytest.approx(1 - last["tokens"] / last["padded_tokens"], abs=0.05)


def test_an_unpacked_length_bucketed_chat_run_resumed_mid_epoch_equals_the_straight_run(write_recipe, tmp_path):
    """packing off: one conversation per row, steps of similar lengths, micro-batches cut to their longest row
    (data.group_by_length defaults to on); three micro-batches of 4 per step."""
    extra = chat_recipe(tmp_path)
    extra["data"]["packing"] = False
    extra["batch"] = {"global_batch": 12, "micro_batch": 4}
    straight = write_recipe("straight", extra)
    assert run_command(straight, []) == 0
    halves = write_recipe("halves", extra)
    assert run_command(halves, [], RunOptions(max_steps=4)) == 0
    assert run_command(halves, []) == 0
    a, b = train_losses(tmp_path / "runs" / "straight"), train_losses(tmp_path / "runs" / "halves")
    assert sorted(b) == list(range(1, 9))
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-5), step
    weights_a = load_file(tmp_path / "runs" / "straight" / "final" / "model.safetensors")
    weights_b = load_file(tmp_path / "runs" / "halves" / "final" / "model.safetensors")
    assert all(torch.allclose(weights_a[k], weights_b[k], atol=1e-6) for k in weights_a)
    # micro-batches cut to their longest row: fewer positions computed than rows of seq_len, and the start record's
    # padding share is that of the cut micro-batches, well under the rows' (one conversation in a 64-token row)
    start = read_records(tmp_path / "runs" / "straight", "run")[0]
    last = read_records(tmp_path / "runs" / "straight", "train")[-1]
    assert last["target_tokens"] < last["tokens"] < last["padded_tokens"] < 8 * 12 * 64
    assert start["data"]["padding_share"] < start["data"]["row_padding_share"]
    assert start["data"]["padding_share"] == pytest.approx(1 - last["tokens"] / last["padded_tokens"], abs=0.05)


def test_lora_with_added_tokens_needs_the_embeddings_in_modules_to_save(write_recipe, tmp_path):
    extra = chat_recipe(tmp_path, steps=2)
    extra["model"]["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    refused = write_recipe("refused", extra)
    with pytest.raises(UserError) as caught:
        run_command(refused, [])
    assert "modules_to_save" in str(caught.value) and "embed_tokens" in str(caught.value)
    assert not (tmp_path / "runs" / "refused").exists()
    extra["model"]["lora"]["modules_to_save"] = ["embed_tokens", "lm_head"]
    assert run_command(write_recipe("saved", extra), []) == 0
    losses = train_losses(tmp_path / "runs" / "saved")
    assert sorted(losses) == [1, 2] and all(v == v for v in losses.values())


def test_unpacked_chat_laid_out_packed_trains_the_cut_rows_losses_in_fewer_micro_batches(
    write_recipe, tmp_path, monkeypatch
):
    """What a GPU run does with unpacked chat (varlen attention, each step laid out packed: data/rows/loader.py),
    forced on the CPU, where sdpa keeps a packed row's samples apart with its mask: the same samples in the same
    steps (length bucketing off on both sides), the same losses, fewer micro-batches, whole rows counted as computed,
    and a validation loss equal to the cut rows' one."""
    extra = chat_recipe(tmp_path, steps=4)
    extra["data"].update(packing=False, group_by_length=False)
    extra["batch"] = {"global_batch": 16, "micro_batch": 4}
    extra["train"] = {"steps": 4, "save_every": 4, "eval_every": 4}
    cut = write_recipe("cut", extra)
    assert run_command(cut, []) == 0
    import memtrain.train.launch as launch  # noqa: PLC0415
    import memtrain.train.setup as setup  # noqa: PLC0415

    monkeypatch.setattr(setup, "packs_steps", lambda recipe: True)
    monkeypatch.setattr(launch, "packs_steps", lambda recipe: True)
    laid = write_recipe("laid", extra)
    assert run_command(laid, []) == 0
    # an OOM before the second micro-batch of step 2: the samples of the micro-batches not done are laid out again
    # at a smaller size (micro-batches laid out packed are not consecutive slices of the step's samples)
    monkeypatch.setenv("MEMTRAIN_INJECT_OOM", "1:1")
    oom = write_recipe("laid-oom", {**extra, "batch": {**extra["batch"], "micro_batch": 2, "policy": "adaptive"}})
    assert run_command(oom, []) == 0
    runs = tmp_path / "runs"
    assert [o["step"] for o in read_records(runs / "laid-oom", "oom")] == [1]
    _same_losses(runs, "cut", ("laid", "laid-oom"), steps=4)
    cut_steps, laid_steps = read_records(runs / "cut", "train"), read_records(runs / "laid", "train")
    assert sum(r["grad_accum"] for r in laid_steps) < sum(r["grad_accum"] for r in cut_steps) == 4 * 4
    assert laid_steps[-1]["tokens"] == cut_steps[-1]["tokens"]
    assert laid_steps[-1]["padded_tokens"] % 64 == 0  # whole rows of seq_len
    evals = [read_records(runs / name, "eval")[-1]["loss"] for name in ("cut", "laid")]
    assert evals[1] == pytest.approx(evals[0], rel=1e-4)


def _traced_micro_batches(trace: Path) -> dict[tuple[int, int], list[list[int]]]:
    """(step, rank) -> the micro-batches of sample ids that went into the applied step (MEMTRAIN_TRACE_SAMPLES)."""
    out: dict[tuple[int, int], list[list[int]]] = {}
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        out.setdefault((record["step"], record["rank"]), []).append(record["indices"])
    return out


def test_two_processes_lay_unpacked_chat_out_packed_and_train_one_process_losses(write_recipe, tmp_path, monkeypatch):
    """What two GPUs do with unpacked chat (varlen attention, each step laid out packed), forced on the CPU in the
    child processes by a sitecustomize module (sdpa keeps a packed row's samples apart with its mask). Each rank packs
    its share of the step into rows of its own; at micro-batch 1 the ranks' row counts differ, and both run the most
    either makes (the other's rows split), so their gradient reductions pair and the run ends. Every step holds the
    samples and the losses of one process laid out the same way."""
    extra = chat_recipe(tmp_path, steps=4)
    extra["data"].update(packing=False, group_by_length=False)
    extra["batch"] = {"global_batch": 8, "micro_batch": 1}
    extra["train"] = {"steps": 4, "save_every": 4, "eval_every": 100}
    forced = tmp_path / "forced"
    forced.mkdir()
    (forced / "sitecustomize.py").write_text(
        "import memtrain.model.attention as attention\n\nattention.packs_steps = lambda recipe: True\n"
    )
    pythonpath = os.pathsep.join([str(forced), str(Path.cwd()), os.environ.get("PYTHONPATH", "")])

    def two_processes(name: str, batch: dict, **env) -> Path:
        trace = tmp_path / f"{name}.samples.jsonl"
        recipe = write_recipe(name, {**extra, "hardware": {"gpus": 2}, "batch": batch})
        run_in_child(recipe, MEMTRAIN_TRACE_SAMPLES=str(trace), PYTHONPATH=pythonpath, **env)
        return trace

    two_trace = two_processes("two", extra["batch"])
    # an OOM on rank 1 before the second micro-batch of step 2, at micro-batch 2: both ranks retry the rest at 1,
    # laid out again in as many micro-batches on each
    two_processes(
        "two-oom",
        {"global_batch": 8, "micro_batch": 2, "policy": "adaptive"},
        MEMTRAIN_INJECT_OOM="1:1",
        MEMTRAIN_INJECT_RANK="1",
    )
    import memtrain.train.launch as launch  # noqa: PLC0415
    import memtrain.train.setup as setup  # noqa: PLC0415

    monkeypatch.setattr(setup, "packs_steps", lambda recipe: True)
    monkeypatch.setattr(launch, "packs_steps", lambda recipe: True)
    one_trace = tmp_path / "one.samples.jsonl"
    monkeypatch.setenv("MEMTRAIN_TRACE_SAMPLES", str(one_trace))
    one = write_recipe("one", {**extra, "hardware": {"gpus": 1}})
    assert run_command(one, []) == 0
    train_set = build_data(load_recipe(one).recipe).train_set
    two_batches, one_batches = _traced_micro_batches(two_trace), _traced_micro_batches(one_trace)
    split_steps = laid_out = 0
    for step in range(4):
        ranks = [two_batches[(step, rank)] for rank in (0, 1)]
        assert len(ranks[0]) == len(ranks[1]), step  # as many micro-batches on each rank
        shares = [sorted(i for batch in rank for i in batch) for rank in ranks]
        assert sorted(shares[0] + shares[1]) == sorted(i for batch in one_batches[(step, 0)] for i in batch)
        split_steps += any(len(packed_rows(train_set, share)) < len(ranks[0]) for share in shares)
        laid_out += any(len(batch) > 1 for rank in ranks for batch in rank)  # cut rows hold one sample each
    assert laid_out and split_steps  # laid out packed; some step's shares made unequal rows, the lighter one's split
    runs = tmp_path / "runs"
    assert [o["step"] for o in read_records(runs / "two-oom", "oom")] == [1]
    _same_losses(runs, "one", ("two", "two-oom"), steps=4)


def _same_losses(runs: Path, reference: str, names: tuple[str, ...], steps: int) -> None:
    """Every run of `names` logged the reference run's training loss at each of its `steps` steps."""
    expected = train_losses(runs / reference)
    assert sorted(expected) == list(range(1, steps + 1))
    for name in names:
        losses = train_losses(runs / name)
        assert sorted(losses) == sorted(expected), name
        for step, loss in expected.items():
            assert losses[step] == pytest.approx(loss, rel=1e-4), (name, step)


def _uneven_after_an_oom(train_set, order, global_batch: int, step: int) -> tuple[int, int] | None:
    """(micro-batch index, samples of rank 1's micro-batch there) of the first forward OOM of `step` after which the
    shares left are too uneven to lay out in as many micro-batches on each rank at micro-batch 1 (one rank has fewer
    samples left than the micro-batches another needs), where rank 1's micro-batch at that index holds more samples
    than any micro-batch of the step at micro-batch 1 does, so the injected OOM does not fire again after the
    restart; two ranks, steps laid out packed at micro-batch 2; None when the step has none."""
    per_rank = global_batch // 2
    samples = order.indices(step * global_batch, global_batch)
    shares = [list(samples[start : start + per_rank]) for start in (0, per_rank)]
    count = max(-(-len(packed_rows(train_set, share)) // 2) for share in shares)
    laid = [packed_micro_batches(train_set, share, 2, count) for share in shares]
    smaller = max(len(packed_rows(train_set, share)) for share in shares)
    widest_at_one = max(len(batch) for share in shares for batch in packed_micro_batches(train_set, share, 1, smaller))
    for index in range(1, count):
        left = [[i for batch in batches[index:] for i in batch] for batches in laid]
        needed = max(len(packed_rows(train_set, share)) for share in left)
        if needed > min(len(share) for share in left) and len(laid[1][index]) > widest_at_one:
            return index, len(laid[1][index])
    return None


def test_two_processes_start_again_when_a_forward_oom_leaves_shares_too_uneven_to_pair(
    write_recipe, tmp_path, monkeypatch
):
    """Steps laid out packed on two processes, an OOM in a forward on rank 1: where one rank has fewer samples left
    than the micro-batches the other now needs, the two cannot run as many micro-batches as each other, which their
    gradient reductions need; every process starts again from the last checkpoint at micro-batch 1 (a note in the
    run directory), and the run trains every sample once with one process's losses. The step and micro-batch come
    from the data's own layout (the seed the first that makes such a step)."""
    extra = chat_recipe(tmp_path, steps=4)
    extra["data"].update(packing=False, group_by_length=False)
    extra["train"] = {"steps": 4, "save_every": 2, "eval_every": 100}
    for seed in range(16):
        extra["train"]["seed"] = seed
        probe = write_recipe(f"probe-{seed}", {**extra, "batch": {"global_batch": 16, "micro_batch": 2}})
        recipe = load_recipe(probe).recipe
        train_set = build_data(recipe).train_set
        order = sample_order(recipe.data, train_set, seed, 16, pack_steps=True)
        # the step after the checkpoint of step 2, where the restart goes back to
        point = _uneven_after_an_oom(train_set, order, global_batch=16, step=2)
        if point is not None:
            break
    else:
        pytest.fail("no seed of 16 makes shares too uneven after an OOM: the data's lengths changed")
    (index, samples), step = point, 2
    forced = tmp_path / "forced"
    forced.mkdir()
    (forced / "sitecustomize.py").write_text(
        "import memtrain.model.attention as attention\n\nattention.packs_steps = lambda recipe: True\n"
    )
    pythonpath = os.pathsep.join([str(forced), str(Path.cwd()), os.environ.get("PYTHONPATH", "")])
    trace = tmp_path / "uneven.samples.jsonl"
    uneven = write_recipe(
        "uneven",
        {**extra, "hardware": {"gpus": 2}, "batch": {"global_batch": 16, "micro_batch": 2, "policy": "adaptive"}},
    )
    said = run_in_child(
        uneven,
        MEMTRAIN_TRACE_SAMPLES=str(trace),
        PYTHONPATH=pythonpath,
        MEMTRAIN_INJECT_OOM=f"{step}:{index}:mb>={samples}",
        MEMTRAIN_INJECT_RANK="1",
    )
    import memtrain.train.launch as launch  # noqa: PLC0415
    import memtrain.train.setup as setup  # noqa: PLC0415

    monkeypatch.setattr(setup, "packs_steps", lambda recipe: True)
    monkeypatch.setattr(launch, "packs_steps", lambda recipe: True)
    one_trace = tmp_path / "one.samples.jsonl"
    monkeypatch.setenv("MEMTRAIN_TRACE_SAMPLES", str(one_trace))
    assert run_command(write_recipe("one", {**extra, "batch": {"global_batch": 16, "micro_batch": 1}}), []) == 0
    runs = tmp_path / "runs"
    # recorded once, by the attempt that shrank, and said once by each attempt
    ooms = read_records(runs / "uneven", "oom")
    assert [(o["step"], o["micro_batch"], o["in_backward"]) for o in ooms] == [(step, 2, False)]
    said = " ".join(said.split())
    assert (
        said.count(
            f"out of memory in a forward of step {step + 1} on rank 1 (micro-batch 2); the samples left on the "
            "processes are too uneven to lay out packed in as many micro-batches on each, so it cannot be retried in "
            "place: every process starts again from step 2, its last checkpoint, at micro-batch 1"
        )
        == 1
    ), said[-3000:]
    assert (
        said.count(
            f"· starting at micro-batch 1: rank 1 ran out of memory in the forward of step {step + 1} at micro-batch 2"
        )
        == 1
    ), said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert [r["micro_batch"] for r in read_records(runs / "uneven", "train")] == [2, 2] + [1] * 2
    two_batches, one_batches = _traced_micro_batches(trace), _traced_micro_batches(one_trace)
    for at in range(4):  # every sample of each step once, none lost, none twice
        ranks = [two_batches[(at, rank)] for rank in (0, 1)]
        assert len(ranks[0]) == len(ranks[1]), at
        both = sorted(i for rank in ranks for batch in rank for i in batch)
        assert both == sorted(i for batch in one_batches[(at, 0)] for i in batch), at
    _same_losses(runs, "one", ("uneven",), steps=4)
