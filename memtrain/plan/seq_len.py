"""The longest `data.seq_len` a recipe fits on a card, by bisection over the plan.

Memory grows with the sequence (activations, logits, a packed mask), so the set of lengths that fit is a prefix
of the multiples of SEQ_LEN_STEP: bisection finds its end in about log2(max / step) plans. A length counts as
fitting when its plan fits without being tight, the margin `batch.micro_batch: auto` and `checkpointing.strategy:
auto` ask for: a tight plan may run out of memory. Both `auto` keys are resolved at each length, as the run would
resolve them. Pure: plans only, nothing is allocated.

Packed rows are priced by how many samples the densest row holds at each length (the attention backward grows with
them): counted in the data where the caller read it (`densest_row_samples`, a function of the length), else rows of
ASSUMED_SAMPLE_TOKENS-token samples are assumed (plan/attention_backward.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memtrain.model.config import model_config
from memtrain.plan.planner import Plan, plan_recipe
from memtrain.recipe.schema import Recipe

# Lengths are searched in these steps: whole tiles of the attention kernels and a multiple of every pad multiple
# the tokenizers ask for (8, 64, 128).
SEQ_LEN_STEP = 256
# The schema's own ceiling on data.seq_len (recipe/schema.py), for models that name no position limit.
SEQ_LEN_CEILING = 1_048_576


def with_seq_len(recipe: Recipe, seq_len: int) -> Recipe:
    """The recipe at another data.seq_len."""
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"seq_len": seq_len})})


def search_limit(recipe: Recipe, step: int = SEQ_LEN_STEP) -> int:
    """The longest length the search may try: the model's positions, rounded down to the step."""
    return max_positions(recipe) // step * step


def max_positions(recipe: Recipe) -> int:
    """The longest sequence the model's config allows (max_position_embeddings), within the schema's ceiling."""
    positions = getattr(model_config(recipe.model), "max_position_embeddings", None)
    return min(positions, SEQ_LEN_CEILING) if isinstance(positions, int) else SEQ_LEN_CEILING


def comfortable(plan: Plan) -> bool:
    """Fits the card and the host, with the margin of the largest allocator slack measured (not tight)."""
    return plan.fits and not plan.tight


@dataclass(frozen=True)
class LongestSeqLen:
    """The answer: the longest length that fits (0: not even one step), its plan, and the next step's plan."""

    seq_len: int
    plan: Plan | None  # at seq_len (None when nothing fits)
    next_plan: Plan | None  # at seq_len + step (None when seq_len is the model's limit)
    limit: int  # the model's positions, rounded down to the step: the search's upper end
    step: int = SEQ_LEN_STEP
    first_miss: int = 0  # the shortest length whose plan misses outright, tight ones aside (0: none up to limit)
    densest_row_samples: int | None = None  # the data's densest row at seq_len, as `plan` priced it (None: assumed)

    @property
    def model_limited(self) -> bool:
        """The model's positions, not the card, stop the search."""
        return self.next_plan is None and self.seq_len == self.limit

    def to_json(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "step": self.step,
            "limit": self.limit,
            "model_limited": self.model_limited,
            "peak_reserved_bytes": self.plan.peak_reserved_bytes if self.plan else None,
            "headroom_bytes": self.plan.headroom_bytes if self.plan else None,
            "host_bytes": self.plan.host_bytes if self.plan else None,
            "checkpointing": self.plan.checkpointing if self.plan else None,
            "micro_batch": self.plan.micro_batch if self.plan else None,
            "next_seq_len": self.next_plan.seq_len if self.next_plan else None,
            "next_peak_reserved_bytes": self.next_plan.peak_reserved_bytes if self.next_plan else None,
            "first_miss": self.first_miss or None,
            # the attention backward's sequences a micro-batch at seq_len, and whether the data counted them
            "packed_sequences": self.plan.packed_sequences if self.plan else None,
            "packed_sequences_counted": self.plan.packed_sequences_counted if self.plan else None,
            "densest_row_samples": self.densest_row_samples,
        }


def longest_seq_len(
    recipe: Recipe,
    gpu: str | None = None,
    *,
    exact_pinned: bool = True,
    name: str = "recipe",
    step: int = SEQ_LEN_STEP,
    planner: Callable[..., Plan] = plan_recipe,
    densest_row_samples: Callable[[int], int] | None = None,
) -> LongestSeqLen:
    """The longest multiple of `step` (up to the model's positions) at which `recipe` fits `gpu` comfortably.

    planner: plan_recipe, or a caller's wrapper of it (the command's places key-path errors at file:line).
    densest_row_samples: seq_len -> the most samples one row of the training data holds at that length
    (data/rows/densest_by_length.py); None: the planner's assumption.
    """
    limit = search_limit(recipe, step)
    cache: dict[int, Plan] = {}

    def densest_at(seq_len: int) -> int | None:
        return densest_row_samples(seq_len) if densest_row_samples is not None and seq_len else None

    def plan_at(seq_len: int) -> Plan:
        if seq_len not in cache:
            cache[seq_len] = planner(
                with_seq_len(recipe, seq_len),
                gpu,
                exact_pinned=exact_pinned,
                name=name,
                densest_row_samples=densest_at(seq_len),
            )
        return cache[seq_len]

    def last(fitting: Callable[[Plan], bool], low: int = 0) -> int:
        """The last step count whose plan is `fitting` (0 when none), bisected over [low, limit // step]."""
        high = limit // step
        while low < high:
            middle = (low + high + 1) // 2
            if fitting(plan_at(middle * step)):
                low = middle
            else:
                high = middle - 1
        return low

    seq_len = last(comfortable) * step
    fitting = last(lambda plan: plan.fits, seq_len // step) * step  # tight lengths lie between the two
    next_len = seq_len + step
    return LongestSeqLen(
        seq_len=seq_len,
        plan=plan_at(seq_len) if seq_len else None,
        next_plan=plan_at(next_len) if next_len <= limit else None,
        limit=limit,
        step=step,
        first_miss=fitting + step if fitting + step <= limit else 0,
        densest_row_samples=densest_at(seq_len),
    )
