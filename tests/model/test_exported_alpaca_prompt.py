"""A model trained through `data.template: alpaca` on records with an input is prompted, from its export alone, with
what it was trained on: the exported tokenizer's apply_chat_template, given the input as the user message's 'input'
(the form the exported template documents), writes the token ids training wrote, the preamble for a task with an
input and the ### Input: block included; content alone stays the prompt of a task without one."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from memtrain.data.read.conversation import to_conversation
from memtrain.data.render.chat import ConversationEncoder
from memtrain.data.render.templates import shipped_template
from memtrain.data.rows.prompts import prompt_of
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.recipe.schema import Data, DatasetSpec, Model
from memtrain.train.state.final_model import export_model
from tests.model.families import tiny_config

RECORD = {"instruction": "Write the word in capital letters.", "input": "king", "output": "KING"}
INPUT_PREAMBLE = "paired with an input that provides further context"


def test_the_exported_template_prompts_a_record_with_an_input_as_training_wrote_it(tmp_path):
    tokenizer = load_tokenizer(Model(preset="tiny", tokenizer="builtin:shakespeare"))
    data_file = tmp_path / "alpaca.jsonl"
    data_file.write_text("{}\n")
    spec = DatasetSpec(path=str(data_file), type="instruction")
    conversation = to_conversation(RECORD, spec, str(data_file), 1)
    encoder = ConversationEncoder(tokenizer, shipped_template("alpaca"), train_on="last_turn")
    trained_ids, _ = encoder.encode(conversation)
    prompt_ids, _, _ = prompt_of(encoder, conversation)
    assert INPUT_PREAMBLE in tokenizer.decode(trained_ids) and "### Input:\nking" in tokenizer.decode(trained_ids)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    )
    data = Data(train=[{"path": str(data_file), "type": "instruction"}], template="alpaca")
    out = export_model(None, model, tokenizer, tmp_path / "export", rank=0, zero3=False, data=data)
    exported = AutoTokenizer.from_pretrained(out)

    # what a user of the export writes: the instruction as content, the input beside it
    asked = [{"role": "user", "content": RECORD["instruction"], "input": RECORD["input"]}]
    answered = [*asked, {"role": "assistant", "content": RECORD["output"]}]
    assert _ids(exported.apply_chat_template(answered, tokenize=True)) == trained_ids
    assert _ids(exported.apply_chat_template(asked, tokenize=True, add_generation_prompt=True)) == prompt_ids
    # the conversation as memtrain reads it (content joined, the two parts beside it) renders the same
    assert _ids(exported.apply_chat_template(conversation, tokenize=True)) == trained_ids
    # the template says how to prompt it, in the file the export carries
    assert "give the input as the message's 'input'" in exported.chat_template
    # the same text in the content alone is a task without an input, as the template documents
    plain = exported.apply_chat_template(
        [{"role": "user", "content": f"{RECORD['instruction']}\n\n{RECORD['input']}"}], tokenize=False
    )
    assert INPUT_PREAMBLE not in plain


def _ids(value) -> list[int]:
    """apply_chat_template(tokenize=True)'s ids: a list, or a BatchEncoding's input_ids (transformers 5)."""
    return list(value["input_ids"]) if hasattr(value, "keys") else list(value)
