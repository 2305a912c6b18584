"""The module handed to DeepSpeed for a preference objective: (loss sum over pairs, pair count), as TrainableLM's.

A micro-batch of B pairs is one forward of 2B rows (rows 0..B-1 the chosen sequences, B..2B-1 the rejected ones;
for KTO the records and their mismatched KL rows), the layout data/rows/pairs.py collates; or, laid out packed, rows
holding several sequences end to end, with `position_ids` restarting at each and `sequence_ids` numbering them in
that same order (sequence k of 2B), summed per sequence instead of per row. The step divides the
sum by the global batch's pairs, so the guard, the adaptive micro-batch and gradient accumulation work unchanged.

The reference: `adapters_off` runs the same PEFT model with its adapters disabled and no gradient (no second copy in
memory); `precomputed` reads the batch's `ref_logps`, which the run computed in a first pass
(train/state/reference.py); `none` for ORPO and SimPO.

The implicit rewards, their accuracy and the log-probabilities are summed per micro-batch into `metric_sums`
(a (metrics, 2) tensor of sums and counts on the model's device) for the loop to take, all-reduce and log.
"""

from __future__ import annotations

import torch
from torch import nn

from memtrain.labels import IGNORE_INDEX
from memtrain.model.architecture import logit_softcap
from memtrain.model.layers import hf_model
from memtrain.model.preference_loss import (
    PreferenceSettings,
    dpo_sigmoid,
    ipo,
    kl_reference_point,
    kto,
    orpo,
    simpo,
)
from memtrain.model.sequence_logps import segment_logps, sequence_logps, target_mask, token_logps
from memtrain.model.wrapper import check_packed_attention, needs_one_sequence, sample_bounds
from memtrain.recipe.schema import Precision, Recipe

REFERENCES = ("adapters_off", "precomputed", "none")
# The metrics each micro-batch adds to (sum, count); the margin is their difference of means (TRL's names in
# metrics.jsonl without the slash: rewards/chosen -> reward_chosen, ...).
METRIC_SUMS = ("reward_chosen", "reward_rejected", "reward_accuracy", "logp_chosen", "logp_rejected")


def reference_of(recipe: Recipe) -> str:
    """The reference the recipe's run uses (preference.reference with auto resolved): REFERENCES."""
    return recipe.preference_settings.reference_for(recipe.train.objective, recipe.model.lora is not None)


def preference_metrics(sums: torch.Tensor | list) -> dict[str, float]:
    """Means of the summed metrics (rows of (sum, count), METRIC_SUMS order); the margin is chosen - rejected.

    A metric none of the summed sequences had (KTO's accuracy, a side with no record) is left out.
    """
    table = torch.as_tensor(sums, dtype=torch.float64).tolist()
    out = {name: total / count for name, (total, count) in zip(METRIC_SUMS, table, strict=True) if count > 0}
    if "reward_chosen" in out and "reward_rejected" in out:
        out["reward_margin"] = out["reward_chosen"] - out["reward_rejected"]
    return out


