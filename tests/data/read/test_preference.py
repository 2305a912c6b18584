"""Preference and KTO records read into a prompt and answers, and rendered token by token: conversations as
apply_chat_template writes them (the prompt as its generation prompt, the answer's turn the targets), text as the
tokenizer writes it with an EOS after the answer. Bad records name file, line and field."""

from __future__ import annotations

import pytest

from memtrain.data.read.preference import PreferencePair, to_kto, to_pair
from memtrain.data.render.pairs import PairEncoder
from memtrain.data.render.templates import shipped_template
from memtrain.errors import DataError
from memtrain.recipe.schema import DatasetSpec

PREF = DatasetSpec(path="p.jsonl", type="preference")
KTO = DatasetSpec(path="k.jsonl", type="kto")
USER = {"role": "user", "content": "What is 2 + 3?"}


def said(record: dict, spec: DatasetSpec = PREF):
    with pytest.raises(DataError) as caught:
        (to_kto if spec.type == "kto" else to_pair)(record, spec, "p.jsonl", 7)
    [problem] = caught.value.problems
    assert problem.file == "p.jsonl" and problem.line == 7 and problem.hint
    return problem


def test_explicit_conversational_and_text_records():
    pair = to_pair({"prompt": [USER], "chosen": [{"role": "assistant", "content": "5"}], "rejected": "6"}, PREF, "p", 1)
    assert pair == PreferencePair(
        [USER], [{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}]
    )
    assert pair.conversational and not pair.identical
    # a string prompt beside messages is the user's turn; all strings stay text
    assert to_pair(
        {"prompt": "Hi", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}, PREF, "p", 1
    ).prompt == [{"role": "user", "content": "Hi"}]
    assert to_pair({"prompt": "Q: 2+3?\nA:", "chosen": " 5", "rejected": " 6"}, PREF, "p", 1) == PreferencePair(
        "Q: 2+3?\nA:", " 5", " 6"
    )
    renamed = DatasetSpec(path="p", type="preference", prompt_field="q", chosen_field="good", rejected_field="bad")
    assert to_pair({"q": "x", "good": "y", "bad": "z"}, renamed, "p", 1) == PreferencePair("x", "y", "z")


def test_implicit_forms_share_the_prompt_up_to_the_last_assistant_turn():
    chosen = [
        USER,
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And +1?"},
        {"role": "assistant", "content": "6"},
    ]
    rejected = chosen[:3] + [{"role": "assistant", "content": "7"}]
    pair = to_pair({"chosen": chosen, "rejected": rejected}, PREF, "p", 1)
    assert pair.prompt == chosen[:3] and pair.chosen == chosen[3:] and pair.rejected == rejected[3:]
    # the two part at the first answer: the prompt is the user's turn, each answer the rest of its conversation
    early = [
        USER,
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And +1?"},
        {"role": "assistant", "content": "5"},
    ]
    pair = to_pair({"chosen": chosen, "rejected": early}, PREF, "p", 1)
    assert pair.prompt == [USER] and pair.chosen == chosen[1:] and pair.rejected == early[1:]
    # Anthropic HH as text: up to the last "Assistant:" before the two part
    hh = "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: 2+3?\n\nAssistant:"
    pair = to_pair({"chosen": hh + " 5", "rejected": hh + " 6"}, PREF, "p", 1)
    assert pair == PreferencePair(hh, " 5", " 6")
    # whole conversations beside a prompt field (UltraFeedback-binarized's layout) are read as the implicit form
    assert (
        to_pair({"prompt": "What is 2 + 3?", "chosen": chosen, "rejected": rejected}, PREF, "p", 1).prompt == chosen[:3]
    )
    assert to_pair({"chosen": hh + " 5", "rejected": hh + " 5"}, PREF, "p", 1).identical


