"""A saved model generates as it was trained to: its special-token ids are its tokenizer's, and a chat run's
final/ and merged export stop at the template's end-of-turn token (<|im_end|> for chatml) as well as at the
tokenizer's eos, with use_cache on (memtrain.model.merge.set_inference_config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor

from memtrain.commands.run import run_command
from memtrain.data.tokens.tokenizer import ASSETS, load_tokenizer
from memtrain.model.final_dir import export_run
from memtrain.model.merge import set_inference_config
from memtrain.recipe.schema import Data, Model
from memtrain.train.state.final_model import export_model
from tests.data.render.test_templates import family_tokenizer
from tests.model.families import tiny_config
from tests.train.test_chat_run import chat_recipe

CHAT_BASE = ASSETS / "models" / "shakespeare-mini"
EOS, PAD, IM_END = 0, 1, 4097  # <|endoftext|>, <|pad|>, <|im_end|> in builtin:shakespeare(-chat)


def _ids(value) -> list[int]:
    return [value] if isinstance(value, int) else list(value)


def test_the_shipped_chat_base_has_the_special_token_ids_of_its_tokenizer():
    """config.json and generation_config.json name the tokenizer's bos, eos and pad (they once said bos 1 =
    <|pad|>, eos 2 = "!": generation stopped at any "!" and never at <|endoftext|>)."""
    for tokenizer in (AutoTokenizer.from_pretrained(CHAT_BASE), load_tokenizer(Model(path=str(CHAT_BASE)))):
        assert tokenizer.convert_ids_to_tokens([tokenizer.eos_token_id, tokenizer.pad_token_id]) == [
            "<|endoftext|>",
            "<|pad|>",
        ]
        for config in (AutoConfig.from_pretrained(CHAT_BASE), GenerationConfig.from_pretrained(CHAT_BASE)):
            assert config.bos_token_id == tokenizer.bos_token_id
            assert _ids(config.eos_token_id) == [tokenizer.eos_token_id]
            assert config.pad_token_id == tokenizer.pad_token_id
    # the base model knows no chat format: <|im_end|> does not end its text
    assert IM_END not in _ids(GenerationConfig.from_pretrained(CHAT_BASE).eos_token_id)


def test_set_inference_config_replaces_a_presets_default_ids_and_keeps_real_end_tokens():
    tokenizer = load_tokenizer(Model(preset="mini", tokenizer="builtin:shakespeare-chat"))
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))  # Llama's defaults: bos 1, eos 2
    model.config.use_cache = False  # as training sets it
    model.generation_config.eos_token_id = [2, IM_END]  # "!" is not an end token; <|im_end|> (special) may be
    generation = set_inference_config(model, tokenizer, [IM_END])
    assert generation is model.generation_config
    assert (
        generation.eos_token_id == [IM_END, EOS] and generation.pad_token_id == PAD and generation.bos_token_id == EOS
    )
    assert model.config.eos_token_id == EOS and model.config.bos_token_id == EOS and model.config.pad_token_id == PAD
    assert model.config.use_cache is True and generation.use_cache is True


class _ForceAt(LogitsProcessor):
    """Greedy decoding forced to write `token` as the `at`-th new token (and never a stop token before it)."""

    def __init__(self, prompt_len: int, at: int, token: int, stops: list[int]):
        self.prompt_len, self.at, self.token, self.stops = prompt_len, at, token, stops

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        if input_ids.shape[1] - self.prompt_len == self.at:
            scores[:] = -float("inf")
            scores[:, self.token] = 0.0
        else:
            scores[:, self.stops] = -float("inf")
        return scores


def _assert_stops_at_im_end(directory: Path) -> None:
    """from_pretrained alone: the generation config lists <|im_end|> and eos, and generate() on a chat prompt
    ends at the <|im_end|> it writes instead of running on to max_new_tokens."""
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert model.config.use_cache is True
    assert _ids(model.generation_config.eos_token_id) == [IM_END, EOS]
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == PAD
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END
    text = "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    # the saved tokenizer carries the template the run trained with (the Shakespeare tokenizer had none)
    assert (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 2 plus 3?"}], tokenize=False, add_generation_prompt=True
        )
        == text
    )
    prompt = tokenizer(text, return_tensors="pt")
    width = prompt["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **prompt, do_sample=False, max_new_tokens=20, logits_processor=[_ForceAt(width, 3, IM_END, [IM_END, EOS])]
        )
    new = out[0, width:].tolist()
    assert len(new) == 4 and new[-1] == IM_END, new


@pytest.mark.parametrize("family, end", [("qwen2", "<|im_end|>"), ("gemma2", "<end_of_turn>")])
def test_an_export_with_the_tokenizers_own_template_stops_at_the_token_training_targets(family, end, tmp_path):
    """data.template unset, a model directory whose tokenizer has its family's chat_template: the exported
    generation_config.json lists the end-of-turn token training targeted after each answer, and generate()
    from the export alone ends there (it once listed the eos only and ran on past <|im_end|>)."""
    tokenizer = family_tokenizer(family)
    end_id, eos = tokenizer.convert_tokens_to_ids(end), tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config(
            family, vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
        )
    )
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}) + "\n"
    )
    data = Data(train=[{"path": str(data_file), "type": "chat"}], template=None)
    out = export_model(None, model, tokenizer, tmp_path / "export", rank=0, zero3=False, data=data)
    assert _ids(json.loads((out / "generation_config.json").read_text())["eos_token_id"]) == [end_id, eos]
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    saved_tokenizer = AutoTokenizer.from_pretrained(out)
    text = saved_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 3?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = saved_tokenizer(text, add_special_tokens=False, return_tensors="pt")
    width = prompt["input_ids"].shape[1]
    with torch.no_grad():
        generated = exported.generate(
            **prompt, do_sample=False, max_new_tokens=20, logits_processor=[_ForceAt(width, 3, end_id, [end_id, eos])]
        )
    new = generated[0, width:].tolist()
    assert len(new) == 4 and new[-1] == end_id, new


@pytest.mark.slow
def test_a_chat_run_and_its_merged_export_stop_at_the_end_of_a_turn(write_recipe, tmp_path):
    """A full fine-tune with chatml on a tokenizer that lacked the markers: final/ and `export --merge` (a copy)."""
    run_dir = tmp_path / "runs" / "chat"
    assert run_command(write_recipe("chat", chat_recipe(tmp_path, steps=2)), []) == 0
    saved = json.loads((run_dir / "final" / "config.json").read_text())
    assert saved["use_cache"] is True and saved["eos_token_id"] == EOS and saved["bos_token_id"] == EOS
    _assert_stops_at_im_end(run_dir / "final")
    _assert_stops_at_im_end(export_run(run_dir, merge=True, out_dir=tmp_path / "exp1"))


@pytest.mark.slow
def test_a_lora_chat_run_merged_into_the_shipped_base_stops_at_the_end_of_a_turn(write_recipe, tmp_path):
    """LoRA on the chat base (the quickstart's model and tokenizer): the adapter's final/ carries the stop ids
    in a generation_config.json, and the merge writes them into the merged model's."""
    extra = {
        "model": {
            "preset": None,
            "path": str(CHAT_BASE),
            "tokenizer": "builtin:shakespeare-chat",
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        },
        "data": {
            "train": [{"path": "builtin:chat", "type": "chat"}],
            "validation": [{"path": "builtin:chat/validation", "type": "chat"}],
            "seq_len": 64,
            "template": "chatml",
            "packing": True,
        },
        "train": {"steps": 2, "save_every": 2, "eval_every": 100},
    }
    run_dir = tmp_path / "runs" / "lora"
    assert run_command(write_recipe("lora", extra), []) == 0
    assert (run_dir / "final" / "adapter_config.json").is_file()
    assert _ids(GenerationConfig.from_pretrained(run_dir / "final").eos_token_id) == [IM_END, EOS]
    merged = export_run(run_dir, merge=True, out_dir=tmp_path / "merged", dtype=torch.float32)
    _assert_stops_at_im_end(merged)


def test_an_end_token_the_base_lists_stays_when_it_is_also_the_pad():
    """Qwen3's and Qwen2.5-Instruct's layout: eos <|im_end|>, pad <|endoftext|>, and generation_config.json's eos
    [<|im_end|>, <|endoftext|>]. The export kept only <|im_end|>: the base's document end stopped
    nothing."""
    tokenizer = family_tokenizer("qwen2")
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token = "<|im_end|>", "<|endoftext|>", None  # as Qwen's
    model = AutoModelForCausalLM.from_config(
        tiny_config("qwen2", vocab_size=len(tokenizer), eos_token_id=im_end, pad_token_id=endoftext)
    )
    model.generation_config.eos_token_id = [im_end, endoftext]
    generation = set_inference_config(model, tokenizer, [im_end])
    assert _ids(generation.eos_token_id) == [im_end, endoftext] and generation.pad_token_id == endoftext
