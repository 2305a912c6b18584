"""The validation loss over unpacked samples laid out packed (the loader's `pack_steps`) equals the cut rows' one,
and an out-of-memory error halves the micro-batch and splits the samples not yet run again."""

from __future__ import annotations

import pytest
import torch

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.loader import BatchLoader
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.recipe.schema import Data, Model
from memtrain.train.eval.validation_loss import evaluate, in_chunks, run_shrinking
from memtrain.train.runtime.distributed import Place
from tests.data.rows.test_packing import tiny_model

CHAT = [{"path": "builtin:chat", "type": "chat"}]
CHAT_VALIDATION = [{"path": "builtin:chat/validation", "type": "chat"}]


def test_packed_and_cut_validation_give_the_same_loss(tmp_path):
    chat_tokenizer = load_tokenizer(Model(preset="tiny", tokenizer="builtin:shakespeare-chat"))
    data = Data(
        train=CHAT,
        validation=CHAT_VALIDATION,
        seq_len=128,
        packing=False,
        template="chatml",
        cache_dir=str(tmp_path / "cache"),
    )
    _, val_set = build_datasets(data, chat_tokenizer, seed=0)
    model = tiny_model(len(chat_tokenizer), "sdpa")  # fp32: sdpa keeps packed samples apart with a mask
    cpu = Place.single(torch.device("cpu"))
    losses, batches = {}, {}
    for pack in (False, True):
        with BatchLoader(val_set, torch.device("cpu"), trim=True, pack_steps=pack) as loader:
            batches[pack] = []
            losses[pack] = evaluate(
                model,
                loader,
                val_set,
                samples=40,
                micro_batch=4,
                place=cpu,
                before=lambda i, n, pack=pack: batches[pack].append(n),
            )
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)
    assert batches[False] == [4] * 10 and len(batches[True]) < 10 and sum(batches[True]) == 40


class FakeOom(RuntimeError):
    def __init__(self):
        super().__init__("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_an_oom_halves_the_micro_batch_and_splits_the_rest_again():
    ran, failed = [], []

    def one(chunk):
        if len(chunk) > 2 and not failed:
            failed.append(chunk)
            raise FakeOom()
        ran.append(chunk)

    def split(indices, size):  # as a packing loader: the chunks depend on the size asked for
        return in_chunks(indices, size)

    size = run_shrinking(list(range(10)), 4, one, torch.device("cpu"), split=split)
    assert failed == [[0, 1, 2, 3]]
    assert ran == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]] and size == 2
