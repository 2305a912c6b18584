"""The densest row at each length from token counts (loader.densest_row_at), and from a set built once at the longest
length (densest_by_length.py): the count `densest_row_samples` gives for the set built at each length itself."""

from __future__ import annotations

import numpy as np
import pytest

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.densest_by_length import densest_row_by_length, rows_by_length
from memtrain.data.rows.loader import densest_row_at, densest_row_samples, document_pieces, rows_at
from tests.data.rows.test_pairs import answer, user

WIDTHS = (64, 96, 128, 192, 256)


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_packed_rows_count_their_fullest_row(truncation):
    # at 256: 100+100+50 (6 tokens of padding) and 60 alone; the 300-token sample fills a row alone (truncated) or is
    # left out, and either way shares no row
    tokens = [100, 100, 50, 60, 300]
    assert densest_row_at(tokens, 256, truncation=truncation, packing=True) == 3
    # at 128: 100 alone twice, 60+50 (18 of padding): two
    assert densest_row_at(tokens, 128, truncation=truncation, packing=True) == 2
    # at 512 (300 whole): 300+100+100 and 60+50
    assert densest_row_at(tokens, 512, truncation=truncation, packing=True) == 3
    # a row wider than every sample together holds them all
    assert densest_row_at(tokens, 1024, truncation=truncation, packing=True) == 5


def test_unpacked_rows_laid_out_packed_count_the_shortest_that_fit_one_row():
    tokens = [100, 100, 50, 60, 300]
    # 50 + 60 + 100 = 210 fit 256, a fourth (310) does not
    assert densest_row_at(tokens, 256, truncation="truncate", packing=False) == 3
    assert densest_row_at(tokens, 100, truncation="truncate", packing=False) == 1  # 50 + 60 > 100
    assert densest_row_at(tokens, 110, truncation="drop", packing=False) == 2  # 50 + 60 = 110
    assert densest_row_at([], 256, truncation="drop", packing=True) == 1  # nothing left still prices one sequence


def test_documents_are_cut_into_pieces_whose_rest_packs_with_samples():
    # 600 tokens at 256: 256, 256 and a rest of 88, which shares a row with the 100 and the 60 (8 of padding)
    assert document_pieces([600], 256).tolist() == [256, 256, 88]
    assert densest_row_at([100, 60], 256, truncation="drop", packing=True, documents=[600]) == 3
    # at 128: four pieces of 128 and a rest of 88: 100, 88 and 60 no two of which fit 128
    assert densest_row_at([100, 60], 128, truncation="drop", packing=True, documents=[600]) == 1
    # a rest of one token holds no target and is left out, as the data code leaves it out
    assert document_pieces([257, 300], 256).tolist() == [256, 256, 44]
    with pytest.raises(ValueError, match="truncation"):
        densest_row_at([1], 8, truncation="cut", packing=True)


def _chat(i: int) -> dict:
    # prompts of 2 to 12 words, answers of 1 to 120: tokens from about 15 to a few hundred
    return {"messages": user("tell me " + "more " * (i % 11)) + answer("so " * (1 + (i * 37) % 120))}


def _sample_data(make_data, write_jsonl, *, packing: bool, truncation: str, seq_len: int):
    chats = write_jsonl("chat.jsonl", [_chat(i) for i in range(40)])
    docs = write_jsonl("docs.jsonl", [{"text": "word " * (20 + 45 * i)} for i in range(8)])
    train = [{"path": chats, "type": "chat"}, {"path": docs, "type": "text"}]
    return make_data(
        train=train,
        validation=[{"path": chats, "type": "chat"}],
        template="chatml",
        packing=packing,
        truncation=truncation,
        seq_len=seq_len,
    )


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_the_set_built_once_counts_what_each_length_builds(chat_tokenizer, make_data, write_jsonl, packing, truncation):
    """Chat samples (some longer than the shorter lengths) and text documents (cut into pieces), packed or one a
    row: the count from the set built once at 1,024 tokens is the one each length's own set gives."""
    data = _sample_data(make_data, write_jsonl, packing=False, truncation=truncation, seq_len=1024)
    longest, _ = build_datasets(data, chat_tokenizer, seed=0)
    counted = densest_row_by_length(longest, data.model_copy(update={"packing": packing}))
    assert longest.samples.length.max() > max(WIDTHS)  # some samples are cut or left out at every width
    seen = set()
    for width in WIDTHS:
        at = _sample_data(make_data, write_jsonl, packing=packing, truncation=truncation, seq_len=width)
        built, _ = build_datasets(at, chat_tokenizer, seed=0)
        assert counted(width) == densest_row_samples(built), width
        seen.add(counted(width))
    assert len(seen) > 2  # the count follows the length


