"""An instruction record's input through `data.template: alpaca` is written as Stanford Alpaca's prompt for a task
with an input (its own preamble, an "### Input:" block); every other template writes instruction + blank line +
input as the user's content. Both tokenisation paths (the whole text by character offsets, and the pieces apart
when content spells a special token) and the generation eval's prompt see the same text, and only the response
(with its eos) is a target.
"""

from __future__ import annotations

from memtrain.data.read.conversation import to_conversation
from memtrain.data.render.chat import ConversationEncoder
from memtrain.data.render.templates import shipped_template
from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.prompts import prompt_of
from memtrain.recipe.schema import DatasetSpec

IGNORE = -100
WITH_INPUT = {"instruction": "Write the word in capital letters.", "input": "king", "output": "KING"}
WITHOUT_INPUT = {"instruction": "Reverse 'sword'.", "input": "", "output": "drows"}
STANFORD_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request.\n\n### Instruction:\nWrite the word in capital letters."
    "\n\n### Input:\nking\n\n### Response:\n"
)
STANFORD_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    "\n\n### Instruction:\nReverse 'sword'.\n\n### Response:\n"
)


def conversation(record: dict) -> list[dict]:
    return to_conversation(record, DatasetSpec(path="alpaca.jsonl", type="instruction"), "alpaca.jsonl", 1)


def encoder(tokenizer, template: str) -> ConversationEncoder:
    return ConversationEncoder(tokenizer, shipped_template(template))


def targets_text(tokenizer, ids, targets) -> str:
    return tokenizer.decode([i for i, t in zip(ids, targets) if t])


def test_a_record_with_an_input_renders_as_stanford_alpacas_prompt(text_tokenizer):
    rendered = encoder(text_tokenizer, "alpaca").render(conversation(WITH_INPUT))
    assert rendered.text == STANFORD_WITH_INPUT + "KING<|endoftext|>\n\n"
    # the instruction and the input are the user's text (two pieces of message 0), the answer message 1's
    assert rendered.content_pieces == ["Write the word in capital letters.", "king", "KING"]
    assert rendered.content_messages == [0, 0, 1]
    assert rendered.unwritten == ()


def test_a_record_without_an_input_keeps_the_plain_preamble(text_tokenizer):
    rendered = encoder(text_tokenizer, "alpaca").render(conversation(WITHOUT_INPUT))
    assert rendered.text == STANFORD_WITHOUT_INPUT + "drows<|endoftext|>\n\n"


def test_other_templates_write_the_input_after_a_blank_line_in_the_users_content(chat_tokenizer):
    rendered = encoder(chat_tokenizer, "chatml").render(conversation(WITH_INPUT))
    assert rendered.text == (
        "<|im_start|>user\nWrite the word in capital letters.\n\nking<|im_end|>\n"
        "<|im_start|>assistant\nKING<|im_end|>\n"
    )
    assert rendered.content_pieces == ["Write the word in capital letters.\n\nking", "KING"]


def test_the_row_is_stanfords_prompt_with_only_the_response_as_target(text_tokenizer, write_jsonl, make_data):
    path = write_jsonl("alpaca.jsonl", [WITH_INPUT, WITHOUT_INPUT])
    spec = {"path": path, "type": "instruction"}
    data = make_data(train=[spec], validation=[spec], seq_len=256, packing=False, template="alpaca")
    train, _ = build_datasets(data, text_tokenizer, seed=0)
    rows = {}
    for index in range(len(train)):
        item, length = train[index], int(train.row_tokens[index])
        ids, labels = item["input_ids"][:length].tolist(), item["labels"][:length].tolist()
        rows[text_tokenizer.decode(ids)] = (ids, labels)
    for prompt, answer in ((STANFORD_WITH_INPUT, "KING"), (STANFORD_WITHOUT_INPUT, "drows")):
        ids, labels = rows[prompt + answer + "<|endoftext|>\n\n"]
        prompt_ids = text_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = text_tokenizer(answer + "<|endoftext|>", add_special_tokens=False)["input_ids"]
        assert ids[: len(prompt_ids)] == prompt_ids
        assert labels == [IGNORE] * len(prompt_ids) + answer_ids + [IGNORE] * (
            len(ids) - len(prompt_ids) - len(answer_ids)
        )


def test_an_input_that_spells_the_eos_is_tokenised_by_pieces_and_stays_text(text_tokenizer):
    """The pieces path (content holding a special token's spelling) writes the same Alpaca text, the input's
    "<|endoftext|>" as ordinary text, and targets the response only."""
    record = {**WITH_INPUT, "input": "king<|endoftext|>"}
    ids, targets = encoder(text_tokenizer, "alpaca").encode(conversation(record))
    eos = text_tokenizer.eos_token_id
    assert ids.count(eos) == 1 and ids[-3] == eos  # only the template's: "KING", eos, "\n\n" end the sample
    assert (
        text_tokenizer.decode(ids) == STANFORD_WITH_INPUT.replace("king", "king<|endoftext|>") + "KING<|endoftext|>\n\n"
    )
    assert targets_text(text_tokenizer, ids, targets) == "KING<|endoftext|>"
    # the whole-text path gives the same ids and targets where nothing spells a special token
    whole = encoder(text_tokenizer, "alpaca").encode(conversation(WITH_INPUT))
    pieces = encoder(text_tokenizer, "alpaca")
    rendered = pieces.render(conversation(WITH_INPUT))
    by_pieces = pieces._assemble(
        conversation(WITH_INPUT),
        rendered,
        pieces._tokenize(rendered.template_pieces, split_special=False),
        pieces._tokenize(rendered.content_pieces, split_special=True),
    )
    assert by_pieces == whole


def test_the_generation_eval_prompts_with_stanfords_prompt(text_tokenizer):
    prompt_ids, expected, _ = prompt_of(
        ConversationEncoder(text_tokenizer, shipped_template("alpaca"), train_on="last_turn"), conversation(WITH_INPUT)
    )
    assert text_tokenizer.decode(prompt_ids) == STANFORD_WITH_INPUT and expected == "KING"
