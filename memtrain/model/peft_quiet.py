"""PEFT's calls without transformers' warning about them.

PEFT before 0.22 reads `model.is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning at each
read, so every LoRA run, `plan` of a LoRA recipe, `eval` and `export --merge` printed a warning about two libraries'
versions that a user cannot act on (PEFT 0.22 reads it quietly itself). It is silenced around PEFT's calls, and
nothing else is.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def peft_quietly() -> Iterator[None]:
    """Within the block, transformers' `is_gradient_checkpointing` deprecation warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
