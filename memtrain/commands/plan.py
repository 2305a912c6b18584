"""`memtrain plan`: print the memory plan of a recipe, advise when it does not fit, write a fitted recipe."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path

import yaml
from rich.table import Table

from memtrain.checks.environment import Environment, current_environment, packages_needed
from memtrain.checks.load import load_checked, recipe_checks
from memtrain.commands.max_seq_len import max_seq_len_command
from memtrain.commands.plan_data import read_data, reads_data, unread_note
from memtrain.data.rows.loader import densest_row_samples, sample_order, token_slots
from memtrain.data.rows.row_set import DataStats
from memtrain.errors import Problem, RecipeError
from memtrain.files import write_atomically
from memtrain.model.attention import packs_steps, resolve_attention, with_attention
from memtrain.model.compiled import resolve_compile
from memtrain.plan.advice import Advice, advise
from memtrain.plan.attention_backward import ASSUMED_SAMPLE_TOKENS
from memtrain.plan.planner import TERMS, Plan, plan_recipe, resolve_micro_batch
from memtrain.recipe.load import apply_overrides, input_paths, is_relative_path
from memtrain.recipe.schema import gpu_spec
from memtrain.recipe.sources import COMMAND_LINE, LoadedRecipe, Sources
from memtrain.train.progress_bar import tokenising_progress
from memtrain.train.runtime.allocator import exact_pinned_supported
from memtrain.train.setup import build_data
from memtrain.units import gib

# Steps `plan --data` walks through to price bucketed batches (a million rows would take too long to wait for).
PRICED_STEPS = 1000

LABELS = {
    "params": "model_params",
    "gradients": "gradients",
    "optimizer_states": "optimizer_states",
    "activations": "activation_memory",
    "logits_loss": "logits + loss",
    "deepspeed_buffers": "DeepSpeed buffers",
    "reduce_stream": "ZeRO-3 reduce stream",
    "cuda_context": "CUDA context",
    "allocator_slack": "allocator slack",
}


def load_for_plan(recipe: Path, overrides: list[str], env: Environment) -> LoadedRecipe:
    """Load and check a recipe, except the quick 'weights exceed the card' check (planning a recipe that does not
    fit is this command's job: its advice says what to change) and the optional packages the run will import (a
    plan is what one runs before installing anything; `packages_needed` names them)."""
    return load_checked(recipe, overrides, env, weights_fit=False, packages=False)


def located_plan(
    loaded: LoadedRecipe,
    *,
    gpu: str | None,
    exact_pinned: bool,
    micro_batch: int | None = None,
    densest_row_samples: int | None = None,
) -> Plan:
    """plan_recipe as this command asks it: the recipe's name on the plan, and key-path errors placed at the
    recipe's file:line. exact_pinned: pinned host buffers priced as this PyTorch allocates them."""
    with loaded.sources.located():
        return plan_recipe(
            loaded.recipe,
            gpu,
            micro_batch=micro_batch,
            exact_pinned=exact_pinned,
            name=loaded.name,
            densest_row_samples=densest_row_samples,
        )


def verdict(plan: Plan) -> str:
    """'fits with X GiB to spare' or 'misses by X GiB' (GPU), plus the host when it is the problem."""
    if plan.tight:
        high = plan.peak_reserved_high_bytes + plan.terms["cuda_context"]
        text = (
            f"fits with {gib(plan.headroom_bytes):.2f} GiB to spare, but tight: at the largest allocator "
            f"slack measured for such runs it needs {gib(high):.2f} GiB"
        )
    elif plan.headroom_bytes >= 0:
        text = f"fits with {gib(plan.headroom_bytes):.2f} GiB to spare"
    else:
        text = f"misses by {gib(-plan.headroom_bytes):.2f} GiB"
    if not plan.host_fits:
        text += (
            f"; host memory misses by {gib(plan.host_bytes - plan.host_capacity_bytes):.1f} GiB: the run needs "
            f"{gib(plan.host_bytes):.1f} GiB of host ({plan.host_peak_phase.replace('_', ' ')}), this recipe declares "
            f"{gib(plan.host_capacity_bytes):.1f} (hardware.host_memory)"
        )
    return text


