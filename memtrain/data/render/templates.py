"""Chat templates: the shipped ones (Jinja files under assets/templates) or the tokenizer's own chat_template.

A shipped template is a .jinja file in the language of Hugging Face's `chat_template`, listed in
assets/templates/templates.json with the markers it writes that must be single special tokens
(`special_tokens`) and the token that closes an assistant turn (`end_of_turn`; "eos_token" stands for
the tokenizer's eos). Adding a template is adding a file and an entry; no code changes.

The markers must be *special* tokens: content is tokenised with split_special_tokens=True, so a user
who types "<|im_start|>" gets ordinary text, and only the template can produce the real marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

from transformers import PreTrainedTokenizerBase

from memtrain.data.read.corpus import ASSETS
from memtrain.errors import DataError, Problem
from memtrain.recipe.schema import PAIR_TYPES, Data

TEMPLATES_DIR = ASSETS / "templates"
INDEX = TEMPLATES_DIR / "templates.json"
TOKENIZER_TEMPLATE = "tokenizer"  # the name a tokenizer's own chat_template goes by in messages
EOS_PLACEHOLDER = "eos_token"


@dataclass(frozen=True)
class ChatTemplate:
    name: str  # a shipped name, or "tokenizer" for the tokenizer's own chat_template
    source: str  # the Jinja text
    special_tokens: tuple[str, ...]  # markers the template writes that must be single special tokens
    end_of_turn: str | None  # token closing an assistant turn; None: the first special token after it
    #                                   (render.turn_end_id finds that one, for generation to stop at)


@cache
def _index() -> dict[str, dict]:
    return json.loads(INDEX.read_text())


def shipped_template_names() -> list[str]:
    """Names `data.template` accepts: chatml, llama-3, alpaca, ..."""
    return sorted(_index())


def shipped_template(name: str) -> ChatTemplate:
    """The shipped template `name`; raises DataError (key data.template) naming the ones there are."""
    entry = _index().get(name)
    if entry is None:
        raise DataError(
            Problem(
                f"there is no chat template {name!r}",
                key="data.template",
                hint="use one of "
                + ", ".join(shipped_template_names())
                + ", or leave data.template out to use the tokenizer's own chat_template",
            )
        )
    return ChatTemplate(
        name=name,
        source=(TEMPLATES_DIR / entry["file"]).read_text(),
        special_tokens=tuple(entry["special_tokens"]),
        end_of_turn=entry["end_of_turn"],
    )


def resolve_template(name: str | None, tokenizer: PreTrainedTokenizerBase) -> ChatTemplate:
    """The template conversations are written with: `name` when given, else the tokenizer's own chat_template.

    Raises DataError when `name` is None and the tokenizer has no chat_template.
    """
    if name is not None:
        return shipped_template(name)
    own = tokenizer.chat_template
    if isinstance(own, dict):  # several named templates: "default" is the one for plain chat
        own = own.get("default")
    if not own:
        raise DataError(
            Problem(
                "the tokenizer has no chat_template, and completion, instruction and chat data need one",
                key="data.template",
                hint="set data.template to one of "
                + ", ".join(shipped_template_names())
                + " (builtin:shakespeare-chat is a tokenizer with a chatml chat_template)",
            )
        )
    return ChatTemplate(name=TOKENIZER_TEMPLATE, source=own, special_tokens=(), end_of_turn=None)


def end_of_turn_id(template: ChatTemplate, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The id of the token the template names as closing an assistant turn, None when the template leaves it to
    be found (the tokenizer's own template): memtrain.data.render.chat.turn_end_id finds it, as training does."""
    if template.end_of_turn is None:
        return None
    token = tokenizer.eos_token if template.end_of_turn == EOS_PLACEHOLDER else template.end_of_turn
    return tokenizer.convert_tokens_to_ids(token)


def missing_special_tokens(template: ChatTemplate, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The template's markers the tokenizer does not have as special tokens (a plain vocabulary entry does
    not count: content could then spell it)."""
    special = set(tokenizer.all_special_tokens)
    special.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return [token for token in template.special_tokens if token not in special]


def ensure_template_tokens(data: Data, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Check (and with `data.add_special_tokens`, add) the special tokens the recipe's chat template needs.

    Returns the tokens added to `tokenizer`, in order: the model must grow its embeddings to len(tokenizer)
    and train the new rows (for LoRA: embeddings and lm_head in modules_to_save). Empty when nothing was
    added, or the data needs no template (text only). Raises DataError naming the missing tokens otherwise.
    Idempotent: a second call adds nothing.
    """
    if not needs_template(data):
        return []
    template = resolve_template(data.template, tokenizer)
    missing = missing_special_tokens(template, tokenizer)
    if not missing:
        return []
    if not data.add_special_tokens:
        raise DataError(
            Problem(
                f"chat template {template.name} writes {', '.join(missing)}, which the tokenizer lacks as special "
                "tokens",
                key="data.template",
                hint="set data.add_special_tokens: true to add them (the model's embeddings grow and are trained), "
                "use a tokenizer that has them, or a template written with tokens it has",
            )
        )
    # False: extend the tokenizer's extra special tokens, not replace them (positional: transformers 4 and 5
    # name this argument differently).
    tokenizer.add_special_tokens({"additional_special_tokens": missing}, False)
    return missing


def needs_template(data: Data) -> bool:
    """True when some dataset of the recipe is a completion, instruction or chat dataset, or preference or kto data
    with data.template set (text pairs need no template; conversational pairs without data.template use the
    tokenizer's own: `pair_template`)."""
    sources = [data.train] + ([data.validation] if data.validation is not None else [])
    return any(
        not isinstance(source, str)
        and any(spec.type != "text" and (spec.type not in PAIR_TYPES or data.template is not None) for spec in source)
        for source in sources
    )


def pair_template(data: Data, tokenizer: PreTrainedTokenizerBase) -> ChatTemplate | None:
    """The template preference and kto conversations are written with: data.template, else the tokenizer's own
    chat_template, else None (then only text records can be written; a conversation is an error at its line)."""
    if data.template is not None:
        return shipped_template(data.template)
    own = tokenizer.chat_template
    if isinstance(own, dict):
        own = own.get("default")
    return ChatTemplate(name=TOKENIZER_TEMPLATE, source=own, special_tokens=(), end_of_turn=None) if own else None


def conversation_template(data: Data, tokenizer: PreTrainedTokenizerBase) -> ChatTemplate | None:
    """The template the recipe's conversations are written with: data.template or the tokenizer's own for completion,
    instruction and chat data (DataError when there is none); for preference and kto data, `pair_template`; None when
    the data has no conversations to write (text)."""
    if needs_template(data):
        return resolve_template(data.template, tokenizer)
    return pair_template(data, tokenizer) if data.holds_pairs else None
