"""The generation evaluation: exact-match scoring, stopping at the end-of-turn token, RNG and mode left alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memtrain.data.rows.prompts import HeldOutPrompt
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.recipe.schema import Model
from memtrain.train.eval import generation as generate_eval
from memtrain.train.eval.generation import (
    generation_eval,
    greedy_generate,
    is_exact_match,
    stop_token_ids,
)
from tests.data.render.test_templates import family_end_of_turn, family_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(Model(preset="mini", tokenizer="builtin:shakespeare-chat"))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4160,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def prompt(tokenizer, question: str, expected: str, task: str | None = None) -> HeldOutPrompt:
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return HeldOutPrompt(tokenizer(text, add_special_tokens=False)["input_ids"], expected, question, "f", 1, task)


@pytest.mark.parametrize(
    "generated, expected, match",
    [
        ("42", "42", True),
        (" 42\n", "42", True),
        ("42", " 42 ", True),
        ("\t\nSOUND ", "SOUND", True),
        ("42.", "42", False),
        ("sound", "SOUND", False),
        ("4 2", "42", False),
        ("", "42", False),
        ("420", "42", False),
    ],
)
def test_exact_match_ignores_only_surrounding_whitespace(generated, expected, match):
    assert is_exact_match(generated, expected) is match


def test_chatml_stops_at_im_end_and_eos(tokenizer):
    assert stop_token_ids("chatml", tokenizer) == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.eos_token_id,
    ]
    assert stop_token_ids("alpaca", tokenizer) == [tokenizer.eos_token_id]  # its end of turn is the eos


def test_the_tokenizers_own_chatml_template_stops_at_im_end_too(tokenizer):
    """data.template unset: builtin:shakespeare-chat's own chat_template is ChatML (it once stopped at eos only,
    and a right answer followed by <|im_end|> scored 0)."""
    assert stop_token_ids(None, tokenizer) == stop_token_ids("chatml", tokenizer)


@pytest.mark.parametrize("family, end", [("qwen2", "<|im_end|>"), ("gemma2", "<end_of_turn>"), ("phi3", "<|end|>")])
def test_a_family_tokenizer_template_stops_at_its_end_of_turn_token_and_eos(family, end):
    family_tok = family_tokenizer(family)
    assert family_end_of_turn(family, family_tok) == family_tok.convert_tokens_to_ids(end)
    assert stop_token_ids(None, family_tok) == [family_tok.convert_tokens_to_ids(end), family_tok.eos_token_id]


def test_a_template_closing_answers_with_the_eos_or_with_nothing_stops_at_the_eos_alone():
    for family in ("mistral", "plain"):  # [INST] q [/INST]a</s>; "assistant: a\n" (warned about: data.render)
        family_tok = family_tokenizer(family)
        assert stop_token_ids(None, family_tok) == [family_tok.eos_token_id]


def test_generation_stops_at_the_end_of_turn_token(tokenizer, model):
    """The free continuation, then the same with one of its tokens made the stop token: cut just before it."""
    ids = prompt(tokenizer, "What is 2 + 2?", "4").prompt_ids
    free = greedy_generate(model, [ids], stop_ids=[-1], pad_id=tokenizer.pad_token_id, max_new_tokens=12)[0]
    assert len(free) == 12
    for at in (0, 3, 7):
        stop = free[at]
        cut = greedy_generate(model, [ids], stop_ids=[stop], pad_id=tokenizer.pad_token_id, max_new_tokens=12)[0]
        assert cut == free[: free.index(stop)]


def test_batched_generation_with_left_padding_equals_one_by_one(tokenizer, model):
    prompts = [
        prompt(tokenizer, q, "").prompt_ids
        for q in ("What is 2 + 2?", "Reverse the word 'sound'.", "How many letters are in 'day'?", "Hi")
    ]
    batched = greedy_generate(model, prompts, [-1], tokenizer.pad_token_id, 6, batch_size=4)
    alone = [greedy_generate(model, [p], [-1], tokenizer.pad_token_id, 6)[0] for p in prompts]
    assert batched == alone
    answered = []  # the progress a command draws (memtrain eval): after each batch, how many of all
    assert (
        greedy_generate(
            model,
            prompts,
            [-1],
            tokenizer.pad_token_id,
            6,
            batch_size=3,
            on_batch=lambda done, total: answered.append((done, total)),
        )
        == batched
    )
    assert answered == [(3, 4), (4, 4)]


def test_scores_count_exact_matches_and_keep_the_first_samples(tokenizer, model, monkeypatch):
    answers = [" 4\n", "5", "s", "SOUND"]
    monkeypatch.setattr(
        generate_eval,
        "greedy_generate",
        lambda model, prompts, *a, **k: [
            tokenizer(text, add_special_tokens=False)["input_ids"] for text in answers[: len(prompts)]
        ],
    )
    prompts = [
        prompt(tokenizer, "What is 2 + 2?", "4", "add"),
        prompt(tokenizer, "What is 2 + 2?", "4", "add"),
        prompt(tokenizer, "First letter of 'sound'?", "s", "first_letter"),
        prompt(tokenizer, "'sound' in capitals?", "SOUNDS", "upper"),
    ]
    score = generation_eval(model, tokenizer, prompts, [0], skipped=2, keep_samples=3)
    assert (score.correct, score.total, score.skipped, score.exact_match) == (2, 4, 2, 0.5)
    assert score.by_task == {"add": 0.5, "first_letter": 1.0, "upper": 0.0}
    assert [(s.expected, s.generated, s.correct) for s in score.samples] == [
        ("4", "4", True),
        ("4", "5", False),
        ("s", "s", True),
    ]
    record = score.as_record()
    assert record["exact_match"] == 0.5 and len(record["samples"]) == 3 and record["samples"][0]["question"]
    assert generation_eval(model, tokenizer, [], [0]).total == 0


def test_the_score_counts_the_prompts_training_also_holds(tokenizer, model, monkeypatch):
    monkeypatch.setattr(
        generate_eval, "greedy_generate", lambda model, prompts, *a, **k: [tokenizer("4")["input_ids"]] * len(prompts)
    )
    asked = prompt(tokenizer, "What is 2 + 2?", "4")
    seen = [
        dataclasses.replace(asked, prompt_in_train=True, answer_in_train=True),
        dataclasses.replace(asked, prompt_in_train=True, answer_in_train=False),
        dataclasses.replace(asked, prompt_in_train=False, answer_in_train=False),
    ]
    score = generation_eval(model, tokenizer, seen, [0])
    assert (score.prompts_in_train, score.answers_in_train) == (2, 1)
    assert score.describe(0) == (
        "step 0: exact match 1.000 (3/3 held-out answers, 2 of them also in training (1 with the same answer))"
    )
    unknown = generation_eval(model, tokenizer, [asked], [0])  # the training files gone: not known, not said
    assert (
        unknown.prompts_in_train is None and unknown.describe(0) == "step 0: exact match 1.000 (1/1 held-out answers)"
    )


def test_the_evaluation_leaves_rng_and_training_mode_as_it_found_them(tokenizer, model, monkeypatch):
    real = generate_eval.greedy_generate

    def drawing(*args, **kwargs):  # a generation that draws random numbers (sampling would)
        torch.rand(10)
        assert not args[0].training  # and runs in eval mode
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_eval, "greedy_generate", drawing)
    model.train()
    try:
        torch.manual_seed(123)
        expected_next = torch.rand(3)
        torch.manual_seed(123)
        generation_eval(model, tokenizer, [prompt(tokenizer, "What is 2 + 2?", "4")], [0])
        assert model.training
        assert torch.equal(torch.rand(3), expected_next)
    finally:
        model.eval()
