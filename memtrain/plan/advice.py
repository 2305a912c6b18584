"""Advice: the cheapest change that makes a recipe fit, walking the article's decision tree.

Levers, in the tree's order: activation checkpointing → tiled MLPs (long sequences) → lean LoRA dropout → precision
(chunked loss, bf16 master and optimizer states) → micro-batch (gradient accumulation keeps the global batch) →
optimizer offload (or, for a full fine-tune on one GPU, the optimizer step in backward with paged 8-bit states) →
parameter offload / NVMe → fewer parameters kept gathered (ZeRO-3) → LoRA → quantised base weights (QLoRA); and,
when the host cannot hold the offloaded states, pageable buffers, parameters back on the GPU and optimizer states
on NVMe (the plan checks host capacity only when the recipe sets `hardware.host_memory`; `memtrain run`'s preflight
checks the machine's memory otherwise). Every combination of one option per lever is planned (the plan is
arithmetic on cached traces, so this takes seconds); combinations the recipe checks refuse (quantised weights with
ZeRO-3, say) are dropped; the ones that fit are ranked by their estimated slowdown, ties broken by the tree's
order, and each is returned as `key.path=value` overrides. A change whose plan is *tight* (it fits at the expected
allocator slack, not at the largest one measured) ranks after every change that fits with that margin: see
`advise`. The speed costs are rough fractions of step time, documented in docs/PLAN.md.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from memtrain.errors import Problem, RecipeError
from memtrain.model.config import model_config
from memtrain.model.tiled_mlp import tile_count
from memtrain.plan.planner import Plan, micro_batch_candidates, plan_recipe
from memtrain.recipe.load import apply_overrides, validate
from memtrain.recipe.rules import check_rules
from memtrain.recipe.schema import Recipe
from memtrain.recipe.sources import LoadedRecipe


@dataclass(frozen=True)
class Option:
    overrides: tuple[str, ...]
    speed_cost: float  # extra step time as a fraction (0.33 = a third slower)
    reason: str
    halvings: int = 0  # micro-batch halvings: priced by `_merge`, per combination (the rate depends on its offload)


@dataclass
class Advice:
    overrides: list[str]
    plan: Plan
    speed_cost: float
    reason: str

    @property
    def peak_reserved_bytes(self) -> int:
        return self.plan.peak_reserved_bytes

    @property
    def tight(self) -> bool:
        """Fits at the expected allocator slack but not at the largest measured: it may not fit (Plan.tight)."""
        return self.plan.tight

    def to_json(self) -> dict:
        return {
            "overrides": self.overrides,
            "speed_cost": self.speed_cost,
            "reason": self.reason,
            "tight": self.tight,
            "peak_reserved_bytes": self.plan.peak_reserved_bytes,
            "headroom_bytes": self.plan.headroom_bytes,
            "host_bytes": self.plan.host_bytes,
            "nvme_bytes": self.plan.nvme_bytes,
        }


KEEP = Option((), 0.0, "")


# Recomputed layers' inputs in pinned host memory (checkpointing.offload_inputs): two copies over PCIe per layer
# and step, not overlapped with compute (save_on_cpu's copies run on the compute stream). Not measured yet: a
# layer's input at 65,536 tokens is 0.5 GiB, about 20 ms each way at 25 GB/s against a layer's forward and
# backward of several hundred ms on a 24 GB card.
INPUTS_ON_HOST_COST = 0.15


def _inputs_on_host(r: Recipe) -> tuple[str, ...]:
    """checkpointing.offload_inputs, where it can be turned on (not with compiled layers, nor when on already)."""
    if r.checkpointing.offload_inputs or r.train.compile is True:
        return ()
    return ("checkpointing.offload_inputs=true",)


# A memory budget halved (checkpointing.memory_budget): the compiler recomputes more of each layer, matmuls among it
# once the element-wise work is spent. On the CPU one Llama-2-7B LoRA layer's forward and backward took 0.80 s at 0.2
# against 0.70 at 0.4 (1.01 with the whole layer recomputed); on an H100 the 7B recipe stepped alike at 0.4 (2 x 1024)
# and 0.2 (4 x 1024).
HALVED_BUDGET_COST = 0.14
SMALLEST_BUDGET = 0.05  # below it the budget is every_layer by another name


def _checkpointing_options(r: Recipe) -> list[Option]:
    on_host = _inputs_on_host(r)
    why_host = "keep the recomputed layers' inputs in pinned host memory (long sequences)"
    if r.checkpointing.strategy == "every_layer":
        return [KEEP] + ([Option(on_host, INPUTS_ON_HOST_COST, why_host)] if on_host else [])
    options = [KEEP]
    halved = r.checkpointing.memory_budget / 2
    if r.checkpointing.strategy == "memory_budget" and halved >= SMALLEST_BUDGET:
        options.append(
            Option(
                (f"checkpointing.memory_budget={halved:g}",),
                HALVED_BUDGET_COST,
                "let the compiler recompute more of each decoder layer",
            )
        )
    if r.checkpointing.strategy == "none":
        options.append(
            Option(
                ("checkpointing.strategy=every_n_layers", "checkpointing.every_n_layers=2"),
                0.17,
                "recompute every second decoder layer in backward",
            )
        )
    options.append(
        Option(
            ("checkpointing.strategy=every_layer",),
            0.33,
            "recompute every decoder layer in backward (one extra forward)",
        )
    )
    if on_host:
        options.append(
            Option(
                ("checkpointing.strategy=every_layer", *on_host),
                0.33 + INPUTS_ON_HOST_COST,
                f"recompute every decoder layer in backward and {why_host}",
            )
        )
    return options


# Tiled MLPs (checkpointing.mlp_tiles): one more MLP forward per layer and step (DeepSpeed's TiledMLP recomputes it
# in backward), and the MLP is about 40 % of a 7B layer's forward at 32,768 tokens (attention's score matmuls grow
# with the length; the MLP's do not), in a step of about four forwards (forward, recompute, backward's two).
# Not measured yet.
MLP_TILES_COST = 0.1


def _mlp_tiles_options(r: Recipe) -> list[Option]:
    """checkpointing.mlp_tiles=auto where it tiles at all (the sequence longer than the hidden size) and is off;
    the recipe checks drop it where compiled layers or the optimizer stepped in backward refuse it."""
    if r.checkpointing.mlp_tiles != 0 or tile_count("auto", r.data.seq_len, model_config(r.model).hidden_size) == 0:
        return [KEEP]
    why = "compute each layer's MLP in tiles along the sequence, recomputed in backward (long sequences)"
    return [KEEP, Option(("checkpointing.mlp_tiles=auto",), MLP_TILES_COST, why)]


def _lora_dropout_options(r: Recipe) -> list[Option]:
    lora = r.model.lora
    if lora is None or lora.dropout == 0 or lora.lean_dropout or r.train.compile is True:
        return [KEEP]  # slower compiled (docs/BENCHMARKS.md: its autograd function is not fused); under auto it
        # turns compilation off, a trade of speed for memory that advice offers only where the recipe does not fit
    return [
        KEEP,
        Option(
            ("model.lora.lean_dropout=true",),
            0.1,
            "regenerate LoRA dropout masks in backward instead of keeping the dropped inputs",
        ),
    ]


def _precision_options(r: Recipe) -> list[Option]:
    options = [KEEP]
    p = r.precision
    if not p.chunked_loss:
        options.append(
            Option(("precision.chunked_loss=true",), 0.02, "compute the loss in chunks: no full fp32 logits")
        )
    if p.compute == "bf16" and p.master == "fp32":
        chunk = () if p.chunked_loss else ("precision.chunked_loss=true",)
        options.append(
            Option(
                chunk + ("precision.master=bf16",),
                0.03,
                "bf16 master weights and optimizer states (halves them; less precise updates)",
            )
        )
    return options


def _micro_batch_options(r: Recipe, current: int) -> list[Option]:
    """Smaller micro-batches; their cost is priced by `_merge`, which knows whether the combination they are
    part of offloads the parameters (the recipe alone does not: another lever may add the offload)."""
    options = [KEEP]
    for size in reversed([m for m in micro_batch_candidates(r) if m < current]):
        halvings = (current // size).bit_length() - 1
        options.append(
            Option(
                (f"batch.micro_batch={size}",),
                0.0,
                f"micro-batch {size} with more gradient accumulation (same global batch)",
                halvings=max(halvings, 1),
            )
        )
    return options


def _per_halving(params_offloaded: bool) -> float:
    """The slowdown of halving the micro-batch. With parameters offloaded every micro-batch gathers every
    parameter from the host again: the 3B ZeRO-3 recipe ran at 3,458 tokens/s at micro-batch 4 against 5,279
    at 8 (docs/BENCHMARKS.md)."""
    return 0.5 if params_offloaded else 0.05


def _offload_options(r: Recipe) -> list[Option]:
    o = r.offload
    options = [KEEP]
    if o.optimizer == "none":
        options.append(Option(("offload.optimizer=cpu",), 0.25, "optimizer states on the CPU (ZeRO-Offload)"))
    if o.params == "none":
        options.append(
            Option(
                ("offload.optimizer=cpu", "offload.params=cpu", "offload.zero_stage=3"),
                0.6,
                "optimizer states and parameters on the CPU (ZeRO-3 offload)",
            )
        )
    if r.hardware.nvme_path and o.params != "nvme":
        options.append(
            Option(
                ("offload.optimizer=nvme", "offload.params=nvme", "offload.zero_stage=3"),
                1.5,
                "optimizer states and parameters on NVMe (ZeRO-Infinity)",
            )
        )
    return options + _in_backward_options(r)


def _in_backward_options(r: Recipe) -> list[Option]:
    """A full fine-tune on one GPU without offload: bf16 weights updated in backward by paged 8-bit AdamW (no
    gradients kept, 2 bytes of state per weight in unified memory). Measured 9.8x the tokens/s of the 64 GiB-host
    ZeRO-3 offload recipe at a quarter of its host memory (docs/BENCHMARKS.md); it changes the math (8-bit
    states, no clipping, every micro-batch a step: within 2 % of fp32 AdamW's validation loss in
    benchmarks/convergence.csv), so it carries a cost, as LoRA does."""
    if (
        r.model.lora is not None
        or r.model.quant_type
        or r.hardware.world_size > 1
        or r.precision.compute != "bf16"
        or r.precision.mode != "cast"
        or r.optimizer.step_in_backward
    ):
        return []
    b = r.batch.global_batch
    return [
        Option(
            (
                "optimizer.step_in_backward=true",
                "optimizer.name=paged_adamw_8bit",
                "optimizer.grad_clip=0",
                "offload.optimizer=none",
                "offload.params=none",
                "offload.zero_stage=0",
                "precision.master=bf16",
                f"batch.micro_batch={b}",
                "batch.policy=fixed",
            ),
            0.3,
            f"each weight updated in backward by paged 8-bit AdamW, its gradient freed (one micro-batch of "
            f"{b} per step, no clipping); measured faster than ZeRO offload: its cost stands for the changed "
            "optimizer math (benchmarks/convergence.csv)",
        )
    ]


def _host_options(r: Recipe) -> list[Option]:
    """Host-side levers, for a recipe whose offloaded states do not fit `hardware.host_memory`: pageable
    instead of page-locked buffers (PyTorch rounds a pinned buffer up to a power of two), parameters back
    on the GPU where it has room (ZeRO-3 keeps them partitioned there), optimizer states on NVMe alone."""
    o = r.offload
    options = [KEEP]
    if o.optimizer == "none" and o.params == "none":
        return options
    if o.pin_memory:
        # measured: the 7B ZeRO-3 full fine-tune ran 4,713 tokens/s pinned and 2,477 unpinned, one invocation each at
        # micro-batch 16 (benchmarks/vs_hf.csv): 1.90x the time
        options.append(
            Option(
                ("offload.pin_memory=false",),
                0.9,
                "pageable host buffers instead of page-locked ones (no power-of-two rounding; slower copies)",
            )
        )
    if o.params == "cpu":
        options.append(
            Option(
                ("offload.params=none",),
                0.0,
                "parameters on the GPU, partitioned (only the optimizer stays on the host)",
            )
        )
    if r.hardware.nvme_path and o.optimizer == "cpu":
        # DeepSpeed's optimizer swapper takes fp32 master weights only (recipe/rules.py)
        options.append(
            Option(
                ("offload.optimizer=nvme", "offload.zero_stage=3", "precision.master=fp32"),
                1.0,
                "optimizer states on NVMe, fp32 (the host keeps gradients and swap buffers)",
            )
        )
    return options


LEAN_LIVE_PARAMETERS = 300_000_000


def _live_parameters_options(r: Recipe) -> list[Option]:
    # ZeRO-3 keeps up to max_live_parameters gathered between uses; 3e8 instead of 1e9 saves 1.3 GiB of
    # bf16 and cost the 3B recipe at micro-batch 8 about 4 % (docs/BENCHMARKS.md, two invocations)
    if r.offload.max_live_parameters <= LEAN_LIVE_PARAMETERS:
        return [KEEP]
    return [
        KEEP,
        Option(
            (f"offload.max_live_parameters={LEAN_LIVE_PARAMETERS}",),
            0.04,
            "ZeRO-3 keeps fewer gathered parameters between uses (3e8)",
        ),
    ]


def _lora_options(r: Recipe) -> list[Option]:
    if r.model.lora is not None:
        return [KEEP]
    # LoRA is fast, but it changes what is trained: last in the tree, so it carries a large cost.
    return [KEEP, Option(("model.lora.r=16",), 1.0, "train LoRA adapters (r=16) instead of all weights")]


def _quantize_options(r: Recipe) -> list[Option]:
    if r.model.quant_type or r.precision.mode == "autocast":
        return [KEEP]
    # Quantised weights are frozen, so they come with LoRA: a full fine-tune pays LoRA's cost as well.
    lora = () if r.model.lora is not None else ("model.lora.r=16",)
    cost = 0.3 if r.model.lora is not None else 1.3
    return [
        KEEP,
        Option(
            lora + ("model.quantize.type=nf4",),
            cost,
            "4-bit nf4 base weights (QLoRA): ~0.52 instead of 2 bytes per weight, dequantised in every matmul",
        ),
    ]


def _merge(r: Recipe, options: tuple[Option, ...]) -> tuple[list[str], float, str]:
    """One option per lever as one change: the overrides (a later lever's value of a key wins), the summed cost
    and the reasons. A smaller micro-batch is priced at the rate of the merged change's parameter offload, not
    the recipe's: halving the micro-batch of a change that also offloads the parameters re-gathers them twice
    as often (docs/PLAN.md)."""
    overrides: dict[str, str] = {}
    for option in options:
        for item in option.overrides:
            key, _, value = item.partition("=")
            overrides[key] = value
    params_offloaded = overrides.get("offload.params", r.offload.params) != "none"
    cost = sum(option.speed_cost + option.halvings * _per_halving(params_offloaded) for option in options)
    reason = "; ".join(option.reason for option in options if option.reason)
    return [f"{k}={v}" for k, v in overrides.items()], cost, reason


def with_overrides(loaded: LoadedRecipe, overrides: list[str]) -> LoadedRecipe:
    """The loaded recipe with `key.path=value` overrides applied (validated, not cross-checked)."""
    data = loaded.recipe.model_dump(mode="json")
    sources = copy.deepcopy(loaded.sources)
    data, problems = apply_overrides(data, overrides, sources)
    if problems:
        raise RecipeError(problems)
    return dataclasses.replace(loaded, recipe=validate(data, sources), sources=sources)


# The checks a combination must pass: (loaded recipe) -> problems. The recipe's own rules by default; the
# command hands in those of the environment too (a quantised base without bitsandbytes installed, say).
Checks = Callable[[LoadedRecipe], list[Problem]]


def _problem_keys(loaded: LoadedRecipe, checks: Checks) -> set[tuple[str, str]]:
    return {(p.key, p.message) for p in checks(loaded)}


def advise(
    loaded: LoadedRecipe,
    gpu: str | None = None,
    limit: int = 3,
    exact_pinned: bool = True,
    checks: Checks = check_rules,
    densest_row_samples: int | None = None,
) -> list[Advice]:
    """Changes that make the recipe fit, cheapest first ([] when it already fits or nothing does).
    densest_row_samples: the data's densest row, where counted (plan_recipe's; None: assumed).

    Changes whose plan is tight come after every change that fits with the margin of the largest allocator
    slack measured, whatever their cost: a tight plan may run out of memory on the card (runs with that slack
    were measured), which is why `batch.micro_batch: auto` does not take a tight size, and `plan --fit` writes
    the first change, so a slower one with margin beats a faster gamble. Tight ones are not dropped: they fill
    the list when fewer than `limit` changes have the margin, so a card where only tight changes fit still gets
    them, marked (Advice.tight). The search therefore runs on until `limit` changes with margin are found.

    A combination the checks refuse and the recipe as given did not (e.g. nf4 with ZeRO-3) is skipped.
    """
    r = loaded.recipe

    def plan_of(candidate: LoadedRecipe) -> Plan:
        return plan_recipe(
            candidate.recipe,
            gpu,
            exact_pinned=exact_pinned,
            name=candidate.name,
            densest_row_samples=densest_row_samples,
        )

    current = plan_of(loaded)
    if current.fits:
        return []
    micro_options = [KEEP] if r.batch.micro_batch == "auto" else _micro_batch_options(r, current.micro_batch)
    levers = [
        _checkpointing_options(r),
        _mlp_tiles_options(r),
        _lora_dropout_options(r),
        _precision_options(r),
        micro_options,
        _offload_options(r),
        _live_parameters_options(r),
        _lora_options(r),
        _quantize_options(r),
    ]
    if not current.host_fits:
        levers.append(_host_options(r))
    candidates = []
    for order, combination in enumerate(itertools.product(*levers)):
        overrides, cost, reason = _merge(r, combination)
        if overrides:
            candidates.append((cost, order, overrides, reason))
    # Cheapest first, so the search stops at the first `limit` fits with margin.
    candidates.sort(key=lambda item: (item[0], item[1]))
    before = _problem_keys(loaded, checks)
    comfortable: list[Advice] = []
    tight: list[Advice] = []
    seen: set[tuple[str, ...]] = set()
    for cost, _, overrides, reason in candidates:
        # A superset of a change that already fits with margin only costs more; one of a tight change may
        # be the margin's price (a smaller micro-batch on top, say), so it is planned.
        if tuple(sorted(overrides)) in seen or any(set(a.overrides) <= set(overrides) for a in comfortable):
            continue
        seen.add(tuple(sorted(overrides)))
        candidate = with_overrides(loaded, overrides)
        if _problem_keys(candidate, checks) - before:
            continue
        plan = plan_of(candidate)
        if not plan.fits:
            continue
        advice = Advice(overrides, plan, round(cost, 2), reason)
        if not plan.tight:
            comfortable.append(advice)
            if len(comfortable) >= limit:
                break
        elif len(tight) < limit and not any(set(a.overrides) <= set(overrides) for a in tight):
            tight.append(advice)  # a superset of a tight change that is tight as well only costs more
    return (comfortable + tight)[:limit]
