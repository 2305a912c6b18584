"""`memtrain plan --max-seq-len`: the longest data.seq_len a recipe fits on the card, and what would lengthen it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from rich.table import Table

from memtrain.checks.environment import current_environment
from memtrain.checks.load import recipe_checks
from memtrain.plan.advice import advise, with_overrides
from memtrain.plan.planner import plan_recipe
from memtrain.plan.seq_len import LongestSeqLen, longest_seq_len
from memtrain.recipe.sources import LoadedRecipe
from memtrain.units import gib

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


def _longest(loaded: LoadedRecipe, gpu: str | None, exact_pinned: bool) -> LongestSeqLen:
    def planner(recipe, card, **options):
        with loaded.sources.located():  # key-path errors at the recipe's file:line
            return plan_recipe(recipe, card, **options)

    return longest_seq_len(loaded.recipe, gpu, exact_pinned=exact_pinned, name=loaded.name, planner=planner)


def levers(loaded: LoadedRecipe, found: LongestSeqLen, *, gpu: str | None, exact_pinned: bool) -> list[Lever]:
    """The advice's cheapest changes that make the shortest missing length fit (plan/advice.py's decision tree:
    checkpointing, chunked loss, micro-batch, offload, ...), each with the longest length it reaches. None when the
    model's positions stop the search first."""
    if not found.first_miss:
        return []
    longer = with_overrides(loaded, [f"data.seq_len={found.first_miss}"])
    advice = advise(
        longer,
        gpu,
        limit=LEVERS,
        exact_pinned=exact_pinned,
        checks=recipe_checks(current_environment(), packages=False),
    )
    out = []
    for item in advice:
        changed = with_overrides(loaded, item.overrides)
        out.append(Lever(item.overrides, item.reason, item.speed_cost, _longest(changed, gpu, exact_pinned)))
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


def max_seq_len_command(loaded: LoadedRecipe, *, gpu: str | None, exact_pinned: bool, as_json: bool, console) -> int:
    """Print the longest length (rich tables or --json); 0 when some length fits, 1 when none does."""
    found = _longest(loaded, gpu, exact_pinned)
    found_levers = levers(loaded, found, gpu=gpu, exact_pinned=exact_pinned)
    code = 0 if found.seq_len else 1
    if as_json:
        console.print_json(
            json.dumps(
                {
                    "max_seq_len": found.to_json(),
                    "recipe_seq_len": loaded.recipe.data.seq_len,
                    "levers": [lever.to_json() for lever in found_levers],
                }
            )
        )
        return code
    console.print(_table(found, loaded.name))
    if found_levers:
        console.print(_levers_table(found_levers))
    if found.seq_len and found.seq_len < loaded.recipe.data.seq_len:
        console.print(
            f"[yellow]![/] the recipe's data.seq_len {loaded.recipe.data.seq_len:,} does not fit: "
            f"data.seq_len={found.seq_len} does",
            highlight=False,
        )
    return code
