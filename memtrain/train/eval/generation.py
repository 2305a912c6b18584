"""Generation-based evaluation: greedy answers to held-out prompts, scored by exact match.

    prompts, skipped = held_out_prompts(recipe.data, tokenizer, limit)        (memtrain.data.rows.prompts)
    score = generation_eval(model, tokenizer, prompts, stop_token_ids(...))   exact match, a few samples

A prompt is the conversation up to its last assistant turn as training tokenised it; the model continues
it greedily until the end-of-turn token training targets (<|im_end|> for chatml or a ChatML tokenizer
template, <end_of_turn> for Gemma's; the tokenizer's eos as well), at most the longest expected answer's
tokens + MAX_NEW_TOKENS_MARGIN. An answer is right when it equals
the expected one after stripping whitespace at both ends (nothing else: case and punctuation count).

In a run (`train.eval_generate: N`), rank 0 scores the first N held-out conversations at step 0 and at
the end and writes a "generation" record to metrics.jsonl:
    {"kind": "generation", "step": S, "exact_match": 0..1, "correct": C, "total": N', "skipped": K,
     "by_task": {...}, "prompts_in_train": P, "answers_in_train": A,
     "samples": [{"question", "expected", "generated", "correct"}, ...]}
P and A count the prompts asked whose prompt (and prompt and answer) the training data also holds
(memtrain.data.rows.overlap); null where that is not known (the training files are gone).
Generation draws no random numbers (greedy), but the RNG states are restored around it anyway, and the
model is put back in the mode it was in, so a run with the evaluation trains exactly as one without.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from memtrain.data.render.chat import turn_end_id
from memtrain.data.render.templates import resolve_template
from memtrain.data.rows.prompts import HeldOutPrompt, held_out_prompts
from memtrain.monitor.metrics import GENERATION_KIND
from memtrain.recipe.schema import Recipe

MAX_NEW_TOKENS_MARGIN = 16  # tokens allowed beyond the longest expected answer
BATCH_SIZE = 16  # prompts generated together (left-padded)
SAMPLES_KEPT = 3


@dataclass(frozen=True)
class GeneratedSample:
    question: str
    expected: str
    generated: str
    correct: bool
    task: str | None = None


@dataclass(frozen=True)
class GenerationScore:
    exact_match: float  # correct / total, 0 when there is no prompt
    correct: int
    total: int
    skipped: int  # held-out conversations not asked (prompt too long, cannot render, or no validation sample)
    samples: list[GeneratedSample]  # the first few, for people to read
    by_task: dict[str, float] = field(default_factory=dict)  # exact match per record "task", when records name one
    # of the prompts asked, those whose prompt (and prompt and answer) training also holds; None: not known
    prompts_in_train: int | None = None
    answers_in_train: int | None = None

    def describe(self, step: int) -> str:
        """One line for people: 'step 0: exact match 0.120 (12/100 held-out answers)', with how many of them training
        also holds where any: '(20/20 held-out answers, 20 of them also in training)'."""
        return f"step {step}: exact match {self.exact_match:.3f} ({self.answers_said()})"

    def answers_said(self) -> str:
        """'12/100 held-out answers', and ', 20 of them also in training' where training holds any of the prompts."""
        said = f"{self.correct}/{self.total} held-out answers"
        if self.prompts_in_train:
            same = (
                ""
                if self.answers_in_train == self.prompts_in_train
                else f" ({self.answers_in_train} with the same answer)"
            )
            said += f", {self.prompts_in_train} of them also in training{same}"
        return said

    def as_record(self) -> dict:
        """The fields of a metrics record / the --json output."""
        return {
            "exact_match": self.exact_match,
            "correct": self.correct,
            "total": self.total,
            "skipped": self.skipped,
            "by_task": self.by_task,
            "prompts_in_train": self.prompts_in_train,
            "answers_in_train": self.answers_in_train,
            "samples": [asdict(s) for s in self.samples],
        }


def is_exact_match(generated: str, expected: str) -> bool:
    """True when the answer equals the expected one, whitespace at both ends aside."""
    return generated.strip() == expected.strip()


def stop_token_ids(template_name: str | None, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens generation stops at: the end-of-turn token training targets (the template's own, or for the
    tokenizer's chat_template the first special token it writes after an answer: <|im_end|>, <end_of_turn>,
    <|end|>), and the tokenizer's eos."""
    stop = turn_end_id(resolve_template(template_name, tokenizer), tokenizer)
    ids = [stop] if stop is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def greedy_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    stop_ids: list[int],
    pad_id: int,
    max_new_tokens: int,
    batch_size: int = BATCH_SIZE,
    on_batch: Callable[[int, int], None] | None = None,
    streamer=None,
) -> list[list[int]]:
    """The tokens the model writes after each prompt, greedily, up to (not including) the first stop token.

    Prompts are left-padded into batches of `batch_size` (the attention mask hides the padding). The caller
    sets the model's mode (eval) and the no-grad context. on_batch(prompts answered, all): after each batch.
    streamer: a transformers streamer that receives the tokens as they come (one prompt only: `memtrain chat`).
    """
    device = next(model.parameters()).device
    config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        use_cache=True,
    )
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        generated = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            streamer=streamer,
        )
        for row in generated[:, width:].tolist():
            cut = next((i for i, token in enumerate(row) if token in stop_ids), len(row))
            out.append(row[:cut])
        if on_batch is not None:
            on_batch(len(out), len(prompts))
    return out


