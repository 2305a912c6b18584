"""`memtrain plan --max-seq-len`: the longest data.seq_len a recipe fits on the card, and what would lengthen it.

With --data the training data is read once and every length planned prices the attention backward by the densest
row the data has at that length; without it, rows of ASSUMED_SAMPLE_TOKENS-token samples are assumed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from rich.table import Table

from memtrain.checks.environment import current_environment
from memtrain.checks.load import recipe_checks
from memtrain.commands.plan_data import read_data, reads_data, unread_note
from memtrain.data.rows.dataset import text_rows_by_length
from memtrain.data.rows.densest_by_length import densest_row_by_length, rows_by_length
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.plan.advice import advise, with_overrides
from memtrain.plan.attention_backward import ASSUMED_SAMPLE_TOKENS
from memtrain.plan.planner import plan_recipe
from memtrain.plan.seq_len import LongestSeqLen, longest_seq_len, search_limit, with_seq_len
from memtrain.recipe.sources import LoadedRecipe
from memtrain.train.progress_bar import tokenising_progress
from memtrain.train.setup import build_data
from memtrain.units import gib

# seq_len -> the most samples one row of the training data holds at that length (None: the planner's assumption)
DensestRow = Callable[[int], int] | None

# Levers priced: the cheapest changes that make the next length fit, each searched for its own longest length.
LEVERS = 3


@dataclass(frozen=True)
class Lever:
    """A change (key.path=value overrides) and the longest length the recipe fits with it."""

    overrides: list[str]
    reason: str
    speed_cost: float
    longest: LongestSeqLen

    def to_json(self) -> dict:
        return {
            "overrides": self.overrides,
            "reason": self.reason,
            "speed_cost": self.speed_cost,
            "seq_len": self.longest.seq_len,
            "peak_reserved_bytes": self.longest.plan.peak_reserved_bytes if self.longest.plan else None,
        }


def data_by_length(loaded: LoadedRecipe) -> tuple[Callable[[int], int], Callable[[int], int]]:
    """--data: the training data read once (tokenised into the cache, a bar per file), built at the longest length
    the search may try with one sample a row; the densest row it makes at each length, and the rows it makes there
    (data/rows/densest_by_length.py). Text windows hold one sequence each at any length; their count is the text's
    tokens cut at each length (data/rows/dataset.py)."""
    recipe = loaded.recipe
    if recipe.data.is_text:
        with tokenising_progress(), loaded.sources.located():
            return (lambda seq_len: 1), text_rows_by_length(recipe.data, load_tokenizer(recipe.model))
    longest = with_seq_len(recipe, search_limit(recipe))
    one_a_row = longest.model_copy(update={"data": longest.data.model_copy(update={"packing": False})})
    with tokenising_progress(), loaded.sources.located():
        data = build_data(one_a_row)
    return densest_row_by_length(data.train_set, recipe.data), rows_by_length(data.train_set, recipe.data)


def too_few_rows(loaded: LoadedRecipe, rows_there: int | None) -> int | None:
    """`rows_there` (the rows the data makes at the answer) where they are fewer than one global batch (the run
    refuses such data: train/setup.py), else None. The search is over memory; this says when its answer is one the
    data cannot fill."""
    return rows_there if rows_there is not None and rows_there < loaded.recipe.batch.global_batch else None


def _longest(loaded: LoadedRecipe, gpu: str | None, exact_pinned: bool, densest_row: DensestRow) -> LongestSeqLen:
    def planner(recipe, card, **options):
        with loaded.sources.located():  # key-path errors at the recipe's file:line
            return plan_recipe(recipe, card, **options)

    return longest_seq_len(
        loaded.recipe,
        gpu,
        exact_pinned=exact_pinned,
        name=loaded.name,
        planner=planner,
        densest_row_samples=densest_row,
    )


def levers(
    loaded: LoadedRecipe, found: LongestSeqLen, *, gpu: str | None, exact_pinned: bool, densest_row: DensestRow = None
) -> list[Lever]:
    """The advice's cheapest changes that make the shortest missing length fit (plan/advice.py's decision tree:
    checkpointing, chunked loss, micro-batch, offload, ...), each with the longest length it reaches; with
    `densest_row`, every plan priced by the data's densest row at its length (no change the advice makes touches the
    data). None when the model's positions stop the search first."""
    if not found.first_miss:
        return []
    longer = with_overrides(loaded, [f"data.seq_len={found.first_miss}"])
    advice = advise(
        longer,
        gpu,
        limit=LEVERS,
        exact_pinned=exact_pinned,
        checks=recipe_checks(current_environment(), packages=False),
        densest_row_samples=densest_row(found.first_miss) if densest_row is not None else None,
    )
    out = []
    for item in advice:
        changed = with_overrides(loaded, item.overrides)
        longest = _longest(changed, gpu, exact_pinned, densest_row)
        out.append(Lever(item.overrides, item.reason, item.speed_cost, longest))
    return sorted(out, key=lambda lever: (-lever.longest.seq_len, lever.speed_cost))


