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


def test_wrong_answers_are_the_mistakes_of_each_task():
    rng = random.Random(0)
    for _ in range(50):
        assert abs(int(wrong_answer("add", "What is 2 + 3?", "5", rng, [])) - 5) in (1, 10)
        assert int(wrong_answer("length", "How many letters are in 'king'?", "4", rng, [])) in (3, 5)
        assert wrong_answer("first_letter", "What is the first letter of 'king'?", "k", rng, []) in "ing"
        assert wrong_answer("reverse", "Reverse the word 'king'.", "gnik", rng, []) in ("king", "ngik", "gink", "gnki")
        assert wrong_answer("upper", "Write 'king' in capital letters.", "KING", rng, []).upper() == "KING"
        assert wrong_answer("subtract", "What is 3 - 3?", "0", rng, []) in ("1", "10")


def test_builtin_pairs_build_into_pair_sets(chat_tokenizer, make_data):
    data = make_data(
        train=[{"path": "builtin:preference/validation", "type": "preference"}], template="chatml", seq_len=128
    )
    train, validation = build_datasets(data, chat_tokenizer, seed=0)
    assert isinstance(train, PairRows) and len(train) + len(validation) == 300 and len(validation) == 15
    assert train.stats.identical == 0 and train.stats.truncated == 0
