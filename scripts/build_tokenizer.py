"""Train the bundled byte-level BPE tokenizer on the bundled Shakespeare corpus.

Run once; its output (memtrain/assets/tokenizer/shakespeare) is committed so that no run needs a
download or a training step. `python scripts/build_tokenizer.py` rebuilds it identically.
"""

from __future__ import annotations

import gzip
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "memtrain/assets/corpus/shakespeare/train.txt.gz"
OUT = ROOT / "memtrain/assets/tokenizer/shakespeare"
VOCAB_SIZE = 4096
SPECIAL = ["<|endoftext|>", "<|pad|>"]


def main() -> None:
    text = gzip.decompress(CORPUS.read_bytes()).decode("utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL[0],
        pad_token=SPECIAL[1],
        bos_token=SPECIAL[0],
        model_max_length=1_000_000,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(OUT)
    print(f"wrote {OUT} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
