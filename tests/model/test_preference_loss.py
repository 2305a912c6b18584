"""memtrain's preference losses and gradients equal TRL's own computation on the same tiny model and pairs.

DPO (sigmoid, ipo) and KTO: a real trl DPOTrainer / KTOTrainer on a tiny Llama with its own reference model, its
collated batch fed to its _compute_loss and, relaid as data/rows/pairs.py collates (labels = the completion tokens),
to memtrain's PreferenceLM with the reference's log-probabilities that PreferenceLM computes on TRL's reference
model. SimPO, ORPO and DPO's label smoothing: TRL's CPOTrainer.cpo_loss / ORPOTrainer.odds_ratio_loss and their
get_batch_logps on the full logits (the methods read only the attributes given). All in fp32, within 1e-5.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from torch import nn
from transformers import AutoTokenizer, LlamaForCausalLM

from memtrain.labels import IGNORE_INDEX
from memtrain.model.preference import PreferenceLM, preference_metrics
from memtrain.model.preference_loss import PreferenceSettings
from memtrain.model.sequence_logps import sequence_logps, target_mask, token_logps
from memtrain.recipe.schema import Precision
from tests.conftest import ROOT
from tests.model.families import tiny_config

trl = pytest.importorskip("trl")
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer  # noqa: E402 — after the importorskip
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

TOKENIZER = ROOT / "memtrain/assets/tokenizer/shakespeare-chat"
PROMPTS = ["To be, or not", "Now is the winter", "Friends, Romans,", "All the world's"]
CHOSEN = [" to be: that is the question", " of our discontent", " countrymen, lend me your ears", " a stage"]
REJECTED = [" maybe", " of summer and sun, made glorious", " and others", " a small village in the north"]
FP32 = Precision(compute="fp32")
TOL = 1e-5


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config("llama")).float()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() and ours
    worst = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
    assert worst < TOL, worst


def _labels(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    return input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def dpo_trainer(tokenizer, tmp_path_factory):
    data = Dataset.from_dict({"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED})
    args = DPOConfig(
        output_dir=str(tmp_path_factory.mktemp("dpo")),
        report_to="none",
        per_device_train_batch_size=4,
        use_cpu=True,
        bf16=False,
    )
    return DPOTrainer(model=_model(0), ref_model=_model(1), args=args, train_dataset=data, processing_class=tokenizer)


def _trl_dpo(trainer, loss_type: str, beta: float):
    trainer.loss_types, trainer.loss_weights, trainer.beta = [loss_type], [1.0], beta
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch, False)
    loss.backward()
    return batch, loss.item(), _grads(trainer.model)


@pytest.mark.parametrize(("loss_type", "beta"), [("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.1)])
def test_dpo_equals_trl(dpo_trainer, loss_type, beta):
    batch, trl_loss, trl_grads = _trl_dpo(dpo_trainer, loss_type, beta)
    settings = PreferenceSettings(objective="dpo", beta=beta, loss_type=loss_type)
    labels = _labels(batch["input_ids"], batch["completion_mask"])
    reference = PreferenceLM(dpo_trainer.ref_model, FP32, settings, "precomputed")
    ref_logps = reference.reference_logps(batch["input_ids"], labels, batch["attention_mask"])
    policy = PreferenceLM(dpo_trainer.model, FP32, settings, "precomputed")
    policy.model.zero_grad()
    loss_sum, pairs = policy(batch["input_ids"], labels, batch["attention_mask"], ref_logps=ref_logps)
    (loss_sum / pairs).backward()
    assert int(pairs) == 4
    assert abs((loss_sum / pairs).item() - trl_loss) < TOL
    assert (loss_sum / pairs).item() != pytest.approx(math.log(2), abs=1e-3)  # a real reference, not the policy
    _assert_same_grads(_grads(policy.model), trl_grads)
    metrics = preference_metrics(policy.take_metric_sums())
    chosen = dpo_trainer._metrics["train"]["rewards/chosen"][-1]
    margin = dpo_trainer._metrics["train"]["rewards/margins"][-1]
    accuracy = dpo_trainer._metrics["train"]["rewards/accuracies"][-1]
    assert metrics["reward_chosen"] == pytest.approx(chosen, abs=TOL)
    assert metrics["reward_margin"] == pytest.approx(margin, abs=TOL)
    assert metrics["reward_accuracy"] == pytest.approx(accuracy)
    assert metrics["logp_chosen"] == pytest.approx(dpo_trainer._metrics["train"]["logps/chosen"][-1], abs=1e-5)


def test_chunked_log_probs_equal_whole(dpo_trainer):
    """The chunked per-token log-probs (and their gradient) equal the whole batch's logits at once."""
    batch = next(iter(dpo_trainer.get_train_dataloader()))
    model = dpo_trainer.model
    labels = _labels(batch["input_ids"], batch["completion_mask"])
    out = []
    for chunk in (None, 5):
        model.zero_grad()
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        per_token = token_logps(model.lm_head, hidden, labels, chunk_tokens=chunk)
        sums, counts = sequence_logps(per_token, target_mask(labels))
        sums.sum().backward()
        out.append((sums.detach(), counts, _grads(model)))
    assert torch.allclose(out[0][0], out[1][0], atol=TOL)
    assert out[0][1].tolist() == batch["completion_mask"][:, 1:].sum(-1).float().tolist()
    _assert_same_grads(out[1][2], out[0][2])


