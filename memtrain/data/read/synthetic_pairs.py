"""The preference quickstart's data, made here from the bundled chat data: each conversation's question with its
right answer chosen and a plausible wrong one rejected.

The wrong answers are the mistakes a small model makes on these tasks, chosen so that a small model can learn from
the pairs which answer is right. A sum, difference or product: a number of the question echoed, or the other
operation's result (the difference for a sum, the sum for a difference or a product); a follow-up ("And plus 7?"):
the earlier answer left as it was, or the follow-up's number taken away; off by one or ten only where neither
mistake is there to make. Off by one or ten is otherwise left out: telling 81 from 80 needs a model that can add,
which the small chat base cannot, and such pairs teach it nothing. A letter count off by one; a reversed word with
two letters swapped, or not reversed; a word in capitals with one letter left small, or not in capitals; another
letter of the word for its first letter; and now and then the answer to another question of the same kind. Every
record is {"task": ..., "prompt": [...], "chosen": [...], "rejected": [...]} in TRL's conversational preference
layout: the prompt is the conversation up to its last answer (system prompt and follow-up turns included), chosen
and rejected are one assistant message each.

train.jsonl comes from the chat data's train.jsonl and validation.jsonl from its validation.jsonl, whose last
questions training never asks, so held-out pairs are held-out questions.

    python -m memtrain.data.read.synthetic_pairs      # rewrite memtrain/assets/preference from memtrain/assets/chat

The output is a function of SEED and the chat files; the files are committed, so runs need no generation.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

from memtrain.data.read.corpus import ASSETS
from memtrain.data.read.synthetic import CHAT_DIR

SEED = 2025
PREFERENCE_DIR = ASSETS / "preference"
ANOTHER_ANSWER_SHARE = 0.1  # rejected answers taken from another question of the same task
_QUOTED = re.compile(r"'([^']+)'")
_NUMBER = re.compile(r"\d+")


def wrong_answer(task: str, messages: list[dict], rng: random.Random, same_task: list[str]) -> str:
    """A plausible wrong answer to the last question of `messages` (a conversation of `task` ending in its right
    answer), never the right answer itself (module doc)."""
    answer, question = messages[-1]["content"], messages[-2]["content"]
    others = [a for a in same_task if a != answer]
    if others and rng.random() < ANOTHER_ANSWER_SHARE:
        return rng.choice(others)
    kind = task.split("+")[0]
    if kind in ("add", "subtract", "multiply") or "follow_up" in task:
        return _wrong_number(task, messages, rng)
    if kind == "length":
        return _off_by(int(answer), (1,), rng, lowest=1)
    word_match = _QUOTED.search(question)
    word = word_match.group(1) if word_match else answer
    if kind == "reverse":
        return _swap_two(answer, rng) if rng.random() < 0.6 or word == answer else word
    if kind == "upper":
        if rng.random() < 0.5 and len(answer) > 1:
            at = rng.randrange(len(answer))
            return answer[:at] + answer[at].lower() + answer[at + 1 :]
        return word
    if kind == "first_letter":
        letters = [c for c in dict.fromkeys(word) if c != answer]
        return rng.choice(letters) if letters else chr((ord(answer) - ord("a") + 1) % 26 + ord("a"))
    return answer + answer[-1]


def _wrong_number(task: str, messages: list[dict], rng: random.Random) -> str:
    """An arithmetic mistake (module doc): a number of the question echoed (for a follow-up, the earlier answer) or
    the other operation's result, half the time each; the answer off by one or ten where neither is there to make."""
    answer = int(messages[-1]["content"])
    question = messages[-2]["content"]
    numbers = [int(n) for n in _NUMBER.findall(question)]
    if "follow_up" in task:
        earlier = int(messages[-3]["content"])
        echoed = [earlier]
        other_operation = [earlier - numbers[0]]
    else:
        echoed = numbers
        a, b = numbers
        other_operation = {"add": [abs(a - b)], "subtract": [a + b], "multiply": [a + b]}[task.split("+")[0]]
    echoed = [n for n in echoed if n != answer]
    other_operation = [n for n in other_operation if n != answer and n >= 0]
    mistakes = [echoed, other_operation] if rng.random() < 0.5 else [other_operation, echoed]
    for choices in mistakes:  # one kind or the other, half the time each, where it is there to make
        if choices:
            return str(rng.choice(choices))
    return _off_by(answer, (1, 1, 1, 10), rng, lowest=0)


def _off_by(value: int, steps: tuple[int, ...], rng: random.Random, lowest: int) -> str:
    """`value` one of `steps` up or down, never below `lowest`."""
    step = rng.choice(steps)
    return str(value + step if value - step < lowest or rng.random() < 0.5 else value - step)


def _swap_two(text: str, rng: random.Random) -> str:
    """`text` with two neighbouring, different letters swapped (a letter doubled when it has no such pair)."""
    spots = [i for i in range(len(text) - 1) if text[i] != text[i + 1]]
    if not spots:
        return text + text[-1]
    i = rng.choice(spots)
    return text[:i] + text[i + 1] + text[i] + text[i + 2 :]


def preference_records(chat_records: list[dict], seed: int) -> list[dict]:
    """A preference record per chat record (module doc)."""
    rng = random.Random(seed)
    by_task: dict[str, list[str]] = {}
    for record in chat_records:
        by_task.setdefault(record["task"], []).append(record["messages"][-1]["content"])
    out = []
    for record in chat_records:
        messages = record["messages"]
        answer = messages[-1]["content"]
        wrong = wrong_answer(record["task"], messages, rng, by_task[record["task"]])
        assert wrong != answer, (record, wrong)
        out.append(
            {
                "task": record["task"],
                "prompt": messages[:-1],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return out


def write_preference_data(directory: Path = PREFERENCE_DIR, chat_dir: Path = CHAT_DIR, seed: int = SEED) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for offset, split in enumerate(("train", "validation")):
        with open(chat_dir / f"{split}.jsonl", encoding="utf-8") as handle:
            chat = [json.loads(line) for line in handle if line.strip()]
        with open(directory / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            for record in preference_records(chat, seed + offset):
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def main(argv: list[str]) -> int:
    write_preference_data()
    print(f"wrote {PREFERENCE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