def plan_table(plan: Plan, auto_micro_batch: bool = False) -> Table:
    """The article's breakdown per GPU, then the phases, host, NVMe, capacity and verdict.
    auto_micro_batch: the recipe's batch.micro_batch is 'auto' (the title says the size is the planner's)."""
    machines = f"{plan.nodes} nodes × " if plan.nodes > 1 else ""
    chosen = " (auto)" if auto_micro_batch else ""
    table = Table(
        title=f"{plan.recipe_name} on {machines}{plan.gpus} × {plan.gpu_name} — ZeRO-{plan.zero_stage}, "
        f"micro-batch {plan.micro_batch}{chosen} × {plan.seq_len} tokens, checkpointing "
        f"{plan.checkpointing}" + (", compiled layers" if plan.compiled_layers else ""),
        title_justify="left",
    )
    table.add_column("per GPU", style="bold")
    table.add_column("GiB", justify="right")
    if plan.preference:  # the micro-batch counts pairs: say what its rows are and what the reference costs
        table.add_row(f"[dim]{plan.preference}[/]", "", end_section=True)
    for term in TERMS:
        if term == "reduce_stream" and not plan.terms[term]:
            continue  # only ZeRO-3 with an offloaded optimizer has one; the article's rows always show
        table.add_row(LABELS[term], f"{gib(plan.terms[term]):.2f}")
        if term == "activations" and plan.packed_sequences:
            source = (
                "the data's densest row"
                if plan.packed_sequences_counted
                else f"assumed: samples of {ASSUMED_SAMPLE_TOKENS} tokens; --data counts them"
            )
            table.add_row(
                f"  [dim]attention backward priced for {plan.packed_sequences} packed sequences a micro-batch "
                f"({source})[/]",
                "",
            )
    table.add_section()
    for phase, allocated in plan.phases.items():
        marker = " ← peak" if phase == plan.peak_phase else ""
        table.add_row(f"phase {phase} (allocated){marker}", f"{gib(allocated):.2f}")
    table.add_section()
    table.add_row("peak allocated", f"{gib(plan.peak_allocated_bytes):.2f}")
    table.add_row("peak reserved", f"{gib(plan.peak_reserved_bytes):.2f}")
    table.add_row("peak reserved + CUDA context", f"{gib(plan.gpu_required_bytes):.2f}")
    table.add_row("card capacity", f"{gib(plan.gpu_capacity_bytes):.2f}")
    table.add_section()
    host = ", ".join(f"{k} {gib(v):.1f}" for k, v in plan.host_breakdown.items() if v)
    pinned = "pinned buffers at their size" if plan.pinned_exact else "pinned buffers rounded up to 2^k by this PyTorch"
    each = ", each node" if plan.nodes > 1 else ""
    table.add_row(f"host ({pinned}{each})", f"{gib(plan.host_bytes):.2f}", end_section=False)
    table.add_row(f"  [dim]{host}[/]", "")
    for phase, value in plan.host_phases.items():
        marker = " ← peak" if phase == plan.host_peak_phase else ""
        table.add_row(f"  host phase {phase}{marker}", f"{gib(value):.2f}")
    kinds = plan.host_kinds
    if kinds:
        table.add_row(
            f"  [dim]at the peak: pinned {gib(kinds['pinned']):.1f}, pageable {gib(kinds['pageable']):.1f}; "
            f"page cache of the checkpoint files {gib(kinds['page_cache']):.1f} (reclaimable, not counted)[/]",
            "",
        )
    if plan.host_capacity_bytes is not None:
        table.add_row("host capacity", f"{gib(plan.host_capacity_bytes):.2f}")
    table.add_row(f"NVMe{' (each node)' if plan.nodes > 1 else ''}", f"{gib(plan.nvme_bytes):.2f}")
    style = "red" if not plan.fits else "yellow" if plan.tight else "green"
    table.add_section()
    table.add_row(f"[{style}]verdict[/]", f"[{style}]{verdict(plan)}[/]")
    return table


