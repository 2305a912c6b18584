"""Perplexity, exp(mean token loss): one function and one cap for the metrics, the progress line, `memtrain
eval` and the plots.

Past a loss of MAX_LOSS nats (perplexity e^50 ≈ 5.2e21) the number says nothing a person can use (a model
guessing uniformly among a 256k-token vocabulary scores 2.6e5), and exp overflows a float past ~709. So above
the cap (and for a loss that is not finite) `perplexity` gives None, which JSON records write as null (the
loss stays in the record), and `perplexity_text` says so: "> 5.2e21", never a capped number that looks measured.
"""

from __future__ import annotations

import math

MAX_LOSS = 50.0


def _scientific(value: float, digits: int) -> str:
    mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


OVER_CAP_TEXT = "> " + _scientific(math.exp(MAX_LOSS), 2)  # "> 5.2e21"


def perplexity(loss: float | None) -> float | None:
    """exp(loss), or None when the loss is missing, not finite or above MAX_LOSS."""
    if loss is None or not math.isfinite(loss) or loss > MAX_LOSS:
        return None
    return math.exp(loss)


def perplexity_text(loss: float | None, decimals: int = 2) -> str:
    """For people: the perplexity with `decimals` places, a million and more in 3 significant digits (1.23e9),
    OVER_CAP_TEXT above the cap, "nan" for a loss that is missing or NaN."""
    value = perplexity(loss)
    if value is None:
        return "nan" if loss is None or math.isnan(loss) else OVER_CAP_TEXT
    if value >= 1e6:
        return _scientific(value, 3)
    return f"{value:.{decimals}f}"
