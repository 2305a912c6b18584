"""`memtrain export RUN_DIR [--merge] [-o DIR]`: the run's final model, or its LoRA adapter merged into the base."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from memtrain.model.export import export_run


def export_command(run_dir: Path, merge: bool, output: Path | None, console: Console) -> int:
    """Export and say where the model is and how to load it."""
    out = export_run(run_dir, merge=merge, out_dir=output)
    kind = "adapter" if (out / "adapter_config.json").is_file() else "model"
    loader = "PeftModel.from_pretrained(base, path)" if kind == "adapter" else "AutoModelForCausalLM.from_pretrained(path)"
    console.print(f"[green]✓[/] {kind} in {out} — load it with {loader}", highlight=False)
    return 0