def fitted_yaml(recipe: Path, overrides: list[str], output: Path) -> str:
    """The recipe file's own YAML with `overrides` applied; `extends` and the relative input paths (read
    relative to the recipe file, or to the working directory when an override gave them) re-pointed relative
    to `output`."""
    data = yaml.safe_load(recipe.read_text()) or {}
    sources = Sources(recipe_file=str(recipe))
    data, problems = apply_overrides(data, overrides, sources)
    if problems:
        raise RecipeError(problems)
    if isinstance(data.get("extends"), str) and not Path(data["extends"]).is_absolute():
        base = (recipe.parent / data["extends"]).resolve()
        data["extends"] = os.path.relpath(base, output.resolve().parent)
    for holder, key, path in input_paths(data):
        if is_relative_path(holder.get(key)):
            origin = Path.cwd() if sources.where(path)[0] == COMMAND_LINE else recipe.parent
            holder[key] = os.path.relpath(os.path.abspath(origin / holder[key]), output.resolve().parent)
    header = f"# Fitted by `memtrain plan --fit` from {recipe}: {' '.join(overrides)}\n"
    return header + yaml.safe_dump(data, sort_keys=False)


def _advice_table(advice: list[Advice]) -> Table:
    """The advice, one row each; a tight one (listed after those with margin) says so in yellow."""
    table = Table(title="cheapest changes that fit (tight ones last: they may not)", title_justify="left")
    table.add_column("overrides", overflow="fold", ratio=3)
    table.add_column("peak GiB", justify="right")
    table.add_column("spare GiB", justify="right")
    table.add_column("tight", justify="center")
    table.add_column("slowdown", justify="right")
    table.add_column("why", ratio=2)
    for item in advice:
        table.add_row(
            "\n".join(item.overrides),
            f"{gib(item.peak_reserved_bytes):.2f}",
            f"{gib(item.plan.headroom_bytes):.2f}",
            "[yellow]yes[/]" if item.tight else "no",
            f"+{item.speed_cost:.0%}",
            item.reason,
        )
    return table


def gpu_override(gpu: str) -> str:
    """`hardware.gpu=<gpu>` as the user gave --gpu, quoted where YAML would read it as a number (a size in
    plain bytes), which hardware.gpu does not take."""
    return f"hardware.gpu={gpu}" if isinstance(yaml.safe_load(gpu), str) else f"hardware.gpu='{gpu}'"


def larger_micro_batch(
    loaded: LoadedRecipe, plan: Plan, *, gpu: str | None, exact_pinned: bool, densest_row_samples: int | None = None
) -> Plan | None:
    """The plan at the largest micro-batch that also fits (not tight), when it is larger than the recipe's.

    Spare memory spent on a larger micro-batch means fewer micro-batches per step at the same global
    batch; with an offloaded optimizer each one costs a round trip of the gradients through the host
    (1.1B offload, 4 → 16: about 2×, 9,100 and 18,712 tokens/s in two invocations, benchmarks/vs_hf.csv).
    """
    if not plan.fits or plan.tight or loaded.recipe.batch.micro_batch == "auto":
        return None
    best = resolve_micro_batch(loaded.recipe, gpu, exact_pinned, densest_row_samples)
    if best <= plan.micro_batch:
        return None
    return located_plan(
        loaded, gpu=gpu, exact_pinned=exact_pinned, micro_batch=best, densest_row_samples=densest_row_samples
    )


def fewer_recomputed_layers(
    loaded: LoadedRecipe, plan: Plan, *, gpu: str | None, exact_pinned: bool, densest_row_samples: int | None = None
) -> Plan | None:
    """The plan of checkpointing.strategy=auto at this micro-batch, when it recomputes fewer decoder
    layers than the recipe's whole-layer strategy and still fits (docs/BENCHMARKS.md: 7B LoRA 25 of 32
    layers instead of 32: 1.12x HF + DeepSpeed, where every layer gave 0.98x in an earlier invocation)."""
    if not plan.fits or plan.tight or loaded.recipe.checkpointing.strategy not in ("every_layer", "every_n_layers"):
        return None
    checkpointing = loaded.recipe.checkpointing.model_copy(update={"strategy": "auto"})
    auto = dataclasses.replace(loaded, recipe=loaded.recipe.model_copy(update={"checkpointing": checkpointing}))
    fewer = located_plan(
        auto,
        gpu=gpu,
        exact_pinned=exact_pinned,
        micro_batch=plan.micro_batch,
        densest_row_samples=densest_row_samples,
    )
    return fewer if fewer.fits and fewer.recomputed_layers < plan.recomputed_layers else None