def _full_logps(model, input_ids, attention_mask, labels, average):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return logits, ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)


def _pairs_batch(dpo_trainer):
    batch = next(iter(dpo_trainer.get_train_dataloader()))
    return batch, _labels(batch["input_ids"], batch["completion_mask"])


def test_simpo_equals_trl_cpo(dpo_trainer):
    batch, labels = _pairs_batch(dpo_trainer)
    model, n = dpo_trainer.model, len(PROMPTS)
    trl_self = SimpleNamespace(
        alpha=0.0,
        beta=2.0,
        simpo_gamma=0.5,
        label_smoothing=0.0,
        loss_type="simpo",
        accelerator=SimpleNamespace(device="cpu"),
    )
    model.zero_grad()
    _, logps = _full_logps(model, batch["input_ids"], batch["attention_mask"], labels, average=True)
    losses, _, _ = CPOTrainer.cpo_loss(trl_self, logps[:n], logps[n:])
    losses.mean().backward()  # CPO's simpo sets cpo_alpha 0: no NLL term
    theirs = (losses.mean().item(), _grads(model))
    policy = PreferenceLM(model, FP32, PreferenceSettings(objective="simpo", beta=2.0, simpo_gamma=0.5), "none")
    model.zero_grad()
    loss_sum, pairs = policy(batch["input_ids"], labels, batch["attention_mask"])
    (loss_sum / pairs).backward()
    assert abs((loss_sum / pairs).item() - theirs[0]) < TOL
    _assert_same_grads(_grads(model), theirs[1])


def test_orpo_equals_trl(dpo_trainer):
    """TRL averages the SFT term's tokens over its batch; memtrain over each pair's chosen sequence. So TRL runs one
    pair at a time and its losses are averaged: the same objective, independent of the micro-batch's cut."""
    batch, labels = _pairs_batch(dpo_trainer)
    model, n, lam = dpo_trainer.model, len(PROMPTS), 0.25
    trl_self = SimpleNamespace(beta=lam, accelerator=SimpleNamespace(device="cpu"))
    model.zero_grad()
    total = 0.0
    for i in range(n):
        rows = [i, n + i]
        ids, mask, lab = batch["input_ids"][rows], batch["attention_mask"][rows], labels[rows]
        logits, logps = _full_logps(model, ids, mask, lab, average=True)
        nll_labels = ids.masked_fill(mask == 0, IGNORE_INDEX)  # TRL: the chosen prompt and completion
        nll = nn.CrossEntropyLoss()(logits[:1, :-1].reshape(-1, logits.shape[-1]), nll_labels[:1, 1:].reshape(-1))
        losses, *_ = ORPOTrainer.odds_ratio_loss(trl_self, logps[:1], logps[1:])
        loss = (nll - losses.mean()) / n  # ORPOTrainer.get_batch_loss_metrics, one pair
        loss.backward()
        total += loss.item()
    theirs = _grads(model)
    policy = PreferenceLM(model, FP32, PreferenceSettings(objective="orpo", orpo_lambda=lam), "none")
    model.zero_grad()
    loss_sum, pairs = policy(batch["input_ids"], labels, batch["attention_mask"])
    (loss_sum / pairs).backward()
    assert abs((loss_sum / pairs).item() - total) < TOL
    _assert_same_grads(_grads(model), theirs)


def test_dpo_label_smoothing_equals_trl(dpo_trainer):
    """Conservative DPO: TRL's CPO sigmoid loss is -(1-ε) log σ(β x) - ε log σ(-β x) of x = its two inputs' difference;
    given the two sides' log ratios it is DPO's sigmoid loss with label smoothing (DPOTrainer has it only for its
    'robust' variant)."""
    batch, labels = _pairs_batch(dpo_trainer)
    model, n, beta, eps = dpo_trainer.model, len(PROMPTS), 0.3, 0.2
    settings = PreferenceSettings(objective="dpo", beta=beta, label_smoothing=eps)
    reference = PreferenceLM(dpo_trainer.ref_model, FP32, settings, "precomputed")
    ref = reference.reference_logps(batch["input_ids"], labels, batch["attention_mask"])
    trl_self = SimpleNamespace(
        alpha=0.0, beta=beta, label_smoothing=eps, loss_type="sigmoid", accelerator=SimpleNamespace(device="cpu")
    )
    model.zero_grad()
    _, logps = _full_logps(model, batch["input_ids"], batch["attention_mask"], labels, average=False)
    losses, _, _ = CPOTrainer.cpo_loss(trl_self, logps[:n] - ref[:n], logps[n:] - ref[n:])
    losses.mean().backward()
    theirs = (losses.mean().item(), _grads(model))
    policy = PreferenceLM(model, FP32, settings, "precomputed")
    model.zero_grad()
    loss_sum, pairs = policy(batch["input_ids"], labels, batch["attention_mask"], ref_logps=ref)
    (loss_sum / pairs).backward()
    assert abs((loss_sum / pairs).item() - theirs[0]) < TOL
    _assert_same_grads(_grads(model), theirs[1])