def _table(found: LongestSeqLen, name: str) -> Table:
    plan = found.plan
    title = f"{name}: the longest data.seq_len that fits"
    if plan is not None:
        title += f" on {plan.gpu_name} (micro-batch {plan.micro_batch}, checkpointing {plan.checkpointing})"
    table = Table(title=title, title_justify="left")
    table.add_column("data.seq_len", justify="right")
    table.add_column("peak reserved GiB", justify="right")
    table.add_column("spare GiB", justify="right")
    table.add_column("host GiB", justify="right")
    table.add_column("")
    if plan is not None:
        why = "the model's positions" if found.model_limited else "fits"
        table.add_row(
            f"{found.seq_len:,}",
            f"{gib(plan.peak_reserved_bytes):.2f}",
            f"{gib(plan.headroom_bytes):.2f}",
            f"{gib(plan.host_bytes):.1f}",
            f"[green]{why}[/]",
        )
    else:
        table.add_row(f"< {found.step}", "", "", "", f"[red]not even {found.step} tokens fit[/]")
    if plan is not None and plan.packed_sequences:
        source = (
            f"the data's densest row at {found.seq_len:,} tokens: {found.densest_row_samples:,} samples"
            if found.densest_row_samples is not None
            else f"assumed: samples of {ASSUMED_SAMPLE_TOKENS} tokens; --data counts them"
        )
        table.caption = (
            f"attention backward priced for {plan.packed_sequences:,} packed sequences a micro-batch ({source})"
        )
        table.caption_justify = "left"
    if found.next_plan is not None:
        over = found.next_plan
        said = "tight" if over.fits else "misses"
        table.add_row(
            f"{over.seq_len:,}",
            f"{gib(over.peak_reserved_bytes):.2f}",
            f"{gib(over.headroom_bytes):.2f}",
            f"{gib(over.host_bytes):.1f}",
            f"[red]{said}[/]",
        )
    return table


def _levers_table(found_levers: list[Lever]) -> Table:
    table = Table(title="changes that lengthen it (longest first)", title_justify="left")
    table.add_column("overrides", overflow="fold", ratio=3)
    table.add_column("longest seq_len", justify="right")
    table.add_column("slowdown", justify="right")
    table.add_column("why", ratio=2)
    for lever in found_levers:
        table.add_row(
            "\n".join(lever.overrides), f"{lever.longest.seq_len:,}", f"+{lever.speed_cost:.0%}", lever.reason
        )
    return table


def max_seq_len_command(
    loaded: LoadedRecipe,
    *,
    gpu: str | None,
    exact_pinned: bool,
    as_json: bool,
    console,
    with_data: bool | None = False,
) -> int:
    """Print the longest length (rich tables or --json); 0 when some length fits, 1 when none does.
    with_data: price each length by the data's densest row at it (`data_by_length`), and say when the data cannot
    fill one step at the answer; None: where the data is small and here (plan_data.py)."""
    densest_row, rows, unread = None, None, None
    if reads_data(loaded.recipe, with_data):
        counted, unread = read_data(lambda: data_by_length(loaded), with_data)
        densest_row, rows = counted or (None, None)
    found = _longest(loaded, gpu, exact_pinned, densest_row)
    found_levers = levers(loaded, found, gpu=gpu, exact_pinned=exact_pinned, densest_row=densest_row)
    rows_there = rows(found.seq_len) if rows is not None and found.seq_len else None  # packs the data once more
    few = too_few_rows(loaded, rows_there)
    code = 0 if found.seq_len else 1
    if as_json:
        console.print_json(
            json.dumps(
                {
                    "max_seq_len": found.to_json(),
                    "recipe_seq_len": loaded.recipe.data.seq_len,
                    "levers": [lever.to_json() for lever in found_levers],
                    **({"rows_at_seq_len": rows_there, "too_few_rows": few} if rows is not None else {}),
                    **({"data_unread": unread} if unread else {}),
                }
            )
        )
        return code
    console.print(_table(found, loaded.name))
    if found_levers:
        console.print(_levers_table(found_levers))
    if unread:
        console.print(unread_note(unread), highlight=False, soft_wrap=True)
    if few is not None:
        global_batch, items = loaded.recipe.batch.global_batch, loaded.recipe.data.item_name
        console.print(
            f"[yellow]![/] at {found.seq_len:,} tokens the data makes {few} {items if few != 1 else items[:-1]}, "
            f"fewer than one global batch of {global_batch}: a run there is refused — lower batch.global_batch, add "
            "data, or choose a shorter data.seq_len",
            highlight=False,
        )
    if found.seq_len and found.seq_len < loaded.recipe.data.seq_len:
        console.print(
            f"[yellow]![/] the recipe's data.seq_len {loaded.recipe.data.seq_len:,} does not fit: "
            f"data.seq_len={found.seq_len} does",
            highlight=False,
        )
    return code
