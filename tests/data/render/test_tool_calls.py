"""Tool-calling conversations through a template that writes tools (Qwen2.5's chat template, as it ships in its
tokenizer_config.json): the assistant's calls and answers are targets, the tools' results and the schemas are not,
token by token as the template renders them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from memtrain.data.read.conversation import to_conversation
from memtrain.errors import DataError
from memtrain.recipe.schema import DatasetSpec
from tests.data.render.test_chat_masking import C, T, expected, first_row

QWEN25_TEMPLATE = (Path(__file__).parent / "templates" / "qwen2.5.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
# OpenAI's layout: the call's arguments as a JSON string, no content beside the call
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 degrees in Paris."},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def one_dataset(make_data, path):
    """The record as the one training sample (validation apart); the tools' schemas take a few hundred tokens."""
    spec = {"path": path, "type": "chat"}
    return make_data(train=[spec], validation=[spec], seq_len=1024, packing=False)


@pytest.fixture
def qwen_tokenizer(chat_tokenizer):
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


def test_calls_are_targets_and_tool_results_and_schemas_are_not(qwen_tokenizer, write_jsonl, make_data):
    path = write_jsonl("tools.jsonl", [{"messages": CONVERSATION, "tools": TOOLS}])
    got = first_row(qwen_tokenizer, one_dataset(make_data, path))
    # the template's own rendering, with the tools in its system prompt
    conversation = to_conversation({"messages": CONVERSATION}, DatasetSpec(path=path, type="chat"), path, 1)
    full = qwen_tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
    system = full[: full.index("<|im_start|>user\n")]
    assert json.dumps(TOOLS[0]) in system and system.endswith("</tool_call><|im_end|>\n")
    segments = [
        (T, system + "<|im_start|>user\n", False),
        (C, "What is the weather in Paris?", False),
        (T, "<|im_end|>\n<|im_start|>assistant\n", False),
        (C, CALL, True),  # the call, from where the generation prompt ends
        (T, "<|im_end|>", True),
        (T, "\n<|im_start|>user\n<tool_response>\n", False),
        (C, '{"temp": 21}', False),  # the tool's result is an input
        (T, "\n</tool_response><|im_end|>\n<|im_start|>assistant\n", False),
        (C, "It is 21 degrees in Paris.", True),
        (T, "<|im_end|>", True),
        (T, "\n", False),
    ]
    assert "".join(text for _, text, _ in segments) == full
    assert got == expected(qwen_tokenizer, segments)


def test_a_call_beside_text_trains_both_and_the_newline_between(qwen_tokenizer, write_jsonl, make_data):
    turns = copy.deepcopy(CONVERSATION[:2])
    turns[1]["content"] = "Let me look."
    path = write_jsonl("tools.jsonl", [{"messages": turns, "tools": json.dumps(TOOLS)}])  # tools as a JSON string
    got = first_row(qwen_tokenizer, one_dataset(make_data, path))
    full = qwen_tokenizer.apply_chat_template(
        [turns[0], {**turns[1], "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}],
        tools=TOOLS,
        tokenize=False,
    )
    system = full[: full.index("<|im_start|>user\n")]
    segments = [
        (T, system + "<|im_start|>user\n", False),
        (C, "What is the weather in Paris?", False),
        (T, "<|im_end|>\n<|im_start|>assistant\n", False),
        (C, "Let me look.", True),
        (C, "\n" + CALL, True),
        (T, "<|im_end|>", True),
        (T, "\n", False),
    ]
    assert "".join(text for _, text, _ in segments) == full
    assert got == expected(qwen_tokenizer, segments)


def test_a_call_without_a_function_name_is_said_at_its_record(write_jsonl):
    bad = copy.deepcopy(CONVERSATION)
    bad[1]["tool_calls"][0]["function"].pop("name")
    with pytest.raises(DataError) as error:
        to_conversation({"messages": bad}, DatasetSpec(path="x.jsonl", type="chat"), "x.jsonl", 7)
    (problem,) = error.value.problems
    assert problem.line == 7 and problem.key == "messages[1].tool_calls[0]" and "no function name" in problem.message
