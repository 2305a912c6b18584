"""`memtrain chat RUN_DIR`: talk to a run's model, its answers streamed token by token as they come.

The model is the run's final one (whole, or its adapter on the base it trained on), or one of its checkpoints
(`--checkpoint N`): memtrain.train.state.saved_model. A turn is written as training wrote conversations: the same
ConversationEncoder and template (data.template, or the tokenizer's own), the prompt everything before the answer's
first target token, which is how `memtrain eval` asks its held-out questions (memtrain.data.rows.prompts.prompt_of).
The answer stops at the run's end-of-turn token or eos. `--temperature 0` (the default) answers greedily through the
evaluation's own generation (memtrain.train.eval.generation.greedy_generate), so `memtrain chat --prompt Q` answers a
held-out question Q as `memtrain eval` scored it. A run trained on text alone has no turns: the prompt is continued.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from transformers import PreTrainedTokenizerBase, TextStreamer

from memtrain.data.read.conversation import Message
from memtrain.data.render.chat import ConversationEncoder
from memtrain.data.render.templates import needs_template, resolve_template
from memtrain.data.rows.prompts import prompt_of
from memtrain.errors import Problem, UserError
from memtrain.train.eval.generation import greedy_generate, stop_token_ids
from memtrain.train.state.saved_model import SavedModel, load_saved_model

# The assistant turn a prompt is cut from: its content is after the cut, so any text serves.
_PLACEHOLDER_ANSWER = "…"
EXIT_WORDS = ("/exit", "/quit")
RESET_WORD = "/reset"


class ConsoleStreamer(TextStreamer):
    """transformers' TextStreamer, written to the command's console instead of print()."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, console: Console):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.console = console

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.console.file.write(text + ("\n" if stream_end else ""))
        self.console.file.flush()


class Conversation:
    """A chat with a saved model: the turns so far, and how a new one is asked."""

    def __init__(self, saved: SavedModel, system: str | None, max_new_tokens: int, temperature: float):
        self.saved, self.system = saved, system
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        data, tokenizer = saved.recipe.data, saved.tokenizer
        self.chat = needs_template(data) or bool(tokenizer.chat_template)
        if self.chat:
            template = resolve_template(data.template, tokenizer)
            self.encoder = ConversationEncoder(tokenizer, template, train_on_inputs=False, train_on="last_turn")
            self.stop_ids = stop_token_ids(data.template, tokenizer)
        else:
            self.stop_ids = [tokenizer.eos_token_id]
        self.turns: list[Message] = []

    def reset(self) -> None:
        self.turns = []

    def prompt_ids(self, text: str) -> list[int]:
        """The tokens the model continues: the conversation with this user turn, up to the answer."""
        if not self.chat:
            return self.saved.tokenizer(text)["input_ids"]
        system = [{"role": "system", "content": self.system}] if self.system else []
        messages = [*system, *self.turns, {"role": "user", "content": text}]
        prompt = prompt_of(self.encoder, [*messages, {"role": "assistant", "content": _PLACEHOLDER_ANSWER}])
        if prompt is None:
            raise UserError(
                Problem(
                    "the run's chat template cannot write this conversation (it may refuse a system message, or "
                    "expect turns in another order)",
                    hint="leave out --system, or /reset the conversation",
                )
            )
        return prompt[0]

    def ask(self, text: str, streamer: TextStreamer | None = None) -> str:
        """The model's answer to `text` (streamed to `streamer` as it comes), kept as the next turn."""
        ids = self.prompt_ids(text)
        model, tokenizer = self.saved.model, self.saved.tokenizer
        with torch.no_grad():
            if self.temperature == 0:
                (answer,) = greedy_generate(
                    model, [ids], self.stop_ids, tokenizer.pad_token_id, self.max_new_tokens, 1, streamer=streamer
                )
            else:
                answer = self._sample(ids, streamer)
        reply = tokenizer.decode(answer, skip_special_tokens=False).strip()
        self.turns += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        return reply

    def _sample(self, ids: list[int], streamer: TextStreamer | None) -> list[int]:
        model, tokenizer = self.saved.model, self.saved.tokenizer
        device = next(model.parameters()).device
        out = model.generate(
            input_ids=torch.tensor([ids], device=device),
            attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=device),
            do_sample=True,
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=tokenizer.pad_token_id,
            streamer=streamer,
        )[0, len(ids) :].tolist()
        return out[: next((i for i, token in enumerate(out) if token in self.stop_ids), len(out))]


def chat_command(
    run_dir: Path,
    *,
    checkpoint: str | None = None,
    prompt: str | None = None,
    system: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    console: Console,
    read_line: Callable[[str], str] = input,
) -> int:
    """Answer `prompt` once, or talk until /exit or end of input; returns the exit code."""
    if max_new_tokens < 1:
        raise UserError(Problem(f"--max-new-tokens must be 1 or more, got {max_new_tokens}", hint="e.g. 256"))
    if temperature < 0:
        raise UserError(Problem(f"--temperature must be 0 or more, got {temperature}", hint="0 answers greedily"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    saved = load_saved_model(Path(run_dir), device, checkpoint=checkpoint)
    conversation = Conversation(saved, system, max_new_tokens, temperature)
    streamer = ConsoleStreamer(saved.tokenizer, console)
    if prompt is not None:
        conversation.ask(prompt, streamer)
        return 0
    console.print(
        f"[dim]·[/] talking to {saved.source} ({'greedy' if temperature == 0 else f'temperature {temperature:g}'}); "
        f"{RESET_WORD} starts over, {EXIT_WORDS[0]} or Ctrl-D ends",
        highlight=False,
    )
    while True:
        try:
            text = read_line("you> ").strip()
        except EOFError:
            return 0
        if text in EXIT_WORDS:
            return 0
        if text == RESET_WORD:
            conversation.reset()
            continue
        if text:
            conversation.ask(text, streamer)