class PreferenceLM(nn.Module):
    """A Hugging Face causal LM (or its PEFT wrapper) whose forward returns (fp32 sum of per-pair losses, pairs).

    settings: the objective and its constants; reference: adapters_off | precomputed | none (REFERENCES).
    """

    def __init__(self, model: nn.Module, precision: Precision, settings: PreferenceSettings, reference: str):
        super().__init__()
        if reference not in REFERENCES:
            raise ValueError(f"reference {reference!r} is not one of {REFERENCES}")
        self.model = model
        self.settings = settings
        self.reference = reference
        self.fp32_loss = precision.fp32_loss
        self.chunk_tokens = precision.loss_chunk_tokens if precision.chunked_loss else None
        self.logit_softcap = logit_softcap(hf_model(model).config)
        self.metric_sums: torch.Tensor | None = None

    # --- log-probabilities -------------------------------------------------------------------------------------
    def token_logps(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        targets: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ):
        """fp32 (rows, seq - 1) log-probabilities of `targets` (label t = token at t; -100 ignored), chunked.
        position_ids: rows of sequences laid end to end (each restarting at 0), kept apart by the attention kernel."""
        base = hf_model(self.model)
        bounds = {}
        if position_ids is not None:
            attn = base.config._attn_implementation
            check_packed_attention(attn)
            bounds = sample_bounds(attn, position_ids)
        hidden = base.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **bounds
        ).last_hidden_state
        return token_logps(
            base.get_output_embeddings(),
            hidden,
            targets,
            fp32_loss=self.fp32_loss,
            chunk_tokens=self.chunk_tokens,
            softcap=self.logit_softcap,
        )

    def sequence_logps(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        sequence_ids: torch.Tensor | None = None,
    ):
        """fp32 summed log-probabilities of each sequence's targets: (rows,), or (sequences,) for packed rows."""
        per_token = self.token_logps(input_ids, attention_mask, labels, position_ids)
        return _sums(per_token, target_mask(labels), sequence_ids, _sequence_count(sequence_ids))[0]

    @torch.no_grad()
    def reference_logps(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        sequence_ids: torch.Tensor | None = None,
        **_,
    ) -> torch.Tensor:
        """The reference's summed log-probabilities per sequence: the adapters disabled under adapters_off, else the
        model as it is (the precomputing pass runs it on the initial weights)."""
        args = (input_ids, labels, attention_mask, position_ids, sequence_ids)
        if self.reference == "adapters_off":
            with self.model.disable_adapter():
                return self.sequence_logps(*args)
        return self.sequence_logps(*args)

    def _reference(self, batch: dict, ref_logps: torch.Tensor | None) -> torch.Tensor:
        if ref_logps is not None:
            return ref_logps.float()
        if self.reference != "adapters_off":
            raise RuntimeError(f"a {self.settings.objective} batch without ref_logps under reference {self.reference}")
        return self.reference_logps(**batch)

    # --- forward -----------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
        kto_label: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        sequence_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
        if self.settings.objective == "kto":
            if sequence_ids is not None:
                raise ValueError("KTO records and their KL rows are not laid out packed")
            return self._kto(batch, ref_logps, kto_label)
        if sequence_ids is not None:
            attn = hf_model(self.model).config._attn_implementation
            if needs_one_sequence(attn, input_ids.shape[0]):  # flash attention reads restarts in a batch of one
                input_ids, labels, position_ids, sequence_ids = (
                    t.reshape(1, -1) for t in (input_ids, labels, position_ids, sequence_ids)
                )
            batch.update(input_ids=input_ids, labels=labels, position_ids=position_ids, sequence_ids=sequence_ids)
        return self._pairs(batch, ref_logps)

    def _pairs(self, batch: dict, ref_logps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.settings
        input_ids, labels, attention_mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
        position_ids, sequence_ids = batch.get("position_ids"), batch.get("sequence_ids")
        # sequences: 2n, the chosen ones first (packed rows number them: one device sync, read once here)
        n = input_ids.shape[0] // 2 if sequence_ids is None else _sequence_count(sequence_ids) // 2
        # The reference's no-grad forward first, while none of this micro-batch's activations are held for backward
        ref = self._reference(batch, ref_logps) if s.objective == "dpo" else None
        targets = labels
        if s.objective == "orpo":  # its SFT term reads the chosen prompt too: every real token is a target
            if sequence_ids is not None:  # but not a sequence's first, which follows another sequence in its row
                real = (sequence_ids >= 0) & (position_ids != 0)
            elif attention_mask is not None:
                real = attention_mask.bool()
            else:
                real = torch.ones_like(input_ids, dtype=torch.bool)
            targets = input_ids.masked_fill(~real, IGNORE_INDEX)
        per_token = self.token_logps(input_ids, attention_mask, targets, position_ids)
        sums, counts = _sums(per_token, target_mask(labels), sequence_ids, 2 * n)
        if ref is not None:
            logratios = sums - ref
            if s.loss_type == "ipo":
                out = ipo(logratios[:n], logratios[n:], counts[:n], counts[n:], beta=s.beta)
            else:
                out = dpo_sigmoid(logratios[:n], logratios[n:], beta=s.beta, label_smoothing=s.label_smoothing)
            if s.sft_weight:  # RPO: the chosen answer's mean NLL per pair (per pair, as ORPO's SFT term below)
                out.losses = out.losses - s.sft_weight * sums[:n] / counts[:n].clamp(min=1.0)
        else:
            means = sums / counts.clamp(min=1.0)
            if s.objective == "simpo":
                out = simpo(means[:n], means[n:], beta=s.beta, gamma=s.simpo_gamma)
            elif s.objective == "orpo":
                nll_sums, nll_counts = (t[:n] for t in _sums(per_token, target_mask(targets), sequence_ids, 2 * n))
                out = orpo(means[:n], means[n:], -nll_sums / nll_counts.clamp(min=1.0), lam=s.orpo_lambda)
            else:
                raise ValueError(f"unknown preference objective {s.objective!r}")
        ones = torch.ones_like(out.chosen_rewards)
        accurate = (out.chosen_rewards > out.rejected_rewards).float()
        self._add_metrics(
            [
                (out.chosen_rewards, ones),
                (out.rejected_rewards, ones),
                (accurate, ones),
                (sums[:n].detach(), ones),
                (sums[n:].detach(), ones),
            ]
        )
        return out.losses.sum().float(), torch.tensor(n, device=input_ids.device)

    def _kto(
        self, batch: dict, ref_logps: torch.Tensor | None, kto_label: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.settings
        input_ids, labels, attention_mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
        n = input_ids.shape[0] // 2
        mask = attention_mask[:n] if attention_mask is not None else None
        # the no-grad forwards first, while none of this micro-batch's activations are held for backward: the KL
        # rows only set the reference point, which is detached (as TRL computes them), and the reference
        ref = self._reference(batch, ref_logps)
        with torch.no_grad():
            kl_mask = attention_mask[n:] if attention_mask is not None else None
            kl_logps = self.sequence_logps(input_ids[n:], labels[n:], kl_mask)
        logps = self.sequence_logps(input_ids[:n], labels[:n], mask)
        desirable = kto_label.to(device=input_ids.device, dtype=torch.bool)
        z = kl_reference_point(kl_logps, ref[n:])
        losses = kto(
            logps,
            ref[:n],
            desirable,
            z,
            beta=s.beta,
            desirable_weight=s.kto_desirable_weight,
            undesirable_weight=s.kto_undesirable_weight,
        )
        rewards = s.beta * (logps.detach() - ref[:n])
        d = desirable.float()
        u = 1.0 - d
        self._add_metrics(
            [(rewards * d, d), (rewards * u, u), (rewards * 0, d * 0), (logps.detach() * d, d), (logps.detach() * u, u)]
        )
        return losses.sum().float(), torch.tensor(n, device=input_ids.device)

    # --- metrics -----------------------------------------------------------------------------------------------
    def _add_metrics(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        rows = torch.stack([torch.stack([v.float().sum(), c.float().sum()]) for v, c in parts]).detach()
        self.metric_sums = rows if self.metric_sums is None else self.metric_sums + rows

    def take_metric_sums(self) -> torch.Tensor | None:
        """The (metrics, 2) sums and counts since the last take (None when no batch ran), and a fresh start."""
        sums, self.metric_sums = self.metric_sums, None
        return sums


def _sequence_count(sequence_ids: torch.Tensor | None) -> int | None:
    """How many sequences packed rows number (a device sync); None for rows of one sequence each."""
    return None if sequence_ids is None else int(sequence_ids.max()) + 1


def _sums(
    per_token: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor | None, count: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probs, target counts) per sequence: per row, or per numbered sequence of packed rows (`count` of
    them)."""
    if sequence_ids is None:
        return sequence_logps(per_token, mask)
    return segment_logps(per_token, mask, sequence_ids, count)
