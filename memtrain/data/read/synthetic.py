"""The chat quickstart's assets, made here: a synthetic task data set with checkable answers, and a chat tokenizer.

Tasks a small model can learn in minutes on a CPU and that are scored by exact match: adding,
subtracting and multiplying small numbers, and reversing, upper-casing, counting the letters of, or
naming the first letter of a word from the bundled Shakespeare plays (so the tokenizer knows the words).
Some conversations carry a system prompt, some have two turns (a follow-up on the first answer). Every
record is {"task": ..., "messages": [...]} in OpenAI layout; the last assistant message is the answer.

The tokenizer is the bundled Shakespeare BPE plus the ChatML markers <|im_start|> and <|im_end|> as special
tokens (ids 4096 and 4097, after the 4096 of the base, so a model pre-trained with the base keeps its rows)
and a ChatML chat_template. Its eos stays <|endoftext|>: text data and the base model keep their separator;
a chat turn ends with <|im_end|>, the token generation stops at.

    python -m memtrain.data.read.synthetic            # rewrite memtrain/assets/chat and the shakespeare-chat tokenizer

The output is a function of SEED and the counts below; the files are committed, so runs need no generation.
"""

from __future__ import annotations

import collections
import gzip
import json
import random
import re
import sys
from pathlib import Path

from memtrain.data.read.corpus import ASSETS

SEED = 2024
TRAIN_RECORDS = 3000
VALIDATION_RECORDS = 300
# Words the string tasks draw from: the most frequent lowercase words of the plays, of 3 to 8 letters.
VOCABULARY_SIZE = 400
CHAT_DIR = ASSETS / "chat"
BASE_TOKENIZER = ASSETS / "tokenizer" / "shakespeare"
CHAT_TOKENIZER = ASSETS / "tokenizer" / "shakespeare-chat"
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")
SYSTEM_PROMPTS = ("Answer with the result only.", "You are a careful assistant. Reply with just the answer.")
SYSTEM_SHARE = 0.3  # conversations that open with a system prompt
FOLLOW_UP_SHARE = 0.2  # arithmetic conversations with a second turn


def shakespeare_words(count: int = VOCABULARY_SIZE) -> list[str]:
    """The `count` most frequent lowercase words (3-8 letters) of the bundled training plays, ties alphabetical."""
    with gzip.open(ASSETS / "corpus" / "shakespeare" / "train.txt.gz", "rt", encoding="utf-8") as handle:
        counts = collections.Counter(re.findall(r"\b[a-z]{3,8}\b", handle.read()))
    return [word for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:count]]


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.choice(("add", "subtract", "multiply"))
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return kind, f"What is {a} + {b}?", str(a + b)
    if kind == "subtract":
        a = rng.randint(0, 99)
        b = rng.randint(0, a)
        return kind, f"What is {a} - {b}?", str(a - b)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return kind, f"What is {a} times {b}?", str(a * b)


def _word_task(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice(words)
    kind = rng.choice(("reverse", "upper", "length", "first_letter"))
    if kind == "reverse":
        return kind, f"Reverse the word '{word}'.", word[::-1]
    if kind == "upper":
        return kind, f"Write '{word}' in capital letters.", word.upper()
    if kind == "length":
        return kind, f"How many letters are in '{word}'?", str(len(word))
    return kind, f"What is the first letter of '{word}'?", word[0]


def make_record(rng: random.Random, words: list[str]) -> dict:
    """One conversation: a task, sometimes a system prompt first, sometimes an arithmetic follow-up."""
    arithmetic = rng.random() < 0.5
    task, question, answer = _arithmetic(rng) if arithmetic else _word_task(rng, words)
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if arithmetic and rng.random() < FOLLOW_UP_SHARE:
        extra = rng.randint(1, 20)
        messages += [
            {"role": "user", "content": f"And plus {extra}?"},
            {"role": "assistant", "content": str(int(answer) + extra)},
        ]
        task += "+follow_up"
    if rng.random() < SYSTEM_SHARE:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return {"task": task, "messages": messages}


def make_records(count: int, seed: int, words: list[str]) -> list[dict]:
    rng = random.Random(seed)
    return [make_record(rng, words) for _ in range(count)]


def write_chat_data(directory: Path = CHAT_DIR, seed: int = SEED) -> None:
    """train.jsonl and validation.jsonl; validation holds no question that training asks."""
    words = shakespeare_words()
    train = make_records(TRAIN_RECORDS, seed, words)
    seen = {json.dumps(r["messages"][-2:]) for r in train}
    validation = [
        r for r in make_records(VALIDATION_RECORDS * 3, seed + 1, words) if json.dumps(r["messages"][-2:]) not in seen
    ][:VALIDATION_RECORDS]
    directory.mkdir(parents=True, exist_ok=True)
    for name, records in (("train", train), ("validation", validation)):
        with open(directory / f"{name}.jsonl", "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_chat_tokenizer(directory: Path = CHAT_TOKENIZER) -> None:
    """The Shakespeare BPE with the ChatML markers as special tokens and the shipped chatml template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(BASE_TOKENIZER), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_MARKERS)}, False)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer.backend_tokenizer.to_str(pretty=True) + "\n")
    config = json.loads((BASE_TOKENIZER / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = list(CHAT_MARKERS)
    config["chat_template"] = (ASSETS / "templates" / "chatml.jinja").read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str]) -> int:
    write_chat_data()
    write_chat_tokenizer()
    print(f"wrote {CHAT_DIR} and {CHAT_TOKENIZER}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
