"""PNG plots of a run's metrics: loss, speed, memory, batch size, host memory; a preference run's rewards.

Drawn with matplotlib's Agg canvas on Figure objects (no pyplot state, no display). Every plot copes
with a run that has only some of the fields: CPU runs record no GPU memory, a young run has no eval yet.
A resumed run repeats the steps after its checkpoint; the newest record of each step wins.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from memtrain.files import atomic_path
from memtrain.monitor.perplexity import perplexity, perplexity_text
from memtrain.monitor.series import series, steady_speeds, throughput, tokens_are_targets
from memtrain.units import GiB

FIGURE_SIZE_INCHES = (9.0, 4.8)
DPI = 100
PLOT_FILES = ("loss.png", "speed.png", "memory.png", "batch.png", "host.png")
REWARDS_FILE = "rewards.png"  # drawn only for a preference run (train.objective dpo, orpo, simpo, kto)

TRAIN_COLOR = "#1f77b4"
EVAL_COLOR = "#d62728"
CAP_COLOR = "#b22222"
PLAN_COLOR = "#7f3fbf"
OOM_COLOR = "#e41a1c"


def render_plots(records: list[dict], out_dir: Path) -> list[Path]:
    """Write loss.png, speed.png, memory.png, batch.png and host.png (and a preference run's rewards.png) into
    `out_dir`; return their paths."""
    out_dir = Path(out_dir)
    plots = list(zip(PLOT_FILES, (plot_loss, plot_speed, plot_memory, plot_batch, plot_host)))
    if is_preference_run(records):
        plots.append((REWARDS_FILE, plot_rewards))
    paths = []
    for name, paint in plots:
        figure = Figure(figsize=FIGURE_SIZE_INCHES, dpi=DPI, layout="constrained")
        FigureCanvasAgg(figure)
        paint(figure, records)
        for axes in figure.axes:
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        path = out_dir / name
        with atomic_path(path) as tmp:  # a reader never sees half a PNG
            figure.savefig(tmp, format="png", dpi=DPI)
        paths.append(path)
    return paths


def _step_axes(figure: Figure, ylabel: str, title: str):
    """One plot with steps on x, the quantity (with its unit) on y, and a light grid."""
    axes = figure.add_subplot()
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    return axes


def plot_loss(figure: Figure, records: list[dict]) -> None:
    """Training and validation loss by step, with perplexity (exp(loss)) as the scale of a second axis."""
    axes = _step_axes(figure, "loss (nats / token)", "Loss")
    handles = []
    steps, losses = series(records, "train", "loss")
    if steps:
        handles += axes.plot(steps, losses, color=TRAIN_COLOR, linewidth=1.2, alpha=0.85, label="train loss")
    eval_steps, eval_losses = series(records, "eval", "loss")
    if eval_steps:
        handles += axes.plot(
            eval_steps, eval_losses, color=EVAL_COLOR, marker="o", linewidth=1.5, label="validation loss"
        )
    if handles and not is_preference_run(records):  # a preference loss is no token NLL: no perplexity scale
        # Perplexity is exp(loss): a second scale on the same axis reads every loss point as a perplexity.
        twin = axes.twinx()
        twin.set_ylim(axes.get_ylim())
        twin.set_yticks([tick for tick in axes.get_yticks() if axes.get_ylim()[0] <= tick <= axes.get_ylim()[1]])
        twin.yaxis.set_major_formatter(FuncFormatter(lambda loss, _: _perplexity_text(loss)))
        twin.set_ylabel("perplexity = exp(loss)")
    if handles:
        axes.legend(handles=handles, loc="best")
    else:
        _no_data(axes, "no loss recorded yet")


def is_preference_run(records: list[dict]) -> bool:
    """True when the training records carry a preference objective's rewards."""
    return any(r["kind"] == "train" and "reward_chosen" in r for r in records)


def plot_rewards(figure: Figure, records: list[dict]) -> None:
    """A preference run: above, how often the chosen answer's implicit reward beats the rejected one's (training
    steps and held-out pairs); below, the two rewards and their margin (TRL's rewards/* metrics)."""
    accuracy_axes, reward_axes = figure.subplots(2, 1, sharex=True)
    accuracy_axes.set_title("Rewards")
    accuracy_axes.set_ylabel("reward accuracy")
    accuracy_axes.set_ylim(-0.02, 1.02)
    accuracy_axes.axhline(0.5, color="gray", linestyle="--", linewidth=1)  # a coin flip
    steps, accuracies = series(records, "train", "reward_accuracy")
    if steps:
        accuracy_axes.plot(steps, accuracies, color=TRAIN_COLOR, linewidth=1, alpha=0.6, label="train")
    eval_steps, eval_accuracies = series(records, "eval", "reward_accuracy")
    if eval_steps:
        accuracy_axes.plot(eval_steps, eval_accuracies, color=EVAL_COLOR, marker="o", label="held-out pairs")
    reward_axes.set_xlabel("step")
    reward_axes.set_ylabel("implicit reward")
    reward_axes.axhline(0.0, color="gray", linewidth=0.8)
    for field, style in (("reward_chosen", "-"), ("reward_rejected", ":"), ("reward_margin", "--")):
        field_steps, values = series(records, "train", field)
        if field_steps:
            label = field.removeprefix("reward_")
            reward_axes.plot(field_steps, values, color=TRAIN_COLOR, linestyle=style, linewidth=1, label=label)
    eval_steps, margins = series(records, "eval", "reward_margin")
    if eval_steps:
        reward_axes.plot(eval_steps, margins, color=EVAL_COLOR, marker="o", label="held-out margin")
    for axes in (accuracy_axes, reward_axes):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(loc="best", fontsize="small")


def plot_speed(figure: Figure, records: list[dict]) -> None:
    """Training throughput in real tokens per second by step (padding left out), with the median as a reference
    line."""
    unit = "target tokens/s" if tokens_are_targets(records) else "tokens/s"  # older runs counted targets alone
    axes = _step_axes(figure, f"throughput ({unit})", "Training speed")
    steps, speeds = throughput(records)
    if not steps:
        _no_data(axes, "no throughput recorded yet")
        return
    axes.plot(steps, speeds, color=TRAIN_COLOR, linewidth=1.2, label=unit)
    middle = median(steady_speeds(records))  # each start's first step carries its warm-up
    axes.axhline(middle, color="gray", linestyle="--", linewidth=1, label=f"median {middle:,.0f} tokens/s")
    axes.set_ylim(0, max(speeds) * 1.15)
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    axes.legend(loc="lower right")


def plot_memory(figure: Figure, records: list[dict]) -> None:
    """GPU allocated / reserved / peak reserved (GiB) against the cap; the plan's peak dashed; OOMs marked."""
    axes = _step_axes(figure, "GPU memory (GiB)", "GPU memory")
    curves = [
        ("gpu_allocated_bytes", "allocated", "#1f77b4", "-"),
        ("gpu_peak_allocated_bytes", "peak allocated (in step)", "#1f77b4", ":"),
        ("gpu_reserved_bytes", "reserved", "#ff7f0e", "-"),
        ("gpu_peak_reserved_bytes", "peak reserved (in step)", "#8c564b", ":"),
    ]
    drawn, top_gib = False, 0.0
    for field, label, color, style in curves:
        steps, values = series(records, "train", field)
        if steps and max(values) > 0:
            axes.plot(steps, [v / GiB for v in values], color=color, linestyle=style, linewidth=1.4, label=label)
            drawn, top_gib = True, max(top_gib, max(values) / GiB)
    cap_bytes = _last_positive(records, "gpu_cap_bytes")
    if cap_bytes:
        axes.axhline(cap_bytes / GiB, color=CAP_COLOR, linewidth=1.8, label=f"cap {cap_bytes / GiB:.1f} GiB")
    plan_bytes = _last_positive(records, "plan_peak_reserved_bytes", kind="run")
    if plan_bytes and cap_bytes and plan_bytes > 1.5 * cap_bytes:
        # a plan far above the cap (a recipe that cannot fit as written) would squash every curve
        axes.plot(
            [], [], color=PLAN_COLOR, linestyle="--", label=f"planned peak {plan_bytes / GiB:.1f} GiB (off scale)"
        )
        plan_bytes = None
    elif plan_bytes:
        axes.axhline(
            plan_bytes / GiB,
            color=PLAN_COLOR,
            linestyle="--",
            linewidth=1.5,
            label=f"planned peak {plan_bytes / GiB:.1f} GiB",
        )
    forecast_steps, forecasts = series(records, "forecast", "predicted_peak_bytes")
    if forecast_steps:
        axes.plot(
            forecast_steps,
            [v / GiB for v in forecasts],
            color=PLAN_COLOR,
            marker="x",
            linestyle="none",
            label="forecast peak",
        )
    ooms = [record for record in records if record.get("kind") == "oom"]
    by_step: dict[int, list[str]] = {}
    for oom in ooms:
        by_step.setdefault(oom["step"], []).append(str(oom.get("micro_batch", "?")))
    for number, (step, sizes) in enumerate(by_step.items()):
        axes.axvline(
            step, color=OOM_COLOR, linestyle="-.", linewidth=1.2, label="out of memory" if number == 0 else None
        )
        axes.annotate(
            f"OOM at micro-batch {', '.join(sizes)}",
            xy=(step, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            color=OOM_COLOR,
            fontsize=8,
            rotation=90,
            va="top",
        )
    if not drawn and not ooms:
        _no_data(axes, "no GPU memory recorded (CPU run?) — see host.png")
    if drawn or cap_bytes or plan_bytes or ooms:
        top_gib = max([top_gib] + [b / GiB for b in (cap_bytes, plan_bytes) if b] + [v / GiB for v in forecasts])
        axes.set_ylim(0, top_gib * 1.12 or 1)
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # outside: never covers a curve


def plot_batch(figure: Figure, records: list[dict]) -> None:
    """Micro-batch (sequences) and gradient accumulation (micro-batches per step) by step; changes marked."""
    top, bottom = figure.subplots(2, 1, sharex=True)
    steps, micro_batches = series(records, "train", "micro_batch")
    accum_steps, accumulations = series(records, "train", "grad_accum")
    top.set_title("Batch size")
    top.set_ylabel("micro-batch\n(sequences)")
    bottom.set_ylabel("accumulation\n(micro-batches/step)")
    bottom.set_xlabel("step")
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    if steps:
        top.step(steps, micro_batches, where="post", color=TRAIN_COLOR, linewidth=1.6)
        top.set_ylim(0, max(micro_batches) * 1.25)
    else:
        _no_data(top, "no micro-batch recorded yet")
    if accum_steps:
        bottom.step(accum_steps, accumulations, where="post", color="#ff7f0e", linewidth=1.6)
        bottom.set_ylim(0, max(accumulations) * 1.25)
    labels_by_step: dict[int, list[str]] = {}
    for change in (record for record in records if record.get("kind") == "batch"):
        label = f"{change.get('old_micro_batch')}→{change.get('new_micro_batch')}"
        if change.get("reason"):
            label += f" {change['reason']}"
        labels_by_step.setdefault(int(change["step"]), []).append(label)
    for step, labels in labels_by_step.items():
        top.axvline(step, color="gray", linestyle=":", linewidth=1)
        # Vertical text beside its line: changes a few steps apart do not run into each other.
        top.annotate(
            "; ".join(labels),
            xy=(step, 0.97),
            xycoords=("data", "axes fraction"),
            xytext=(2, 0),
            textcoords="offset points",
            fontsize=7,
            color="dimgray",
            rotation=90,
            va="top",
        )
    for oom in (record for record in records if record.get("kind") == "oom"):
        top.axvline(oom["step"], color=OOM_COLOR, linestyle="-.", linewidth=1.2)


def plot_host(figure: Figure, records: list[dict]) -> None:
    """Host resident memory (GiB) of the training process by step, current and peak."""
    axes = _step_axes(figure, "host memory (GiB)", "Host memory (resident set of the training process)")
    top_gib = 0.0
    for field, label, style in (("host_rss_bytes", "RSS", "-"), ("host_peak_rss_bytes", "peak RSS", "--")):
        steps, values = series(records, "train", field)
        if steps and max(values) > 0:
            axes.plot(steps, [v / GiB for v in values], linestyle=style, linewidth=1.4, label=label)
            top_gib = max(top_gib, max(values) / GiB)
    if top_gib:
        axes.set_ylim(0, top_gib * 1.15)
        axes.legend(loc="lower right")
    else:
        _no_data(axes, "no host memory recorded yet")


def _perplexity_text(loss: float) -> str:
    """A tick of the perplexity scale: the cap and over-cap text shared with the metrics (monitor/perplexity.py)."""
    value = perplexity(loss)
    if value is None or value >= 1e6:
        return perplexity_text(loss)
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def _no_data(axes, text: str) -> None:
    axes.text(0.5, 0.5, text, transform=axes.transAxes, ha="center", va="center", color="gray", fontsize=12)


def _last_positive(records: list[dict], field: str, kind: str | None = None) -> float | None:
    for record in reversed(records):
        if kind is not None and record.get("kind") != kind:
            continue
        value = record.get(field)
        if isinstance(value, (int, float)) and value > 0:
            return value
    return None