def generation_eval(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[HeldOutPrompt],
    stop_ids: list[int],
    *,
    skipped: int = 0,
    keep_samples: int = SAMPLES_KEPT,
    batch_size: int = BATCH_SIZE,
    on_batch: Callable[[int, int], None] | None = None,
) -> GenerationScore:
    """Exact match of the model's greedy answers to `prompts` (on_batch: as greedy_generate's).

    Leaves the model in the mode it found it in and every RNG (CPU and CUDA) in the state it found it in.
    """
    if not prompts:
        return GenerationScore(0.0, 0, 0, skipped, [])
    longest = max(len(tokenizer(p.expected, add_special_tokens=False)["input_ids"]) for p in prompts)
    device = next(model.parameters()).device
    was_training = model.training
    cuda = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            model.eval()
            answers = greedy_generate(
                model,
                [p.prompt_ids for p in prompts],
                stop_ids,
                tokenizer.pad_token_id,
                longest + MAX_NEW_TOKENS_MARGIN,
                batch_size,
                on_batch,
            )
    finally:
        model.train(was_training)
    texts = tokenizer.batch_decode(answers, skip_special_tokens=False)
    correct = [is_exact_match(text, p.expected) for text, p in zip(texts, prompts)]
    per_task: dict[str, list[bool]] = defaultdict(list)
    for ok, p in zip(correct, prompts):
        if p.task is not None:
            per_task[p.task].append(ok)
    samples = [
        GeneratedSample(p.question, p.expected.strip(), text.strip(), ok, p.task)
        for p, text, ok in list(zip(prompts, texts, correct))[:keep_samples]
    ]
    known = all(p.prompt_in_train is not None for p in prompts)
    return GenerationScore(
        exact_match=sum(correct) / len(prompts),
        correct=sum(correct),
        total=len(prompts),
        skipped=skipped,
        samples=samples,
        by_task={task: sum(oks) / len(oks) for task, oks in sorted(per_task.items())},
        prompts_in_train=sum(bool(p.prompt_in_train) for p in prompts) if known else None,
        answers_in_train=sum(bool(p.answer_in_train) for p in prompts) if known else None,
    )


class GenerationEval:
    """The run's generation evaluation (`train.eval_generate`): its prompts, built once on rank 0."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompts: list[HeldOutPrompt], skipped: int, stop_ids: list[int]
    ):
        self.tokenizer, self.prompts, self.skipped, self.stop_ids = tokenizer, prompts, skipped, stop_ids

    @classmethod
    def for_run(cls, recipe: Recipe, tokenizer: PreTrainedTokenizerBase, is_main: bool) -> GenerationEval | None:
        """The evaluation a recipe asks for, on the main rank; None when it asks for none (or on other ranks)."""
        count = recipe.train.eval_generate
        if not count or not is_main:
            return None
        prompts, skipped = held_out_prompts(recipe.data, tokenizer, limit=count)
        return cls(tokenizer, prompts, skipped, stop_token_ids(recipe.data.template, tokenizer))

    def record(self, model: torch.nn.Module, metrics, step: int) -> GenerationScore:
        """Score the model now and write a "generation" record at `step` to the run's metrics."""
        score = generation_eval(model, self.tokenizer, self.prompts, self.stop_ids, skipped=self.skipped)
        metrics.event(GENERATION_KIND, step, **score.as_record())
        return score
