"""A conversation through a chat template into token ids and a target mask (which tokens the loss sees).

The template is rendered once with every message's content replaced by a sentinel. Splitting the text at
the sentinels separates what the template wrote (markers, role headers, BOS/EOS) from what the data
said, as character spans of the rendered text. A second render with the real content must equal the pieces
joined back together: a template that rewrites content in another way than trimming it is refused rather than
trained on text it never writes.

The rendered text is tokenised whole, as `apply_chat_template(tokenize=True)` and every inference server do,
and each token is assigned to the template or to a message by its character offsets: the ids a model trains
on are the ids it is prompted with. (Tokenising the pieces apart put token boundaries where inference never
has them: Mistral's "[/INST] answer" became "▁" + "answer" instead of "▁answer".) A token that spans the
template's text and a message's (that "▁answer") belongs to the message. Two cases are tokenised piece by
piece instead, template pieces with special tokens parsed and content with split_special_tokens=True: content
that spells a special token (it stays ordinary text and cannot open or close a turn), and a tokenizer
without offsets (a slow, Python-only one).

Targets (train_on_inputs false): the content of each trained assistant turn, and the template text that
closes it up to and including the end-of-turn token (so the model learns to stop), never the next turn's
header. Which turns are trained: all assistant turns, or the last one only (`train_on`).

Tool calls: the template writes an assistant's `tool_calls` from structured data (JSON it serialises itself), where
no sentinel can go. Their text is found by rendering the conversation through that message with and without its
calls: what differs is the calls' text, a content piece of that message (from where the generation prompt ends, when
the message has no text of its own), so the calls are targets as an answer is. Tool messages are inputs, as users'
are. The record's `tools` go to the template as apply_chat_template(tools=...).

The end-of-turn token is the template's own (a shipped template names it), else the first special token the
template writes after an assistant's content. `ConversationEncoder.turn_end_id` finds that same token in a
probe conversation, so generation (in-run eval, `memtrain eval`, an export's generation_config.json) stops
exactly where training taught the model to stop; `unclosed_turn_warning` says when there is no such token.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from memtrain.data.read.conversation import PART_KEYS, TOOLS_KEY, Message
from memtrain.data.render.templates import (
    TOKENIZER_TEMPLATE,
    ChatTemplate,
    conversation_template,
    end_of_turn_id,
)
from memtrain.recipe.schema import Data

# Private-use code points: no template writes them and tokenizers never see them (they are replaced before).
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_SPLIT = re.compile("\ue000(\\d+)\ue001")
# The conversation every template can render (Gemma's refuses a system message, Mistral's wants user first):
# what the template writes after its answer is what closes an assistant turn.
_PROBE: list[Message] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
# How conversations become ids and targets; part of the token cache's key (a change re-tokenises chat data).
# 2: the rendered text tokenised whole (1: template and content pieces tokenised apart).
# 3: with a token boundary where an answer that starts with whitespace starts (`_answer_cuts`); an instruction's
#    input in parts of its own (PART_KEYS).
CHAT_ENCODING_VERSION = "3"


class RenderError(ValueError):
    """A conversation the template cannot render, or renders in a way the mask cannot follow."""


@dataclass(frozen=True)
class Rendered:
    """A conversation split into the template's text and the messages' content, in order."""

    template_pieces: list[str]  # one more than content pieces: before, between and after them
    content_pieces: list[str]
    content_messages: list[int]  # the message each content piece belongs to
    unwritten: tuple[int, ...] = ()  # messages with content the template did not write (Mistral's system message)

    @property
    def text(self) -> str:
        return "".join(t + c for t, c in zip(self.template_pieces, self.content_pieces + [""]))

    def content_spans(self) -> list[tuple[int, int]]:
        """Each content piece's [start, end) in `text`."""
        spans, at = [], 0
        for template, content in zip(self.template_pieces, self.content_pieces):
            at += len(template)
            spans.append((at, at + len(content)))
            at += len(content)
        return spans


class Encoded(NamedTuple):
    """One conversation as the model trains on it."""

    ids: list[int]
    targets: list[bool]  # per token: does the loss see it
    unwritten: tuple[int, ...]  # messages with content the template did not write (see Rendered)


