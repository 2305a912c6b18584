"""Held-out records that training also holds: counted (prompts, and prompts with their answers) in the rows' stats,
on each held-out prompt of the generation eval, and, with data.validation_dedup, left out of validation."""

from __future__ import annotations

import pytest

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.overlap import HeldOutOverlap, conversation_keys, normalised, overlap_warning
from memtrain.data.rows.prompts import held_out_prompts
from memtrain.errors import DataError
from memtrain.train.eval.generation import GenerationScore

WORDS = ("king", "crown", "sword", "night", "lord", "heaven")


def sharegpt(word: str, answer: str | None = None) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": f"Reverse '{word}'."},
            {"from": "gpt", "value": answer or word[::-1]},
        ]
    }


def alpaca(word: str, answer: str | None = None) -> dict:
    return {"instruction": "Write the word in capital letters.", "input": word, "output": answer or word.upper()}


def test_copies_that_differ_in_case_spacing_or_unicode_form_are_one_prompt():
    assert normalised("  What IS\tthe  Capital?\n") == "what is the capital?"
    assert normalised("ﬁne café") == normalised("fine cafe\u0301")  # NFKC: a ligature, a combining accent
    ask = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    same = [{"role": "user", "content": " what is  2+2? "}, {"role": "assistant", "content": "4 "}]
    other_answer = [ask[0], {"role": "assistant", "content": "four"}]
    with_system = [{"role": "system", "content": "Be brief."}, *ask]
    assert conversation_keys(ask) == conversation_keys(same)
    assert conversation_keys(ask)[0] == conversation_keys(other_answer)[0]
    assert conversation_keys(ask)[1] != conversation_keys(other_answer)[1]
    assert conversation_keys(ask)[0] != conversation_keys(with_system)[0]  # what the model is prompted with differs


def test_a_file_of_a_few_records_repeated_holds_out_only_prompts_training_has(chat_tokenizer, write_jsonl, make_data):
    """40 records cycling through 6 questions: the tail of 2 held out (5 %) are both in training, with their answers."""
    path = write_jsonl("repeated.jsonl", [sharegpt(WORDS[i % 6]) for i in range(40)])
    data = make_data(train=[{"path": path, "type": "chat"}], seq_len=64, packing=False)
    train, validation = build_datasets(data, chat_tokenizer, seed=0)
    assert validation.stats.held_out == HeldOutOverlap(samples=2, prompts_in_train=2, answers_in_train=2, dropped=0)
    assert train.stats.held_out == validation.stats.held_out  # the run's start record reads the training stats
    assert "held-out: 2 of 2 prompts also in training (2 with the same answer)" in train.stats.describe()
    prompts, _ = held_out_prompts(data, chat_tokenizer)
    assert [(p.prompt_in_train, p.answer_in_train) for p in prompts] == [(True, True), (True, True)]
    warning = overlap_warning(validation.stats.held_out, dedup=False)
    assert "2 of 2 held-out prompts also occur in the training data" in warning and "validation_dedup: true" in warning


def test_a_separate_validation_file_is_compared_with_training_prompt_and_answer_apart(
    chat_tokenizer, write_jsonl, make_data
):
    train_path = write_jsonl("train.jsonl", [alpaca(w) for w in WORDS])
    held_out = [alpaca("KING "), alpaca("crown", answer="Crown!"), alpaca("moon"), alpaca("star")]
    validation_path = write_jsonl("validation.jsonl", held_out)
    keys = {"train": [{"path": train_path, "type": "instruction"}], "seq_len": 64, "packing": False}
    data = make_data(validation=[{"path": validation_path, "type": "instruction"}], **keys)
    _, validation = build_datasets(data, chat_tokenizer, seed=0)
    # "KING " is king's prompt (case and spacing aside) with king's answer; crown's prompt with another answer
    assert validation.stats.held_out == HeldOutOverlap(samples=4, prompts_in_train=2, answers_in_train=1, dropped=0)
    prompts, _ = held_out_prompts(data, chat_tokenizer)
    assert [(p.line, p.prompt_in_train, p.answer_in_train) for p in prompts] == [
        (1, True, True),
        (2, True, False),
        (3, False, False),
        (4, False, False),
    ]

    dedup = make_data(validation=[{"path": validation_path, "type": "instruction"}], validation_dedup=True, **keys)
    _, kept = build_datasets(dedup, chat_tokenizer, seed=0)
    assert kept.stats.held_out == HeldOutOverlap(samples=4, prompts_in_train=2, answers_in_train=1, dropped=2)
    assert kept.stats.samples == 2 and len(kept) == 2
    assert overlap_warning(kept.stats.held_out, dedup=True) is None
    prompts, skipped = held_out_prompts(dedup, chat_tokenizer)
    assert [(p.line, p.prompt_in_train) for p in prompts] == [(3, False), (4, False)]
    assert skipped == 0  # left out as trained on, not skipped


def test_dedup_that_leaves_nothing_to_validate_on_is_said_at_its_key(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("repeated.jsonl", [sharegpt(WORDS[i % 2]) for i in range(20)])
    data = make_data(train=[{"path": path, "type": "chat"}], seq_len=64, validation_dedup=True)
    with pytest.raises(DataError) as caught:
        build_datasets(data, chat_tokenizer, seed=0)
    [problem] = caught.value.problems
    assert problem.key == "data.validation_dedup" and "leaves nothing to validate on" in problem.message


def test_the_exact_match_says_how_many_answers_were_also_trained_on():
    score = GenerationScore(1.0, 20, 20, 0, [], prompts_in_train=20, answers_in_train=20)
    assert score.describe(30) == "step 30: exact match 1.000 (20/20 held-out answers, 20 of them also in training)"
    mixed = GenerationScore(0.25, 5, 20, 0, [], prompts_in_train=5, answers_in_train=3)
    assert mixed.answers_said() == "5/20 held-out answers, 5 of them also in training (3 with the same answer)"
    assert GenerationScore(0.5, 1, 2, 0, [], prompts_in_train=0, answers_in_train=0).answers_said() == (
        "1/2 held-out answers"
    )
    assert mixed.as_record()["prompts_in_train"] == 5 and mixed.as_record()["answers_in_train"] == 3
