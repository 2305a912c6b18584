"""Which tokens are targets: hand-written conversations against hand-written expectations, token by token.

Each expectation is the rendered text written out by hand as segments: template text (markers parsed as
special tokens), content (tokenised so it cannot spell a marker), and whether the segment is a target.
The segments are tokenised one by one and laid end to end; the dataset's first row must equal that,
with labels -100 exactly where the segment is not a target (and on the sample's first token, which
nothing predicts).
"""

from __future__ import annotations

import pytest

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.recipe.schema import Model

T, C = "template", "content"
IGNORE = -100
SYSTEM = "Answer with the result only."


def expected(tokenizer, segments: list[tuple[str, str, bool]]) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for segments of (kind, text, is_target)."""
    ids: list[int] = []
    labels: list[int] = []
    for kind, text, target in segments:
        piece = tokenizer(text, add_special_tokens=False, split_special_tokens=(kind == C))["input_ids"]
        ids += piece
        labels += piece if target else [IGNORE] * len(piece)
    labels[0] = IGNORE
    return ids, labels


def first_row(tokenizer, data) -> tuple[list[int], list[int]]:
    train, _ = build_datasets(data, tokenizer, seed=0)
    assert len(train) == 1
    item = train[0]
    length = int(train.row_tokens[0])
    assert (item["labels"][length:] == IGNORE).all() and (item["input_ids"][length:] == tokenizer.pad_token_id).all()
    return item["input_ids"][:length].tolist(), item["labels"][:length].tolist()


def one_dataset(make_data, path, type_, **keys):
    # validation given separately so the single training record is not held out
    spec = {"path": path, "type": type_, **keys.pop("spec", {})}
    return make_data(train=[spec], validation=[spec], seq_len=256, packing=False, **keys)


MULTI_TURN = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And plus 4?"},
    {"role": "assistant", "content": "9"},
]


def chatml_segments(last_turn_only: bool = False, everything: bool = False) -> list[tuple[str, str, bool]]:
    first = everything or not last_turn_only
    return [
        (T, "<|im_start|>system\n", everything),
        (C, SYSTEM, everything),
        (T, "<|im_end|>\n<|im_start|>user\n", everything),
        (C, "What is 2 + 3?", everything),
        (T, "<|im_end|>\n<|im_start|>assistant\n", everything),
        (C, "5", first),
        (T, "<|im_end|>", first),
        (T, "\n<|im_start|>user\n", everything),
        (C, "And plus 4?", everything),
        (T, "<|im_end|>\n<|im_start|>assistant\n", everything),
        (C, "9", True),
        (T, "<|im_end|>", True),
        (T, "\n", everything),
    ]


def test_chat_multi_turn_with_system_prompt_trains_every_assistant_turn(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", [{"messages": MULTI_TURN}])
    got = first_row(chat_tokenizer, one_dataset(make_data, path, "chat"))
    assert got == expected(chat_tokenizer, chatml_segments())


def test_last_turn_trains_only_the_final_answer(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", [{"messages": MULTI_TURN}])
    got = first_row(chat_tokenizer, one_dataset(make_data, path, "chat", train_on="last_turn"))
    assert got == expected(chat_tokenizer, chatml_segments(last_turn_only=True))


def test_train_on_inputs_makes_every_token_a_target(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", [{"messages": MULTI_TURN}])
    ids, labels = first_row(chat_tokenizer, one_dataset(make_data, path, "chat", train_on_inputs=True))
    assert (ids, labels) == expected(chat_tokenizer, chatml_segments(everything=True))
    assert labels[1:] == ids[1:]


def test_sharegpt_conversations_mask_like_the_same_openai_messages(chat_tokenizer, write_jsonl, make_data):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    record = {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in MULTI_TURN]}
    path = write_jsonl("sharegpt.jsonl", [record])
    got = first_row(chat_tokenizer, one_dataset(make_data, path, "chat"))
    assert got == expected(chat_tokenizer, chatml_segments())


def test_sharegpt_with_mapped_role_names(chat_tokenizer, write_jsonl, make_data):
    record = {"dialogue": [{"from": "asker", "value": "What is 2 + 3?"}, {"from": "answerer", "value": "5"}]}
    path = write_jsonl("custom.jsonl", [record])
    data = one_dataset(
        make_data,
        path,
        "chat",
        spec={
            "messages_field": "dialogue",
            "chat_format": "sharegpt",
            "roles": {"asker": "user", "answerer": "assistant"},
        },
    )
    assert first_row(chat_tokenizer, data) == expected(
        chat_tokenizer,
        [
            (T, "<|im_start|>user\n", False),
            (C, "What is 2 + 3?", False),
            (T, "<|im_end|>\n<|im_start|>assistant\n", False),
            (C, "5", True),
            (T, "<|im_end|>", True),
            (T, "\n", False),
        ],
    )


ALPACA_INPUT_PREAMBLE = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
)


def test_instruction_with_input_through_the_alpaca_template(text_tokenizer, write_jsonl, make_data):
    record = {"instruction": "Write the word in capital letters.", "input": "king", "output": "KING"}
    path = write_jsonl("alpaca.jsonl", [record])
    got = first_row(text_tokenizer, one_dataset(make_data, path, "instruction", template="alpaca"))
    assert got == expected(
        text_tokenizer,
        [
            (T, ALPACA_INPUT_PREAMBLE + "### Instruction:\n", False),
            (C, "Write the word in capital letters.", False),
            (T, "\n\n### Input:\n", False),
            (C, "king", False),
            (T, "\n\n### Response:\n", False),
            (C, "KING", True),
            (T, "<|endoftext|>", True),
            (T, "\n\n", False),
        ],
    )


def test_instruction_without_input_and_with_a_system_field(text_tokenizer, write_jsonl, make_data):
    record = {"sys": "Be terse.", "instruction": "Reverse 'sword'.", "input": "", "output": "drows"}
    path = write_jsonl("alpaca.jsonl", [record])
    data = one_dataset(make_data, path, "instruction", template="alpaca", spec={"system_field": "sys"})
    assert first_row(text_tokenizer, data) == expected(
        text_tokenizer,
        [
            (T, "", False),
            (C, "Be terse.", False),
            (T, "\n\n### Instruction:\n", False),
            (C, "Reverse 'sword'.", False),
            (T, "\n\n### Response:\n", False),
            (C, "drows", True),
            (T, "<|endoftext|>", True),
            (T, "\n\n", False),
        ],
    )


def test_completion_is_a_user_prompt_and_an_assistant_answer(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("completion.jsonl", [{"q": "What is 7 times 8?", "a": "56"}])
    data = one_dataset(make_data, path, "completion", spec={"prompt_field": "q", "completion_field": "a"})
    assert first_row(chat_tokenizer, data) == expected(
        chat_tokenizer,
        [
            (T, "<|im_start|>user\n", False),
            (C, "What is 7 times 8?", False),
            (T, "<|im_end|>\n<|im_start|>assistant\n", False),
            (C, "56", True),
            (T, "<|im_end|>", True),
            (T, "\n", False),
        ],
    )


def test_llama3_template_ends_each_turn_with_eot(write_jsonl, make_data):
    tokenizer = load_tokenizer(Model(preset="tiny", tokenizer="builtin:shakespeare-chat"))  # gains llama-3 markers
    path = write_jsonl("chat.jsonl", [{"messages": MULTI_TURN[1:3]}])
    data = one_dataset(make_data, path, "chat", template="llama-3", add_special_tokens=True)
    assert first_row(tokenizer, data) == expected(
        tokenizer,
        [
            (T, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", False),
            (C, "What is 2 + 3?", False),
            (T, "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", False),
            (C, "5", True),
            (T, "<|eot_id|>", True),
        ],
    )


def test_a_truncated_sample_keeps_its_prompt_masked(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", [{"messages": MULTI_TURN}])
    full_ids, full_labels = expected(chat_tokenizer, chatml_segments())
    seq_len = len(full_ids) - 3  # cuts the last answer "9" with its "<|im_end|>\n"; the first answer stays
    spec = {"path": path, "type": "chat"}
    data = make_data(train=[spec], validation=[spec], seq_len=seq_len, packing=False)
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    item = train[0]
    assert item["input_ids"].tolist() == full_ids[:seq_len]
    assert item["labels"].tolist() == full_labels[:seq_len]
    assert train.stats.truncated == 1


@pytest.mark.parametrize("train_on", ["all_turns", "last_turn"])
def test_targets_count_what_the_loss_sees(chat_tokenizer, write_jsonl, make_data, train_on):
    path = write_jsonl("chat.jsonl", [{"messages": MULTI_TURN}, {"messages": MULTI_TURN[1:3]}] * 3)
    spec = {"path": path, "type": "chat"}
    data = make_data(train=[spec], validation=[spec], seq_len=64, train_on=train_on)
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    for rows in ([0], list(range(len(train)))):
        assert train.targets(rows) == sum(int((train[i]["labels"][1:] != IGNORE).sum()) for i in rows)
    assert train.stats.target_tokens == train.targets(range(len(train)))
