"""An answer that starts with whitespace: the template's header before it ("<|im_start|>assistant\\n", alpaca's
"### Response:\\n") stays the prompt's, token for token as the generation prompt writes it, and the targets are the
answer's own characters and the template's closing token.

The rendered text is tokenised whole, and GPT-2's pre-tokenizer joins the header's "\\n" with the answer's first
space into one token "\\n ": that token was a target, and the prompt before the answer ended at "assistant"
instead of "assistant\\n" (the generation prompt), so the model learnt to write the header's newline itself and
was prompted with a token sequence it never saw before an answer.
"""

from __future__ import annotations

import pytest

from memtrain.data.render.chat import ConversationEncoder
from memtrain.data.render.templates import ChatTemplate, shipped_template
from memtrain.data.rows.dataset import build_datasets

IGNORE = -100
END = {"chatml": "<|im_end|>", "alpaca": "<|endoftext|>"}


def conversation(answer: str) -> list[dict]:
    return [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": answer}]


def generation_prompt(tokenizer, template: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        conversation("")[:1],
        chat_template=shipped_template(template).source,
        tokenize=False,
        add_generation_prompt=True,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template", ["chatml", "alpaca"])
@pytest.mark.parametrize("answer", ["  Paris", " \nParis"])
def test_the_headers_newline_is_the_prompts_and_only_the_answer_is_a_target(chat_tokenizer, template, answer):
    encoder = ConversationEncoder(chat_tokenizer, shipped_template(template))
    ids, targets = encoder.encode(conversation(answer))
    first = targets.index(True)
    assert ids[:first] == generation_prompt(chat_tokenizer, template)  # ends with the header's "\n" token
    assert chat_tokenizer.decode(ids[first - 1]) == "\n"
    answer_ids = chat_tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert [i for i, t in zip(ids, targets) if t] == answer_ids + [chat_tokenizer.convert_tokens_to_ids(END[template])]
    assert chat_tokenizer.decode([i for i, t in zip(ids, targets) if t]) == answer + END[template]
    # the pieces path (content spelling a special token, slow tokenizers) had the boundary there already
    rendered = encoder.render(conversation(answer))
    by_pieces = encoder._assemble(
        conversation(answer),
        rendered,
        encoder._tokenize(rendered.template_pieces, split_special=False),
        encoder._tokenize(rendered.content_pieces, split_special=True),
    )
    assert by_pieces == (ids, targets)


def test_a_dataset_rows_labels_start_at_the_answers_first_character(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", [{"messages": conversation("  Paris")}])
    spec = {"path": path, "type": "chat"}
    train, _ = build_datasets(
        make_data(train=[spec], validation=[spec], seq_len=64, packing=False), chat_tokenizer, seed=0
    )
    item, length = train[0], int(train.row_tokens[0])
    ids, labels = item["input_ids"][:length].tolist(), item["labels"][:length].tolist()
    prompt = generation_prompt(chat_tokenizer, "chatml")
    end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # "<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n" | " " " Paris" "<|im_end|>" | "\n"
    assert ids[: len(prompt)] == prompt and labels[: len(prompt)] == [IGNORE] * len(prompt)
    assert labels[len(prompt) :] == [*chat_tokenizer("  Paris", add_special_tokens=False)["input_ids"], end, IGNORE]
    assert chat_tokenizer.decode(ids[len(prompt) :]) == "  Paris<|im_end|>\n"


def test_an_answer_that_starts_with_a_word_keeps_the_templates_space_joined_to_it(chat_tokenizer):
    """The narrow rule: a template that writes "assistant: " before the answer tokenises " Paris" as one token, as
    inference writes it after a prompt ending in ":"; that token stays the answer's (generation_prompt_warning
    says the prompt differs)."""
    plain = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
    encoder = ConversationEncoder(chat_tokenizer, ChatTemplate("tokenizer", plain, (), None))
    ids, targets = encoder.encode(conversation("Paris"))
    assert [chat_tokenizer.decode(i) for i, t in zip(ids, targets) if t] == [" Paris", "<|im_end|>"]
