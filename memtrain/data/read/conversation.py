"""Every record type as one shape: a conversation, a list of {"role": system|user|assistant|tool, "content": str}.

completion:  user = prompt, assistant = completion.
instruction: user = instruction, followed by a blank line and the input when there is one; assistant = output;
             a system message first when the dataset names a system_field and the record holds text there.
             A user message with an input also carries the two apart (PART_KEYS: "instruction", "input"), for a
             template that writes them in blocks of their own (alpaca's "### Input:"); others write its content.
chat:        the record's messages (OpenAI role/content) or conversations (sharegpt from/value), roles mapped;
             a system_field's text first (LLaMA-Factory's sharegpt "system" column) unless the messages start
             with a system message; an empty system message is left out. A message's content may be a list of
             parts (OpenAI's [{"type": "text", "text": ...}]): its text parts are joined (PART_SEPARATOR), any
             other part (an image, audio) is refused naming its index.
             Tool calling (OpenAI's layout, as transformers' chat templates take it): an assistant message's
             `tool_calls` (its content may then be empty), `tool` messages with the calls' results, and the record's
             `tools` (the function schemas), which ride on the first message (TOOLS_KEY) for the template to write.
The chat template then decides how a conversation is written out; nothing here knows about tokens.
A record that cannot become a valid conversation raises `DataError` naming file, line and field; one whose answer
is missing or empty (no assistant message, an empty output) raises its subclass `Untrainable`, which
`data.skip_untrainable` turns into a record left out and counted.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from memtrain.data.read.corpus import json_kind
from memtrain.errors import DataError, Problem
from memtrain.recipe.schema import DatasetSpec

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
# sharegpt writes human / gpt (LLaMA-Factory's observation for a tool's result); OpenAI-style files write user /
# assistant / tool. DatasetSpec.roles adds to these.
DEFAULT_ROLE_NAMES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
    "observation": "tool",
}
# A record's function schemas (OpenAI's "tools"), kept on its conversation's first message: a conversation is a list
# of messages wherever it goes (slices of it included), and the template is handed them as apply_chat_template(tools=).
TOOLS_KEY = "tools"
# A tool message's keys that templates read beside its content
TOOL_MESSAGE_KEYS = ("name", "tool_call_id")
# The keys a message is read with, per chat layout.
LAYOUT_KEYS = {"openai": ("role", "content"), "sharegpt": ("from", "value")}
LAYOUT_FIELDS = {"openai": "messages", "sharegpt": "conversations"}
# Keys beside "content" that hold parts of a message's text, which a template may write instead of the content
# (render.py finds them in the rendered text as it finds content). Only an instruction record's user message has them.
PART_KEYS = ("instruction", "input")
# How to go on past records without an answer, said where one is found.
SKIP_HINT = " (data.skip_untrainable: true leaves such records out, counted and warned about)"


class Untrainable(DataError):
    """A record with nothing to train on: no assistant message, or an answer that is empty (or null)."""


def to_conversation(record: dict, spec: DatasetSpec, file: str, line: int) -> list[Message]:
    """The conversation a record of a completion, instruction or chat dataset stands for.

    Raises `DataError` with one problem (file, line, the record's field as key) when a field is missing, is
    not a non-empty string, a role is unknown, or the conversation has no assistant turn.
    """
    where = _Where(file, line)
    if spec.type == "completion":
        return [
            {"role": "user", "content": where.text(record, spec.prompt_field, "prompt_field")},
            {
                "role": "assistant",
                "content": where.text(record, spec.completion_field, "completion_field", answer=True),
            },
        ]
    if spec.type == "instruction":
        return _instruction(record, spec, where)
    if spec.type == "chat":
        return _chat(record, spec, where)
    raise ValueError(f"records of type {spec.type!r} are documents, not conversations")


def document_text(record: dict, spec: DatasetSpec, file: str, line: int) -> str:
    """The document of a text dataset's record: the string in `spec.field` (may be empty)."""
    return _Where(file, line).text(record, spec.field, "field", allow_empty=True)


class _Where:
    """Where a record came from, to write problems that point at it."""

    def __init__(self, file: str, line: int):
        self.file, self.line = file, line

    def fail(self, message: str, key: str, hint: str, *, untrainable: bool = False) -> DataError:
        problem = Problem(message, file=self.file, line=self.line, key=key, hint=hint)
        return Untrainable(problem) if untrainable else DataError(problem)

    def text(self, record: dict, field: str, setting: str, *, allow_empty: bool = False, answer: bool = False) -> str:
        """The string in `field`, which the dataset's `setting` (output_field, ...) names."""
        if field not in record:
            raise self.missing(record, field, setting)
        return self.content(record[field], field, allow_empty=allow_empty, answer=answer)

    def missing(self, record: dict, field: str, setting: str) -> DataError:
        """The error for a record without `field`, naming the fields it has and the one meant, if close."""
        fields = ", ".join(record) or "none"
        close = difflib.get_close_matches(field, [str(k) for k in record], n=1)
        hint = (
            f"set the dataset's {setting}: {close[0]} if that field holds it"
            if close
            else f"set the dataset's {setting} to the field that holds it"
        )
        return self.fail(f"no field {field!r}; fields here: {fields}", field, hint)

    def optional_text(self, record: dict, field: str) -> str:
        """The string in `field`, or "" where the record has no such field or null there (columnar files)."""
        value = record.get(field)
        return "" if value is None else self.content(value, field, allow_empty=True)

    def content(self, value: object, key: str, *, allow_empty: bool = False, answer: bool = False) -> str:
        """`value` as text; `answer`: the response a record trains on, whose absence (null, empty) is Untrainable."""
        if not isinstance(value, str):
            raise self.fail(
                f"is {json_kind(value)}, not a string",
                key,
                f"the field must hold text{SKIP_HINT if answer and value is None else ''}",
                untrainable=answer and value is None,
            )
        if not allow_empty and not value.strip():
            raise self.fail(
                "is empty", key, f"give it text, or remove the record{SKIP_HINT if answer else ''}", untrainable=answer
            )
        return value


def _instruction(record: dict, spec: DatasetSpec, where: _Where) -> list[Message]:
    instruction = where.text(record, spec.instruction_field, "instruction_field")
    extra = where.optional_text(record, spec.input_field)
    if extra.strip():
        user = {"role": "user", "content": f"{instruction}\n\n{extra}", "instruction": instruction, "input": extra}
    else:
        user = {"role": "user", "content": instruction}
    messages = [
        user,
        {"role": "assistant", "content": where.text(record, spec.output_field, "output_field", answer=True)},
    ]
    return _with_system(messages, record, spec, where)


# Fields that hold a system prompt in the layouts users bring: LLaMA-Factory's sharegpt and alpaca "system" column,
# OpenOrca's "system_prompt". A dataset reads one only when it names it (system_field).
SYSTEM_FIELDS = ("system", "system_prompt")


def unread_system_field(record: dict, spec: DatasetSpec) -> str | None:
    """The field of SYSTEM_FIELDS where an instruction or chat record holds text that its dataset does not read (it
    names no system_field): the model trains without that prompt. None when there is none."""
    if spec.type not in ("instruction", "chat") or spec.system_field is not None:
        return None
    return next((name for name in SYSTEM_FIELDS if isinstance(record.get(name), str) and record[name].strip()), None)


def _with_system(messages: list[Message], record: dict, spec: DatasetSpec, where: _Where) -> list[Message]:
    """`messages` after the system prompt of the record's system_field, when the dataset names one and the record
    holds text there (missing, null or empty: none), and the messages do not start with their own."""
    if spec.system_field is None or (messages and messages[0]["role"] == "system"):
        return messages
    system = where.optional_text(record, spec.system_field)
    return [{"role": "system", "content": system}, *messages] if system.strip() else messages


def _chat(record: dict, spec: DatasetSpec, where: _Where) -> list[Message]:
    field, layout = _chat_field(record, spec, where)
    turns = record[field]
    if not isinstance(turns, list) or not turns:
        shown = "an empty list" if isinstance(turns, list) else json_kind(turns)
        raise where.fail(f"is {shown}, not a list of messages", field, "each record needs a list of messages")
    role_names = {**DEFAULT_ROLE_NAMES, **spec.roles}
    messages = [_message(turn, f"{field}[{i}]", layout, role_names, where) for i, turn in enumerate(turns)]
    messages = _with_system([m for m in messages if m["role"] != "system" or m["content"].strip()], record, spec, where)
    tools = _tools(record, where)
    if tools:
        messages[0] = {**messages[0], TOOLS_KEY: tools}
    if not any(m["role"] == "assistant" for m in messages):
        raise where.fail(
            "the conversation has no assistant turn, so nothing to train on",
            field,
            "add the response, map the responding role to assistant with the dataset's roles:, or remove "
            f"the record{SKIP_HINT}",
            untrainable=True,
        )
    return messages


def _chat_field(record: dict, spec: DatasetSpec, where: _Where) -> tuple[str, str]:
    """(the record's field with the messages, 'openai' | 'sharegpt' | 'auto' for per-message detection)."""
    if spec.chat_format != "auto":
        field = spec.messages_field or LAYOUT_FIELDS[spec.chat_format]
        candidates = [field]
    else:
        candidates = [spec.messages_field] if spec.messages_field else list(LAYOUT_FIELDS.values())
    # Columnar files (parquet, datasets) give every record every column, None where a record has no value.
    present = [field for field in candidates if record.get(field) is not None] or [c for c in candidates if c in record]
    if present:
        return present[0], spec.chat_format
    fields = ", ".join(record) or "none"
    kind = next((kind for kind, wanted in _OTHER_TYPES.items() if all(record.get(f) is not None for f in wanted)), None)
    raise where.fail(
        f"no field {' or '.join(repr(c) for c in candidates)}; fields here: {fields}",
        candidates[0],
        f"these look like {kind} records: set the dataset's type: {kind}"
        if kind
        else "set the dataset's messages_field to the field that holds the list of messages",
    )


# The default fields of the other record types: a chat dataset whose records have them is of that type.
_OTHER_TYPES = {"instruction": ("instruction", "output"), "completion": ("prompt", "completion")}


def _message(turn: object, key: str, layout: str, role_names: dict[str, str], where: _Where) -> Message:
    if not isinstance(turn, dict):
        raise where.fail(
            f"is {json_kind(turn)}, not a message object",
            key,
            'write each message as {"role": ..., "content": ...} or {"from": ..., "value": ...}',
        )
    if layout == "auto":  # by the keys that hold a value (columnar files give a message both, one of them None)
        layout = "sharegpt" if turn.get("from") is not None and turn.get("role") is None else "openai"
    role_key, content_key = LAYOUT_KEYS[layout]
    for needed in (role_key, content_key):
        if needed not in turn and not (needed == content_key and turn.get("tool_calls")):  # a call needs no text
            fields = ", ".join(turn) or "none"
            raise where.fail(
                f"the message has no {needed!r}; its keys: {fields}",
                f"{key}.{needed}",
                f"{layout} messages have {role_key!r} and {content_key!r}; set chat_format if the "
                "file uses the other layout",
            )
    name = turn[role_key]
    role = role_names.get(name) if isinstance(name, str) else None
    if role is None:
        known = ", ".join(sorted(role_names))
        raise where.fail(
            f"unknown role {name!r}; known roles: {known}",
            f"{key}.{role_key}",
            f"map it in the dataset's roles: ({{{name}: assistant}} for a role that answers, "
            f"{{{name}: user}} for one that asks) or fix the record",
        )
    calls = _tool_calls(turn, key, where) if role == "assistant" else []
    if calls and turn.get(content_key) is None:  # a message that only calls tools
        return {"role": role, "content": "", "tool_calls": calls}
    # an empty system message is left out (_chat), a tool may return nothing, an assistant's calls are its answer;
    # every other message needs text
    message: Message = {
        "role": role,
        "content": where.content(
            _joined_parts(turn[content_key], f"{key}.{content_key}", where),
            f"{key}.{content_key}",
            allow_empty=role in ("system", "tool") or bool(calls),
            answer=role == "assistant",
        ),
    }
    if calls:
        message["tool_calls"] = calls
    if role == "tool":
        message.update({k: turn[k] for k in TOOL_MESSAGE_KEYS if isinstance(turn.get(k), str)})
    return message


# How a message's text parts become one text: the separator vLLM's OpenAI-compatible server puts between the text
# parts of a message when it hands a text-only model's chat template a string, so the model is trained on the prompt
# it will be served with.
PART_SEPARATOR = "\n"


def _joined_parts(content: object, key: str, where: _Where) -> object:
    """A message's content given as a list of parts (OpenAI's [{"type": "text", "text": ...}]) as one text, its text
    parts joined by PART_SEPARATOR; any other content as it is. DataError naming the part's index for a part that is
    not text (an image, audio, a file: nothing a text model can train on) or is malformed."""
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        at = f"{key}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = f"a {kind!r} part" if isinstance(kind, str) else f"{json_kind(part)} without a type"
            raise where.fail(
                f"is {shown}; only text parts can be trained on",
                at,
                'give the message text only: a string, or parts written {"type": "text", "text": ...}; '
                "remove the record or its non-text parts",
            )
        if not isinstance(part.get("text"), str):
            raise where.fail(
                f"the text part's text is {json_kind(part.get('text'))}, not a string",
                f"{at}.text",
                'write a text part as {"type": "text", "text": "..."}',
            )
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)  # no parts: empty text, which the content check refuses where text is needed


