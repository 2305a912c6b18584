"""Preference pairs and KTO records as training sets: the batch layout the preference losses read (chosen rows first,
labels only on the answers, attention mask, trimming), truncation, identical pairs, the cache and the digest."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memtrain.data.rows.dataset import build_datasets, build_validation
from memtrain.data.rows.identity import dataset_digest
from memtrain.data.rows.loader import BatchLoader, SampleOrder, collate, token_slots
from memtrain.data.rows.pairs import KtoRows, PairRows, fit
from memtrain.errors import DataError

IGNORE = -100


def user(text):
    return [{"role": "user", "content": text}]


def answer(text):
    return [{"role": "assistant", "content": text}]


def pair_records(n: int = 12) -> list[dict]:
    return [
        {
            "prompt": user(f"What is {i} + {i}?"),
            "chosen": answer(str(2 * i)),
            "rejected": answer(str(2 * i + 1) * (1 + i % 3)),
        }
        for i in range(n)
    ]


def pairs_data(make_data, write_jsonl, records, **keys):
    path = write_jsonl("pairs.jsonl", records)
    spec = {"path": path, "type": "preference"}
    return make_data(train=[spec], validation=[spec], template="chatml", seq_len=keys.pop("seq_len", 64), **keys)


def encoded(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_a_batch_of_pairs_is_chosen_rows_then_rejected_rows_with_labels_on_the_answers(
    chat_tokenizer, make_data, write_jsonl
):
    records = pair_records()
    data = pairs_data(make_data, write_jsonl, records)
    train, validation = build_datasets(data, chat_tokenizer, seed=0)
    assert isinstance(train, PairRows) and len(train) == len(validation) == 12
    assert train.stats.samples == 12 and train.stats.rows == 24 and train.stats.identical == 0
    batch = collate(train, [0, 1, 2])  # the loader asks the set
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["input_ids"].shape == (6, 64) and batch["input_ids"].dtype == torch.long
    end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # which record each row holds: the order is seeded, so find it by the prompt
    for row in range(6):
        length = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row, :length].tolist()
        assert (batch["attention_mask"][row, length:] == 0).all() and (batch["labels"][row, length:] == IGNORE).all()
        assert (batch["input_ids"][row, length:] == chat_tokenizer.pad_token_id).all()
        text = chat_tokenizer.decode(ids)
        record = next(r for r in records if r["prompt"][0]["content"] in text)
        side = "chosen" if row < 3 else "rejected"
        assert ids == encoded(chat_tokenizer, record["prompt"] + record[side])  # exactly the template's tokens
        labels = batch["labels"][row, :length].tolist()
        targets = [t for t in labels if t != IGNORE]
        assert chat_tokenizer.decode(targets) == record[side][0]["content"] + "<|im_end|>" and targets[-1] == end
        first = labels.index(targets[0])
        prompt = chat_tokenizer.apply_chat_template(record["prompt"], tokenize=True, add_generation_prompt=True)
        assert ids[:first] == list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    # rows i and B + i are one pair: the same prompt
    for i in range(3):
        c, r = batch["input_ids"][i], batch["input_ids"][3 + i]
        first_c = int((batch["labels"][i] != IGNORE).nonzero()[0])
        assert torch.equal(c[:first_c], r[:first_c])
    assert train.targets([0, 1, 2]) == 3  # the loss is normalised by pairs
    assert train.tokens_of([0, 1, 2]) == int(batch["attention_mask"].sum())
    assert train.target_tokens([0, 1, 2]) == int((batch["labels"] != IGNORE).sum())


def test_trim_cuts_to_the_longest_row_and_the_loader_and_reference_log_probs_go_along(
    chat_tokenizer, make_data, write_jsonl
):
    data = pairs_data(make_data, write_jsonl, pair_records())
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    full, cut = collate(train, [3, 5]), collate(train, [3, 5], trim=True)
    width = cut["input_ids"].shape[1]
    longest = int(full["attention_mask"].sum(1).max())
    assert width == -(-longest // 8) * 8 and width < 64
    assert all(torch.equal(full[key][:, :width], cut[key]) for key in full)
    assert (full["labels"][:, width:] == IGNORE).all() and not full["attention_mask"][:, width:].any()
    assert (full["input_ids"][:, width:] == chat_tokenizer.pad_token_id).all()
    assert np.array_equal(train.lengths[[3, 5]], np.maximum(*(full["attention_mask"].sum(1).view(2, 2).numpy())))
    logps = np.arange(24, dtype=np.float64).reshape(12, 2)
    attached = train.with_reference(logps)
    batch = attached.collate([3, 5])
    assert batch["ref_logps"].dtype == torch.float32 and batch["ref_logps"].tolist() == [6, 10, 7, 11]
    assert attached.select([5]).collate([0])["ref_logps"].tolist() == [10, 11]
    with pytest.raises(ValueError):
        train.with_reference(logps[:3])
    with BatchLoader(attached, torch.device("cpu"), prefetch=1, trim=True) as loader:
        loader.prefetch([3, 5])
        got = loader.get([3, 5])
    assert all(torch.equal(got[k], v) for k, v in attached.collate([3, 5], trim=True).items())
    order = SampleOrder(len(train), 0)
    assert token_slots(order, train, 4, 4, 2, False, 1) == 4 * 2 * 64  # each pair computes two rows


def test_a_long_prompt_keeps_its_end_and_a_long_answer_its_start(chat_tokenizer, make_data, write_jsonl):
    long_prompt = " ".join(f"word{i}" for i in range(60))
    records = pair_records(4) + [{"prompt": user(long_prompt), "chosen": answer("yes " * 40), "rejected": answer("no")}]
    data = pairs_data(make_data, write_jsonl, records, seq_len=48)
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    assert train.stats.truncated == 1 and train.stats.dropped_too_long == 0
    index = int(np.argmax(train.lengths))
    batch = collate(train, [index])
    chosen, rejected = batch["input_ids"][0].tolist(), batch["input_ids"][1].tolist()
    assert batch["attention_mask"][0].sum() == 48  # the longer answer fills seq_len
    text = chat_tokenizer.decode(chosen)
    assert "word59" in text and "word0 " not in text  # the prompt lost its start, kept its end
    first_target = int((batch["labels"][0] != IGNORE).nonzero()[0])
    assert first_target == 24  # half of seq_len stays the prompt's
    assert chat_tokenizer.decode(rejected[:first_target]) == chat_tokenizer.decode(chosen[:first_target])
    assert chat_tokenizer.decode([t for t in batch["labels"][1].tolist() if t != IGNORE]) == "no<|im_end|>"
    dropped, _ = build_datasets(data.model_copy(update={"truncation": "drop"}), chat_tokenizer, seed=0)
    assert len(dropped) == 4 and dropped.stats.dropped_too_long == 1
    # the rule alone: the prompt gives way first, down to half of seq_len
    kept, answers = fit([np.array([10, 40, 40])], [np.array([5, 5, 40])], 32)
    assert kept[0].tolist() == [10, 27, 16] and answers[0].tolist() == [5, 5, 16]


def test_identical_answers_are_left_out_and_counted_with_the_first_line(chat_tokenizer, make_data, write_jsonl):
    records = pair_records(6)
    records[2]["rejected"] = records[2]["chosen"]
    records[4]["rejected"] = records[4]["chosen"]
    data = pairs_data(make_data, write_jsonl, records)
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    assert len(train) == 4 and train.stats.identical == 2
    assert "2 with identical answers left out" in train.stats.describe()


def test_bad_records_are_said_together_and_nothing_is_cached(chat_tokenizer, make_data, write_jsonl, tmp_path):
    records = pair_records(4)
    del records[1]["chosen"]
    records[3]["rejected"] = 7
    data = pairs_data(make_data, write_jsonl, records)
    with pytest.raises(DataError) as caught:
        build_datasets(data, chat_tokenizer, seed=0)
    assert [(p.line, p.key) for p in caught.value.problems] == [(2, "chosen"), (4, "rejected")]
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.tokens.npy"))


def test_pairs_are_cached_and_their_digest_is_the_same_each_build(chat_tokenizer, make_data, write_jsonl, tmp_path):
    data = pairs_data(make_data, write_jsonl, pair_records()).model_copy(update={"validation": None})
    train, validation = build_datasets(data, chat_tokenizer, seed=3)
    assert len(train) + len(validation) == 12 and len(validation) == 1  # the held-out tail
    assert len(list((tmp_path / "cache").glob("*.tokens.npy"))) == 1
    again, held = build_datasets(data, chat_tokenizer, seed=3)
    assert dataset_digest(train, validation) == dataset_digest(again, held)
    other, _ = build_datasets(data, chat_tokenizer, seed=4)
    assert dataset_digest(other) != dataset_digest(train)
    assert isinstance(build_validation(data, chat_tokenizer, 3), PairRows)


def test_text_pairs_need_no_template(text_tokenizer, make_data, write_jsonl):
    hh = "\n\nHuman: What is the first letter of 'king'?\n\nAssistant:"
    records = [{"chosen": hh + f" k{i}", "rejected": hh + f" q{i}"} for i in range(5)]
    path = write_jsonl("hh.jsonl", records)
    spec = {"path": path, "type": "preference"}
    data = make_data(train=[spec], validation=[spec], seq_len=64)
    train, _ = build_datasets(data, text_tokenizer, seed=0)
    batch = collate(train, [0])
    targets = [t for t in batch["labels"][0].tolist() if t != IGNORE]
    assert targets[-1] == text_tokenizer.eos_token_id and text_tokenizer.decode(targets[:-1]).startswith(" k")


def test_kto_records_come_with_their_kl_rows_and_labels(chat_tokenizer, make_data, write_jsonl):
    records = [
        {"prompt": user(f"What is {i} + {i}?"), "completion": answer(str(2 * i + i % 2)), "label": i % 2 == 0}
        for i in range(8)
    ]
    path = write_jsonl("kto.jsonl", records)
    spec = {"path": path, "type": "kto"}
    data = make_data(train=[spec], validation=[spec], template="chatml", seq_len=64)
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    assert isinstance(train, KtoRows) and len(train) == 8 and train.stats.kind == "kto records"
    batch = collate(train, [0, 1, 2, 3])
    assert batch["input_ids"].shape[0] == 8 and batch["kto_label"].dtype == torch.bool
    for row in range(4):
        text = chat_tokenizer.decode(batch["input_ids"][row][batch["attention_mask"][row] == 1].tolist())
        record = next(r for r in records if r["prompt"][0]["content"] in text)
        assert bool(batch["kto_label"][row]) == record["label"]
        kl = chat_tokenizer.decode(batch["input_ids"][4 + row][batch["attention_mask"][4 + row] == 1].tolist())
        # the KL row: the same prompt, another record's answer
        assert kl.split("<|im_start|>assistant\n")[0] == text.split("<|im_start|>assistant\n")[0]
        assert kl.split("<|im_start|>assistant\n")[1] != text.split("<|im_start|>assistant\n")[1]
        kl_targets = [t for t in batch["labels"][4 + row].tolist() if t != IGNORE]
        assert chat_tokenizer.decode(kl_targets).endswith("<|im_end|>")
    assert train.targets([0, 1, 2, 3]) == 4
    # the KL rows are fixed per record, whatever the micro-batch
    alone = collate(train, [2])
    assert torch.equal(alone["input_ids"][1], batch["input_ids"][6])
    bad = write_jsonl("bad.jsonl", [{"prompt": "x", "completion": "y", "label": "yes"}])
    with pytest.raises(DataError) as caught:
        build_datasets(make_data(train=[{"path": bad, "type": "kto"}], seq_len=64), chat_tokenizer, seed=0)
    [problem] = caught.value.problems
    assert (problem.line, problem.key) == (1, "label") and "not true or false" in problem.message


def test_people_are_told_of_cut_and_identical_pairs(chat_tokenizer, make_data, write_jsonl):
    from memtrain.data.rows.mixture import noted_datasets
    from memtrain.data.rows.pairs import identical_pairs_warning, pair_truncation_warning

    records = pair_records(6) + [
        {"prompt": user(" ".join(["word"] * 80)), "chosen": answer("a"), "rejected": answer("b")}
    ]
    records[3]["rejected"] = records[3]["chosen"]
    data = pairs_data(make_data, write_jsonl, records, seq_len=48)
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    said = pair_truncation_warning(train)
    assert said.startswith("of 6 training pairs, 1 cut to data.seq_len 48 (the prompt's start, then the answer's end)")
    said = identical_pairs_warning(noted_datasets(data, chat_tokenizer))
    assert said.startswith(f"1 pair of {data.train[0].path} (the first at line 4): the chosen and the rejected answer")
    fine = pairs_data(make_data, write_jsonl, pair_records(4))
    assert pair_truncation_warning(build_datasets(fine, chat_tokenizer, seed=0)[0]) is None
    assert identical_pairs_warning(noted_datasets(fine, chat_tokenizer)) is None


def test_held_out_pairs_are_asked_as_their_chat_questions(chat_tokenizer, make_data):
    from memtrain.data.rows.prompts import held_out_prompts

    pairs = make_data(
        train=[{"path": "builtin:preference/validation", "type": "preference"}],
        validation=[{"path": "builtin:preference/validation", "type": "preference"}],
        template="chatml",
        seq_len=128,
    )
    chat = make_data(
        train=[{"path": "builtin:chat/validation", "type": "chat"}],
        validation=[{"path": "builtin:chat/validation", "type": "chat"}],
        template="chatml",
        seq_len=128,
    )
    asked, skipped = held_out_prompts(pairs, chat_tokenizer, limit=40)
    expected, _ = held_out_prompts(chat, chat_tokenizer, limit=40)
    assert skipped == 0 and len(asked) == 40
    assert [(p.prompt_ids, p.expected, p.line, p.task) for p in asked] == [
        (p.prompt_ids, p.expected, p.line, p.task) for p in expected
    ]
    # without data.validation: the held-out tail of the training pairs, none of them trained on
    tail = pairs.model_copy(update={"validation": None})
    train, validation = build_datasets(tail, chat_tokenizer, seed=0)
    asked, _ = held_out_prompts(tail, chat_tokenizer)
    assert len(asked) == len(validation) == 15 and [p.line for p in asked] == list(range(286, 301))


def test_datasets_of_pairs_mix_by_weight_as_sft_datasets_do(chat_tokenizer, make_data, write_jsonl):
    first = write_jsonl("a.jsonl", pair_records(10))
    second = write_jsonl(
        "b.jsonl", [{**r, "prompt": user("Other " + r["prompt"][0]["content"])} for r in pair_records(8)]
    )
    data = make_data(
        train=[
            {"path": first, "type": "preference", "weight": 0.5},
            {"path": second, "type": "preference", "weight": 2},
        ],
        template="chatml",
        seq_len=64,
        validation_fraction=0.25,
    )
    train, validation = build_datasets(data, chat_tokenizer, seed=0)
    # tails of 2 + 2 held out (round(0.25 × n)); then 8 × 0.5 = 4 and 6 × 2 = 12 training pairs
    assert len(validation) == 4 and len(train) == 16
    prompts = [chat_tokenizer.decode(collate(train, [i])["input_ids"][0].tolist()) for i in range(len(train))]
    assert sum("Other" in p for p in prompts) == 12
    again, _ = build_datasets(data, chat_tokenizer, seed=0)
    assert dataset_digest(again) == dataset_digest(train)


def test_kto_text_records_and_a_held_out_tail(text_tokenizer, make_data, write_jsonl):
    records = [{"prompt": f"Q{i}: ", "completion": f"A{i}", "label": bool(i % 3)} for i in range(20)]
    data = make_data(train=[{"path": write_jsonl("kto.jsonl", records), "type": "kto"}], seq_len=32)
    train, validation = build_datasets(data, text_tokenizer, seed=0)
    assert isinstance(train, KtoRows) and len(train) == 19 and len(validation) == 1
    batch = collate(validation, [0])
    assert text_tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0] == 1].tolist()).startswith("Q19: A19")
    assert batch["kto_label"].tolist() == [bool(19 % 3)]
    assert train.desirable.sum() == sum(bool(i % 3) for i in range(19))


def test_ultrafeedback_binarized_layout_from_a_datasets_directory(chat_tokenizer, make_data, tmp_path):
    """HuggingFaceH4/ultrafeedback_binarized's columns: a prompt string, chosen and rejected as whole conversations,
    scores beside them; read from a save_to_disk directory, the prompt is the conversations' shared user turn."""
    import datasets

    rows = [
        {
            "prompt": f"What is {i} + {i}?",
            "chosen": user(f"What is {i} + {i}?") + answer(str(2 * i)),
            "rejected": user(f"What is {i} + {i}?") + answer(str(2 * i + 1)),
            "score_chosen": 9.0,
            "score_rejected": 2.0,
        }
        for i in range(6)
    ]
    directory = tmp_path / "ultrafeedback"
    datasets.DatasetDict({"train_prefs": datasets.Dataset.from_list(rows)}).save_to_disk(str(directory))
    spec = {"path": str(directory), "type": "preference", "split": "train_prefs"}
    train, _ = build_datasets(
        make_data(train=[spec], validation=[spec], template="chatml", seq_len=64), chat_tokenizer, 0
    )
    assert len(train) == 6
    batch = collate(train, list(range(6)))
    texts = [chat_tokenizer.decode([t for t in row.tolist() if t != IGNORE]) for row in batch["labels"]]
    assert sorted(texts[:6]) == sorted(f"{2 * i}<|im_end|>" for i in range(6))
    assert sorted(texts[6:]) == sorted(f"{2 * i + 1}<|im_end|>" for i in range(6))


