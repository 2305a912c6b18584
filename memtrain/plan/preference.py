"""What a preference objective adds to the memory plan (train.objective dpo, orpo, simpo, kto).

The batch counts pairs: a micro-batch of B pairs is one forward of 2B rows (the chosen and the rejected sequences,
model/preference.py), so its activations, its head and its logits chunks are those of 2B rows. KTO's micro-batch of B
records trains B rows with gradient; its B KL rows run in a forward without gradient.

The reference: `adapters_off` (and KTO's KL rows) is a forward without gradient that the wrapper runs before the
policy's, when none of the micro-batch's activations are held yet: it adds a phase, not a term on top of the
others. It holds one decoder layer's working set, the final norm's output and the loss's chunk of logits of its rows.
`precomputed` keeps 8 bytes per pair (two float32 log-probabilities) in host memory and none on the GPU beyond
a pass like the adapters_off one before training; `none` (ORPO, SimPO) adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtrain.recipe.schema import Recipe

REFERENCE_BYTES_PER_PAIR = 8  # the chosen's and the rejected's summed log-probability, float32 each


@dataclass(frozen=True)
class PreferenceShape:
    """How a micro-batch of a recipe's samples becomes rows, and what runs without gradient."""

    rows_per_sample: int = 1  # rows with gradient per sample (pairs: 2)
    no_grad_rows_per_sample: int = 0  # rows of the largest forward without gradient (the reference's), per sample
    reference: str = "none"  # adapters_off | precomputed | none


def preference_shape(recipe: Recipe) -> PreferenceShape:
    """The shape of the recipe's objective: SFT's one row per sample, a pair's two, KTO's one and its KL row."""
    objective = recipe.train.objective
    if objective == "sft":
        return PreferenceShape()
    reference = recipe.preference_settings.reference_for(objective, recipe.model.lora is not None)
    if objective == "kto":
        # the reference of the records and their KL rows in one forward (adapters_off); else the KL rows alone
        return PreferenceShape(1, 2 if reference == "adapters_off" else 1, reference)
    return PreferenceShape(2, 2 if reference in ("adapters_off", "precomputed") else 0, reference)


def describe(shape: PreferenceShape, objective: str) -> str:
    """One line for the plan: what a micro-batch holds and what the reference costs."""
    if objective == "sft":
        return ""
    rows = "records and their KL rows" if objective == "kto" else "pairs, 2 sequences each"
    reference = {
        "adapters_off": "the LoRA base with its adapters disabled, a forward without gradient before each micro-batch",
        "precomputed": f"precomputed in one pass before training, {REFERENCE_BYTES_PER_PAIR} bytes per pair "
        "on the host",
        "none": "none",
    }[shape.reference]
    return f"{objective}: micro-batches of {rows}; reference: {reference}"
