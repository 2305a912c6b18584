"""A tokenizer's own chat_template (`data.template` unset): the end-of-turn token generation stops at is the one
training targets, a template that writes none after an answer is warned about, and a conversation the template
refuses raises RenderError from `encode`.

The tokenizers are the bundled Shakespeare BPE with each family's markers as special tokens and that family's
chat_template (Qwen2's ChatML, Gemma-2's, Phi-3's, Mistral's), as a model directory from the Hub has them.
`family_tokenizer` is shared with the generation-eval and export tests.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from memtrain.data.render.chat import (
    ConversationEncoder,
    RenderError,
    generation_prompt_warning,
    turn_end_id,
    unclosed_turn_warning,
)
from memtrain.data.render.templates import ensure_template_tokens, resolve_template
from memtrain.data.rows.prompts import prompt_of
from memtrain.data.tokens.tokenizer import ASSETS

QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% endif %}{% endfor %}"
)
PLAIN = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# family: (chat_template, its markers, the token that closes an assistant turn; None: the tokenizer's eos)
FAMILIES = {
    "qwen2": (QWEN2, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "gemma2": (GEMMA2, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "phi3": (PHI3, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|end|>"),
    "mistral": (MISTRAL, ["[INST]", "[/INST]"], None),
    "plain": (PLAIN, [], None),
}
CHAT = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And plus 4?"},
    {"role": "assistant", "content": "9"},
]


def family_tokenizer(family: str) -> PreTrainedTokenizerBase:
    """The Shakespeare BPE with `family`'s markers as special tokens and its chat_template as its own."""
    template, markers, _ = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizer" / "shakespeare")
    if markers:
        tokenizer.add_special_tokens({"additional_special_tokens": markers})
    tokenizer.chat_template = template
    return tokenizer


def family_end_of_turn(family: str, tokenizer: PreTrainedTokenizerBase) -> int:
    token = FAMILIES[family][2]
    return tokenizer.eos_token_id if token is None else tokenizer.convert_tokens_to_ids(token)


def chat_data(make_data, write_jsonl, **keys):
    return make_data(train=[{"path": write_jsonl("chat.jsonl", [{"messages": CHAT}]), "type": "chat"}], **keys)


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3", "mistral"])
def test_a_tokenizer_templates_end_of_turn_is_the_token_training_targets_after_each_answer(family):
    """Qwen2's <|im_end|>, Gemma-2's <end_of_turn>, Phi-3's <|end|> (they once had none: generation never
    stopped there), Mistral's eos; and each answer's last target token is that same token."""
    tokenizer = family_tokenizer(family)
    template = resolve_template(None, tokenizer)
    end = family_end_of_turn(family, tokenizer)
    assert turn_end_id(template, tokenizer) == end
    ids, targets = ConversationEncoder(tokenizer, template).encode(CHAT)
    answer_ends = [i for i, target in enumerate(targets) if target and (i + 1 == len(targets) or not targets[i + 1])]
    assert len(answer_ends) == 2 and [ids[i] for i in answer_ends] == [end, end]


def test_a_shipped_template_keeps_its_named_end_of_turn(chat_tokenizer, text_tokenizer):
    assert turn_end_id(
        resolve_template("chatml", chat_tokenizer), chat_tokenizer
    ) == chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert turn_end_id(resolve_template("alpaca", text_tokenizer), text_tokenizer) == text_tokenizer.eos_token_id


def test_a_template_that_writes_no_special_token_after_an_answer_is_warned_about(make_data, write_jsonl):
    """`user: …\\nassistant: …\\n`: nothing to learn to stop at, so nothing to stop at, and the warning says what,
    which key and what to do."""
    tokenizer = family_tokenizer("plain")
    assert turn_end_id(resolve_template(None, tokenizer), tokenizer) is None
    warning = unclosed_turn_warning(chat_data(make_data, write_jsonl), tokenizer)
    assert warning is not None
    assert warning.startswith("model.tokenizer") and "writes no special token after an assistant's answer" in warning
    assert "'\\n'" in warning and "will not stop" in warning
    assert "set data.template" in warning and "chatml" in warning and "data.add_special_tokens" in warning


def test_no_warning_where_a_special_token_closes_each_answer_or_no_template_is_used(
    make_data, write_jsonl, text_tokenizer
):
    for family in ("qwen2", "gemma2", "phi3", "mistral"):
        assert unclosed_turn_warning(chat_data(make_data, write_jsonl), family_tokenizer(family)) is None
    plain = family_tokenizer("plain")
    shipped = chat_data(make_data, write_jsonl, template="chatml", add_special_tokens=True)
    assert ensure_template_tokens(shipped, plain) == ["<|im_start|>", "<|im_end|>"]
    assert unclosed_turn_warning(shipped, plain) is None  # the fix the warning offers
    text = make_data(train=[{"path": write_jsonl("t.jsonl", [{"text": "hi"}]), "type": "text"}])
    assert unclosed_turn_warning(text, text_tokenizer) is None