def test_forked_workers_build_the_pairs_one_process_builds(
    chat_tokenizer, make_data, write_jsonl, tmp_path, monkeypatch
):
    import memtrain.data.tokens.tokenized as tokenized
    from memtrain.data.tokens import parallel

    records = pair_records(120)
    records[50]["rejected"] = records[50]["chosen"]
    path = write_jsonl("many.jsonl", records)
    monkeypatch.setattr(parallel, "MAX_WORKERS", 2)
    monkeypatch.setattr(tokenized, "BATCH_RECORDS", 8)

    def build(min_batches: int):
        monkeypatch.setattr(parallel, "MIN_BATCHES", min_batches)
        spec = {"path": path, "type": "preference"}
        data = make_data(train=[spec], template="chatml", seq_len=64, cache_dir=str(tmp_path / f"cache-{min_batches}"))
        train, validation = build_datasets(data, chat_tokenizer, seed=0)
        return [collate(s, list(range(len(s)))) for s in (train, validation)], train.stats

    (serial, serial_stats), (forked, forked_stats) = build(10**9), build(1)
    assert serial_stats == forked_stats and serial_stats.identical == 1
    assert all(torch.equal(a[k], b[k]) for a, b in zip(serial, forked) for k in a)


def test_pairs_written_with_the_tokenizers_own_template_are_warned_about_as_chat_data_is(make_data, write_jsonl):
    from memtrain.data.render.chat import generation_prompt_warning, unclosed_turn_warning
    from memtrain.data.tokens.tokenizer import load_tokenizer
    from memtrain.recipe.schema import Model

    tokenizer = load_tokenizer(Model(preset="tiny", tokenizer="builtin:shakespeare"))
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    data = make_data(train=[{"path": write_jsonl("p.jsonl", pair_records(4)), "type": "preference"}], seq_len=64)
    assert "writes no special token after an assistant's answer" in unclosed_turn_warning(data, tokenizer)
    train, _ = build_datasets(data.model_copy(update={"validation_fraction": 0.25}), tokenizer, seed=0)
    text = tokenizer.decode(collate(train, [0])["input_ids"][0].tolist())
    assert text.startswith("user: What is") and "\nassistant: " in text
    tokenizer.chat_template = None  # text pairs need none; a conversation is said at its line
    with pytest.raises(DataError) as caught:
        build_datasets(data, tokenizer, seed=0)
    assert (
        caught.value.problems[0].line == 1
        and "neither data.template nor the tokenizer" in caught.value.problems[0].message
    )
    assert generation_prompt_warning(data, tokenizer) is None
