"""A long document is tokenised in pieces, and the pieces' tokens end to end are the whole document's, for the
tokenizer styles of the model families: byte-level BPE (GPT-2 / the bundled one, Llama 3 / Qwen's split), Metaspace
(SentencePiece conversions), and a normalizer that prepends "▁" to every call (older Llama 2 conversions), for which
no cut holds and the document goes whole."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from memtrain.data.read.corpus import ASSETS
from memtrain.data.tokens import long_text
from memtrain.data.tokens.cache import tokenize_documents
from memtrain.data.tokens.tokenized import SampleRules, tokenize_dataset
from memtrain.recipe.schema import DatasetSpec

PLAYS = gzip.decompress((ASSETS / "corpus/shakespeare/train.txt.gz").read_bytes()).decode()[:200_000]
# Text without spaces between words, where only punctuation can be cut at.
CJK = "天地玄黄，宇宙洪荒。日月盈昃，辰宿列张。寒来暑往，秋收冬藏。闰余成岁，律吕调阳。" * 400
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


def trained(style: str) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token=None if style != "metaspace" else "<unk>", byte_fallback=False))
    alphabet = []
    if style == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif style == "llama3":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif style == "metaspace":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    elif style == "prepend":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=["<unk>", "</s>"], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator([PLAYS, CJK], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")


def whole(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


TEXTS = {"plays": PLAYS, "cjk": CJK, "mixed": PLAYS[:30_000] + CJK[:8_000] + PLAYS[30_000:60_000]}
CUT = {  # style: the texts it cuts (Metaspace prepends "▁" to a piece that does not start with a space)
    "gpt2": {"plays", "cjk", "mixed"},
    "llama3": {"plays", "cjk", "mixed"},
    "metaspace": {"plays", "mixed"},
    "prepend": set(),
}


@pytest.mark.parametrize("style", list(CUT))
def test_pieces_tokenise_as_the_whole_document(style, tmp_path, monkeypatch):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 5_000)
    tokenizer = trained(style)
    for name, text in TEXTS.items():
        parts = long_text.pieces(text, tokenizer)
        assert "".join(parts) == text
        assert (len(parts) > 1) == (name in CUT[style]), (name, len(parts))
        path = tmp_path / f"{style}.txt"
        path.write_text(text)
        tokens, ends = tokenize_documents(str(path), "auto", "text", tokenizer)
        assert tokens.tolist() == whole(tokenizer, text) + [tokenizer.eos_token_id]
        assert ends.tolist() == [len(tokens)]


def test_documents_of_a_jsonl_file_keep_their_ends_when_some_are_cut(text_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 5_000)
    documents = [PLAYS[:23_000], "A short one.", PLAYS[23_000:24_000], PLAYS[24_000:61_000]]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    tokens, ends = tokenize_documents(str(path), "auto", "text", text_tokenizer)
    expected = [whole(text_tokenizer, d) + [text_tokenizer.eos_token_id] for d in documents]
    assert tokens.tolist() == [t for ids in expected for t in ids]
    assert ends.tolist() == np.cumsum([len(ids) for ids in expected]).tolist()


def test_a_text_dataset_of_a_long_txt_file_is_cut_too_and_trains_on_every_token(text_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 5_000)
    path = tmp_path / "plays.txt"
    path.write_text(PLAYS[:60_000])
    assert len(long_text.pieces(PLAYS[:60_000], text_tokenizer)) > 1
    samples = tokenize_dataset(DatasetSpec(path=str(path), type="text"), text_tokenizer, SampleRules(template=None))
    assert samples.tokens.tolist() == whole(text_tokenizer, PLAYS[:60_000]) + [text_tokenizer.eos_token_id]
    assert samples.targets.tolist() == [1] * len(samples.tokens) and samples.ends.tolist() == [len(samples.tokens)]
