"""Where a row's samples come from: each sample's record, as the line (or row) of its data file.

A sample is a view into its dataset's token cache entry, which holds the samples end to end, one per record (a text
dataset's: one per document, cut into pieces later); the record of the sample that starts at a token is found by
where that token falls among the entry's sample ends, and its line by reading the file up to it. For `memtrain
preview`: the few rows shown, not a run's whole data.
"""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedTokenizerBase

from memtrain.data.read.records import read_records
from memtrain.data.rows.mixture import sample_rules
from memtrain.data.rows.row_set import SampleRows
from memtrain.data.tokens.tokenized import tokenized_dataset
from memtrain.recipe.schema import Data, DatasetSpec


def sample_lines(
    dataset: SampleRows, specs: list[DatasetSpec], data: Data, tokenizer: PreTrainedTokenizerBase, samples: list[int]
) -> dict[int, int]:
    """{sample index: the line (or row) of its record in its dataset's file} for `samples` of `dataset`, whose
    sources are `specs` in order (the split's datasets). `tokenizer` as the rows were built with."""
    rules = sample_rules(data, tokenizer)
    wanted: dict[int, dict[int, list[int]]] = {}  # source -> record position -> samples
    for sample in samples:
        source = int(dataset.samples.source[sample])
        ends = tokenized_dataset(specs[source], tokenizer, rules, data.cache_dir).ends
        position = int(np.searchsorted(ends, int(dataset.samples.start[sample]), side="right"))
        wanted.setdefault(source, {}).setdefault(position, []).append(sample)
    lines: dict[int, int] = {}
    for source, positions in wanted.items():
        spec, last = specs[source], max(positions)
        for position, (line, _) in enumerate(read_records(spec.path, spec.split, subset=spec.subset)):
            for sample in positions.get(position, ()):
                lines[sample] = line
            if position >= last:
                break
    return lines
