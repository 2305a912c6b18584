"""How a run ended, and the one line that tells a person."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

EXIT_INTERRUPTED = 130
EXIT_RESTART = 75  # a worker saved after an OOM it could not recover in place; start again from there
# A process of the run died without a word (SIGKILL, the out-of-memory killer, a lost node): sysexits' EX_UNAVAILABLE,
# a service the run needs is gone. Not restarted here: the same command(s) resume from the last checkpoint.
EXIT_PEER_LOST = 69


@dataclass
class RunResult:
    status: str  # "done" | "stopped" (--max-steps) | "interrupted" | "restart" (OOM in ZeRO-1/2 backward)
    step: int
    run_dir: Path
    final_eval_loss: float | None = None
    exported: Path | None = None  # the Hugging Face export, when one was written
    signum: int = signal.SIGINT  # "interrupted": the signal that asked (exit 128 + it: 130 SIGINT, 143 SIGTERM)
    warning: str | None = None  # something to say even though it trained to the end (the loss diverged)
    saved: bool = True  # False under --no-save: no checkpoint was written
    max_steps_left: int | None = None  # "restart": the --max-steps of the next attempt (the same stop step)
    stopped_after_export: int | None = None  # "done": a signal asked to stop during the export, which finished

    @property
    def exit_code(self) -> int:
        return {"restart": EXIT_RESTART, "interrupted": 128 + int(self.signum)}.get(self.status, 0)

    @property
    def finished(self) -> bool:
        """Trained to the end (a ✓ for people; anything else is a ■ with what to do next)."""
        return self.status == "done" and self.warning is None

    def summary(self) -> str:
        """One line saying how the run ended and what to do next."""
        if self.status == "done":
            where = f"model in {self.exported}" if self.exported else f"metrics in {self.run_dir} (--no-save)"
            stop = (
                f" (stopped by {_signal_name(self.stopped_after_export)} during the export, which finished: "
                "the model is complete, nothing is left to run)"
                if self.stopped_after_export is not None
                else ""
            )
            return f"trained {self.step} step{'s' if self.step != 1 else ''}; {where}{stop}" + (
                f"; but {self.warning}" if self.warning else ""
            )
        if self.status == "restart":
            return f"out of memory in backward at step {self.step + 1}; saved, restarting smaller"
        checkpoints = self.run_dir / "checkpoints"
        if not self.saved:
            why = " as asked (--max-steps)" if self.status == "stopped" else ""
            return f"{self.status} at step {self.step}{why}; nothing saved (--no-save)"
        if self.status == "stopped":
            return (
                f"stopped at step {self.step} as asked (--max-steps); checkpoint in {checkpoints} — "
                "run without --max-steps to continue"
            )
        return f"interrupted at step {self.step}; checkpoint in {checkpoints} — run the same command again to resume"


def _signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
