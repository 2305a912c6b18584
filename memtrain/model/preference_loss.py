"""Preference losses as pure functions of per-sequence log-probabilities (DPO sigmoid and IPO, SimPO, ORPO, KTO).

Each returns per-pair (KTO: per-record) losses and the implicit rewards TRL logs, so the caller sums them over the
pairs of a micro-batch and the step divides by the global batch's pairs. The formulas are TRL's (trl 1.16:
DPOTrainer._compute_loss, CPOTrainer.cpo_loss for SimPO, ORPOTrainer.odds_ratio_loss, KTOTrainer._compute_loss);
tests/model/test_preference_loss.py checks losses and gradients against TRL's own code on the same tensors.

Sums and means: DPO, IPO and KTO read the summed log-probability of the completion tokens (IPO divides the log
ratios by the completion's token count, as TRL does, so its beta does not depend on the answer's length); SimPO and
ORPO read the mean log-probability per completion token. ORPO's SFT term is the chosen sequence's mean NLL over
its prompt and completion, as TRL computes it, per pair (TRL averages the tokens of the whole micro-batch, which
would make the objective depend on how the global batch is cut into micro-batches). DPO's optional SFT term
(preference.sft_weight, RPO) is the chosen completion's mean NLL, per pair for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memtrain.recipe.schema import Recipe


@dataclass(frozen=True)
class PreferenceSettings:
    """The preference objective and its constants (the recipe's train.objective and preference section)."""

    objective: str = "dpo"  # dpo | orpo | simpo | kto
    beta: float = 0.1  # DPO/IPO/KTO temperature, SimPO's beta
    loss_type: str = "sigmoid"  # dpo: sigmoid | ipo
    label_smoothing: float = 0.0  # dpo sigmoid: the probability that a pair's label is flipped (conservative DPO)
    sft_weight: float = 0.0  # dpo: the weight of the chosen answer's mean NLL in each pair's loss (RPO)
    simpo_gamma: float = 0.5  # SimPO's target reward margin
    orpo_lambda: float = 0.1  # ORPO's weight of the odds-ratio term
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0

    @classmethod
    def of(cls, recipe: Recipe) -> PreferenceSettings:
        """The recipe's train.objective with its preference section (its defaults where the section is absent)."""
        p, objective = recipe.preference_settings, recipe.train.objective
        return cls(
            objective=objective,
            beta=p.beta_for(objective),
            loss_type=p.loss_type,
            label_smoothing=p.label_smoothing,
            sft_weight=p.sft_weight,
            simpo_gamma=p.simpo_gamma,
            orpo_lambda=p.orpo_lambda,
            kto_desirable_weight=p.kto_desirable_weight,
            kto_undesirable_weight=p.kto_undesirable_weight,
        )


@dataclass
class PairLosses:
    """Per-pair losses (fp32, with gradient) and the detached implicit rewards of each side."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_sigmoid(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, *, beta: float, label_smoothing: float = 0.0
) -> PairLosses:
    """-log σ(β Δ), with label smoothing ε: -(1-ε) log σ(β Δ) - ε log σ(-β Δ) (conservative DPO).

    chosen_logratios / rejected_logratios: summed log p_policy - log p_reference of each side's completion.
    """
    delta = chosen_logratios - rejected_logratios
    losses = -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    return PairLosses(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


def ipo(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float,
) -> PairLosses:
    """(Δ̄ - 1/(2β))², Δ̄ the difference of the per-token mean log ratios (IPO's eq. 17, length-normalised)."""
    delta = chosen_logratios / chosen_tokens.clamp(min=1.0) - rejected_logratios / rejected_tokens.clamp(min=1.0)
    losses = (delta - 1 / (2 * beta)) ** 2
    return PairLosses(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


def simpo(
    chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, *, beta: float, gamma: float
) -> PairLosses:
    """-log σ(β (p̄_chosen - p̄_rejected) - γ) on the mean log-probabilities per completion token; no reference."""
    losses = -F.logsigmoid(beta * (chosen_mean_logps - rejected_mean_logps) - gamma)
    return PairLosses(losses, beta * chosen_mean_logps.detach(), beta * rejected_mean_logps.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, by the branch that stays accurate on each side of -ln 2 (Mächler's note)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo(
    chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, chosen_nll: torch.Tensor, *, lam: float
) -> PairLosses:
    """NLL(chosen) - λ log σ(log odds(chosen) - log odds(rejected)), odds p / (1 - p) of the mean log-probs."""
    chosen = chosen_mean_logps.float()
    rejected = rejected_mean_logps.float()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    losses = chosen_nll - lam * F.logsigmoid(log_odds)
    return PairLosses(losses, lam * chosen.detach(), lam * rejected.detach())


def kto(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> torch.Tensor:
    """Per-record KTO losses: w_d (1 - σ(β (r - z))) for a desirable record, w_u (1 - σ(β (z - r))) otherwise.

    r: the record's log ratio (logps - ref_logps); z: the reference point, the batch's KL estimate, detached and
    clamped at 0 (kl_reference_point). desirable: bool per record.
    """
    logratios = logps - ref_logps
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return torch.where(desirable, chosen, rejected)


def kl_reference_point(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's z: the mean log ratio of the mismatched (prompt, completion) rows, detached, at least 0."""
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
