"""The label the loss skips: the data marks prompts, padding and sample starts with it, the loss ignores it."""

from __future__ import annotations

IGNORE_INDEX = -100  # torch's cross_entropy default ignore_index, as Hugging Face models use it
