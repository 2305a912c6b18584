"""Held-out prompts for a generation-based evaluation: a conversation up to its last assistant turn, and that
turn's content as the expected answer.

The prompt is the token ids training saw before the answer: the conversation is encoded by the same
`ConversationEncoder` (template, tokenizer, special-token rules) with only the last assistant turn as the
target, and the prompt is everything before the first target token. For ChatML that ends with
"<|im_start|>assistant\\n", the template's generation prompt, so no second rendering path exists to drift
from training's.

Where the conversations come from: the records behind the validation rows' samples, as training split them
(`mixture.held_out_records`): the recipe's `data.validation` datasets, or, without them, the last
`data.validation_fraction` of each training dataset's usable samples. Counting that tail in records instead
would move it whenever training dropped a sample (too long, no target) and score trained-on questions as
held out. Text datasets have no answers and are skipped; `has_answers` says whether a recipe has any dataset
that does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from memtrain.data.read.conversation import Message, to_conversation
from memtrain.data.read.preference import to_kto, to_pair
from memtrain.data.read.records import read_records
from memtrain.data.render.chat import ConversationEncoder, RenderError
from memtrain.data.render.templates import resolve_template
from memtrain.data.rows.mixture import HeldOutRecords, held_out_records, sample_rules
from memtrain.data.rows.pairs import held_out_pair_records
from memtrain.recipe.schema import Data, DatasetSpec


@dataclass(frozen=True)
class HeldOutPrompt:
    """One question to generate an answer for."""

    prompt_ids: list[int]  # the conversation up to the answer, as training tokenised it
    expected: str  # the last assistant message's content
    question: str  # the message before it (for people reading samples)
    file: str  # the dataset's path, and the record's line (or row) in it
    line: int
    task: str | None = None  # the record's "task" field when it has one (the bundled chat data does)
    # whether training also holds this prompt, and this prompt with this answer (overlap.py); None: not known
    prompt_in_train: bool | None = None
    answer_in_train: bool | None = None


def has_answers(data: Data) -> bool:
    """True when the recipe's held-out data has conversations with an answer to check (not text only)."""
    return bool(_held_out_specs(data))


def held_out_prompts(
    data: Data, tokenizer: PreTrainedTokenizerBase, limit: int | None = None, max_prompt_tokens: int | None = None
) -> tuple[list[HeldOutPrompt], int]:
    """(prompts, skipped): the first `limit` held-out conversations (all with None) as prompts, in dataset
    order and record order within a dataset.

    A conversation is skipped (and counted) when its prompt alone has `max_prompt_tokens` tokens or more
    (default data.seq_len: training never saw the answer's tokens after it), the template cannot render it,
    or training left its sample out (too long, no target: it is in no validation row either).
    `tokenizer` is the one the run's rows were built with. Raises DataError as training's readers do for a
    record that is not a valid conversation.
    """
    if not has_answers(data):
        return [], 0
    if data.holds_pairs:  # a pair's prompt with its chosen answer (a KTO record's with its desirable one)
        held_out = held_out_pair_records(data, tokenizer)
        template = sample_rules(data, tokenizer).template
        if template is None:  # text pairs: no conversation to prompt
            return [], 0
    else:
        held_out = held_out_records(data, tokenizer)
        template = resolve_template(data.template, tokenizer)
    encoder = ConversationEncoder(tokenizer, template, train_on_inputs=False, train_on="last_turn")
    max_prompt_tokens = data.seq_len if max_prompt_tokens is None else max_prompt_tokens
    prompts: list[HeldOutPrompt] = []
    skipped = 0
    for dataset in held_out:
        spec = dataset.spec
        seen = _seen_in_training(dataset)
        for line, record, messages, position in _conversations(dataset):
            if limit is not None and len(prompts) >= limit:
                return prompts, skipped
            prompt = prompt_of(encoder, messages) if messages is not None else None
            if prompt is None or len(prompt[0]) >= max_prompt_tokens:
                skipped += 1
                continue
            task = record.get("task")
            prompt_in_train, answer_in_train = seen.get(position, (None, None))
            prompts.append(
                HeldOutPrompt(
                    prompt[0],
                    prompt[1],
                    prompt[2],
                    spec.path,
                    line,
                    task if isinstance(task, str) else None,
                    prompt_in_train,
                    answer_in_train,
                )
            )
    return prompts, skipped


def _seen_in_training(held_out: HeldOutRecords) -> dict[int, tuple[bool, bool]]:
    """{record position: (its prompt in training, its prompt and answer in training)}; empty where not known."""
    if held_out.prompt_in_train is None or held_out.pair_in_train is None:
        return {}
    return {
        int(position): (bool(prompt), bool(pair))
        for position, prompt, pair in zip(held_out.samples, held_out.prompt_in_train, held_out.pair_in_train)
    }


def prompt_of(encoder: ConversationEncoder, messages: list[Message]) -> tuple[list[int], str, str] | None:
    """(prompt ids, expected answer, question) of a conversation: everything before its last assistant message,
    that message's content (messages after it are dropped), and the content of the message before it.
    None when the template cannot render it."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return None
    try:
        ids, targets = encoder.encode(messages[: last + 1])
    except RenderError:
        return None
    first_target = next((i for i, t in enumerate(targets) if t), None)
    if first_target is None:
        return None
    question = messages[last - 1]["content"] if last > 0 else ""
    return ids[:first_target], messages[last]["content"], question


def _held_out_specs(data: Data) -> list[DatasetSpec]:
    """The datasets with answers that validation draws from (read from the recipe alone, no tokenizer)."""
    if data.is_text:
        return []
    return [s for s in (data.validation if data.validation is not None else data.train) if s.type != "text"]


def _conversations(held_out: HeldOutRecords) -> Iterator[tuple[int, dict, list[Message] | None, int]]:
    """(line, record, conversation, position in read order) for each held-out record of a dataset, in file order;
    conversation None for a record training left out (no validation sample: counted as skipped, not asked)."""
    spec = held_out.spec
    in_validation = set(held_out.samples.tolist())
    deduplicated = set(held_out.deduplicated.tolist())
    for position, (line, record) in enumerate(read_records(spec.path, spec.split, subset=spec.subset)):
        if position < held_out.first or position in deduplicated:
            continue  # the training side's records (and what training dropped among them), or in training already
        yield line, record, (_conversation(record, spec, line) if position in in_validation else None), position


def _conversation(record: dict, spec: DatasetSpec, line: int) -> list[Message] | None:
    """The conversation a held-out record asks and answers: a preference pair's prompt with its chosen answer, a KTO
    record's prompt with its answer when that is desirable; None for text pairs and undesirable answers (skipped)."""
    if spec.type == "preference":
        pair = to_pair(record, spec, spec.path, line)
        return pair.prompt + pair.chosen if pair.conversational else None
    if spec.type == "kto":
        kto = to_kto(record, spec, spec.path, line)
        return kto.prompt + kto.completion if kto.conversational and kto.desirable else None
    return to_conversation(record, spec, spec.path, line)