def _pad_rows(a: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(a, (0, width - a.shape[1]), value=value)


def test_kto_equals_trl(tokenizer, tmp_path):
    labels_ = [True, False, True, False]
    data = Dataset.from_dict(
        {
            "prompt": PROMPTS,
            "completion": [c if d else r for c, r, d in zip(CHOSEN, REJECTED, labels_)],
            "label": labels_,
        }
    )
    args = KTOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        per_device_train_batch_size=4,
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast, which it applies to the reference model it prepares
        beta=0.2,
        desirable_weight=1.0,
        undesirable_weight=1.5,
    )
    trainer = KTOTrainer(
        model=_model(0), ref_model=_model(1), args=args, train_dataset=data, processing_class=tokenizer
    )
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    model.zero_grad()
    trl_loss = trainer._compute_loss(model, batch, False)
    trl_loss.backward()
    theirs = _grads(model)
    # memtrain's layout: the records, then their KL rows, right-padded to one width
    width = max(batch["input_ids"].shape[1], batch["KL_input_ids"].shape[1])
    pad = tokenizer.pad_token_id
    input_ids = torch.cat([_pad_rows(batch["input_ids"], width, pad), _pad_rows(batch["KL_input_ids"], width, pad)])
    attention = torch.cat(
        [_pad_rows(batch["attention_mask"], width, 0), _pad_rows(batch["KL_attention_mask"], width, 0)]
    )
    completion = torch.cat(
        [_pad_rows(batch["completion_mask"], width, 0), _pad_rows(batch["KL_completion_mask"], width, 0)]
    )
    labels = _labels(input_ids, completion)
    settings = PreferenceSettings(objective="kto", beta=0.2, kto_desirable_weight=1.0, kto_undesirable_weight=1.5)
    ref = PreferenceLM(trainer.ref_model, FP32, settings, "precomputed").reference_logps(input_ids, labels, attention)
    policy = PreferenceLM(model, FP32, settings, "precomputed")
    model.zero_grad()
    loss_sum, records = policy(input_ids, labels, attention, ref_logps=ref, kto_label=batch["label"])
    (loss_sum / records).backward()
    assert int(records) == 4
    assert abs((loss_sum / records).item() - trl_loss.item()) < TOL
    _assert_same_grads(_grads(model), theirs)
    metrics = preference_metrics(policy.take_metric_sums())
    assert metrics["reward_chosen"] == pytest.approx(trainer._metrics["train"]["rewards/chosen"][-1], abs=TOL)
    assert metrics["reward_rejected"] == pytest.approx(trainer._metrics["train"]["rewards/rejected"][-1], abs=TOL)
    assert "reward_accuracy" not in metrics


def test_dpo_with_sft_term_equals_trl_rpo(tokenizer, tmp_path):
    """preference.sft_weight equals TRL's loss_type [sigmoid, sft] with that weight (RPO). TRL averages the SFT term
    over the micro-batch's chosen tokens, memtrain per pair: one pair per micro-batch, where both are the same."""
    data = Dataset.from_dict({"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED})
    args = DPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        per_device_train_batch_size=1,
        use_cpu=True,
        bf16=False,
        loss_type=["sigmoid", "sft"],
        loss_weights=[1.0, 0.7],
        beta=0.2,
    )
    trainer = DPOTrainer(
        model=_model(0), ref_model=_model(1), args=args, train_dataset=data, processing_class=tokenizer
    )
    settings = PreferenceSettings(objective="dpo", beta=0.2, sft_weight=0.7)
    plain = PreferenceSettings(objective="dpo", beta=0.2)
    reference = PreferenceLM(trainer.ref_model, FP32, settings, "precomputed")
    for batch in list(trainer.get_train_dataloader())[:2]:
        trainer.model.zero_grad()
        trl_loss = trainer._compute_loss(trainer.model, batch, False)
        trl_loss.backward()
        trl_grads = _grads(trainer.model)
        labels = _labels(batch["input_ids"], batch["completion_mask"])
        ref_logps = reference.reference_logps(batch["input_ids"], labels, batch["attention_mask"])
        policy = PreferenceLM(trainer.model, FP32, settings, "precomputed")
        policy.model.zero_grad()
        loss_sum, pairs = policy(batch["input_ids"], labels, batch["attention_mask"], ref_logps=ref_logps)
        loss_sum.backward()
        assert int(pairs) == 1
        assert abs(loss_sum.item() - trl_loss.item()) < TOL
        _assert_same_grads(_grads(policy.model), trl_grads)
        without, _ = PreferenceLM(trainer.model, FP32, plain, "precomputed")(
            batch["input_ids"], labels, batch["attention_mask"], ref_logps=ref_logps
        )
        assert loss_sum.item() - without.item() > 0.1  # the SFT term is there: 0.7 x an untrained model's NLL
