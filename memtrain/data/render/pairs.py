"""A prompt with one answer (a side of a preference pair, a KTO record) into token ids and target flags.

Conversations go through the recipe's chat template exactly as chat data does (chat.py's ConversationEncoder): the
prompt's messages then the answer's, rendered and tokenised whole, so the prompt ends with the template's generation
prompt where the template agrees with itself (chat.generation_prompt_warning says where it does not); the targets are
the answer's assistant turns through their end-of-turn token, never the prompt's turns.

Text goes to the tokenizer as TRL's DPOTrainer sends it: the tokenizer's BOS when it adds one, the prompt and the
answer tokenised as one text (a token that spans both belongs to the answer, as in chat.py), and the EOS after the
answer; the answer's tokens and the EOS are the targets. Content that spells a special token stays text
(split_special_tokens), as in chat data.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from memtrain.data.read.preference import Side
from memtrain.data.render.chat import ConversationEncoder, Encoded, RenderError
from memtrain.data.render.templates import ChatTemplate

Sequence = tuple[Side, Side]  # (prompt, answer)


class PairEncoder:
    """Encodes (prompt, answer) sequences of text or messages; one per tokenizer and template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: ChatTemplate | None):
        self.tokenizer = tokenizer
        self.chat = ConversationEncoder(tokenizer, template) if template is not None else None
        bos = tokenizer.bos_token_id
        # what the tokenizer puts before a text of its own accord (Llama's BOS), as a text prompt starts
        self.bos = [bos] if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else []

    def encode_many(self, sequences: list[Sequence]) -> list[Encoded | RenderError]:
        """(ids, targets) of each sequence, in order; a conversation the template cannot render gives its
        RenderError in its place."""
        out: list[Encoded | RenderError | None] = [None] * len(sequences)
        chats = [at for at, (prompt, _) in enumerate(sequences) if isinstance(prompt, list)]
        if chats and self.chat is None:
            for at in chats:
                out[at] = RenderError(
                    "the record is a conversation, and neither data.template nor the tokenizer names a chat template "
                    "to write it with"
                )
        elif chats:
            conversations = [sequences[at][0] + sequences[at][1] for at in chats]
            encoded = self.chat.encode_many(conversations, [len(sequences[at][0]) for at in chats])
            for at, result in zip(chats, encoded):
                out[at] = result
        texts = [at for at, (prompt, _) in enumerate(sequences) if not isinstance(prompt, list)]
        for at, result in zip(texts, self._encode_texts([sequences[at] for at in texts])):
            out[at] = result
        return out

    def _encode_texts(self, sequences: list[tuple[str, str]]) -> list[Encoded]:
        if not sequences:
            return []
        eos = self.tokenizer.eos_token_id
        out = []
        if self.tokenizer.is_fast:
            done = self.tokenizer(
                [prompt + answer for prompt, answer in sequences],
                add_special_tokens=False,
                split_special_tokens=True,
                return_offsets_mapping=True,
                verbose=False,
            )
            for (prompt, _), ids, offsets in zip(sequences, done["input_ids"], done["offset_mapping"]):
                # a token that reaches into the answer belongs to it
                flags = [end > len(prompt) for _, end in offsets]
                out.append(Encoded([*self.bos, *ids, eos], [False] * len(self.bos) + flags + [True], ()))
            return out
        # a slow (Python) tokenizer has no offsets: the prompt and the answer are tokenised apart
        kwargs = {"add_special_tokens": False, "split_special_tokens": True, "verbose": False}
        prompts = self.tokenizer([p for p, _ in sequences], **kwargs)["input_ids"]
        answers = self.tokenizer([a for _, a in sequences], **kwargs)["input_ids"]
        for p, a in zip(prompts, answers):
            out.append(
                Encoded([*self.bos, *p, *a, eos], [False] * (len(self.bos) + len(p)) + [True] * (len(a) + 1), ())
            )
        return out