def test_encode_raises_render_error_and_prompt_of_skips_the_conversation():
    """Gemma-2's template refuses a system message: `encode` raises (it once returned the RenderError, and
    prompt_of failed with a TypeError unpacking it); `encode_many` still returns it in place."""
    tokenizer = family_tokenizer("gemma2")
    encoder = ConversationEncoder(tokenizer, resolve_template(None, tokenizer), train_on="last_turn")
    messages = [{"role": "system", "content": "Be brief."}] + CHAT[:2]
    with pytest.raises(RenderError, match="^the tokenizer's chat_template cannot render the conversation: System role"):
        encoder.encode(messages)  # not "template tokenizer cannot ...": the internal name
    assert isinstance(encoder.encode_many([messages])[0], RenderError)
    assert prompt_of(encoder, messages) is None
    assert prompt_of(encoder, CHAT[:2]) is not None


LLAMA2 = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3", "mistral", "plain", "llama2"])
def test_training_ids_are_the_tokenizers_own_ids_of_the_rendered_conversation(family):
    """The template's text and the messages' were tokenised apart, so "[INST] What" became "[INST]", "Ġ",
    "What" where the tokenizer (and every inference server) writes "[INST]", "ĠWhat": the model trained on
    boundaries it is never prompted with. The ids are now apply_chat_template's, and the targets still decode to
    exactly the answers and what closes them."""
    tokenizer = family_tokenizer("mistral") if family == "llama2" else family_tokenizer(family)
    if family == "llama2":
        tokenizer.chat_template = LLAMA2
    encoder = ConversationEncoder(tokenizer, resolve_template(None, tokenizer))
    ids, targets = encoder.encode(CHAT)
    own = tokenizer.apply_chat_template(CHAT, tokenize=True)
    assert ids == list(own["input_ids"] if hasattr(own, "keys") else own)
    trained = tokenizer.decode([i for i, t in zip(ids, targets) if t])
    closing = {"qwen2": "<|im_end|>", "gemma2": "<end_of_turn>", "phi3": "<|end|>", "plain": ""}.get(
        family, tokenizer.eos_token
    )
    assert trained.replace(" ", "") == f"5{closing}9{closing}".replace(" ", "")


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3"])
def test_an_eval_prompt_is_the_tokenizers_own_generation_prompt(family):
    tokenizer = family_tokenizer(family)
    encoder = ConversationEncoder(tokenizer, resolve_template(None, tokenizer), train_on="last_turn")
    prompt, expected, _ = prompt_of(encoder, CHAT)
    own = tokenizer.apply_chat_template(CHAT[:-1], tokenize=True, add_generation_prompt=True)
    assert prompt == list(own["input_ids"] if hasattr(own, "keys") else own) and expected == "9"


MISTRAL_V03 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}{% if message['role'] == 'user' %}{% if loop.last and system is defined %}"
    "{{ '[INST] ' + system + '\\n\\n' + message['content'] + '[/INST]' }}{% else %}"
    "{{ '[INST] ' + message['content'] + '[/INST]' }}{% endif %}{% else %}"
    "{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def test_a_message_the_template_leaves_out_is_counted_and_warned_about(make_data, write_jsonl, tmp_path):
    """Mistral v0.3's template writes the system message only into the last user turn, so a training
    conversation (ending with its answer) loses it silently. The count survives the token cache (a second build
    reads it back), and conversations without a system message are not counted."""
    from memtrain.data.rows.dataset import build_datasets
    from memtrain.data.rows.mixture import unwritten_messages_warning

    tokenizer = family_tokenizer("mistral")
    tokenizer.chat_template = MISTRAL_V03
    system = [{"role": "system", "content": "Answer tersely."}]
    path = write_jsonl("chat.jsonl", [{"messages": CHAT}, {"messages": system + CHAT}, {"messages": system + CHAT[:2]}])
    data = make_data(train=[{"path": path, "type": "chat"}], validation=None, template=None)
    for _ in range(2):  # tokenised, then from the cache
        build_datasets(data, tokenizer, seed=0)
        warning = unwritten_messages_warning(data, tokenizer)
        assert warning is not None and warning.startswith(
            "model.tokenizer: the tokenizer's chat_template (data.template is not set) did not write"
        )
        assert f"the system message of 2 conversations of {path} (the first at line 2)" in warning
        assert "first user message" in warning
    plain = make_data(
        train=[{"path": write_jsonl("plain.jsonl", [{"messages": CHAT}] * 3), "type": "chat"}],
        validation=None,
        template=None,
    )
    build_datasets(plain, tokenizer, seed=0)
    assert unwritten_messages_warning(plain, tokenizer) is None


QWEN3 = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% if loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{{ m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and "
    "enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3", "mistral"])
def test_a_template_that_prompts_as_it_trains_is_not_warned_about(family, make_data, write_jsonl):
    assert generation_prompt_warning(chat_data(make_data, write_jsonl), family_tokenizer(family)) is None


def test_a_template_whose_generation_prompt_differs_from_training_is_warned_about(make_data, write_jsonl):
    """Qwen3's template writes an empty think block before the last (trained) answer, its default
    generation prompt does not: the merged model is prompted without it. A 'user: …\\nassistant: ' prompt ends with
    a space that training never ends a prompt with."""
    tokenizer = family_tokenizer("qwen2")
    tokenizer.chat_template = QWEN3
    warning = generation_prompt_warning(chat_data(make_data, write_jsonl), tokenizer)
    assert warning is not None and warning.startswith("model.tokenizer: the tokenizer's chat_template")
    assert "</think>" in warning and "enable_thinking=False" in warning
    plain = generation_prompt_warning(chat_data(make_data, write_jsonl), family_tokenizer("plain"))
    assert plain is not None and "assistant:', but" in plain and "assistant: ':" in plain
