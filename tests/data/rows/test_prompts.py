"""Held-out prompts for the generation evaluation: the conversation up to its last answer, as training tokenised it."""

from __future__ import annotations

from memtrain.data.render.chat import ConversationEncoder
from memtrain.data.render.templates import shipped_template
from memtrain.data.rows.mixture import build_rows
from memtrain.data.rows.prompts import has_answers, held_out_prompts, prompt_of

CHAT = [{"path": "builtin:chat", "type": "chat"}]
CHAT_VALIDATION = [{"path": "builtin:chat/validation", "type": "chat"}]


def encoder(tokenizer, **keys):
    return ConversationEncoder(tokenizer, shipped_template("chatml"), **keys)


def test_the_prompt_ends_with_the_assistant_header_and_the_answer_is_the_last_assistant_turn(chat_tokenizer):
    messages = [
        {"role": "system", "content": "Answer with the result only."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And plus 4?"},
        {"role": "assistant", "content": "9"},
        {"role": "user", "content": "Thanks"},
    ]  # after the last answer: left out
    ids, expected, question = prompt_of(encoder(chat_tokenizer, train_on="last_turn"), messages)
    assert expected == "9" and question == "And plus 4?"
    assert chat_tokenizer.decode(ids) == (
        "<|im_start|>system\nAnswer with the result only.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nAnd plus 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    # token for token what training sees before the answer (markers are single special tokens)
    train_ids, targets = encoder(chat_tokenizer).encode(messages[:5])
    assert train_ids[: len(ids)] == ids and targets[len(ids)] and not any(targets[len(ids) - 4 : len(ids)])
    assert ids.count(chat_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5


def test_no_assistant_turn_gives_no_prompt(chat_tokenizer):
    assert prompt_of(encoder(chat_tokenizer, train_on="last_turn"), [{"role": "user", "content": "hi"}]) is None


def test_validation_datasets_give_prompts_in_file_order_up_to_the_limit(chat_tokenizer, make_data):
    data = make_data(train=CHAT, validation=CHAT_VALIDATION, template="chatml", seq_len=128)
    prompts, skipped = held_out_prompts(data, chat_tokenizer, limit=5)
    assert len(prompts) == 5 and skipped == 0
    first = prompts[0]
    assert (first.expected, first.question, first.task, first.line) == (
        "s",
        "What is the first letter of 'sound'?",
        "first_letter",
        1,
    )
    assert first.file == "builtin:chat/validation"
    assert [p.line for p in prompts] == [1, 2, 3, 4, 5]


def test_the_bundled_validation_set_gives_all_its_300_questions_in_file_order(chat_tokenizer, make_data):
    data = make_data(train=CHAT, validation=CHAT_VALIDATION, template="chatml", seq_len=128)  # quickstart-chat's
    prompts, skipped = held_out_prompts(data, chat_tokenizer)
    assert (len(prompts), skipped) == (300, 0) and [p.line for p in prompts] == list(range(1, 301))


def test_prompts_too_long_for_seq_len_are_skipped_and_counted(chat_tokenizer, make_data):
    data = make_data(train=CHAT, validation=CHAT_VALIDATION, template="chatml", seq_len=32)
    prompts, skipped = held_out_prompts(data, chat_tokenizer, limit=20)
    assert skipped > 0 and all(len(p.prompt_ids) < 32 for p in prompts)


def test_without_validation_the_tail_of_the_training_records_is_held_out(chat_tokenizer, make_data, write_jsonl):
    records = [
        {"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]}
        for i in range(20)
    ]
    path = write_jsonl("train.jsonl", records)
    data = make_data(train=[{"path": path, "type": "chat"}], template="chatml", validation_fraction=0.1, seq_len=64)
    prompts, _ = held_out_prompts(data, chat_tokenizer)
    assert [p.expected for p in prompts] == ["19", "20"] and [p.line for p in prompts] == [19, 20]


def test_text_data_has_no_answers(chat_tokenizer, make_data):
    assert not has_answers(make_data(train="builtin:shakespeare"))
    text_list = make_data(train=[{"path": "builtin:shakespeare", "type": "text"}])
    assert not has_answers(text_list) and held_out_prompts(text_list, chat_tokenizer) == ([], 0)
    assert has_answers(make_data(train=CHAT, template="chatml"))


# ---------------------------------------------------------------- held out = the validation split's samples

LONG_PROMPT = " ".join(["wherefore art thou"] * 40)  # far longer than SEQ_LEN tokens: no target left, dropped
SEQ_LEN = 64


def qa(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def leaky_records(n: int = 100, dropped: int = 10, secret_at: int = 95) -> list[dict]:
    """A leaky data file: the first `dropped` records are dropped by training (prompt longer than seq_len),
    and one unique question sits where a tail counted in records (not in usable samples) would hold it out."""
    records = [qa(f"Question {i}: what follows {i}?", str(i + 1)) for i in range(n)]
    for i in range(dropped):
        records[i] = qa(LONG_PROMPT, "no")
    records[secret_at] = qa("What is the secret word?", "zebra")
    return records


def sample_texts(rows, tokenizer) -> list[str]:
    """Each sample the rows hold (repeats included), decoded: what training (or validation) actually sees."""
    views = rows.samples
    return [
        tokenizer.decode(views.tokens[views.source[i]][views.start[i] : views.start[i] + views.length[i]].tolist())
        for i in rows.row_samples
    ]


def asked(prompt, tokenizer) -> str:
    return tokenizer.decode(prompt.prompt_ids) + prompt.expected


def assert_held_out_is_the_validation_split(data, tokenizer) -> list:
    """No held-out question is a training sample, and the questions are the validation samples, one each."""
    train, validation = build_rows(data, tokenizer, seed=0)
    prompts, _ = held_out_prompts(data, tokenizer)
    trained, validated = sample_texts(train, tokenizer), sample_texts(validation, tokenizer)
    for prompt in prompts:
        assert not any(text.startswith(asked(prompt, tokenizer)) for text in trained), prompt.question
    questions = sorted(asked(p, tokenizer) for p in prompts)
    # each validation sample mapped to the question it starts with (to itself when there is none)
    validation_questions = sorted(next((q for q in questions if text.startswith(q)), text) for text in validated)
    assert validation_questions == questions
    return prompts


def test_without_validation_a_record_training_used_is_never_held_out_when_records_were_dropped(
    chat_tokenizer, make_data, write_jsonl
):
    path = write_jsonl("leak.jsonl", leaky_records())
    data = make_data(train=[{"path": path, "type": "chat"}], template="chatml", seq_len=SEQ_LEN)
    prompts = assert_held_out_is_the_validation_split(data, chat_tokenizer)
    # 90 usable samples: round(0.05 x 90) = 4 held out, the last four records; the secret word was trained on
    assert [p.line for p in prompts] == [97, 98, 99, 100]
    assert "zebra" not in [p.expected for p in prompts]


def test_datasets_mixed_with_weights_hold_out_each_its_own_tail(chat_tokenizer, make_data, write_jsonl):
    leaky = write_jsonl("leak.jsonl", leaky_records())
    clean = write_jsonl("clean.jsonl", [qa(f"Say {i} twice", f"{i} {i}") for i in range(40)])
    data = make_data(
        train=[{"path": leaky, "type": "chat", "weight": 2.0}, {"path": clean, "type": "chat", "weight": 0.5}],
        template="chatml",
        seq_len=SEQ_LEN,
    )
    prompts = assert_held_out_is_the_validation_split(data, chat_tokenizer)
    assert [(p.file, p.line) for p in prompts] == [(leaky, n) for n in (97, 98, 99, 100)] + [(clean, 39), (clean, 40)]


def test_with_validation_datasets_the_samples_validation_dropped_are_skipped_not_asked(
    chat_tokenizer, make_data, write_jsonl
):
    # truncation: drop leaves out a sample longer than seq_len whose prompt alone would fit: no validation row
    # holds it, so the generation eval must not ask it either
    long_answer = " ".join(["forsooth"] * 80)
    validation = [qa(f"Question {i}: what follows {i}?", str(i + 1)) for i in range(6)]
    validation[2] = qa("Recite it all", long_answer)
    validation[4] = qa(LONG_PROMPT, "no")
    train = write_jsonl("train.jsonl", [qa(f"Say {i} twice", f"{i} {i}") for i in range(20)])
    data = make_data(
        train=[{"path": train, "type": "chat"}],
        validation=[{"path": write_jsonl("validation.jsonl", validation), "type": "chat"}],
        template="chatml",
        seq_len=SEQ_LEN,
        truncation="drop",
    )
    prompts = assert_held_out_is_the_validation_split(data, chat_tokenizer)
    assert [p.line for p in prompts] == [1, 2, 4, 6]
    assert held_out_prompts(data, chat_tokenizer)[1] == 2
    assert [p.line for p in held_out_prompts(data, chat_tokenizer, limit=2)[0]] == [1, 2]
