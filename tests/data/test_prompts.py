"""Held-out prompts for the generation evaluation: the conversation up to its last answer, as training tokenised it."""
from __future__ import annotations

from memtrain.data.prompts import has_answers, held_out_prompts, prompt_of
from memtrain.data.render import ConversationEncoder
from memtrain.data.templates import shipped_template

CHAT = [{"path": "builtin:chat", "type": "chat"}]
CHAT_VALIDATION = [{"path": "builtin:chat/validation", "type": "chat"}]


def encoder(tokenizer, **keys):
    return ConversationEncoder(tokenizer, shipped_template("chatml"), **keys)


def test_the_prompt_ends_with_the_assistant_header_and_the_answer_is_the_last_assistant_turn(chat_tokenizer):
    messages = [{"role": "system", "content": "Answer with the result only."},
                {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"},
                {"role": "user", "content": "And plus 4?"}, {"role": "assistant", "content": "9"},
                {"role": "user", "content": "Thanks"}]  # after the last answer: left out
    ids, expected, question = prompt_of(encoder(chat_tokenizer, train_on="last_turn"), messages)
    assert expected == "9" and question == "And plus 4?"
    assert chat_tokenizer.decode(ids) == (
        "<|im_start|>system\nAnswer with the result only.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nAnd plus 4?<|im_end|>\n<|im_start|>assistant\n")
    # token for token what training sees before the answer (markers are single special tokens)
    train_ids, targets = encoder(chat_tokenizer).encode(messages[:5])
    assert train_ids[:len(ids)] == ids and targets[len(ids)] and not any(targets[len(ids) - 4:len(ids)])
    assert ids.count(chat_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5


def test_no_assistant_turn_gives_no_prompt(chat_tokenizer):
    assert prompt_of(encoder(chat_tokenizer, train_on="last_turn"), [{"role": "user", "content": "hi"}]) is None


def test_validation_datasets_give_prompts_in_file_order_up_to_the_limit(chat_tokenizer, make_data):
    data = make_data(train=CHAT, validation=CHAT_VALIDATION, template="chatml", seq_len=128)
    prompts, skipped = held_out_prompts(data, chat_tokenizer, limit=5)
    assert len(prompts) == 5 and skipped == 0
    first = prompts[0]
    assert (first.expected, first.question, first.task, first.line) == (
        "s", "What is the first letter of 'sound'?", "first_letter", 1)
    assert first.file == "builtin:chat/validation"
    assert [p.line for p in prompts] == [1, 2, 3, 4, 5]


def test_prompts_too_long_for_seq_len_are_skipped_and_counted(chat_tokenizer, make_data):
    data = make_data(train=CHAT, validation=CHAT_VALIDATION, template="chatml", seq_len=16)
    prompts, skipped = held_out_prompts(data, chat_tokenizer, limit=20)
    assert skipped > 0 and all(len(p.prompt_ids) < 16 for p in prompts)


def test_without_validation_the_tail_of_the_training_records_is_held_out(chat_tokenizer, make_data, write_jsonl):
    records = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                             {"role": "assistant", "content": str(i + 1)}]} for i in range(20)]
    path = write_jsonl("train.jsonl", records)
    data = make_data(train=[{"path": path, "type": "chat"}], template="chatml", validation_fraction=0.1, seq_len=64)
    prompts, _ = held_out_prompts(data, chat_tokenizer)
    assert [p.expected for p in prompts] == ["19", "20"] and [p.line for p in prompts] == [19, 20]


def test_text_data_has_no_answers(chat_tokenizer, make_data):
    assert not has_answers(make_data(train="builtin:shakespeare"))
    text_list = make_data(train=[{"path": "builtin:shakespeare", "type": "text"}])
    assert not has_answers(text_list) and held_out_prompts(text_list, chat_tokenizer) == ([], 0)
    assert has_answers(make_data(train=CHAT, template="chatml"))
