"""`memtrain export RUN_DIR [--merge] [-o DIR]`: the run's final model, or its LoRA adapter merged into the base."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from memtrain.model.final_dir import export_run


def export_command(run_dir: Path, merge: bool, output: Path | None, console: Console) -> int:
    """Export and say where the model is and how to load it.

    --merge of a full fine-tune has no adapter to merge: its final model is already whole, and is copied
    where the merged model would go (so `export --merge -o DIR` gives a whole model in DIR for either kind
    of run); the line says so rather than suggest a merge happened."""
    out = export_run(run_dir, merge=merge, out_dir=output)
    kind = "adapter" if (out / "adapter_config.json").is_file() else "model"
    loader = (
        "PeftModel.from_pretrained(base, path)" if kind == "adapter" else "AutoModelForCausalLM.from_pretrained(path)"
    )
    final = Path(run_dir) / "final"
    note = ""
    if merge and not (final / "adapter_config.json").is_file():
        note = f"; no adapter to merge: the run was a full fine-tune, so its final model ({final}) was copied as it is"
    console.print(f"[green]✓[/] {kind} in {out} — load it with {loader}{note}", highlight=False)
    return 0
