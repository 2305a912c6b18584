"""`memtrain export RUN_DIR [--merge] [-o DIR] [--push-to-hub ORG/NAME]`: the run's final model, or its LoRA adapter
merged into the base; pushed to a Hub repo (private unless --public) with a model card from the recipe and scores."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError
from rich.console import Console

from memtrain.commands.model_card import model_card
from memtrain.errors import Problem, UserError
from memtrain.hub import looks_like_repo_id, offline
from memtrain.model.final_dir import export_run, run_recipe
from memtrain.train.state.saved_model import run_settings_recipe

CARD_FILE = "README.md"


def export_command(
    run_dir: Path,
    merge: bool,
    output: Path | None,
    console: Console,
    push_to_hub: str | None = None,
    public: bool = False,
) -> int:
    """Export and say where the model is and how to load it; with push_to_hub, upload it there too.

    --merge of a full fine-tune has no adapter to merge: its final model is already whole, and is copied
    where the merged model would go (so `export --merge -o DIR` gives a whole model in DIR for either kind
    of run); the line says so rather than suggest a merge happened."""
    if push_to_hub is not None:
        check_push(push_to_hub)  # before any work: a merge of a 7B model takes minutes
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
    if push_to_hub is not None:
        url = push(Path(run_dir), out, push_to_hub, private=not public)
        console.print(f"[green]✓[/] pushed to {url} ({'public' if public else 'private'})", highlight=False)
    return 0


def check_push(repo: str) -> None:
    """What stops a push, said before the export: an id that is no Hub id, offline mode, no token."""
    if not looks_like_repo_id(repo):
        raise UserError(
            Problem(f"--push-to-hub {repo!r} is not a Hub repo id", hint="give ORG/NAME, e.g. my-user/my-model")
        )
    if offline():
        raise UserError(
            Problem(
                f"cannot push to {repo}: HF_HUB_OFFLINE is set, so memtrain does not reach the Hub",
                hint="unset HF_HUB_OFFLINE to push, or export without --push-to-hub and upload the directory later "
                "(`hf upload ORG/NAME DIR`)",
            )
        )
    if get_token() is None:
        raise UserError(
            Problem(
                f"cannot push to {repo}: no Hugging Face token",
                hint="log in (`hf auth login`) or set HF_TOKEN to a token that may write to the repo",
            )
        )


def push(run_dir: Path, out: Path, repo: str, private: bool) -> str:
    """Create the repo (private by default; an existing one is kept as it is) and upload the export and its card in
    one commit; returns the repo's URL."""
    recipe = run_settings_recipe(run_dir) if (run_dir / "run.json").is_file() else run_recipe(run_dir)
    card = model_card(run_dir, recipe, adapter=(out / "adapter_config.json").is_file())
    files = [p for p in sorted(out.rglob("*")) if p.is_file() and p.name != CARD_FILE]
    operations = [CommitOperationAdd(str(p.relative_to(out)), str(p)) for p in files]
    operations.append(CommitOperationAdd(CARD_FILE, str(card).encode()))
    api = HfApi()
    try:
        url = api.create_repo(repo, private=private, exist_ok=True)
        api.create_commit(repo, operations, commit_message=f"memtrain export of {run_dir.name}")
    except HfHubHTTPError as error:
        raise UserError(
            Problem(
                f"cannot push to {repo}: {str(error).splitlines()[0]}",
                hint="check that your token may write to the repo (or create repos in ORG), and the network",
            )
        ) from None
    return str(url)
