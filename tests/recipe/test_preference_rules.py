"""train.objective and the preference section: what each objective accepts, the defaults it resolves to."""

from __future__ import annotations

import pytest

from memtrain.errors import RecipeError
from memtrain.recipe.load import load_recipe_text
from memtrain.recipe.schema import Preference

PAIRS = """\
model: {preset: mini, tokenizer: "builtin:shakespeare-chat"}
data:
  train: [{path: "pairs.jsonl", type: preference}]
  template: chatml
train: {steps: 10, objective: dpo}
"""


def keys(text: str, *overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as caught:
        load_recipe_text(text, "r.yaml", list(overrides))
    return [p.key for p in caught.value.problems]


@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo"])
def test_preference_objectives_take_preference_data_with_their_defaults(objective):
    recipe = load_recipe_text(PAIRS, "r.yaml", [f"train.objective={objective}"]).recipe
    settings = recipe.preference_settings
    assert settings.beta_for(objective) == {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0}[objective]
    assert settings.reference_for(objective, lora=False) == ("precomputed" if objective == "dpo" else "none")
    assert recipe.data.holds_pairs and recipe.data.groups_by_length  # pairs are bucketed and trimmed by default


def test_dpo_under_lora_takes_the_disabled_adapters_as_reference():
    recipe = load_recipe_text(PAIRS, "r.yaml", ["model.lora.r=8", "preference.beta=0.3"]).recipe
    assert recipe.preference_settings.reference_for("dpo", lora=True) == "adapters_off"
    assert recipe.preference_settings.beta_for("dpo") == 0.3


def test_kto_takes_kto_data_and_its_weights():
    text = PAIRS.replace("type: preference", "type: kto").replace("objective: dpo", "objective: kto")
    recipe = load_recipe_text(text, "r.yaml", ["preference.kto_undesirable_weight=1.5"]).recipe
    assert recipe.preference_settings.kto_undesirable_weight == 1.5
    assert keys(text, "preference.orpo_lambda=0.2") == ["preference.orpo_lambda"]


def test_sft_is_the_default_and_refuses_pairs_and_the_section():
    text = PAIRS.replace(", objective: dpo", "")
    assert keys(text) == ["data.train.0.type"]
    chat = text.replace("type: preference", "type: chat")
    assert load_recipe_text(chat, "r.yaml").recipe.train.objective == "sft"
    assert keys(chat, "preference.beta=0.1") == ["preference"]


def test_each_mismatch_of_objective_and_data_is_named_at_its_dataset():
    text = PAIRS.replace(
        "  template: chatml",
        '  validation: [{path: "v.jsonl", type: preference}, {path: "c.jsonl", type: chat}]\n  template: chatml',
    )
    assert keys(text) == ["data.validation.1.type"]
    assert keys(text, "train.objective=kto") == [
        "data.train.0.type",
        "data.validation.0.type",
        "data.validation.1.type",
    ]
    text_path = PAIRS.replace('[{path: "pairs.jsonl", type: preference}]', '"builtin:shakespeare"')
    assert keys(text_path) == ["data.train"]


def test_references_an_objective_cannot_have():
    assert keys(PAIRS, "preference.reference=none") == ["preference.reference"]
    assert keys(PAIRS, "preference.reference=adapters_off") == ["preference.reference"]
    assert load_recipe_text(PAIRS, "r.yaml", ["preference.reference=adapters_off", "model.lora.r=8"])
    for objective in ("orpo", "simpo"):
        assert keys(PAIRS, f"train.objective={objective}", "preference.reference=precomputed") == [
            "preference.reference"
        ]
        assert load_recipe_text(PAIRS, "r.yaml", [f"train.objective={objective}", "preference.reference=none"])


def test_ipo_has_no_label_smoothing_and_a_dumped_recipe_reads_back():
    assert keys(PAIRS, "preference.loss_type=ipo", "preference.label_smoothing=0.1") == ["preference.label_smoothing"]
    recipe = load_recipe_text(PAIRS, "r.yaml", ["preference.label_smoothing=0.1"]).recipe
    dumped = recipe.model_dump(mode="json")  # run.json spells every default out, simpo_gamma of a dpo run too
    assert type(recipe).model_validate(dumped) == recipe
    assert Preference.model_validate(dumped["preference"]).label_smoothing == 0.1


def test_sft_target_keys_do_nothing_for_pairs():
    assert keys(PAIRS, "data.train_on_inputs=true", "data.train_on=last_turn") == [
        "data.train_on_inputs",
        "data.train_on",
    ]
