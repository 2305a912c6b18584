"""Multi-turn conversations of a spread of token lengths for the chat benchmarks, cut from the bundled plays.

The bundled chat data (builtin:chat) holds conversations of a few dozen tokens: right for tests, not for timing a
7B model, where a micro-batch of them is a few hundred tokens and the step is launch-bound. Chat data people train
on holds conversations of 100 to 1,500 tokens; these are that: each record is OpenAI's {"messages": [...]} layout,
1 to 4 user / assistant turns whose total length is drawn uniformly from `--min-tokens` to `--max-tokens`
(counted with the recipe's tokenizer, the answers twice the questions). memtrain and TRL read the same file.

    python -m scripts.bench_chats RECIPE [key=value ...] --out chats.jsonl --conversations 2000 \
        --min-tokens 100 --max-tokens 1500
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from memtrain.data.read.corpus import read_documents
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.recipe.load import load_recipe

QUESTION_SHARE = 1 / 3  # of each turn's tokens; the answer has the rest


def conversations(tokenizer, text: str, count: int, min_tokens: int, max_tokens: int, seed: int) -> list[dict]:
    """`count` conversations of min_tokens..max_tokens tokens of message text, 1-4 turns each."""
    if not 0 < min_tokens <= max_tokens:
        raise SystemExit(f"--min-tokens ({min_tokens}) must be positive and at most --max-tokens ({max_tokens})")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2 * max_tokens:
        raise SystemExit(f"the text holds {len(ids)} tokens, fewer than two conversations of {max_tokens}")
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        total = rng.randint(min_tokens, max_tokens)
        turns = rng.randint(1, min(4, max(1, total // 25)))
        start = rng.randrange(0, len(ids) - total)
        messages, at = [], start
        for turn in range(turns):
            length = total // turns + (total % turns if turn == turns - 1 else 0)
            asked = max(1, int(length * QUESTION_SHARE))
            for role, size in (("user", asked), ("assistant", length - asked)):
                messages.append({"role": role, "content": tokenizer.decode(ids[at : at + max(1, size)])})
                at += max(1, size)
        records.append({"messages": messages})
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path, help="the recipe whose tokenizer counts the tokens")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe (model.tokenizer=...)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--min-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = load_tokenizer(load_recipe(args.recipe, args.overrides).recipe.model)
    text = "\n".join(read_documents("builtin:shakespeare"))
    records = conversations(tokenizer, text, args.conversations, args.min_tokens, args.max_tokens, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(record) + "\n" for record in records))
    print(f"wrote {len(records)} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
