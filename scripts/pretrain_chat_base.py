"""Pre-train the chat quickstart's base model and store it in memtrain/assets/models/shakespeare-mini.

    python scripts/pretrain_chat_base.py                 # task texts, scripts/pretrain-chat-base.yaml, store final/
    python scripts/pretrain_chat_base.py --from-run DIR  # store the final/ of a run already made

The base is the `mini` preset (1.9 M parameters, builtin:shakespeare-chat) pre-trained on the bundled plays
and on TASK_RECORDS synthetic task conversations written as plain text, one message a line (memtrain.data.
synthetic with its own seed; none asks a question of the chat validation set). It has never seen a ChatML
marker: at the chat quickstart's step 0 it does not answer in the chat format at all, and fine-tuning on the
chat data teaches it to. Its weights are stored in bf16 (3.7 MB; training loads them in its own dtype) with
the chat tokenizer beside them, and its special-token ids in config.json / generation_config.json: bos and eos
<|endoftext|> (0, the document separator; the tokenizer prepends nothing), pad <|pad|> (1), no end-of-turn
token (the base knows no chat format). A preset's configs carry Llama's default ids (bos 1, eos 2), which in
this tokenizer are <|pad|> and "!": store() replaces them (memtrain.model.merge.set_inference_config).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from memtrain.commands.run import run_command
from memtrain.data.read.synthetic import CHAT_DIR, make_records, shakespeare_words
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.files import atomic_path, write_atomically
from memtrain.model.merge import set_inference_config
from memtrain.recipe.schema import Model
from memtrain.train.resolve import RunOptions

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "scripts" / "pretrain-chat-base.yaml"
OUT = ROOT / "memtrain" / "assets" / "models" / "shakespeare-mini"
TASKS = ROOT / "runs" / "pretrain-chat-base" / "synthetic-tasks.jsonl"  # the path the recipe names
TASK_RECORDS = 30_000
TASK_SEED = 7  # not the chat data's seeds (2024, 2025)
SOURCE = """# shakespeare-mini: the chat quickstart's base model

A Llama of the `mini` shape (configs/models/mini.yaml: 4 layers, hidden 128, 1.9 M parameters, a 4160-row
vocabulary) pre-trained by `scripts/pretrain_chat_base.py` with `scripts/pretrain-chat-base.yaml`: {steps} steps
of 16 x 128 tokens, tokenizer `builtin:shakespeare-chat`, on the bundled plays (public domain) and on {tasks}
synthetic task conversations written as plain text, one message a line (memtrain/data/read/synthetic.py, seed
{seed}; none asks a question of builtin:chat/validation). Validation loss on Twelfth Night at the end: {loss:.3f}
(perplexity {ppl:.1f}). Weights in bf16. It has never seen a ChatML marker (their embedding rows are as
initialised): `recipes/quickstart-chat.yaml` fine-tunes it to answer in the chat format.
"""


def write_task_texts(path: Path = TASKS, count: int = TASK_RECORDS, seed: int = TASK_SEED) -> int:
    """Synthetic task conversations as plain-text documents ({"text": "question\\nanswer..."}), none holding a
    question of the chat validation set (the follow-up "And plus N?" aside: it means nothing alone); returns
    how many were written."""
    held_out = set()
    for line in (CHAT_DIR / "validation.jsonl").read_text().splitlines():
        held_out.update(
            m["content"]
            for m in json.loads(line)["messages"]
            if m["role"] == "user" and not m["content"].startswith("And plus")
        )
    records = [
        r
        for r in make_records(count, seed, shakespeare_words())
        if not any(m["content"] in held_out for m in r["messages"])
    ]
    texts = ["\n".join(m["content"] for m in r["messages"] if m["role"] != "system") for r in records]
    write_atomically(path, "".join(json.dumps({"text": text}) + "\n" for text in texts))
    return len(texts)


def store(run_dir: Path, out: Path, tasks: int) -> None:
    """The run's final model in bf16 with the chat tokenizer and its special-token ids (a base model: it stops at
    <|endoftext|> only), written to `out` whole or not at all."""
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final", local_files_only=True).to(torch.bfloat16)
    tokenizer = load_tokenizer(Model(preset="mini", tokenizer="builtin:shakespeare-chat"))
    set_inference_config(model, tokenizer)  # the preset's default ids (bos 1, eos 2) are not this tokenizer's
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if r["kind"] == "eval"]
    steps = max(r["step"] for r in records if r["kind"] == "train")
    with atomic_path(out, directory=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE.md").write_text(
            SOURCE.format(
                steps=steps, loss=evals[-1]["loss"], ppl=math.exp(evals[-1]["loss"]), tasks=tasks, seed=TASK_SEED
            )
        )
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
        print(f"wrote {write_task_texts()} task texts to {TASKS}")
        code = run_command(RECIPE, [f"train.output_dir={args.run_dir}"], RunOptions(resume=False))
        if code != 0:
            return code
        run_dir = args.run_dir
    store(run_dir, args.out, tasks=len(TASKS.read_text().splitlines()) if TASKS.exists() else write_task_texts())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