def test_bad_preference_records_name_line_and_field():
    assert said({"prompt": "x", "rejected": "y"}).key == "chosen"
    problem = said({"prompt": "x", "chosen": "y", "rejectd": "z"})
    assert problem.key == "rejected" and "rejectd" in problem.hint
    assert said({"prompt": "x", "chosen": "", "rejected": "z"}).key == "chosen"
    assert said({"prompt": "x", "chosen": 5, "rejected": "z"}).key == "chosen"
    no_prompt = said({"chosen": "Human: hi\nAssistant: a", "rejected": "Human: yo\nAssistant: b"})
    assert no_prompt.key == "chosen" and "share no prompt" in no_prompt.message
    other_user = [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]
    assert (
        "share no prompt"
        in said({"chosen": [USER, {"role": "assistant", "content": "a"}], "rejected": other_user}).message
    )
    assert (
        said({"prompt": [USER, {"role": "assistant", "content": "5"}], "chosen": "a", "rejected": "b"}).key == "prompt"
    )
    assert said({"prompt": "x", "chosen": [{"role": "robot", "content": "a"}], "rejected": "b"}).key == "chosen[0].role"


def test_kto_records_and_their_labels():
    record = to_kto({"prompt": [USER], "completion": "5", "label": True}, KTO, "k", 1)
    assert record.prompt == [USER] and record.completion == [{"role": "assistant", "content": "5"}] and record.desirable
    assert not to_kto({"prompt": "x", "completion": "y", "label": False}, KTO, "k", 1).desirable
    for label in ("true", 1, None):
        problem = said({"prompt": "x", "completion": "y", "label": label}, KTO)
        assert problem.key == "label" and "not true or false" in problem.message
    assert said({"prompt": "x", "completion": "y"}, KTO).key == "label"
    assert said({"prompt": "x", "label": True}, KTO).key == "completion"


def split(ids: list[int], targets: list[bool]) -> tuple[list[int], list[int], list[int]]:
    """(tokens before the first target, the targets, the tokens after the last one); targets are one run."""
    first = targets.index(True)
    last = len(targets) - targets[::-1].index(True)
    assert all(targets[first:last])
    return ids[:first], ids[first:last], ids[last:]


def test_a_conversation_renders_as_apply_chat_template_with_the_answer_as_target(chat_tokenizer):
    encoder = PairEncoder(chat_tokenizer, shipped_template("chatml"))
    system = {"role": "system", "content": "Answer with the result only."}
    prompt = [system, USER]
    for answer in ("5", " 5 "):
        [encoded] = encoder.encode_many([(prompt, [{"role": "assistant", "content": answer}])])
        whole = chat_tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": answer}], tokenize=True)
        asked = chat_tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        whole = whole["input_ids"] if hasattr(whole, "keys") else whole
        asked = asked["input_ids"] if hasattr(asked, "keys") else asked
        if answer == "5":  # an answer that starts with whitespace starts at a token boundary (chat.py), not joined
            assert encoded.ids == list(whole)
        before, target, after = split(encoded.ids, encoded.targets)
        assert before == list(asked)  # the prompt ends as the generation prompt does
        end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert target[-1] == end and chat_tokenizer.decode(target[:-1]).strip() == answer.strip()
        assert chat_tokenizer.decode(after) == "\n"


def test_only_the_answers_turns_are_targets_after_a_multi_turn_prompt(chat_tokenizer):
    encoder = PairEncoder(chat_tokenizer, shipped_template("chatml"))
    prompt = [USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And +1?"}]
    [encoded] = encoder.encode_many([(prompt, [{"role": "assistant", "content": "6"}])])
    _, target, _ = split(encoded.ids, encoded.targets)
    assert chat_tokenizer.decode(target) == "6<|im_end|>"


def test_text_is_the_prompt_and_answer_then_eos_with_the_answer_as_target(text_tokenizer):
    encoder = PairEncoder(text_tokenizer, None)
    prompt, answer = "\n\nHuman: What is the first letter of 'king'?\n\nAssistant:", " k"
    [encoded] = encoder.encode_many([(prompt, answer)])
    whole = text_tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
    assert encoded.ids == [*encoder.bos, *whole, text_tokenizer.eos_token_id]
    before, target, after = split(encoded.ids, encoded.targets)
    assert text_tokenizer.decode(before) == prompt and text_tokenizer.decode(target[:-1]) == answer
    assert target[-1] == text_tokenizer.eos_token_id and after == []
    # text that spells a special token stays text
    [spelled] = encoder.encode_many([("Say <|endoftext|>", " no")])
    assert spelled.ids.count(text_tokenizer.eos_token_id) == 1
