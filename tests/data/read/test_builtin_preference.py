"""builtin:preference: the chat data's questions with the right answer chosen and a plausible wrong one rejected,
held-out pairs from held-out questions, built into pairs with the bundled chat tokenizer."""

from __future__ import annotations

import json
import random

from memtrain.data.read.records import builtin_dataset_names, read_records, resolve_dataset_path
from memtrain.data.read.synthetic import CHAT_DIR
from memtrain.data.read.synthetic_pairs import PREFERENCE_DIR, preference_records, wrong_answer
from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.pairs import PairRows


def test_the_bundled_pairs_are_the_chat_questions_with_a_wrong_answer_rejected():
    assert {"preference", "preference/validation"} <= set(builtin_dataset_names())
    assert resolve_dataset_path("builtin:preference/validation") == PREFERENCE_DIR / "validation.jsonl"
    for split in ("train", "validation"):
        chat = [r for _, r in read_records(str(CHAT_DIR / f"{split}.jsonl"))]
        pairs = [r for _, r in read_records(f"builtin:preference{'' if split == 'train' else '/' + split}")]
        assert len(pairs) == len(chat) and pairs == preference_records(chat, 2025 + (split == "validation"))
        for record, pair in zip(chat, pairs):
            assert pair["prompt"] == record["messages"][:-1] and pair["chosen"] == record["messages"][-1:]
            assert pair["rejected"][0]["role"] == "assistant" and pair["rejected"] != pair["chosen"]
    # as the chat data holds its validation out: no last question with its answer that training has
    train_questions = {json.dumps(r["prompt"][-1:] + r["chosen"]) for _, r in read_records("builtin:preference")}
    held_out = [json.dumps(r["prompt"][-1:] + r["chosen"]) for _, r in read_records("builtin:preference/validation")]
    assert not train_questions & set(held_out)


def _asked(*turns: str) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": turn} for i, turn in enumerate(turns)]


def _wrong(task: str, *turns: str, draws: int = 200) -> set[str]:
    rng = random.Random(0)
    return {wrong_answer(task, _asked(*turns), rng, []) for _ in range(draws)}


def test_wrong_answers_are_the_mistakes_of_each_task():
    # arithmetic: a number of the question echoed or the other operation's result, every one of them drawn
    assert _wrong("add", "What is 78 + 3?", "81") == {"78", "3", "75"}
    assert _wrong("add", "What is 2 + 3?", "5") == {"2", "3", "1"}  # the difference: the larger less the smaller
    assert _wrong("multiply", "What is 4 times 7?", "28") == {"4", "7", "11"}
    assert _wrong("subtract", "What is 3 - 3?", "0") == {"3", "6"}
    # a follow-up: the earlier answer left as it was, or the follow-up's number taken away
    assert _wrong("subtract+follow_up", "What is 12 - 0?", "12", "And plus 7?", "19") == {"12", "5"}
    assert _wrong("add+follow_up", "What is 1 + 0?", "1", "And plus 4?", "5") == {"1"}  # 1 - 4 is below zero
    # where neither mistake is there to make (numbers that are the answer): off by one or ten
    assert _wrong("subtract+follow_up", "What is 5 - 0?", "5", "And plus 0?", "5") == {"4", "6", "15"}
    assert _wrong("add", "What is 0 + 0?", "0") == {"1", "10"}
    assert _wrong("length", "How many letters are in 'king'?", "4") == {"3", "5"}
    assert _wrong("first_letter", "What is the first letter of 'king'?", "k") == {"i", "n", "g"}
    assert _wrong("reverse", "Reverse the word 'king'.", "gnik") == {"king", "ngik", "gink", "gnki"}
    assert {w.upper() for w in _wrong("upper", "Write 'king' in capital letters.", "KING")} == {"KING"}


def test_builtin_pairs_build_into_pair_sets(chat_tokenizer, make_data):
    data = make_data(
        train=[{"path": "builtin:preference/validation", "type": "preference"}], template="chatml", seq_len=128
    )
    train, validation = build_datasets(data, chat_tokenizer, seed=0)
    assert isinstance(train, PairRows) and len(train) + len(validation) == 300 and len(validation) == 15
    assert train.stats.identical == 0 and train.stats.truncated == 0
