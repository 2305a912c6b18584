"""train.launch.prepare: what a run says about its data before any work."""
from __future__ import annotations

from memtrain.checks.load import load_checked
from memtrain.train.hooks import Hooks
from memtrain.train.launch import prepare
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
