"""train.launch.prepare: what a run says about its data before any work."""

from __future__ import annotations

from pathlib import Path

from memtrain.checks.load import load_checked
from memtrain.train.launch import prepare
from memtrain.train.step.hooks import Hooks
from tests.train.test_chat_run import chat_recipe


def test_the_data_note_says_when_micro_batches_are_cut_to_their_longest_row(write_recipe, tmp_path):
    """The rows' padding share is that of rows of seq_len; length-bucketed micro-batches compute less of it."""
    extra = chat_recipe(tmp_path)
    packed = prepare(load_checked(write_recipe("packed", extra), []), Hooks.from_env())
    [note] = [n for n in packed.notes if n.startswith("training data:")]
    assert "padding" in note and "cut to their longest row" not in note
    extra["data"]["packing"] = False
    unpacked = prepare(load_checked(write_recipe("unpacked", extra), []), Hooks.from_env())
    [note] = [n for n in unpacked.notes if n.startswith("training data:")]
    assert "cut to their longest row" in note and "memtrain plan --data" in note


def test_the_added_tokens_note_says_whether_the_embeddings_grow(write_recipe, tmp_path):
    """The micro preset's 4096 rows grow to the tokenizer's 4098; shakespeare-mini's vocabulary is padded to 4160
    rows, which already hold the two new ids, and the model keeps its size (model/build.py resizes only when the
    tokenizer outgrows it)."""
    extra = chat_recipe(tmp_path)
    grows = prepare(load_checked(write_recipe("grows", extra), []), Hooks.from_env())
    [note] = [n for n in grows.notes if n.startswith("added")]
    assert note.endswith("the model's embeddings grow from 4096 to 4098 rows and the new ones are trained")
    mini = Path(__file__).resolve().parents[2] / "memtrain" / "assets" / "models" / "shakespeare-mini"
    extra["model"] = {"preset": None, "path": str(mini), "tokenizer": "builtin:shakespeare"}
    kept = prepare(load_checked(write_recipe("kept", extra), []), Hooks.from_env())
    [note] = [n for n in kept.notes if n.startswith("added")]
    assert "as ids 4096-4097, rows the model's 4160-row embeddings already have (its size is kept)" in note


def test_a_template_that_closes_no_turn_is_a_warning_of_the_run(write_recipe, tmp_path):
    from tests.data.render.test_templates import family_tokenizer

    plain = tmp_path / "plain-tokenizer"
    family_tokenizer("plain").save_pretrained(plain)
    extra = chat_recipe(tmp_path)
    extra["model"]["tokenizer"] = str(plain)
    extra["data"].update(template=None, add_special_tokens=False)
    prepared = prepare(load_checked(write_recipe("plain", extra), []), Hooks.from_env())
    assert any(
        w.startswith(
            "model.tokenizer: the tokenizer's chat_template (data.template is not set) writes no "
            "special token after an assistant's answer"
        )
        for w in prepared.warnings
    ), prepared.warnings
