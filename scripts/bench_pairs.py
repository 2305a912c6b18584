"""Preference pairs of a fixed token length for the DPO benchmarks, cut from the bundled plays.

Each record is TRL's standard (text) preference layout, {"prompt", "chosen", "rejected"}: the prompt is a passage
of `--prompt-tokens` tokens, the chosen answer the passage's next `--answer-tokens` tokens, the rejected answer as
many tokens from elsewhere in the plays. memtrain and TRL read the same file and tokenise it with the same
tokenizer (the recipe's), so both sides train on the same pairs of about prompt + answer tokens each.

    python -m scripts.bench_pairs RECIPE --out pairs.jsonl --pairs 512 --prompt-tokens 512 --answer-tokens 512
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from memtrain.data.read.corpus import read_documents
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.recipe.load import load_recipe


def pairs(tokenizer, text: str, count: int, prompt_tokens: int, answer_tokens: int, seed: int) -> list[dict]:
    """`count` pairs: a prompt, its continuation (chosen) and a passage from elsewhere (rejected), by token counts."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    span = prompt_tokens + answer_tokens
    if len(ids) < 2 * span:
        raise SystemExit(f"the text holds {len(ids)} tokens, fewer than two pairs of {span}")
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        start = rng.randrange(0, len(ids) - span)
        other = rng.randrange(0, len(ids) - answer_tokens)
        records.append(
            {
                "prompt": tokenizer.decode(ids[start : start + prompt_tokens]),
                "chosen": tokenizer.decode(ids[start + prompt_tokens : start + span]),
                "rejected": tokenizer.decode(ids[other : other + answer_tokens]),
            }
        )
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path, help="the recipe whose tokenizer counts the tokens")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--answer-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = load_tokenizer(load_recipe(args.recipe).recipe.model)
    text = "\n".join(read_documents("builtin:shakespeare"))
    records = pairs(tokenizer, text, args.pairs, args.prompt_tokens, args.answer_tokens, args.seed)
    args.out.write_text("".join(json.dumps(record) + "\n" for record in records))
    print(f"wrote {len(records)} pairs to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
