"""Pre-train the chat quickstart's base model and store it in memtrain/assets/models/shakespeare-mini.

    python scripts/pretrain_chat_base.py                 # runs recipes/pretrain-chat-base.yaml, then stores final/
    python scripts/pretrain_chat_base.py --from-run DIR  # store the final/ of a run already made

The base is the `mini` preset (1.9 M parameters) trained on the bundled plays with builtin:shakespeare-chat,
so it writes Shakespeare-like text and has never seen a question, an answer or a ChatML marker: what the
chat quickstart's model knows about answering comes from fine-tuning alone. Its weights are stored in bf16
(3.7 MB; training loads them in its own dtype) with the chat tokenizer beside them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from memtrain.commands.run import run_command
from memtrain.data.tokenizer import load_tokenizer
from memtrain.files import atomic_path
from memtrain.recipe.schema import Model
from memtrain.train.run import RunOptions

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "pretrain-chat-base.yaml"
OUT = ROOT / "memtrain" / "assets" / "models" / "shakespeare-mini"
SOURCE = """# shakespeare-mini: the chat quickstart's base model

A Llama of the `mini` shape (configs/models/mini.yaml: 4 layers, hidden 128, 1.9 M parameters, a 4160-row
vocabulary) pre-trained by `scripts/pretrain_chat_base.py` with `recipes/pretrain-chat-base.yaml`: {steps} steps
of 16 x 128 tokens of the bundled plays (public domain), tokenizer `builtin:shakespeare-chat`. Validation loss
on Twelfth Night at the end: {loss:.3f} (perplexity {ppl:.1f}). Weights in bf16. It has never seen a question,
an answer or a ChatML marker (their embedding rows are as initialised): `recipes/quickstart-chat.yaml`
fine-tunes it on the synthetic chat data.
"""


def store(run_dir: Path, out: Path) -> None:
    """The run's final model in bf16 with the chat tokenizer, written to `out` whole or not at all."""
    import json
    import math

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final", local_files_only=True).to(torch.bfloat16)
    tokenizer = load_tokenizer(Model(preset="mini", tokenizer="builtin:shakespeare-chat"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if r["kind"] == "eval"]
    steps = max(r["step"] for r in records if r["kind"] == "train")
    with atomic_path(out, directory=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE.md").write_text(SOURCE.format(steps=steps, loss=evals[-1]["loss"],
                                                     ppl=math.exp(evals[-1]["loss"])))
        tmp.chmod(0o755)  # a shipped asset: readable by everyone (the temporary directory and files are private)
        for file in tmp.iterdir():
            file.chmod(0o644)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-run", type=Path, help="store the final/ of this finished run instead of training")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "pretrain-chat-base")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    run_dir = args.from_run
    if run_dir is None:
        code = run_command(RECIPE, [f"train.output_dir={args.run_dir}"], RunOptions(resume=False))
        if code != 0:
            return code
        run_dir = args.run_dir
    store(run_dir, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
