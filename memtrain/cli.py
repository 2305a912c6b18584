"""The `memtrain` command: run, plan, compile, validate, schema, report.

Each command reads a recipe, hands it to the module that owns the work, and prints the result for
people (rich) or machines (--json). Input errors become one line per problem and exit code 2.
"""

from __future__ import annotations

import functools
import json
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from memtrain import __version__
from memtrain.checks.environment import current_environment, packages_needed
from memtrain.checks.load import load_checked
from memtrain.commands.chat import chat_command
from memtrain.commands.compile import compile_command
from memtrain.commands.eval import eval_command
from memtrain.commands.export import export_command
from memtrain.commands.plan import plan_command
from memtrain.commands.prepare import prepare_command
from memtrain.commands.preview import preview_command
from memtrain.commands.report import report_command
from memtrain.commands.run import run_command
from memtrain.commands.validate import validate_data
from memtrain.errors import UserError
from memtrain.recipe.schema import Recipe
from memtrain.train.resolve import RunOptions
from memtrain.train.runtime.nodes import JOIN_TIMEOUT_S, NodeFlags
from memtrain.train.runtime.signals import exit_code, signal_name, signum_of

app = typer.Typer(
    name="memtrain",
    help="Fine-tune 1B-7B language models on one or two 24 GB GPUs. Plan memory before the run, "
    "compile the DeepSpeed config from a YAML recipe, and train.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
console = Console()
err_console = Console(stderr=True)


def _flags_take_no_value() -> None:
    """Show a flag (--json, --fit, --help) in --help without a value type: typer's rich help (0.29) writes the type of
    every option, "--json <bool>", as if the flag took a value, and `--json true` is then refused. Older typers
    (0.1x, as some images ship) have no such method and need nothing."""
    shown = getattr(typer.core.TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_without_value", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.flags_without_value = True
    typer.core.TyperOption.display_type_rich = display_type_rich


_flags_take_no_value()

RecipeArg = typer.Argument(..., help="Recipe YAML file.", show_default=False)
OverridesArg = typer.Argument(None, help="Overrides as key.path=value, e.g. batch.micro_batch=2.", show_default=False)


def report_user_errors(command):
    """Print UserErrors as one line per problem and exit 2; never show a traceback for them. A Ctrl-C ends a
    command with one line and the shell's 130, whatever typer's version does with it (recent ones exit 130 without a
    word; older ones print "Aborted!" and exit 1, which `plan` uses for "does not fit")."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as interrupt:
            signum = signum_of(interrupt)
            err_console.print(f"[yellow]■[/] stopped by {signal_name(signum)}", highlight=False)
            raise typer.Exit(code=exit_code(signum)) from None
        except UserError as error:
            kind = type(error).__name__.replace("Error", " error").lower()
            err_console.print(f"[bold red]{kind}[/]: {error.count}", highlight=False)
            for problem in error.problems:
                err_console.print(f"  [red]✗[/] {escape(problem.format())}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=error.exit_code) from None

    return wrapper


STACK = ("torch", "deepspeed", "transformers", "peft")  # what a bug report needs beside memtrain's own version


def print_version(value: bool) -> None:
    if value:

        def installed(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "not installed"

        stack = ", ".join(f"{name} {installed(name)}" for name in STACK)
        print(f"memtrain {__version__} ({stack}; Python {platform.python_version()})")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False,
        "--version",
        callback=print_version,
        is_eager=True,
        help="Print memtrain's version and its stack's, and exit.",
    ),
):
    """Fine-tune 1B-7B language models on one or two 24 GB GPUs."""


@app.command()
@report_user_errors
def validate(
    recipe: Path = RecipeArg,
    overrides: Optional[list[str]] = OverridesArg,
    as_json: bool = typer.Option(False, "--json", help="Print the resolved recipe as JSON."),
    data: bool = typer.Option(
        False,
        "--data",
        help="Also read the data as a run does (tokenised once, then cached): bad records are said at file:line.",
    ),
):
    """Check a recipe: YAML syntax, unknown keys, types, ranges and contradictions; with --data, its data too.

    Example: [bold]memtrain validate recipes/llama2-7b-lora-24gb.yaml batch.micro_batch=2[/]
    """
    env = current_environment()
    loaded = load_checked(recipe, overrides, env, packages=False)  # what the run imports: said, not refused
    described = validate_data(loaded, err_console if as_json else console) if data else None
    if as_json:
        print(loaded.recipe.model_dump_json(indent=2))
    else:
        console.print(f"[green]✓[/] {recipe} is a valid recipe ({loaded.name})")
        if described is not None:
            console.print(f"[green]✓[/] its data reads: {described}", highlight=False, soft_wrap=True)
        for package in packages_needed(loaded.recipe, env):
            console.print(f"[yellow]![/] the run needs {package}: not installed here", highlight=False)


@app.command()
def schema():
    """Print the recipe JSON Schema (for editor completion, e.g. yaml-language-server).

    Example: [bold]memtrain schema > memtrain.schema.json[/]
    """
    print(json.dumps(Recipe.model_json_schema(), indent=2))


@app.command("compile")
@report_user_errors
def compile_(
    recipe: Path = RecipeArg,
    overrides: Optional[list[str]] = OverridesArg,
    output: Optional[Path] = typer.Option(
        None, "-o", "--output", help="Write the DeepSpeed config here (default: stdout)."
    ),
):
    """Write the DeepSpeed ZeRO / ZeRO-Offload / ZeRO-Infinity config of a recipe.

    Example: [bold]memtrain compile recipes/llama2-7b-full-offload-2x24gb.yaml -o ds_config.json[/]
    """
    raise typer.Exit(code=compile_command(recipe, list(overrides or []), output, console))


@app.command()
@report_user_errors
def plan(
    recipe: Path = RecipeArg,
    overrides: Optional[list[str]] = OverridesArg,
    gpu: Optional[str] = typer.Option(
        None, "--gpu", help="Ask about another card: a profile (rtx4090) or a size (16GiB)."
    ),
    fit: bool = typer.Option(
        False,
        "--fit",
        help="When it does not fit, apply the cheapest change that fits with margin (with -o; a recipe that fits is "
        "written as it is; with --gpu, the file names that card).",
    ),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="With --fit: write the fitted recipe here."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    data: Optional[bool] = typer.Option(
        None,
        "--data/--no-data",
        help="Read the data (tokenised once, then cached): tokens, target tokens and padding per step, and the "
        "attention backward priced for the densest packed row; --no-data assumes 256-token samples. Default: read "
        "where the data is on this machine and under 16 MiB.",
        show_default=False,
    ),
    max_seq_len: bool = typer.Option(
        False,
        "--max-seq-len",
        help="Search the longest data.seq_len (a multiple of 256) that fits the card, and changes that lengthen it; "
        "with the data read, each length priced by the densest row the data makes at it.",
    ),
):
    """Predict peak GPU memory, host RAM and NVMe bytes, without a GPU; say whether it fits.

    Example: [bold]memtrain plan recipes/llama2-7b-lora-24gb.yaml --gpu rtx4090[/]
    """
    code = plan_command(
        recipe,
        list(overrides or []),
        gpu=gpu,
        fit=fit,
        output=output,
        as_json=as_json,
        console=console,
        with_data=data,
        max_seq_len=max_seq_len,
    )
    raise typer.Exit(code=code)


@app.command()
@report_user_errors
def prepare(
    recipe: Path = RecipeArg,
    overrides: Optional[list[str]] = OverridesArg,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Do a run's one-time work ahead of it: tokenise the data into the cache and build the DeepSpeed ops it loads.

    Run it on the machine that will train (while its GPU is busy, say); the run then starts from the caches.
    Example: [bold]memtrain prepare recipes/tinyllama-1.1b-full-offload-24gb.yaml[/]
    """
    raise typer.Exit(code=prepare_command(recipe, list(overrides or []), as_json, console))


@app.command()
@report_user_errors
def preview(
    recipe: Path = RecipeArg,
    overrides: Optional[list[str]] = OverridesArg,
    rows: int = typer.Option(2, "--rows", min=1, help="How many rows to show."),
    start: int = typer.Option(
        0, "--start", min=0, help="The first row to show, by index (a run draws the rows in a shuffled order)."
    ),
    split: str = typer.Option("train", "--split", help="train or validation."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output: every span with its token ids."),
):
    """Show rows of the data as the model trains on them, the loss's targets marked (is it the answers only?).

    The data is built as `run` builds it: template, masking, truncation, packing and the run's row order.
    Example: [bold]memtrain preview recipes/quickstart-chat.yaml --rows 1[/]
    """
    raise typer.Exit(code=preview_command(recipe, list(overrides or []), rows, start, split, as_json, console))


@app.command()
@report_user_errors
def run(
    recipe: Path = RecipeArg,
    overrides: Optional[list[str]] = OverridesArg,
    resume: bool = typer.Option(
        True, "--resume/--no-resume", help="Continue from the newest complete checkpoint in the run directory."
    ),
    max_steps: Optional[int] = typer.Option(
        None,
        "--max-steps",
        min=1,
        help="Stop after this many more optimizer steps, counted from where the run resumes (the schedule still "
        "follows the recipe).",
    ),
    profile: int = typer.Option(
        0, "--profile", help="Record a torch.profiler trace of N steps into the run directory."
    ),
    save: bool = typer.Option(
        True, "--save/--no-save", help="--no-save: write no checkpoints and no final model (benchmarks, smoke tests)."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Start over in a run directory that holds a run; the old run is moved aside (NAME.previous-DATE).",
    ),
    nnodes: Optional[int] = typer.Option(
        None,
        "--nnodes",
        min=1,
        help="Machines the run spans (hardware.nodes; default: the recipe's, or SLURM_NNODES). Run the same command "
        "on each.",
        rich_help_panel="Several nodes",
    ),
    node_rank: Optional[int] = typer.Option(
        None,
        "--node-rank",
        min=0,
        help="This machine's rank, 0..N-1; 0 hosts the rendezvous (default: NODE_RANK or SLURM_NODEID).",
        rich_help_panel="Several nodes",
    ),
    master_addr: Optional[str] = typer.Option(
        None,
        "--master-addr",
        help="Node 0's hostname or IP, the same on every node (default: MASTER_ADDR, or the first host of the Slurm "
        "job).",
        rich_help_panel="Several nodes",
    ),
    master_port: Optional[int] = typer.Option(
        None,
        "--master-port",
        min=1,
        max=65535,
        help="Node 0's rendezvous port (default: MASTER_PORT, else 29500).",
        rich_help_panel="Several nodes",
    ),
    join_timeout: int = typer.Option(
        JOIN_TIMEOUT_S,
        "--join-timeout",
        min=1,
        help="Seconds the nodes wait for each other at start-up before giving up with exit 2.",
        rich_help_panel="Several nodes",
    ),
    hostfile: Optional[Path] = typer.Option(
        None,
        "--hostfile",
        help="DeepSpeed-style hostfile (`host slots=N` lines, this machine first): run once, here, and memtrain "
        "starts every node (the others through --remote-shell).",
        rich_help_panel="Several nodes",
    ),
    remote_shell: str = typer.Option(
        "ssh",
        "--remote-shell",
        help="With --hostfile: the command that runs a command on another host, as REMOTE_SHELL HOST COMMAND "
        '(e.g. "ssh -p 2222").',
        rich_help_panel="Several nodes",
    ),
):
    """Train a recipe on DeepSpeed (GPUs, or the CPU when there is none); on several machines, one command per node.

    Example: [bold]memtrain run recipes/quickstart.yaml[/]
    Two nodes: [bold]memtrain run RECIPE --nnodes 2 --node-rank 0|1 --master-addr node0 --master-port 29500[/]
    Or once, on the first of them: [bold]memtrain run RECIPE --hostfile hostfile[/]
    """
    options = RunOptions(resume=resume, max_steps=max_steps, profile_steps=profile, save=save, overwrite=overwrite)
    nodes = NodeFlags(nnodes, node_rank, master_addr, master_port, join_timeout, hostfile, remote_shell)
    raise typer.Exit(code=run_command(recipe, list(overrides or []), options, nodes=nodes))


@app.command()
@report_user_errors
def export(
    run_dir: Path = typer.Argument(..., help="A finished run directory (holds final/).", show_default=False),
    merge: bool = typer.Option(
        False,
        "--merge",
        help="Merge a LoRA adapter into its base weights: a whole Hugging "
        "Face model that loads without PEFT (QLoRA: onto the dequantised base).",
    ),
    output: Optional[Path] = typer.Option(
        None,
        "-o",
        "--output",
        help="Write here (default: RUN_DIR/merged with --merge; without it, RUN_DIR/final is the export).",
    ),
    push_to_hub: Optional[str] = typer.Option(
        None,
        "--push-to-hub",
        help="Upload the export to this Hub repo (ORG/NAME) with a model card from the recipe and scores.",
    ),
    public: bool = typer.Option(False, "--public", help="With --push-to-hub: a public repo (default: private)."),
):
    """Export a run's model: the adapter or full model as trained, or merged into its base.

    Example: [bold]memtrain export runs/llama2-7b-lora-24gb --merge -o llama2-7b-tuned[/]
    """
    raise typer.Exit(code=export_command(run_dir, merge, output, console, push_to_hub=push_to_hub, public=public))


@app.command()
@report_user_errors
def report(
    run_dir: Path = typer.Argument(..., help="A run directory (holds metrics.jsonl).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Plot a run's loss, speed, memory and batch size into PNG files and print a summary.

    Example: [bold]memtrain report runs/quickstart[/]
    """
    raise typer.Exit(code=report_command(run_dir, as_json=as_json, console=console))


@app.command("eval")
@report_user_errors
def eval_(
    run_dir: Path = typer.Argument(
        ..., help="A finished run directory (holds final/ and run.json).", show_default=False
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the scores as JSON."),
    samples: int = typer.Option(3, "--samples", help="Generated answers to show beside the expected ones."),
    limit: Optional[int] = typer.Option(
        None, "--limit", help="Answer only the first N held-out conversations (with --tasks: N examples per task)."
    ),
    tasks: Optional[str] = typer.Option(
        None,
        "--tasks",
        help="lm-evaluation-harness tasks, comma-separated, instead of the held-out scores (pip install "
        "'memtrain[lmeval]'); scores go to metrics.jsonl as 'benchmark' records.",
    ),
    include_path: Optional[Path] = typer.Option(
        None, "--include-path", help="With --tasks: a folder of your own task YAML files (local data works offline)."
    ),
):
    """Score a finished run: held-out loss, and exact match of greedy answers to held-out conversations.

    Example: [bold]memtrain eval runs/quickstart-chat[/]  (or --tasks arc_easy,hellaswag)
    """
    names = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else None
    code = eval_command(
        run_dir,
        as_json=as_json,
        samples=samples,
        limit=limit,
        console=console,
        tasks=names,
        include_path=include_path,
    )
    raise typer.Exit(code=code)


@app.command("chat")
@report_user_errors
def chat(
    run_dir: Path = typer.Argument(
        ..., help="A run directory (final/, or checkpoints/ with --checkpoint).", show_default=False
    ),
    checkpoint: Optional[str] = typer.Option(
        None, "--checkpoint", help="Talk to a checkpoint instead of the final model: its step, or its directory."
    ),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Answer this once and exit (for scripts)."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message before the conversation."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="The longest answer, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 answers greedily."),
):
    """Talk to a run's model through its chat template, the answer streamed as it is written.

    Example: [bold]memtrain chat runs/quickstart-chat[/]  (or --prompt "What is 3 + 4?" to answer once)
    """
    code = chat_command(
        run_dir,
        checkpoint=checkpoint,
        prompt=prompt,
        system=system,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        console=console,
    )
    raise typer.Exit(code=code)


if __name__ == "__main__":
    app()
