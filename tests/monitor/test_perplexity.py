"""One perplexity cap for the metrics, the progress line, `memtrain eval` and the plots."""

from __future__ import annotations

import math

import pytest

from memtrain.monitor.perplexity import MAX_LOSS, OVER_CAP_TEXT, perplexity, perplexity_text
from memtrain.monitor.plots import _perplexity_text as plot_tick


def test_under_the_cap_it_is_exp_of_the_loss():
    assert perplexity(2.0) == pytest.approx(math.exp(2.0)) and perplexity(MAX_LOSS) == pytest.approx(math.exp(50))
    assert perplexity_text(2.0) == "7.39" and perplexity_text(2.0, 1) == "7.4" and perplexity_text(20.0) == "4.85e8"


def test_over_the_cap_says_so_instead_of_a_capped_number():
    assert OVER_CAP_TEXT == "> 5.2e21"
    for loss in (75.88, 800.0, math.inf):  # a run at lr 0.9: validation loss 75.88
        assert perplexity(loss) is None  # JSON null; the record keeps the loss
        assert perplexity_text(loss) == OVER_CAP_TEXT and plot_tick(loss) == OVER_CAP_TEXT
    assert perplexity(None) is None and perplexity_text(math.nan) == "nan"
    assert plot_tick(1.0) == "2.72" and plot_tick(8.0) == "2,981"