def _pair(i: int) -> dict:
    # prompts of 1 to 60 words, answers of 1 to 50: some pairs are cut at 64 tokens, a few at 128
    return {
        "prompt": user("why " * (1 + (i * 13) % 60)),
        "chosen": answer("yes " * (1 + (i * 7) % 50)),
        "rejected": answer("no " * (1 + (i * 11) % 30)),
    }


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_pairs_built_once_count_what_each_length_builds(chat_tokenizer, make_data, write_jsonl, truncation):
    """Preference pairs cut at a length (the prompt's start, then the answer's end) or left out, each pair's two
    sequences laid out in twice the length."""
    path = write_jsonl("pairs.jsonl", [_pair(i) for i in range(30)])

    def data(seq_len: int):
        spec = {"path": path, "type": "preference"}
        return make_data(train=[spec], validation=[spec], template="chatml", truncation=truncation, seq_len=seq_len)

    longest, _ = build_datasets(data(512), chat_tokenizer, seed=0)
    counted = densest_row_by_length(longest, data(512))
    rows = rows_by_length(longest, data(512))
    lengths = np.maximum(longest.views["chosen"].length, longest.views["rejected"].length)
    assert (lengths > 64).sum() > 5  # cut (or left out) at the shortest widths
    seen = set()
    for width in WIDTHS:
        built, _ = build_datasets(data(width), chat_tokenizer, seed=0)
        assert counted(width) == densest_row_samples(built), width
        assert rows(width) == len(built), width  # a pair is a row: what batch.global_batch counts
        seen.add(rows(width))
    assert len(seen) == 1 if truncation == "truncate" else len(seen) > 2  # drop leaves out fewer as the length grows


def test_a_cut_pair_loses_its_prompts_start_on_both_sides(chat_tokenizer, make_data, write_jsonl):
    """A pair of 101 and 62 tokens at 96: cut as one sequence of 96 and one of 62 it would not share a row of 192 with
    a pair of 19 + 18; both sequences lose the same 5 prompt tokens (96 + 57), and it does."""
    short = {"prompt": user("why "), "chosen": answer("yes "), "rejected": answer("no ")}
    long = {"prompt": user("why " * 45), "chosen": answer("yes " * 20), "rejected": answer("no ")}
    path = write_jsonl("pairs.jsonl", [short, long])

    def data(seq_len: int):
        spec = {"path": path, "type": "preference"}
        return make_data(train=[spec], validation=[spec], template="chatml", seq_len=seq_len)

    longest, _ = build_datasets(data(512), chat_tokenizer, seed=0)
    assert sorted(longest.packing_units()[0].tolist()) == [19 + 18, 101 + 62]
    built, _ = build_datasets(data(96), chat_tokenizer, seed=0)
    assert sorted(built.packing_units()[0].tolist()) == [19 + 18, 96 + 57]
    assert densest_row_by_length(longest, data(512))(96) == densest_row_samples(built) == 2


def test_rows_at_a_length_count_what_the_global_batch_counts():
    """Packed rows where data.packing, else one sample a row; samples longer than the row truncated or left out."""
    tokens = [50, 60, 70, 300]
    assert rows_at(tokens, 256, truncation="truncate", packing=False) == 4
    assert rows_at(tokens, 256, truncation="drop", packing=False) == 3
    assert rows_at(tokens, 256, truncation="truncate", packing=True) == 2  # 256 alone; 50 + 60 + 70 in one
    assert rows_at(tokens, 1024, truncation="truncate", packing=True) == 1
    assert rows_at([], 256, truncation="truncate", packing=True, documents=[600]) == 3  # pieces of 256, 256, 88
