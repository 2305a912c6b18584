"""Preference pairs of a fixed token length (or of lengths drawn from a range) for the DPO benchmarks, cut from the
bundled plays.

Each record is TRL's standard (text) preference layout, {"prompt", "chosen", "rejected"}: the prompt is a passage
of `--prompt-tokens` tokens, the chosen answer the passage's next `--answer-tokens` tokens, the rejected answer as
many tokens from elsewhere in the plays. memtrain and TRL read the same file and tokenise it with the same
tokenizer (the recipe's), so both sides train on the same pairs of about prompt + answer tokens each. With
`--min-prompt-tokens` / `--min-answer-tokens` each prompt and each answer takes a length drawn uniformly from the
range instead, as real preference data varies.

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


def pairs(
    tokenizer,
    text: str,
    count: int,
    prompt_tokens: int,
    answer_tokens: int,
    seed: int,
    min_prompt_tokens: int | None = None,
    min_answer_tokens: int | None = None,
) -> list[dict]:
    """`count` pairs: a prompt, its continuation (chosen) and a passage from elsewhere (rejected), by token counts
    (each drawn from min..max where a minimum is given)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    span = prompt_tokens + answer_tokens
    if len(ids) < 2 * span:
        raise SystemExit(f"the text holds {len(ids)} tokens, fewer than two pairs of {span}")
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        prompt = rng.randint(min_prompt_tokens or prompt_tokens, prompt_tokens)
        chosen, rejected = (rng.randint(min_answer_tokens or answer_tokens, answer_tokens) for _ in range(2))
        start = rng.randrange(0, len(ids) - span)
        other = rng.randrange(0, len(ids) - answer_tokens)
        records.append(
            {
                "prompt": tokenizer.decode(ids[start : start + prompt]),
                "chosen": tokenizer.decode(ids[start + prompt : start + prompt + chosen]),
                "rejected": tokenizer.decode(ids[other : other + rejected]),
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
    parser.add_argument("--min-prompt-tokens", type=int, default=None, help="draw each prompt's length from here")
    parser.add_argument("--min-answer-tokens", type=int, default=None, help="draw each answer's length from here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for kind in ("prompt", "answer"):
        least, most = getattr(args, f"min_{kind}_tokens"), getattr(args, f"{kind}_tokens")
        if least is not None and not 1 <= least <= most:
            parser.error(f"--min-{kind}-tokens {least} must be between 1 and --{kind}-tokens ({most})")
    tokenizer = load_tokenizer(load_recipe(args.recipe).recipe.model)
    text = "\n".join(read_documents("builtin:shakespeare"))
    records = pairs(
        tokenizer,
        text,
        args.pairs,
        args.prompt_tokens,
        args.answer_tokens,
        args.seed,
        args.min_prompt_tokens,
        args.min_answer_tokens,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(record) + "\n" for record in records))
    print(f"wrote {len(records)} pairs to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