class ConversationEncoder:
    """Turns conversations into (token ids, target flags) with one template, tokenizer and target policy."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: ChatTemplate,
        *,
        train_on_inputs: bool = False,
        train_on: str = "all_turns",
    ):
        if train_on not in ("all_turns", "last_turn"):
            raise ValueError(f"train_on must be all_turns or last_turn, got {train_on!r}")
        self.tokenizer = tokenizer
        self.template = template
        self.train_on_inputs = train_on_inputs
        self.last_turn_only = train_on == "last_turn"
        self.end_of_turn = end_of_turn_id(template, tokenizer)
        # Every special token, not only the named ones: Llama 3's <|eot_id|> is an added special token only.
        self.special_ids = set(tokenizer.all_special_ids) | {
            i for i, token in tokenizer.added_tokens_decoder.items() if token.special
        }

    def render(self, messages: list[Message]) -> Rendered:
        """Split the rendered conversation into template and content pieces; RenderError when it cannot.

        A message's content is one piece; a template that writes a message's parts instead (an instruction
        record's "instruction" and "input", PART_KEYS) gives a piece for each part it writes."""
        slots: list[tuple[int, str]] = []  # (message, key) behind each sentinel, in message order
        masked = []
        for i, message in enumerate(messages):
            masked.append(dict(message))
            keys = ("content", *(k for k in PART_KEYS if isinstance(message.get(k), str)))
            if message.get("tool_calls") and not message["content"]:
                keys = ()  # a message that only calls tools: its calls are found by _with_tool_calls
            for key in keys:
                masked[-1][key] = _SENTINEL.format(len(slots))
                slots.append((i, key))
        text = self._apply(masked)
        parts = _SENTINEL_SPLIT.split(text)
        template_pieces, numbers = parts[0::2], [int(j) for j in parts[1::2]]
        if any(b <= a for a, b in zip(numbers, numbers[1:])):  # slots are numbered in message order
            raise RenderError(
                f"{self._template_said} writes the messages' content out of order or more "
                "than once, so their tokens cannot be told apart"
            )
        order = [slots[j] for j in numbers]
        written = {i for i, _ in order}
        for strip in (False, True):
            contents = [messages[i][key].strip() if strip else messages[i][key] for i, key in order]
            joined = "".join(t + c for t, c in zip(template_pieces, contents + [""]))
            if joined == self._apply(messages):
                unwritten = tuple(i for i, m in enumerate(messages) if i not in written and m["content"].strip())
                rendered = Rendered(template_pieces, contents, [i for i, _ in order], unwritten)
                return self._with_tool_calls(messages, rendered)
        raise RenderError(
            f"{self._template_said} changes the messages' content while writing it, so "
            "the content's tokens cannot be found"
        )

    def encode(self, messages: list[Message]) -> tuple[list[int], list[bool]]:
        """(token ids, target flag per token) of one conversation; raises RenderError when it cannot be rendered
        (`encode_many` returns it in place, for batches that go on past a bad conversation)."""
        encoded = self.encode_many([messages])[0]
        if isinstance(encoded, RenderError):
            raise encoded
        return encoded.ids, encoded.targets

    def encode_many(
        self, conversations: list[list[Message]], trained_from: list[int] | None = None
    ) -> list[Encoded | RenderError]:
        """`encode` for many conversations with a few tokenizer calls in all, each with the messages its template
        did not write; a failure is returned in its place. `trained_from`: per conversation, the first message whose
        assistant turns may be targets (a preference pair's answer after its prompt); none: every message."""
        firsts = trained_from if trained_from is not None else [0] * len(conversations)
        out: list[Encoded | RenderError | None] = []
        rendered: list[tuple[int, Rendered]] = []
        for messages in conversations:
            try:
                rendered.append((len(out), self.render(messages)))
                out.append(None)
            except RenderError as err:
                out.append(err)
        by_pieces = rendered
        if self.tokenizer.is_fast and rendered:
            whole = self._tokenize_at([r.text for _, r in rendered], [[] for _ in rendered])
            cuts = [self._answer_cuts(conversations[at], r, offsets) for (at, r), (_, offsets) in zip(rendered, whole)]
            again = [k for k, c in enumerate(cuts) if c]
            for k, tokenized in zip(
                again, self._tokenize_at([rendered[k][1].text for k in again], [cuts[k] for k in again])
            ):
                whole[k] = tokenized
            by_pieces = []
            for (at, r), (ids, offsets) in zip(rendered, whole):
                assembled = self._assemble_whole(conversations[at], r, ids, offsets, firsts[at])
                if assembled is None:  # content that spells a special token
                    by_pieces.append((at, r))
                else:
                    out[at] = Encoded(*assembled, r.unwritten)
        template_ids = iter(self._tokenize([p for _, r in by_pieces for p in r.template_pieces], split_special=False))
        content_ids = iter(self._tokenize([p for _, r in by_pieces for p in r.content_pieces], split_special=True))
        for at, r in by_pieces:
            pieces_t = [next(template_ids) for _ in r.template_pieces]
            pieces_c = [next(content_ids) for _ in r.content_pieces]
            out[at] = Encoded(*self._assemble(conversations[at], r, pieces_t, pieces_c, firsts[at]), r.unwritten)
        return out

    def turn_end_id(self) -> int | None:
        """The token that closes an assistant turn as training targets it, for generation to stop at: the
        template's end_of_turn, else the first special token the template writes after the assistant's content
        of a probe conversation (`_closing_length`'s rule). None when it writes none there (nothing to stop at:
        `unclosed_turn_warning`) or cannot render the probe."""
        if self.end_of_turn is not None:
            return self.end_of_turn
        closing = self.probe_closing()
        if closing is None:
            return None
        closed = self._closing_length(closing)
        return closing[closed - 1] if closed else None

    def probe_closing(self) -> list[int] | None:
        """The template's tokens after the assistant's content of a probe conversation (user, assistant), as
        training tokenises them; None when the template cannot render it."""
        try:
            rendered = self.render(_PROBE)
        except RenderError:
            return None
        answer = rendered.content_messages.index(len(_PROBE) - 1)
        return self._tokenize([rendered.template_pieces[answer + 1]], split_special=False)[0]

    # ------------------------------------------------------------ internals

    @property
    def _template_said(self) -> str:
        """The template as messages name it: a shipped one by its name, a tokenizer's own as such."""
        if self.template.name == TOKENIZER_TEMPLATE:
            return "the tokenizer's chat_template"
        return f"template {self.template.name}"

    def _with_tool_calls(self, messages: list[Message], rendered: Rendered) -> Rendered:
        """`rendered` with the text of each assistant message's tool calls as a content piece of that message (the
        module doc): the span where the conversation through it differs from the same without its calls."""
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or not message.get("tool_calls"):
                continue
            with_calls = self._apply(messages[: i + 1])
            without = self._apply([*messages[:i], {k: v for k, v in message.items() if k != "tool_calls"}])
            # Where the calls' text starts: after the message's own text (what the template writes between the two
            # belongs to the calls); with none, where the generation prompt ends, the prompt at inference. The two
            # renders' common prefix only where neither is known: it may run on into a character both share next
            # ("<" of "<|im_end|>" and of "<tool_call>").
            spans = [span for span, m in zip(rendered.content_spans(), rendered.content_messages) if m == i]
            asked = self._apply(messages[:i], add_generation_prompt=True) if i else ""
            if spans:
                start = spans[-1][1]
            elif asked and with_calls.startswith(asked):
                start = len(asked)
            else:
                start = _common_prefix(with_calls, without)
            end = len(with_calls) - min(_common_prefix(with_calls[::-1], without[::-1]), len(with_calls) - start)
            if start >= end or not rendered.text.startswith(with_calls[:end]):
                raise RenderError(
                    f"{self._template_said} does not write message {i}'s tool calls as text of its own at the "
                    "conversation's end, so their tokens cannot be found"
                )
            rendered = _split_template_piece(rendered, start, end, i, self._template_said)
        return rendered

    def _apply(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        tools = messages[0].get(TOOLS_KEY) if messages else None
        messages = [{k: v for k, v in m.items() if k != TOOLS_KEY} for m in messages] if tools else messages
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                chat_template=self.template.source,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as err:  # jinja2 errors and the template's own raise_exception
            raise RenderError(f"{self._template_said} cannot render the conversation: {err}") from None

    def _tokenize(self, texts: list[str], *, split_special: bool) -> list[list[int]]:
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=split_special, verbose=False)[
            "input_ids"
        ]

    def _tokenize_at(self, texts: list[str], cuts: list[list[int]]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """(ids, character offsets) of each text, tokenised whole but for token boundaries forced at its `cuts`
        (the text is tokenised in pieces between them, in one call for all)."""
        pieces, bounds = [], []
        for text, at in zip(texts, cuts):
            edges = [0, *at, len(text)]
            bounds.append(list(pairwise(edges)))
            pieces += [text[a:b] for a, b in bounds[-1]]
        if not pieces:
            return []
        done = self.tokenizer(pieces, add_special_tokens=False, verbose=False, return_offsets_mapping=True)
        results, k = [], 0
        for spans in bounds:
            ids: list[int] = []
            offsets: list[tuple[int, int]] = []
            for start, _ in spans:
                ids += done["input_ids"][k]
                offsets += [(a + start, b + start) for a, b in done["offset_mapping"][k]]
                k += 1
            results.append((ids, offsets))
        return results

    def _answer_cuts(self, messages: list[Message], r: Rendered, offsets: list[tuple[int, int]]) -> list[int]:
        """Where an assistant's content starts with whitespace that the text's tokenisation joined to the template's
        text before it (the header's newline: "assistant\n" + "  Paris" gave the token "\n " and the prompt ended
        at "assistant"): that content's start, to tokenise the text with a token boundary there, so the prompt
        before the answer ends as the template's generation prompt does and the header is no target. (Content that
        starts with a word keeps the join, as inference tokenises it: Mistral's "[/INST] answer" is "▁answer".)"""
        cuts = []
        j = 0
        for (start, end), message, content in zip(r.content_spans(), r.content_messages, r.content_pieces):
            while j < len(offsets) and _ends_before(offsets[j], start):
                j += 1
            if (
                messages[message]["role"] == "assistant"
                and content[:1].isspace()
                and j < len(offsets)
                and offsets[j][0] < start
                and _overlaps(offsets[j], start, end)
            ):
                cuts.append(start)
        return cuts

    def _assemble(
        self,
        messages: list[Message],
        r: Rendered,
        template_ids: list[list[int]],
        content_ids: list[list[int]],
        first: int = 0,
    ) -> tuple[list[int], list[bool]]:
        trained = self._trained_messages(messages, first)
        ids: list[int] = list(template_ids[0])
        targets: list[bool] = [self.train_on_inputs] * len(ids)
        for content, message, closing in zip(content_ids, r.content_messages, template_ids[1:]):
            is_target = self.train_on_inputs or message in trained
            ids += content
            targets += [is_target] * len(content)
            closed = self._closing_length(closing) if message in trained and not self.train_on_inputs else 0
            ids += closing
            targets += [self.train_on_inputs or i < closed for i in range(len(closing))]
        return ids, targets

    def _assemble_whole(
        self, messages: list[Message], r: Rendered, ids: list[int], offsets: list[tuple[int, int]], first: int = 0
    ) -> tuple[list[int], list[bool]] | None:
        """Targets of the whole text's tokens, by their character offsets (`_assemble`'s rule); None when a special
        token lies inside a message's content (that conversation is tokenised by pieces)."""
        trained = self._trained_messages(messages, first)
        targets = [self.train_on_inputs] * len(ids)
        spans = r.content_spans()
        i = 0
        for k, ((start, end), message) in enumerate(zip(spans, r.content_messages)):
            while i < len(ids) and _ends_before(offsets[i], start):
                i += 1
            first = i
            while i < len(ids) and _overlaps(offsets[i], start, end):
                i += 1
            if any(
                ids[j] in self.special_ids and start <= offsets[j][0] and offsets[j][1] <= end for j in range(first, i)
            ):
                return None
            if self.train_on_inputs:
                continue
            if message in trained:
                targets[first:i] = [True] * (i - first)
                next_start = spans[k + 1][0] if k + 1 < len(spans) else len(r.text)
                after = i
                while after < len(ids) and offsets[after][0] < next_start:
                    after += 1
                closed = self._closing_length(ids[i:after])
                targets[i : i + closed] = [True] * closed
        return list(ids), targets

    def _trained_messages(self, messages: list[Message], first: int = 0) -> set[int]:
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
        return set(assistant[-1:] if self.last_turn_only else assistant)

    def _closing_length(self, closing: list[int]) -> int:
        """Tokens of the template text after an assistant turn that belong to it: up to and including the
        end-of-turn token (the template's own, else the first special token); none when there is none.
        The one rule for that token: `turn_end_id` applies it too."""
        for i, token in enumerate(closing):
            if token == self.end_of_turn or (self.end_of_turn is None and token in self.special_ids):
                return i + 1
        return 0


def _common_prefix(a: str, b: str) -> int:
    """The length of the text `a` and `b` start with."""
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _split_template_piece(rendered: Rendered, start: int, end: int, message: int, said: str) -> Rendered:
    """`rendered` with [start, end) of its text, inside one template piece, made a content piece of `message`."""
    at = 0
    for k, piece in enumerate(rendered.template_pieces):
        if at <= start and end <= at + len(piece):
            a, b = start - at, end - at
            return Rendered(
                [*rendered.template_pieces[:k], piece[:a], piece[b:], *rendered.template_pieces[k + 1 :]],
                [*rendered.content_pieces[:k], piece[a:b], *rendered.content_pieces[k:]],
                [*rendered.content_messages[:k], message, *rendered.content_messages[k:]],
                rendered.unwritten,
            )
        at += len(piece) + (len(rendered.content_pieces[k]) if k < len(rendered.content_pieces) else 0)
    raise RenderError(f"{said} writes message {message}'s tool calls into another message's text")


def _ends_before(offset: tuple[int, int], start: int) -> bool:
    """A token wholly before a content span starting at `start` (a zero-width token at `start` is not)."""
    token_start, token_end = offset
    return token_end <= start and not (token_start == token_end == start)


def _overlaps(offset: tuple[int, int], start: int, end: int) -> bool:
    """A token that holds some of the content span [start, end), or has no width inside it."""
    token_start, token_end = offset
    return token_start < end and (token_end > start or token_start == token_end >= start)


def turn_end_id(template: ChatTemplate, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The id of the token that closes an assistant turn of `template`, as training targets it (see
    `ConversationEncoder.turn_end_id`); None when the template writes no special token after an answer."""
    return ConversationEncoder(tokenizer, template).turn_end_id()


def unclosed_turn_warning(data: Data, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A warning for people when the recipe's chat template writes no special token after an assistant's
    answer (e.g. "user: ...\\nassistant: ...\\n"): the model then has no end-of-turn token to learn, and
    generation (eval, an export) runs on past the answer. None when it does, or the data needs no template.
    `tokenizer`: the run's, after `ensure_template_tokens`."""
    template = conversation_template(data, tokenizer)
    if template is None:
        return None
    encoder = ConversationEncoder(tokenizer, template)
    closing = encoder.probe_closing()
    if closing is None or encoder._closing_length(closing):  # one that cannot render: the data's errors say so
        return None
    where = template_where(encoder.template)
    after = tokenizer.decode(closing)
    written = f"only {after!r}" if after else "nothing"
    return (
        f"{where} writes no special token after an assistant's answer ({written}), so the model learns no "
        "end-of-turn token and generation (eval, an export) will not stop at the end of an answer — set "
        "data.template to a shipped template that closes each turn with a special token, such as chatml "
        "(with data.add_special_tokens: true if the tokenizer lacks its markers), or use a tokenizer whose "
        "chat_template ends each turn with a special token"
    )


def generation_prompt_warning(data: Data, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A warning for people when what the template writes before an answer in training differs from its generation
    prompt (`add_generation_prompt=True`, what inference servers and `apply_chat_template` prompt with): Qwen3's
    writes an empty "<think>\\n\\n</think>\\n\\n" before a trained answer but not in its default prompt, a
    "user: …\\nassistant: " template prompts with a trailing space training never ends a prompt with. The model
    is then prompted with tokens it never saw before an answer. None when the two agree, or the template cannot
    render the probe. `tokenizer`: the run's, after `ensure_template_tokens`."""
    template = conversation_template(data, tokenizer)
    if template is None:
        return None
    encoder = ConversationEncoder(tokenizer, template)
    try:
        ids, targets = encoder.encode(_PROBE)
        prompt_text = tokenizer.apply_chat_template(
            _PROBE[:1], chat_template=encoder.template.source, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that cannot render the probe: the data's own errors say so
        return None
    first = next((i for i, t in enumerate(targets) if t), None)
    prompted = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    if first is None or ids[:first] == prompted:
        return None
    trained, asked = tokenizer.decode(ids[:first]), tokenizer.decode(prompted)
    context = max(len(os.path.commonprefix([trained, asked])) - 12, 0)  # a few characters before they part
    trained, asked = trained[context:], asked[context:]
    return (
        f"{template_where(encoder.template)} ends the prompt before a trained answer with {trained!r}, but "
        f"its generation prompt (add_generation_prompt=True, as inference prompts) ends with {asked!r}: the "
        "model learns to answer after text it is not prompted with — prompt it as training wrote (Qwen3: "
        "apply_chat_template(..., enable_thinking=False)), or set a template whose prompt and training agree "
        "(data.template: chatml)"
    )


def template_where(template: ChatTemplate) -> str:
    """The recipe key a template comes from, and what it is, for a warning about the data."""
    if template.name == TOKENIZER_TEMPLATE:
        return "model.tokenizer: the tokenizer's chat_template (data.template is not set)"
    return f"data.template: chat template {template.name}"
