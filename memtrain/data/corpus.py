"""Reading training text: .txt, .jsonl (one field), gzip, and the bundled builtin corpora."""
from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def builtin_corpus_names() -> list[str]:
    """'shakespeare' (its train split) and 'shakespeare/validation', for every bundled corpus."""
    names = []
    for corpus in sorted((ASSETS / "corpus").iterdir()):
        for split in sorted(corpus.glob("*.txt.gz")):
            stem = split.name[: -len(".txt.gz")]
            names.append(corpus.name if stem == "train" else f"{corpus.name}/{stem}")
    return names