def compile_offered(loaded: LoadedRecipe, plan: Plan) -> bool:
    """Whether `train.compile=true` is worth offering: only where it was measured faster, which is what `auto`
    compiles on a GPU (LoRA of a measured family, without lean dropout: docs/BENCHMARKS.md, 7B LoRA on 24 GB,
    1.50x HF eager), in a recipe that turned it off. Full fine-tunes and other families were not measured
    compiled, and lean dropout was measured slower, so nothing is offered there."""
    r = loaded.recipe
    auto = r.model_copy(update={"train": r.train.model_copy(update={"compile": "auto"})})
    # layer inputs on the host: the offload's saved-tensor hooks do not run inside compiled layers
    return not plan.compiled_layers and not plan.inputs_on_host and resolve_compile(auto, cuda=True)


def data_per_step(recipe, train_set, micro_batch: int) -> dict:
    """What one optimizer step trains on, on average over the training rows: token slots, real tokens,
    target tokens and the padding share (padding costs memory and time, not loss). Rows are seq_len long;
    with length bucketing (data.group_by_length) each micro-batch of `micro_batch` rows is cut to its longest
    row, so the slots and the padding are those of the bucketed steps the run will take (up to
    PRICED_STEPS of them). The memory plan still prices seq_len: the widest micro-batch reaches it."""
    stats: DataStats = train_set.stats
    rows = recipe.batch.global_batch
    sequences = rows * getattr(train_set, "sequences_per_item", 1)  # a pair set's item is two sequences
    per_sequence = 1 / max(stats.rows, 1)
    slots_per_step, padding_share = sequences * stats.seq_len, stats.padding_share
    tokens_per_step = sequences * stats.tokens * per_sequence
    targets_per_step = sequences * stats.target_tokens * per_sequence
    pack = recipe.data.groups_by_length and packs_steps(with_attention(recipe, resolve_attention(recipe, varlen=True)))
    if recipe.data.groups_by_length:  # every column over the same priced steps (padding too)
        order = sample_order(recipe.data, train_set, recipe.train.seed, rows, pack_steps=pack)
        steps = max(1, min(len(train_set) // rows, PRICED_STEPS))
        per_rank = rows // recipe.hardware.gpus
        slots = token_slots(order, train_set, rows, per_rank, min(micro_batch, per_rank), True, steps, pack_steps=pack)
        priced = order.indices(0, steps * rows)
        tokens = train_set.tokens_of(priced)  # a pair's two sequences
        slots_per_step, padding_share = round(slots / steps), 1 - tokens / slots
        tokens_per_step, targets_per_step = tokens / steps, train_set.target_tokens(priced) / steps
    return {
        "rows_per_step": sequences,
        "token_slots_per_step": slots_per_step,
        "tokens_per_step": round(tokens_per_step),
        "target_tokens_per_step": round(targets_per_step),
        "padding_share": padding_share,
        "length_bucketing": recipe.data.groups_by_length and not pack,
        "laid_out_packed": pack,  # each step's samples (pairs) end to end in rows, on the recipe's CUDA card
        "train": {**dataclasses.asdict(stats)},
    }


def _data_table(summary: dict) -> Table:
    table = Table(title="data per optimizer step (average over the training rows)", title_justify="left")
    table.add_column("rows × seq_len")
    table.add_column("token slots", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("target tokens", justify="right")
    table.add_column("padding", justify="right")
    train = summary["train"]
    bucketed = " (length-bucketed)" if summary["length_bucketing"] else ""
    bucketed = " (laid out packed)" if summary.get("laid_out_packed") else bucketed
    table.add_row(
        f"{summary['rows_per_step']} × {train['seq_len']}",
        f"{summary['token_slots_per_step']:,}{bucketed}",
        f"{summary['tokens_per_step']:,}",
        f"{summary['target_tokens_per_step']:,}",
        f"{summary['padding_share']:.1%}",
    )
    return table


def check_gpu_option(gpu: str) -> None:
    """--gpu names a card as hardware.gpu does (the schema's gpu_spec); said at the flag, not at the recipe's key."""
    try:
        gpu_spec(gpu)
    except ValueError as error:
        message, _, hint = str(error).partition(" — ")
        raise RecipeError(Problem(message, key="--gpu", file=COMMAND_LINE, hint=hint)) from None


def plan_command(
    recipe: Path,
    overrides: list[str],
    gpu: str | None,
    fit: bool,
    output: Path | None,
    as_json: bool,
    console,
    with_data: bool | None = False,
    max_seq_len: bool = False,
) -> int:
    """Print the plan (rich table or --json); 0 when it fits or --fit wrote a fitting recipe, else 1.
    --fit -o writes a recipe that fits either way: with the cheapest change, or as it is (overrides applied).
    with_data: read the data (--data), or not (--no-data); None: where it is small and here (plan_data.py)."""
    if max_seq_len and fit:
        raise RecipeError(
            Problem(
                "--max-seq-len searches the length; it does not combine with --fit",
                file=COMMAND_LINE,
                hint="run `memtrain plan --max-seq-len` alone, then --fit with the data.seq_len you chose",
            )
        )
    if output is not None and not fit:
        raise RecipeError(
            Problem(
                "-o/--output writes the fitted recipe, so it needs --fit",
                file=COMMAND_LINE,
                hint="add --fit, or drop -o",
            )
        )
    if gpu is not None:
        check_gpu_option(gpu)
    env = current_environment()
    exact_pinned = exact_pinned_supported()
    loaded = load_for_plan(recipe, overrides, env)
    if max_seq_len:
        return max_seq_len_command(
            loaded, gpu=gpu, exact_pinned=exact_pinned, as_json=as_json, console=console, with_data=with_data
        )
    data, unread = None, None
    if reads_data(loaded.recipe, with_data):  # built first: the plan prices the attention backward by its densest row

        def read():
            with tokenising_progress(), loaded.sources.located():
                return build_data(loaded.recipe)

        data, unread = read_data(read, with_data)
    densest = densest_row_samples(data.train_set) if data is not None else None
    plan = located_plan(loaded, gpu=gpu, exact_pinned=exact_pinned, densest_row_samples=densest)

    # with --data every plan below prices the densest row counted, as the run will
    checks = recipe_checks(env, packages=False)
    advice = (
        [] if plan.fits else advise(loaded, gpu, exact_pinned=exact_pinned, checks=checks, densest_row_samples=densest)
    )
    written, replaced = None, False
    if fit and output is not None and (plan.fits or advice):
        # A recipe that fits is written as it is (with the command line's overrides), so that
        # `plan --fit -o F && memtrain run F` works either way. Later overrides of the same key win.
        changes = [] if plan.fits else advice[0].overrides
        # The card of --gpu goes into the file: `plan F` and `run F` (which resolves batch.micro_batch and
        # checkpointing.strategy `auto` against hardware.gpu) must see the card the recipe was fitted for.
        card = [gpu_override(gpu)] if gpu is not None and gpu != loaded.recipe.hardware.gpu else []
        chosen = list({item.partition("=")[0]: item for item in list(overrides) + card + changes}.values())
        replaced = output.exists()
        if not (plan.fits and not chosen and output.resolve() == recipe.resolve()):  # not the recipe onto itself
            write_atomically(output, fitted_yaml(recipe, chosen, output))
        if not plan.fits:
            # planned as the file says, without --gpu: it names the card
            fitted = located_plan(
                load_for_plan(output, [], env), gpu=None, exact_pinned=exact_pinned, densest_row_samples=densest
            )
            if not fitted.fits:  # the advice was planned on the same recipe; a mismatch is a bug, say so
                raise RuntimeError(f"fitted recipe {output} does not fit: {verdict(fitted)}")
        written = output
    code = 0 if plan.fits or written is not None else 1
    faster = larger_micro_batch(loaded, plan, gpu=gpu, exact_pinned=exact_pinned, densest_row_samples=densest)
    recompute_less = fewer_recomputed_layers(
        loaded, plan, gpu=gpu, exact_pinned=exact_pinned, densest_row_samples=densest
    )
    offer_compile = plan.fits and compile_offered(loaded, plan)
    needed = packages_needed(loaded.recipe, env)
    per_step, data_warnings = None, ()
    if data is not None:
        per_step, data_warnings = data_per_step(loaded.recipe, data.train_set, plan.micro_batch), data.warnings
    if as_json:
        console.print_json(
            json.dumps(
                {
                    "plan": plan.to_json(),
                    "verdict": verdict(plan),
                    **({"data": per_step, "data_warnings": list(data_warnings)} if data is not None else {}),
                    **({"data_unread": unread} if unread else {}),
                    **({"packages_needed": needed} if needed else {}),
                    "advice": [a.to_json() for a in advice],
                    "fitted_recipe": str(written) if written else None,
                    "larger_micro_batch": faster.micro_batch if faster else None,
                    "fewer_recomputed_layers": recompute_less.recomputed_layers if recompute_less else None,
                    "compile_layers": offer_compile,
                }
            )
        )
        return code
    console.print(plan_table(plan, auto_micro_batch=loaded.recipe.batch.micro_batch == "auto"))
    if per_step is not None:
        console.print(_data_table(per_step))
    for warning in data_warnings:
        console.print(f"[yellow]![/] {warning}", highlight=False, soft_wrap=True)
    if unread:
        console.print(unread_note(unread), highlight=False, soft_wrap=True)
    for package in needed:
        console.print(f"[yellow]![/] the run needs {package}: not installed here", highlight=False, soft_wrap=True)
    if faster is not None:
        console.print(
            f"faster: batch.micro_batch={faster.micro_batch} also fits ({gib(faster.peak_reserved_bytes):.2f} "
            f"GiB reserved; the global batch stays {loaded.recipe.batch.global_batch}, with fewer "
            "micro-batches per step) — or batch.micro_batch=auto"
        )
    if recompute_less is not None:
        console.print(
            f"faster: checkpointing.strategy=auto recomputes {recompute_less.recomputed_layers} decoder layers "
            f"instead of {plan.recomputed_layers} ({gib(recompute_less.peak_reserved_bytes):.2f} GiB reserved "
            "at this micro-batch)"
        )
    if offer_compile:
        console.print(
            "faster: train.compile=true fuses each decoder layer's element-wise work (measured speed-ups in "
            "docs/BENCHMARKS.md; the first step waits for the compiler)"
        )
    if advice:
        console.print(_advice_table(advice))
        if written is not None and advice[0].tight:
            console.print(
                f"[yellow]![/] {'replaced' if replaced else 'wrote'} {written} ({verdict(advice[0].plan)}); "
                "no change found fits with that margin, so the run may run out of memory: a shorter "
                "data.seq_len, or a card with more memory (plan it with --gpu), leaves room",
                soft_wrap=True,
            )
        elif written is not None:
            console.print(f"[green]✓[/] {'replaced' if replaced else 'wrote'} {written} ({verdict(advice[0].plan)})")
        elif fit and output is None:
            console.print("[yellow]--fit needs -o FILE to write the fitted recipe[/]")
        else:
            card = ["--gpu", gpu] if gpu is not None else []  # the advice was planned for that card
            console.print(
                f"apply: {shlex.join(['memtrain', 'plan', str(recipe), *card, *overrides, *advice[0].overrides])}"
            )
    elif written is not None:
        console.print(f"[green]✓[/] fits as it is; {'replaced' if replaced else 'wrote'} {written} (no change)")
    elif not plan.fits:
        console.print(
            "[red]no combination of checkpointing, precision, micro-batch, offload and LoRA fits this card[/]"
        )
    return code