def _tool_calls(turn: dict, key: str, where: _Where) -> list[dict]:
    """An assistant message's tool calls, each {"type": "function", "function": {"name", "arguments"}} with the
    arguments as a mapping (OpenAI writes them as a JSON string; transformers' templates write a mapping as JSON)."""
    calls = turn.get("tool_calls")
    if calls is None:
        return []
    hint = 'write tool_calls as [{"type": "function", "function": {"name": ..., "arguments": {...}}}]'
    if not isinstance(calls, list):
        raise where.fail(f"is {json_kind(calls)}, not a list of tool calls", f"{key}.tool_calls", hint)
    out = []
    for i, call in enumerate(calls):
        at = f"{key}.tool_calls[{i}]"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise where.fail("the tool call has no function name", at, hint)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise where.fail("the tool call's arguments are not JSON", f"{at}.arguments", hint) from None
        if not isinstance(arguments, dict):
            raise where.fail(f"the tool call's arguments are {json_kind(arguments)}, not an object", at, hint)
        out.append(
            {
                **({"id": call["id"]} if isinstance(call, dict) and isinstance(call.get("id"), str) else {}),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def _tools(record: dict, where: _Where) -> list[dict]:
    """The record's function schemas ("tools": a list, or that list as a JSON string); [] when it has none."""
    tools = record.get(TOOLS_KEY)
    if tools is None or tools == "":
        return []
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise where.fail("is not JSON", TOOLS_KEY, "write tools as a list of function schemas") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise where.fail(f"is {json_kind(tools)}, not a list of function schemas", TOOLS_KEY, "write tools as a list")
    return tools


def read_messages(value: object, key: str, roles: dict[str, str], file: str, line: int) -> list[Message]:
    """A field's list of chat messages (each OpenAI role/content or sharegpt from/value, `roles` mapped on top of the
    defaults), empty system messages left out: a preference or kto record's prompt or answer. DataError naming file,
    line and the field (with the message's index) when it is not such a list."""
    where = _Where(file, line)
    if not isinstance(value, list) or not value:
        shown = "an empty list" if isinstance(value, list) else json_kind(value)
        raise where.fail(f"is {shown}, not a list of messages", key, "give it text, or a list of chat messages")
    role_names = {**DEFAULT_ROLE_NAMES, **roles}
    messages = [_message(turn, f"{key}[{i}]", "auto", role_names, where) for i, turn in enumerate(value)]
    return [m for m in messages if m["role"] != "system" or m["content"].strip()]


def field_text(record: dict, field: str, setting: str, file: str, line: int) -> str:
    """The non-empty string in `field`, which the dataset's `setting` (chosen_field, ...) names; DataError naming file,
    line and field when it is missing or not such a string."""
    return _Where(file, line).text(record, field, setting)


def missing_field(record: dict, field: str, setting: str, file: str, line: int) -> DataError:
    """The error for a record without `field` (which the dataset's `setting` names), with the fields it has."""
    return _Where(file, line).missing(record, field, setting)
