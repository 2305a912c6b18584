"""The plan of a preference objective: a micro-batch of pairs priced as twice the rows, the reference's forward
without gradient as its own phase, and the verdict from the same peak."""

from __future__ import annotations

from memtrain.plan.planner import plan_recipe
from memtrain.recipe.load import load_recipe_text


def recipe(objective: str = "sft", extra: str = "", micro_batch: int = 2, lora: bool = True):
    data_type = {"sft": "completion", "kto": "kto"}.get(objective, "preference")
    lora_text = "lora: {r: 8, target_modules: [q_proj, v_proj]}" if lora else ""
    text = f"""
model: {{preset: tiny, {lora_text}}}
data: {{train: [{{path: pairs.jsonl, type: {data_type}}}], seq_len: 256, packing: false}}
hardware: {{gpus: 1, gpu: 24GiB}}
precision: {{compute: bf16, chunked_loss: false}}
batch: {{global_batch: 16, micro_batch: {micro_batch}}}
train: {{steps: 10, objective: {objective}}}
{extra}
"""
    return load_recipe_text(text).recipe


def test_pairs_price_twice_the_rows_of_sft():
    """DPO at micro-batch 2 pairs holds the activations and logits of SFT's micro-batch of 4 rows."""
    sft4 = plan_recipe(recipe("sft", micro_batch=4))
    dpo2 = plan_recipe(recipe("dpo", micro_batch=2))
    simpo2 = plan_recipe(recipe("simpo", micro_batch=2))
    sft2 = plan_recipe(recipe("sft", micro_batch=2))
    for plan in (dpo2, simpo2):
        assert plan.terms["activations"] == sft4.terms["activations"] > sft2.terms["activations"]
        assert plan.terms["logits_loss"] == sft4.terms["logits_loss"]
        assert plan.phases["forward_end"] == sft4.phases["forward_end"]
    assert "2 sequences each" in dpo2.preference and sft2.preference == ""
    assert "reference_forward" not in sft2.phases


def test_the_reference_forward_is_a_phase_of_its_own():
    """adapters_off: a forward without gradient of both sequences before the policy's, priced as a phase of its own
    (model states, one layer's working set and the loss forward's logits), not on top of the saved activations."""
    dpo = plan_recipe(recipe("dpo", micro_batch=2))
    simpo = plan_recipe(recipe("simpo", micro_batch=2))
    assert "adapters disabled" in dpo.preference
    assert "reference_forward" in dpo.phases and "reference_forward" not in simpo.phases
    model_states = dpo.terms["params"] + dpo.terms["gradients"] + dpo.terms["optimizer_states"]
    reference = dpo.phases["reference_forward"]
    assert (
        model_states + dpo.terms["logits_loss"] < reference < dpo.phases["backward_start"] == dpo.peak_allocated_bytes
    )
    assert dpo.peak_reserved_bytes == simpo.peak_reserved_bytes  # the same rows with gradient; the peak is theirs
    # its rows are the pairs' two sequences: four times the pairs, more than three times the bytes (the layer scales)
    big = plan_recipe(recipe("dpo", micro_batch=8))
    assert big.phases["reference_forward"] > 3 * reference


def test_kto_trains_one_row_per_record_and_runs_its_kl_rows_without_gradient():
    kto = plan_recipe(recipe("kto", micro_batch=4))
    sft = plan_recipe(recipe("sft", micro_batch=4))
    assert kto.terms["activations"] == sft.terms["activations"]
    assert "reference_forward" in kto.phases


def test_a_full_fine_tune_says_its_precomputed_reference():
    plan = plan_recipe(recipe("dpo", lora=False))
    assert "precomputed" in plan.preference and "8 bytes per pair" in plan.preference
    assert plan.fits
