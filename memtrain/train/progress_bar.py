"""The run's progress bar: step, loss, tokens/s, GPU memory — refreshed from flushed metrics only,
so drawing it never forces a host-device sync. And the data's first tokenisation, while it lasts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Column

from memtrain.data.tokens.progress import listening
from memtrain.monitor.perplexity import perplexity_text
from memtrain.units import gib

BAR_MIN_CHARS = 10  # the training bar's narrowest bar


@contextlib.contextmanager
def bars(console: Console | None = None) -> Iterator[Callable[[str, int, int], None]]:
    """show(what, done, total): a bar per `what` (total 0: not known yet, a count without a bar), drawn only on a
    terminal and removed when the block ends; nothing is drawn until the first call."""
    console = console or Console(stderr=True)
    bar: RichProgress | None = None
    tasks: dict[str, int] = {}

    def show(what: str, done: int, total: int) -> None:
        nonlocal bar
        if not console.is_terminal:
            return
        if bar is None:
            bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
            bar.start()
        if what not in tasks:
            tasks[what] = bar.add_task(what, total=total or None)
        bar.update(tasks[what], completed=done, total=total or None)

    try:
        yield show
    finally:
        if bar is not None:
            bar.stop()


@contextlib.contextmanager
def tokenising_progress(console: Console | None = None) -> Iterator[None]:
    """A bar per data file while the data layer tokenises it (data/tokens/progress.py): records done of all, or pieces
    done when their number is not known yet; nothing when the data comes from the token cache."""
    with bars(console) as show, listening(show):
        yield


class Progress:
    def __init__(self, total_steps: int, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        self.total = total_steps
        self._bar = None
        self._task = None
        self._eval = ""
        self._stats = ""
        if enabled:
            # The step count keeps its width and the stats are cut to what is left (fit_stats), so a narrow console
            # (80 columns, 61,234 steps of a large dataset's epoch) still shows the step, its total and the ETA.
            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=None),
                MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=2 * len(str(total_steps)) + 1)),
                TextColumn("{task.fields[stats]}", table_column=Column(no_wrap=True)),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=console or Console(stderr=True),
                transient=False,
                refresh_per_second=2,
            )

    def __enter__(self):
        if self._bar is not None:
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total, stats="")
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False

    def update(self, step: int, record: dict | None = None) -> None:
        if self._bar is None:
            return
        fields = {}
        if record:
            loss = record.get("loss")  # None: not finite (JSON has no NaN); the guard counts it
            parts = [f"loss {loss:.3f}" if loss is not None else "loss nan"]
            if record.get("reward_accuracy") is not None:  # a preference objective: how often chosen wins
                parts.append(f"reward acc {record['reward_accuracy']:.2f}")
            if record.get("tokens_per_s"):  # real tokens, padding left out
                parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
            if record.get("padded_tokens"):  # of the positions computed so far
                parts.append(f"pad {1 - record['tokens'] / record['padded_tokens']:.0%}")
            if record.get("gpu_peak_reserved_bytes"):
                parts.append(
                    f"gpu {gib(record['gpu_peak_reserved_bytes']):.1f}/{gib(record.get('gpu_cap_bytes', 0)):.0f} GiB"
                )
            parts.append(f"mb {record.get('micro_batch')}")
            self._stats = " · ".join(parts)
            fields["stats"] = self._fitted()
        self._bar.update(self._task, completed=step, **fields)

    def _fitted(self) -> str:
        """The stats and the last validation perplexity, cut with '…' to the room the other columns leave."""
        text = self._stats + self._eval
        room = self._bar.console.width - (
            len("train") + BAR_MIN_CHARS + 2 * len(str(self.total)) + 1 + len("0:00:00 eta -:--:--") + 6
        )  # 6: the spaces between the columns
        return text if len(text) <= room else text[: max(room - 1, 0)] + "…"

    def note_eval(self, step: int, loss: float, reward_accuracy: float | None = None) -> None:
        """The validation loss (and, for a preference objective, the held-out pairs' reward accuracy)."""
        if reward_accuracy is None:
            self._eval = f" · val ppl {perplexity_text(loss, 1)}"  # replaces the previous one
            said = f"step {step}: validation loss {loss:.4f}, perplexity {perplexity_text(loss)}"
        else:  # a preference loss has no perplexity
            self._eval = f" · val reward acc {reward_accuracy:.2f}"
            said = f"step {step}: validation loss {loss:.4f}, reward accuracy {reward_accuracy:.3f}"
        if self._bar is not None:
            self._bar.update(self._task, stats=self._fitted())
            self._bar.console.print(said)

    def note(self, text: str) -> None:
        """Print one line above the bar (e.g. the generation evaluation's score)."""
        if self._bar is not None:
            self._bar.console.print(text, highlight=False)
