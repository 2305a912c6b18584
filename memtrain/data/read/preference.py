"""Preference and KTO records as a prompt and its answers, in one of two forms: text or chat messages.

preference (TRL's preference format), read with the dataset's prompt_field, chosen_field and rejected_field:
  explicit:      prompt, chosen and rejected. Each is a string or a list of chat messages; when any of them is
                 messages the record is a conversation: a string prompt becomes one user message, a string answer
                 one assistant message, and the answers are the assistant's messages that follow the prompt.
  implicit:      no prompt field (or answers that are whole conversations, which start with a user or system
                 message): chosen and rejected share their beginning, and that is the prompt. Messages: their common
                 messages up to the last assistant turn where they part (Anthropic HH as messages). Strings: their
                 common text up to the end of the last "Assistant:" (at a line start) before they part (Anthropic HH
                 as "\\n\\nHuman: ... \\n\\nAssistant: ..."). Two sides that share no such prompt are an error.
kto (TRL's unpaired format), read with prompt_field, completion_field and label_field: a prompt, one answer (string
  or messages, as above) and a label that is a JSON boolean (true: desirable).

A record that is not one of these raises `DataError` naming file, line and field, as conversation.py does.
Nothing here knows about tokens: render/pairs.py writes the records out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from memtrain.data.read.conversation import Message, field_text, missing_field, read_messages
from memtrain.data.read.corpus import json_kind
from memtrain.errors import DataError, Problem
from memtrain.recipe.schema import DatasetSpec

# Where an assistant's turn starts in a plain-text conversation: "Assistant:" at a line start (Anthropic HH), in any
# case. The implicit prompt of two strings ends after the last one before the two part.
ASSISTANT_MARK = re.compile(r"(?im)^[ \t]*assistant[ \t]*:")

Side = str | list[Message]  # a prompt or an answer: text, or chat messages


@dataclass(frozen=True)
class PreferencePair:
    """One preference record: a prompt and two answers, all text or all messages (`conversational`)."""

    prompt: Side
    chosen: Side
    rejected: Side

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)

    @property
    def identical(self) -> bool:
        """The two answers are the same: nothing to prefer (kept out of training, counted)."""
        return self.chosen == self.rejected


@dataclass(frozen=True)
class KtoRecord:
    """One KTO record: a prompt, an answer (text, or messages when `conversational`) and whether it is desirable."""

    prompt: Side
    completion: Side
    desirable: bool

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def to_pair(record: dict, spec: DatasetSpec, file: str, line: int) -> PreferencePair:
    """The preference pair a record stands for (module doc); DataError naming file, line and field otherwise."""
    fields = {"chosen_field": spec.chosen_field, "rejected_field": spec.rejected_field}
    for setting, name in fields.items():
        if name not in record:
            raise missing_field(record, name, setting, file, line)
    chosen = _side(record[spec.chosen_field], spec.chosen_field, spec, file, line)
    rejected = _side(record[spec.rejected_field], spec.rejected_field, spec, file, line)
    if isinstance(chosen, list) != isinstance(rejected, list):
        chosen, rejected = (_as_messages(s, "assistant") for s in (chosen, rejected))
    whole = isinstance(chosen, list) and (chosen[0]["role"] != "assistant" or rejected[0]["role"] != "assistant")
    if spec.prompt_field not in record or record[spec.prompt_field] is None or whole:
        return _implicit(chosen, rejected, spec, file, line)
    prompt = _side(record[spec.prompt_field], spec.prompt_field, spec, file, line)
    if isinstance(prompt, list) or isinstance(chosen, list):
        prompt = _prompt_messages(_as_messages(prompt, "user"), spec.prompt_field, file, line)
        chosen, rejected = (_as_messages(s, "assistant") for s in (chosen, rejected))
    return PreferencePair(prompt, chosen, rejected)


def to_kto(record: dict, spec: DatasetSpec, file: str, line: int) -> KtoRecord:
    """The KTO record a record stands for (module doc); DataError naming file, line and field otherwise."""
    for setting, name in (
        ("prompt_field", spec.prompt_field),
        ("completion_field", spec.completion_field),
        ("label_field", spec.label_field),
    ):
        if name not in record:
            raise missing_field(record, name, setting, file, line)
    label = record[spec.label_field]
    if not isinstance(label, bool):
        raise DataError(
            Problem(
                f"is {json_kind(label)}{'' if label is None else f' ({json.dumps(label)[:40]})'}, not true or false",
                file=file,
                line=line,
                key=spec.label_field,
                hint="write the label as a JSON boolean: true for a desirable completion, false for an undesirable one",
            )
        )
    prompt = _side(record[spec.prompt_field], spec.prompt_field, spec, file, line)
    completion = _side(record[spec.completion_field], spec.completion_field, spec, file, line)
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt = _prompt_messages(_as_messages(prompt, "user"), spec.prompt_field, file, line)
        completion = _as_messages(completion, "assistant")
        _answer_messages(completion, spec.completion_field, file, line)
    return KtoRecord(prompt, completion, label)


# ---------------------------------------------------------------- the forms


def _side(value: object, field: str, spec: DatasetSpec, file: str, line: int) -> Side:
    """A field's text (non-empty) or its chat messages, with an answer's messages checked to be the assistant's when
    they do not start a whole conversation."""
    if isinstance(value, list):
        return read_messages(value, field, spec.roles, file, line)
    return field_text({field: value}, field, field, file, line)


def _as_messages(side: Side, role: str) -> list[Message]:
    return side if isinstance(side, list) else [{"role": role, "content": side}]


def _prompt_messages(messages: list[Message], field: str, file: str, line: int) -> list[Message]:
    """A prompt's messages must end with a turn that an assistant's answer follows."""
    if messages[-1]["role"] == "assistant":
        raise DataError(
            Problem(
                "the prompt ends with an assistant message, so no answer follows it",
                file=file,
                line=line,
                key=field,
                hint="end the prompt with the user's message; the answers go in their own fields",
            )
        )
    return messages


def _answer_messages(messages: list[Message], field: str, file: str, line: int) -> None:
    if messages[0]["role"] != "assistant":
        raise DataError(
            Problem(
                f"the answer starts with a {messages[0]['role']} message, not the assistant's",
                file=file,
                line=line,
                key=field,
                hint="give the answer as the assistant's message(s), the prompt in its own field",
            )
        )


def _implicit(chosen: Side, rejected: Side, spec: DatasetSpec, file: str, line: int) -> PreferencePair:
    """The prompt chosen and rejected share (module doc); DataError at the chosen field when they share none."""
    if isinstance(chosen, list):
        assert isinstance(rejected, list)
        common = 0
        while common < min(len(chosen), len(rejected)) and chosen[common] == rejected[common]:
            common += 1
        # the prompt ends before an assistant turn of both: the last such point within what they share
        cut = next(
            (
                at
                for at in range(min(common, len(chosen) - 1, len(rejected) - 1), 0, -1)
                if chosen[at]["role"] == "assistant" and rejected[at]["role"] == "assistant"
            ),
            None,
        )
        if cut is None:
            raise _no_prompt(spec, file, line, "messages up to an assistant turn where the two part")
        return PreferencePair(chosen[:cut], chosen[cut:], rejected[cut:])
    common = 0
    limit = min(len(chosen), len(rejected))
    while common < limit and chosen[common] == rejected[common]:
        common += 1
    marks = list(ASSISTANT_MARK.finditer(chosen[:common]))
    if not marks:
        raise _no_prompt(spec, file, line, "text up to an 'Assistant:' turn (at a line start) before the two part")
    cut = marks[-1].end()
    return PreferencePair(chosen[:cut], chosen[cut:], rejected[cut:])


def _no_prompt(spec: DatasetSpec, file: str, line: int, what: str) -> DataError:
    return DataError(
        Problem(
            f"the record has no {spec.prompt_field!r} field, and {spec.chosen_field!r} and {spec.rejected_field!r} "
            f"share no prompt: no common {what}",
            file=file,
            line=line,
            key=spec.chosen_field,
            hint=f"give the prompt in its own field (prompt_field: {spec.prompt_field}), or make both sides whole "
            "conversations that start with the same prompt",
        )
    )
