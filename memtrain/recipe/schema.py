"""The recipe: one typed, validated description of a fine-tuning run.

Field-level rules (types, ranges, allowed values) live here; rules that relate several sections
live in `checks.py` so that all of them are reported together.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Literal, Union

from annotated_types import Len
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainSerializer,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from memtrain.configs import gpu_profile_names
from memtrain.units import looks_like_size, parse_bytes

# A spec that names bundled data or a bundled tokenizer (builtin:shakespeare, builtin:chat/validation), not a path.
BUILTIN_PREFIX = "builtin:"
MAX_SEED = 2**64 - 1  # torch.manual_seed takes an unsigned 64-bit integer; a larger one is an OverflowError at run time


def _byte_size(value: object) -> int:
    try:
        return parse_bytes(value)
    except OverflowError:  # "1e999GB" or .inf: float('inf') cannot become int bytes
        raise ValueError("is too large for a size") from None


ByteSize = Annotated[
    int,
    BeforeValidator(_byte_size),
    PlainSerializer(lambda v: v, return_type=int),
    # recipes write sizes as text ("64GiB"), so editors must accept both forms
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": r"^\s*[0-9]*\.?[0-9]+([eE][0-9]+)?\s*([kKmMgGtT][iI]?[bB]|[bB])?\s*$"},
            ],
            "examples": ["24GiB", "64GB"],
        }
    ),
]


def _takes_number_only(annotation: object) -> bool:
    """Whether a field takes a number (int or float: plain, constrained, optional, or beside words such as
    'auto') and nothing that a bool could mean."""

    def unwrap(a: object) -> object:
        return a.__origin__ if getattr(a, "__metadata__", None) is not None else a  # Annotated[int, ...] -> int

    annotation = unwrap(annotation)
    if annotation in (int, float):
        return True
    if type(annotation).__name__ != "UnionType" and getattr(annotation, "__origin__", None) is not Union:
        return False
    args = [unwrap(a) for a in annotation.__args__ if a is not type(None)]
    words = [
        a for a in args if getattr(a, "__origin__", None) is Literal and all(isinstance(v, str) for v in a.__args__)
    ]
    numbers = [a for a in args if a in (int, float)]
    return bool(numbers) and len(numbers) + len(words) == len(args)


Tier = Literal["none", "cpu", "nvme"]
Dtype = Literal["bf16", "fp16", "fp32"]


class Section(BaseModel):
    # nan/inf pass range checks silently (nan > 0 is False but nan <= 1 is too), so refuse them outright
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: object, info: ValidationInfo) -> object:
        # pydantic's lax mode reads `true` as 1 for an int or float field (train.steps=true became 1 step)
        if (
            isinstance(value, bool)
            and info.field_name
            and _takes_number_only(cls.model_fields[info.field_name].annotation)
        ):
            raise ValueError("must be a number, not true/false")
        return value


ALL_LINEAR = "all-linear"  # LoRA on every linear layer but the output head (PEFT's name for it)


class Lora(Section):
    r: int = Field(16, ge=1, le=4096, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    lean_dropout: bool = Field(
        False,
        description="Keep the adapter input and a seed instead of the dropped input and its mask; the mask "
        "is regenerated in backward. Same dropout, fewer activation bytes (Llama-2-7B: 68 KB per token per layer, "
        "so `checkpointing.strategy: auto` recomputes fewer layers), at the cost of two mask generations per adapter "
        "and step; false (default): PEFT's own dropout.",
    )
    target_modules: Annotated[list[str], Field(min_length=1)] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names (or suffixes) that receive adapters, or `all-linear` (default): every linear "
        "layer but the output head, whatever the family calls them (Llama, Qwen, Mistral and Gemma: q/k/v/o_proj, "
        "gate/up/down_proj; Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj), as PEFT's `all-linear`.",
    )
    use_dora: bool = Field(
        False,
        description="DoRA (weight-decomposed LoRA): each adapted weight is split into a trained magnitude "
        "per output feature and a direction that the LoRA product updates; closer to full fine-tuning at low rank. "
        "Costs one trainable vector per adapted module and, every forward, the adapted weight's norm (a weight-sized "
        "transient per module) — slower than plain LoRA.",
    )
    use_rslora: bool = Field(
        False,
        description="Rank-stabilised LoRA: scale the adapters by alpha / sqrt(r) instead of alpha / r, so "
        "large ranks keep learning; costs nothing.",
    )
    loraplus_lr_ratio: float | None = Field(
        None,
        gt=0,
        le=1000,
        description="LoRA+: the B matrices (the adapters' up-projections) learn at "
        "optimizer.lr × this ratio, the A matrices at optimizer.lr (its paper suggests 16); costs nothing. "
        "None: one learning rate for all adapters.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full beside the adapters and saved with them, e.g. ['embed_tokens', "
        "'lm_head'] when tokens are added to the vocabulary. Each keeps a trainable copy of its weights, with "
        "their gradients and optimizer states.",
    )


class Quantize(Section):
    """Base weights stored quantised by bitsandbytes (QLoRA): only with LoRA, whose adapters stay in precision.compute."""  # noqa: E501 (one line: it is the section's description in docs/RECIPES.md and the JSON schema)

    type: Literal["nf4", "fp4", "int8", "none"] = Field(
        "nf4",
        description="nf4 / fp4: 4-bit blockwise weights (blocks of 64; nf4 is the QLoRA paper's normal-float code); "
        "int8: LLM.int8 row-wise 8-bit weights; none: full-precision weights. Every nn.Linear except the output "
        "head is quantised (transformers' rule); embeddings and norms stay in precision.compute, and quantised "
        "layers dequantise to precision.compute for their matmuls.",
    )
    double_quant: bool = Field(
        True,
        description="4-bit only: quantise the per-block scales too (8-bit in blocks of 256), "
        "0.52 instead of 0.56 bytes per weight.",
    )


class Model(Section):
    preset: str | None = Field(
        None, description="Name of a shape preset in configs/models (random initialisation), e.g. 'llama2-7b'."
    )
    path: str | None = Field(
        None,
        description="A local Hugging Face model directory (config.json, safetensors weights, tokenizer), or a Hub id "
        "('org/name', read into huggingface_hub's cache: HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE apply). A path "
        "that exists wins over an id; 'hub:org/name' forces the Hub, './org/name' a local directory.",
    )
    revision: str | None = Field(
        None,
        description="For a Hub id in model.path: the branch, tag or commit to read (default main). A run records the "
        "commit it trained (run.json's recipe) and refuses to resume on another one.",
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer directory, or 'builtin:shakespeare' for the bundled offline BPE tokenizer "
        "('builtin:shakespeare-chat': the same with ChatML's markers and template). "
        "Defaults to the model directory, or the builtin tokenizer for presets.",
    )
    attn_implementation: Literal["auto", "sdpa", "varlen", "eager", "flash_attention_2"] = Field(
        "auto",
        description="Attention kernel. sdpa: PyTorch's scaled_dot_product_attention, no seq_len^2 activation term "
        "for plain rows; packed rows get a block-diagonal mask (micro_batch x seq_len^2 bytes), which keeps PyTorch "
        "off its flash kernel. varlen: PyTorch's variable-length flash kernel (torch.nn.attention.varlen) for packed "
        "rows, given the samples' bounds instead of a mask (sdpa for plain rows); a CUDA GPU of compute capability "
        "8.0+ (RTX 3090 / 4090, A100, H100) and fp16 / bf16 only. auto: varlen for instruction and chat rows and for "
        "preference pairs (not KTO's records) where it runs, else sdpa (the CPU keeps sdpa); on one GPU it lays "
        "unpacked samples and pairs end to end within each step. Where an architecture cannot run sdpa correctly "
        "(Gemma-2's soft-capped attention) memtrain uses eager for sdpa, varlen and auto, and says so.",
    )
    kernels: Literal["auto", "liger", "liger_loss", "none"] = Field(
        "auto",
        description="Liger's Triton kernels (pip install 'memtrain[liger]'): RMSNorm, SwiGLU (GEGLU for "
        "Gemma-2) and RoPE patched into the model, and Liger's fused linear cross-entropy as the loss (never the "
        "full logits; not under ZeRO-3, precision.mode autocast, an fp32 lm_head or LoRA modules_to_save, where the "
        "chunked loss stays). liger_loss: the fused loss only, the layers as transformers writes them (what auto "
        "picks for compiled layers: torch.compile fuses them, and cannot trace through Liger's layer kernels). "
        "auto: where liger-kernel is installed, a CUDA GPU is present and the model is Llama, Mistral, Qwen2, "
        "Qwen3, Gemma-2 or Phi-3; liger / liger_loss: always (an error where it cannot run); none: never.",
    )
    lora: Lora | None = Field(None, description="Train LoRA adapters instead of all weights.")
    quantize: Quantize | None = Field(
        None,
        description="Store the frozen base weights quantised (QLoRA; needs lora and bitsandbytes: "
        "pip install memtrain[qlora]).",
    )

    @property
    def quant_type(self) -> str | None:
        """'nf4' | 'fp4' | 'int8' when the base weights are stored quantised, else None."""
        return self.quantize.type if self.quantize is not None and self.quantize.type != "none" else None


Role = Literal["system", "user", "assistant", "tool"]


def _dataset_source(value: object) -> str:
    """Which member of `data.train` / `data.validation` a value is meant as, so errors speak of that one only."""
    return "datasets" if isinstance(value, (list, tuple, dict)) else "path"


def _one_dataset_as_list(value: object) -> object:
    """A single dataset may be written as a mapping instead of a list of one."""
    return [value] if isinstance(value, dict) else value


# The keys of a DatasetSpec that only some types of dataset read, with those types.
TYPE_KEYS = {
    "field": ("text",),
    "prompt_field": ("completion", "preference", "kto"),
    "completion_field": ("completion", "kto"),
    "chosen_field": ("preference",),
    "rejected_field": ("preference",),
    "label_field": ("kto",),
    "instruction_field": ("instruction",),
    "input_field": ("instruction",),
    "output_field": ("instruction",),
    "system_field": ("instruction", "chat"),
    "messages_field": ("chat",),
    "chat_format": ("chat",),
    "roles": ("chat",),
}


class DatasetSpec(Section):
    """One dataset of `data.train` / `data.validation` when they are a list: where it is, what kind of records it
    holds, which fields to read, and its share of an epoch. A key that only another type reads (the type each
    description starts with) is refused."""

    path: str = Field(
        ...,
        min_length=1,
        description="'hub:org/name' for a Hugging Face Hub dataset (read with datasets.load_dataset from its "
        "snapshot in huggingface_hub's cache: split, subset; its commit is its fingerprint), or "
        "a .jsonl, .json (a list of records), .parquet or .txt file (.jsonl and .json also gzipped: .gz), a "
        "directory written by Hugging Face datasets' save_to_disk, or 'builtin:chat' "
        "('builtin:chat/validation') for the bundled synthetic chat data, 'builtin:preference' "
        "('builtin:preference/validation') for its preference pairs.",
    )
    type: Literal["text", "completion", "instruction", "chat", "preference", "kto"] = Field(
        ...,
        description="text: documents trained on whole (cut into seq_len pieces); completion: a prompt and its "
        "completion; instruction: alpaca-style instruction / input / output; chat: a list of messages (OpenAI "
        "role/content or sharegpt from/value); preference: a prompt with a chosen and a rejected answer "
        "(train.objective dpo, orpo or simpo); kto: a prompt, one answer and a true/false label (train.objective kto).",
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="Share of an epoch: the dataset contributes round(weight x its "
        "samples) samples per epoch, below 1 a seeded subset, above 1 whole repeats plus a seeded "
        "subset; the same samples every epoch and on resume.",
    )
    split: str | None = Field(
        None,
        description="Split of a datasets directory holding several (a DatasetDict), or of a Hub dataset; "
        "default: its only split, or 'train'.",
    )
    subset: str | None = Field(
        None,
        description="A Hub dataset's subset (its configuration's name, load_dataset's second argument); default: "
        "its only one.",
    )
    field: str = Field(
        "text", min_length=1, description="text: the field holding the document (JSONL, JSON, parquet, datasets)."
    )
    prompt_field: str = Field(
        "prompt",
        min_length=1,
        description="completion, preference and kto: the field holding the prompt, a string or a list of chat "
        "messages. preference: a record without it is in the implicit form, whole chosen and rejected "
        "conversations whose shared beginning is the prompt (Anthropic HH).",
    )
    completion_field: str = Field(
        "completion",
        min_length=1,
        description="completion and kto: the field holding the completion (kto: a string or the assistant's messages).",
    )
    chosen_field: str = Field(
        "chosen",
        min_length=1,
        description="preference: the field holding the preferred answer, a string or the assistant's messages "
        "(TRL's preference format), or the whole conversation in the implicit form.",
    )
    rejected_field: str = Field(
        "rejected",
        min_length=1,
        description="preference: the field holding the dispreferred answer, in the chosen answer's form.",
    )
    label_field: str = Field(
        "label",
        min_length=1,
        description="kto: the field holding whether the completion is desirable, a JSON true or false.",
    )
    instruction_field: str = Field(
        "instruction", min_length=1, description="instruction: the field holding the instruction."
    )
    input_field: str = Field(
        "input",
        min_length=1,
        description="instruction: the optional field holding the "
        "input; when present and not empty it follows the instruction after a blank line (data.template alpaca: in "
        "an '### Input:' block after Stanford Alpaca's preamble for a task with an input).",
    )
    output_field: str = Field("output", min_length=1, description="instruction: the field holding the response.")
    system_field: str | None = Field(
        None,
        description="instruction and chat: a field holding a system prompt (none by default; a record without "
        "text there has none; chat: used unless the messages start with a system message, as LLaMA-Factory's "
        "sharegpt 'system' column).",
    )
    messages_field: str | None = Field(
        None,
        description="chat: the field holding the list of messages; default "
        "'messages' (openai), 'conversations' (sharegpt), either with chat_format auto.",
    )
    chat_format: Literal["auto", "openai", "sharegpt"] = Field(
        "auto",
        description="chat: openai (messages of role/content), sharegpt (conversations of from/value), or auto "
        "(decided per record by the keys it has).",
    )
    roles: dict[str, Role] = Field(
        default_factory=dict,
        description="chat: extra role names mapped to system / user / assistant / tool, on top of the "
        "defaults (human, user -> user; gpt, assistant -> assistant; system -> system; tool, observation -> tool). "
        "Tool calling: an assistant message's tool_calls are targets as its text is, tool messages are inputs, and "
        "a record's 'tools' (function schemas) go to the chat template (apply_chat_template(tools=...)).",
    )

    @field_validator(*TYPE_KEYS, mode="after")
    @classmethod
    def _key_of_this_type(cls, value: object, info: ValidationInfo) -> object:
        # a key written for another type of dataset does nothing: refused. Only a value other than the default is:
        # a recipe dumped whole (run.json, a checkpoint's recipe) spells every default out, and reads back. `type`
        # comes before these keys, so it is known unless it was itself invalid
        kind = info.data.get("type")
        types = TYPE_KEYS[info.field_name]
        default = cls.model_fields[info.field_name].get_default(call_default_factory=True)
        if value is not None and value != default and kind is not None and kind not in types:
            raise ValueError(
                f"is read only for {_and(types)} datasets, and this dataset's type is {kind}, so "
                "it would do nothing — remove the key, or correct the dataset's type if it is wrong"
            )
        return value


# The dataset types a preference objective trains on (recipe/rules.py pairs them with train.objective).
PAIR_TYPES = ("preference", "kto")


def _and(words: tuple[str, ...]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 2 else words)


DatasetList = Annotated[list[DatasetSpec], Len(min_length=1)]

DatasetSource = Annotated[
    Annotated[str, Tag("path")]
    # the JSON schema names what a recipe may write (a list, or one dataset as a mapping), not the list it becomes,
    # so that editors accept what validate accepts
    | Annotated[
        DatasetList,
        BeforeValidator(_one_dataset_as_list, json_schema_input_type=DatasetList | DatasetSpec),
        Tag("datasets"),
    ],
    Discriminator(_dataset_source),
]


class Data(Section):
    train: DatasetSource = Field(
        ...,
        description="Training data: a path (a .txt or .jsonl text file, or 'builtin:shakespeare', whose "
        "validation side is 'builtin:shakespeare/validation') trained on as "
        "text, or a list of datasets (path, type, weight and field names; see DatasetSpec) for instruction and chat "
        "data; one dataset may be written as a mapping.",
    )
    validation: DatasetSource | None = Field(
        None,
        description="Validation data, a path or a list of datasets like `train`; when absent, a tail of the "
        "training samples.",
    )
    validation_fraction: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Share of the training data held out when no validation is given: the last windows of text, the "
        "last samples of each dataset of a list (at least one; give data.validation to train on every sample).",
    )
    validation_dedup: bool = Field(
        False,
        description="Leave out of validation the held-out records whose prompt (normalised: case, spacing and "
        "Unicode forms aside) also occurs in the training data, so the held-out loss and exact match score questions "
        "the model was not trained on. Off by default, as in Axolotl and LLaMA-Factory, which validate on the split "
        "they are given: the held-out set stays the one you chose. Either way the run counts such prompts (and "
        "prompt + answer pairs) and says so at the start, in its start record and beside the exact match. "
        "Completion, instruction and chat data; with data.validation files, the training files are read too.",
    )
    format: Literal["auto", "text", "jsonl"] = Field("auto", description="File format; 'auto' decides by extension.")
    field: str = Field("text", min_length=1, description="JSONL field holding the text.")
    seq_len: int = Field(1024, ge=8, le=1_048_576, description="Tokens per training sample.")
    packing: bool = Field(
        True,
        description="Text: pack documents end to end into seq_len windows (else each "
        "document starts its own windows, its last one padded). Datasets: pack whole samples into seq_len rows, each "
        "attending only to itself (position ids restart per sample); else one sample per row, padded. Preference and "
        "kto data are never packed: each pair is its own rows.",
    )
    group_by_length: bool | None = Field(
        None,
        description="Length bucketing: each optimizer step takes rows of similar length (sorted within a "
        "seeded mega-batch of 50 steps, the step groups shuffled) and each micro-batch is cut to its longest row "
        "(rounded up to 8 tokens), so padding is not computed; every row is still seen once per epoch and a "
        "resumed run sees the same batches. null: on when packing is off or the data is preference or kto pairs, off "
        "otherwise; off where unpacked samples or pairs are laid out packed within each step (varlen attention on a "
        "GPU: samples of one length fill rows worst).",
    )
    cache_dir: str | None = Field(
        None,
        description="Token cache directory (default $MEMTRAIN_CACHE, else ~/.cache/memtrain/tokens). It keeps an entry "
        "per version of the data and tokenizer, about the size of the data, and is never pruned: delete it, or "
        "entries in it, to free the space; what a run needs is tokenised again.",
    )
    template: str | None = Field(
        None,
        description="Chat template for completion, instruction and chat datasets: a shipped one (chatml, "
        "llama-3, alpaca) or null for the tokenizer's own chat_template. A conversation is tokenised as "
        "apply_chat_template(tokenize=True) tokenises it, so training sees the token ids inference prompts with; "
        "an answer that starts with whitespace starts at a token boundary, as the generation prompt ends.",
    )
    train_on_inputs: bool = Field(
        False,
        description="Train on every token (prompts, system text and template markers "
        "too); false: only on the responses.",
    )
    train_on: Literal["all_turns", "last_turn"] = Field(
        "all_turns", description="Which assistant turns of a conversation are targets (with train_on_inputs false)."
    )
    truncation: Literal["truncate", "drop"] = Field(
        "truncate",
        description="A sample longer than seq_len: truncate keeps its first seq_len tokens, drop leaves "
        "it out; either way the count is reported, and a sample left with no target tokens is dropped.",
    )
    skip_untrainable: bool = Field(
        False,
        description="Leave out a completion, instruction or chat record with nothing to train on (no assistant "
        "message, or an empty or null answer, as scraped ShareGPT dumps have), counted and warned about with the first "
        "one's line; an error if every record of a dataset is one. False: such a record is an error naming its line.",
    )
    add_special_tokens: bool = Field(
        False,
        description="Add the template's markers (e.g. <|im_start|>, <|im_end|>) to the tokenizer when it lacks "
        "them; the model's embeddings grow to match and are trained. False: a missing marker is an error.",
    )

    @model_validator(mode="after")
    def _train_and_validation_alike(self) -> Data:
        if self.validation is not None and isinstance(self.train, str) != isinstance(self.validation, str):
            # " — " separates the message from the hint (see recipe/messages.py)
            raise ValueError(
                "data.train and data.validation must both be paths (text) or both lists of datasets — "
                "a text file in a list is {path: FILE, type: text}"
            )
        return self

    @property
    def groups_by_length(self) -> bool:
        """Whether steps are length-bucketed and micro-batches cut to their longest row (group_by_length resolved):
        by default on when rows are not packed, which pairs never are."""
        if self.group_by_length is not None:
            return self.group_by_length
        return not self.packing or self.holds_pairs

    @property
    def holds_pairs(self) -> bool:
        """True when the datasets are preference or kto records (a preference objective's data), which become
        pairs of sequences (or KTO records with their KL rows), never packed rows."""
        return not isinstance(self.train, str) and any(spec.type in PAIR_TYPES for spec in self.train)

    @property
    def is_text(self) -> bool:
        """True when `train` is a path: the plain-text path (windows over concatenated documents)."""
        return isinstance(self.train, str)

    @property
    def item_name(self) -> str:
        """What one item of the training data is, for messages that count them (batch.global_batch counts items):
        "windows" of text, "pairs" of a preference objective, "packed rows" (several samples each), or "samples"."""
        if self.is_text:
            return "windows"
        if self.holds_pairs:
            return "pairs"
        return "packed rows" if self.packing else "samples"


def gpu_spec(value: str) -> str:
    """A target card (hardware.gpu, plan --gpu): a GPU profile's name or a positive size; ValueError
    "message — hint" otherwise."""
    if value in gpu_profile_names():
        return value
    if looks_like_size(value):
        if _byte_size(value) <= 0:
            raise ValueError(
                f"a card of '{value}' has no memory to plan against: the size must be positive — "
                "give the card's memory, such as '24GiB'"
            )
        return value
    close = difflib.get_close_matches(value, gpu_profile_names(), n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    # " — " separates the message from the hint (see recipe/messages.py)
    raise ValueError(
        f"'{value}' is neither a GPU profile nor a size — "
        f"{hint}profiles: {', '.join(gpu_profile_names())}; or a size such as '24GiB'"
    )


class Hardware(Section):
    gpus: int = Field(1, ge=1, le=64, description="GPUs (processes) to train on, on each node.")
    nodes: int = Field(
        1,
        ge=1,
        le=256,
        description="Machines the run spans, `gpus` processes on each; one "
        "`memtrain run` per node (--node-rank), or one with --hostfile that starts them all, "
        "docs/MULTINODE.md.",
    )
    gpu: Annotated[str, AfterValidator(gpu_spec)] = Field(
        "rtx3090",
        description="Target card: a profile in configs/gpus (rtx3090, rtx4090, ...) or a size such as '24GiB'.",
    )
    host_memory: ByteSize | None = Field(
        None,
        description="Host RAM available to the run, e.g. '64GiB'. Unset: `memtrain run` checks the plan "
        "against the RAM of the machine it runs on, and `memtrain plan` checks no host capacity (it still "
        "prints the host bytes).",
    )
    nvme_path: str | None = Field(None, description="Directory on a fast disk for the NVMe offload tiers.")
    cap_memory: bool = Field(
        True, description="On a card larger than the target, cap this process to the target's memory."
    )
    expandable_segments: bool = Field(
        True,
        description="PyTorch's expandable CUDA segments: memory one phase frees is "
        "reused by the next whatever the sizes, so little is reserved beyond what is "
        "allocated (PYTORCH_CUDA_ALLOC_CONF, when set, wins).",
    )

    @property
    def world_size(self) -> int:
        """Processes over all nodes: ZeRO partitions over them and the global batch splits over them."""
        return self.nodes * self.gpus


CheckpointAction = Literal["save", "recompute", "offload"]


class Checkpointing(Section):
    strategy: Literal[
        "none", "every_layer", "every_n_layers", "first_n_layers", "auto", "selective", "rules", "memory_budget"
    ] = Field(
        "every_layer",
        description="none: keep all activations; every_layer / every_n_layers / first_n_layers: recompute whole "
        "decoder layers; auto: the planner recomputes the fewest whole layers (from the first) that fit the card; "
        "selective: the article's default (embeddings saved, attention and MLP blocks recomputed); rules: use `rules`; "
        "memory_budget: the compiler chooses what each compiled decoder layer recomputes, within `memory_budget`.",
    )
    memory_budget: float = Field(
        0.5,
        gt=0,
        le=1,
        description="With memory_budget: the share of a decoder layer's activations (beyond its input) that the "
        "compiled layer may keep for backward (PyTorch's activation memory budget: torch.compile's partitioner "
        "recomputes the cheapest operations first, the element-wise ones before any matmul). 1 keeps what the "
        "compiler keeps by default. Needs compiled layers (train.compile auto or true), launched without CUDA "
        "graphs; the plan prices the budget's upper bound. The 7B LoRA recipe ships with 0.3 at 4 x 1024.",
    )
    every_n_layers: int = Field(1, ge=1, description="With every_n_layers: checkpoint one layer in N.")
    first_n_layers: int = Field(
        0,
        ge=0,
        description="With first_n_layers: recompute this many decoder layers, "
        "from the first (all of them when it is more than the model has).",
    )
    rules: dict[str, CheckpointAction] = Field(
        default_factory=dict,
        description="Module-name glob -> save | recompute | offload, e.g. {'model.layers.*.mlp': recompute}.",
    )
    offload_inputs: bool = Field(
        False,
        description="Recomputed decoder layers keep their inputs in pinned host memory instead of on the GPU "
        "(torch.autograd.graph.save_on_cpu around each checkpointed layer): a layer's input is micro_batch x "
        "seq_len x hidden_size, 16 GiB for Llama-3-8B at 65,536 tokens, so long sequences need it. The copies are "
        "not overlapped with compute. With every_layer / every_n_layers / first_n_layers; auto turns it on when "
        "the kept inputs would not fit the card.",
    )
    mlp_tiles: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        0,
        description="Compute every decoder layer's MLP in this many tiles along the sequence (DeepSpeed's TiledMLP): "
        "forward keeps only the MLP's input, backward recomputes it tile by tile, so its intermediates (gate, up, "
        "the activation's output and their gradients, seq_len x intermediate_size each: 1.16 GiB per tensor for "
        "Qwen2.5-7B at 32,768 tokens) exist for one tile at a time. Costs one more MLP forward per layer. 0: off; "
        "auto: ceil(seq_len / hidden_size) tiles, off where that is 1. Not with train.compile nor "
        "optimizer.step_in_backward; checkpointing.strategy auto turns it on (auto) when the recomputed layers "
        "with their inputs on the host would not fit the card.",
    )

    @property
    def compiled_memory_budget(self) -> float:
        """The activation memory budget compiled layers are built with: `memory_budget` under that strategy, else 1
        (what torch.compile's partitioner keeps by default)."""
        return self.memory_budget if self.strategy == "memory_budget" else 1.0


class LossScale(Section):
    initial_scale_power: int = Field(16, ge=0, le=40, description="fp16 initial loss scale = 2**power.")
    growth_interval: int = Field(1000, ge=1, description="Steps without overflow before the scale doubles.")
    hysteresis: int = Field(2, ge=1, description="Overflows tolerated before the scale is lowered.")
    min_scale: float = Field(1.0, gt=0, description="Lowest loss scale.")


class Precision(Section):
    compute: Dtype = Field("bf16", description="Dtype of weights and matmuls on the GPU.")
    mode: Literal["cast", "autocast"] = Field(
        "cast",
        description="cast: weights stored in the compute dtype (fp32_modules compute in fp32 from bf16 storage); "
        "autocast: weights stored in fp32 and matmuls (nn.Linear) run in bf16 through DeepSpeed's torch_autocast, "
        "so fp32_modules keep fp32 weights too, at twice the weight memory.",
    )
    master: Literal["fp32", "bf16"] = Field(
        "fp32", description="Dtype of master weights and optimizer states (bf16 halves host memory)."
    )
    loss_scale: LossScale | None = Field(None, description="fp16 dynamic loss scaling (only with compute: fp16).")
    fp32_modules: list[str] = Field(
        default_factory=list,
        description="Module-name globs kept in fp32, e.g. ['*norm*', 'lm_head'].",
    )
    fp32_loss: bool = Field(True, description="Compute softmax / cross-entropy of the logits in fp32.")
    chunked_loss: bool = Field(
        True, description="Compute the loss over vocabulary-chunks of tokens so full fp32 logits never exist."
    )
    loss_chunk_tokens: int = Field(1024, ge=16, description="Tokens per chunk of the chunked loss.")

    @property
    def storage(self) -> str:
        """The dtype weights (and their gradients) are stored in: fp32 under autocast, else the compute dtype."""
        return "fp32" if self.mode == "autocast" else self.compute


class Aio(Section):
    block_size: int = Field(1_048_576, ge=4096, description="Bytes per asynchronous I/O request to the NVMe.")
    queue_depth: int = Field(8, ge=1, description="I/O requests in flight at once.")
    intra_op_parallelism: int = Field(1, ge=1, description="Threads that submit the I/O of one operation.")
    single_submit: bool = Field(False, description="Submit requests one at a time instead of in batches.")
    overlap_events: bool = Field(True, description="Overlap submitting new requests with waiting for finished ones.")


class Offload(Section):
    zero_stage: Literal["auto", 0, 1, 2, 3] = Field(
        "auto",
        description="ZeRO stage; auto: 3 when parameters are offloaded or the optimizer states go to NVMe "
        "(only ZeRO-3 swaps them to disk); 1 for LoRA on one GPU that holds everything (one rank has nothing to "
        "partition, and ZeRO-1 reduces the adapters' gradients once a step where ZeRO-2's hooks reduce them at every "
        "micro-batch); else 2. 0 only with optimizer.step_in_backward or fp32 weights: DeepSpeed's stage-0 bf16 "
        "optimizer took shorter Adam steps.",
    )
    optimizer: Tier = Field("none", description="Where optimizer states (fp32 master + Adam moments) live.")
    params: Tier = Field("none", description="Where parameters live between uses (needs ZeRO-3).")
    ratio: float = Field(
        1.0,
        gt=0,
        le=1,
        description=(
            "Share of optimizer states offloaded (ZeRO-3 partial offload): the first (1 - ratio) of the optimizer's "
            "sub-groups (1e8 elements each) keep master weights, moments and gradients on the GPU and are updated "
            "there; memtrain checkpoints their moments, which DeepSpeed's own checkpoint leaves out."
        ),
    )
    pin_memory: bool = Field(True, description="Page-locked host buffers for faster transfers.")
    cpu_adam: Literal["deepspeed", "torch"] = Field(
        "deepspeed",
        description=(
            "The AdamW that steps an optimizer offloaded to the CPU: deepspeed, DeepSpeed's CPU Adam (a C++ op built "
            "with the machine's compiler on first use); torch, PyTorch's fused AdamW on the CPU (nothing to build; "
            "fp32 master weights only, offload.optimizer=cpu)."
        ),
    )
    overlap_comm: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "Overlap gradient reduction and transfers with backward on a side stream (ZeRO 2 and 3), at the cost of "
            "several reduce buckets alive at once. auto: on where there is something to overlap (several GPUs, or "
            "states offloaded to the CPU or NVMe); off on one GPU that holds everything, where it only held memory "
            "(0.10 GiB more reserved at the same speed for Llama-3-8B LoRA)."
        ),
    )
    buffer_count: int = Field(5, ge=1, description="Parameter buffers for NVMe/CPU parameter offload.")
    max_live_parameters: int = Field(1_000_000_000, ge=0, description="ZeRO-3: parameters resident on the GPU at once.")
    prefetch_bucket_size: int | Literal["auto"] = Field(
        "auto", description="ZeRO-3 prefetch size in elements; auto derives from hidden size."
    )
    bucket_size: int | Literal["auto"] = Field(
        "auto", description="Reduce / all-gather bucket size in elements; auto derives from hidden size."
    )
    aio: Aio = Field(default_factory=Aio, description="Asynchronous I/O settings for the NVMe tiers (DeepSpeed `aio`).")
    zenflow: bool = Field(
        False,
        description="DeepSpeed ZenFlow (top-k gradient columns updated on the GPU, the rest "
        "by the CPU optimizer, overlapped). Refused: DeepSpeed 0.19.8's ZenFlow scrambles the weight "
        "matrices inside deepspeed.initialize (docs/BENCHMARKS.md, levers).",
    )


class Adaptive(Section):
    grow_after_steps: int = Field(5, ge=1, description="Consecutive steps under grow_below before growing.")
    grow_below: float = Field(0.70, gt=0, lt=1, description="Memory share of the card under which the batch may grow.")
    grow_factor: float = Field(1.5, gt=1, le=4, description="Factor the micro-batch grows by.")
    shrink_above: float = Field(0.90, gt=0, le=1, description="Memory share above which the batch halves.")
    shrink_factor: float = Field(0.5, gt=0, lt=1, description="Factor the micro-batch shrinks by (above shrink_above).")
    min_micro_batch: int = Field(1, ge=1, description="Smallest micro-batch the policy will use.")
    max_micro_batch: int = Field(256, ge=1, description="Largest micro-batch the policy will use.")
    max_oom_at_min: int = Field(3, ge=1, description="OOMs at the minimum size before the run stops.")


class Batch(Section):
    global_batch: int = Field(32, ge=1, description="Samples per optimizer step, over all GPUs.")
    micro_batch: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Samples per forward pass per GPU, or 'auto': the planner's largest size that divides "
        "the per-GPU share of global_batch and fits the card with its measured margin (fewer micro-batches per step; "
        "with an offloaded optimizer each one costs a gradient round trip through the host).",
    )
    policy: Literal["fixed", "adaptive"] = Field(
        "fixed", description="adaptive: grow/shrink micro_batch with memory, global batch fixed."
    )
    adaptive: Adaptive = Field(default_factory=Adaptive, description="Thresholds of the adaptive policy.")


class Optimizer(Section):
    name: Literal["adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit"] = Field(
        "adamw",
        description="adamw: torch's fused AdamW on the GPU, DeepSpeed's CPU Adam when offloaded; adamw_8bit: "
        "bitsandbytes' AdamW with 8-bit blockwise moments (2 instead of 8 bytes per trainable parameter); "
        "paged_*: bitsandbytes' AdamW whose states live in CUDA unified memory that pages to the host under "
        "memory pressure. The bitsandbytes optimizers stay beside the model (no offload.optimizer).",
    )
    lr: float = Field(2e-4, gt=0, lt=1, description="Peak learning rate.")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.95), description="Adam moment decay rates (beta1, beta2)."
    )
    eps: float = Field(1e-8, gt=0, le=1, description="Adam denominator epsilon.")
    # each update multiplies the weights by (1 - lr × weight_decay): far above 1 they flip sign and blow up
    weight_decay: float = Field(0.0, ge=0, le=1, description="Decoupled weight decay (AdamW), usually 0-0.1.")
    grad_clip: float = Field(1.0, ge=0, description="Max gradient norm; 0 disables clipping.")
    step_in_backward: bool = Field(
        False,
        description="Update each parameter as soon as backward has its gradient, and free the gradient "
        "(torchtune's optimizer-in-backward): a full fine-tune never holds the model's gradients. Needs one "
        "micro-batch per step (batch.micro_batch = batch.global_batch, which 'auto' gives it), optimizer.grad_clip=0, "
        "one GPU, offload.zero_stage=0, batch.policy=fixed, precision.mode=cast and the weights as their own master "
        "copy (precision.master=bf16, or fp32 with compute fp32); with "
        "paged_adamw_8bit the states page between the card and the host.",
    )

    @property
    def eight_bit(self) -> bool:
        """bitsandbytes' 8-bit moments (adamw_8bit, paged_adamw_8bit)."""
        return self.name.endswith("8bit")

    @property
    def paged(self) -> bool:
        """bitsandbytes' states in CUDA unified memory (paged_adamw, paged_adamw_8bit)."""
        return self.name.startswith("paged")


class Schedule(Section):
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup from 0 to the peak LR.")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="LR decay after warmup.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a share of the peak LR.")


Objective = Literal["sft", "dpo", "orpo", "simpo", "kto"]


class Train(Section):
    objective: Objective = Field(
        "sft",
        description="What the loss trains: sft, the next token of the targets (supervised fine-tuning); dpo, "
        "orpo, simpo: the chosen answer over the rejected one of preference pairs (data of type preference); kto: "
        "desirable answers up and undesirable ones down, unpaired (data of type kto). The settings of the preference "
        "objectives are the `preference` section. batch.global_batch and micro_batch then count pairs (kto: records).",
    )
    steps: int | None = Field(None, ge=1, description="Optimizer steps; give exactly one of steps and epochs.")
    epochs: float | None = Field(None, gt=0, description="Passes over the training data, instead of steps.")
    eval_every: int = Field(100, ge=1, description="Evaluate every N optimizer steps (and at the end).")
    eval_batches: int = Field(
        8,
        ge=1,
        description="Validation batches per evaluation, over all GPUs, each of batch.micro_batch "
        "samples, or of 4 when it is 'auto' (the set does not depend on the card or the GPU count).",
    )
    eval_generate: int = Field(
        0,
        ge=0,
        description="Held-out conversations the model answers by greedy generation at step 0 and at the "
        "end of the run, scored by exact match with the last assistant message (a 'generation' record in "
        "metrics.jsonl), with the validation loss at step 0 beside the first score; needs completion, instruction or "
        "chat data, and not ZeRO-3. 0: off.",
    )
    save_every: int = Field(500, ge=1, description="Checkpoint every N optimizer steps (and at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept.")
    log_every: int = Field(10, ge=1, description="Flush metrics every N optimizer steps (no per-step host sync).")
    seed: int = Field(
        1234,
        ge=0,
        le=MAX_SEED,
        description="Seed of model initialisation, data order and dropout (0 to 2**64 - 1, what torch's generators "
        "take).",
    )
    max_bad_steps: int = Field(
        3,
        ge=1,
        le=1000,
        description="Steps in a row whose loss or gradient norm is not finite (NaN/inf) before the "
        "run stops; each such step's update is skipped, and no checkpoint is saved from that state.",
    )
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile each decoder layer: fuses the element-wise work around the matmuls "
        "(norms, rotary embedding, SwiGLU, LoRA scaling and dropout) into fewer kernels. The first step waits "
        "for the compiler (one layer is compiled, the others reuse it; its cache makes later runs start sooner). "
        "ZeRO stage 0-2, no activation offload rules, no quantised base. auto: on a CUDA GPU for LoRA of a "
        "family it was measured on (Llama, Mistral, Qwen2; memtrain.model.compiled), not with lean LoRA dropout; "
        "true: wherever allowed; false: never. A layer the compiler fails on runs eager (PyTorch's warning says "
        "why). `memtrain plan` prices compiled layers where the run on a GPU would compile them.",
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto",
        description="Replay each compiled layer's kernels as a CUDA graph (torch.compile's reduce-overhead "
        "mode): one launch instead of dozens, for steps that would otherwise wait on the host (many small "
        "micro-batches). Needs compiled layers on a CUDA GPU, LoRA adapters, nothing recomputed "
        "(checkpointing.strategy: none) and micro-batches of one width (text in seq_len windows). auto: on wherever "
        "those hold; true: the recipe checks refuse it where they do not (a machine without CUDA runs the layers "
        "without graphs); false: never.",
    )
    output_dir: str = Field(
        "runs/{name}", description="Run directory; {name} is the run name (the recipe's name, else its file's stem)."
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None,
        description="Experiment trackers that receive every metric metrics.jsonl receives, and the recipe and the "
        "plan's figures: tensorboard (RUN_DIR/tensorboard), wandb (pip install 'memtrain[wandb]'; WANDB_MODE=offline "
        "works offline), mlflow ('memtrain[mlflow]'; MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns). A "
        "resumed run continues the same tracker run. Default: tensorboard where its package is installed; []: none.",
    )


# The usual beta of each preference objective (TRL's defaults: DPOConfig, CPOConfig for SimPO, ORPOConfig, KTOConfig),
# used when preference.beta is not set.
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0, "kto": 0.1}
# The preference keys each objective reads; a key set for another objective does nothing (recipe/rules.py).
PREFERENCE_KEYS = {
    "loss_type": ("dpo",),
    "label_smoothing": ("dpo",),
    "sft_weight": ("dpo",),
    "simpo_gamma": ("simpo",),
    "orpo_lambda": ("orpo",),
    "kto_desirable_weight": ("kto",),
    "kto_undesirable_weight": ("kto",),
}


class Preference(Section):
    """The settings of a preference objective (train.objective dpo, orpo, simpo or kto)."""

    beta: float | None = Field(
        None,
        gt=0,
        description="Temperature of the implicit reward (DPO, IPO, KTO: how far the policy may move from the "
        "reference; SimPO: the reward scale; ORPO: unused, its weight is orpo_lambda). null: the objective's usual "
        "value, dpo 0.1 (ipo too), simpo 2.0, kto 0.1.",
    )
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="dpo: sigmoid, DPO's -log sigmoid(beta × margin); ipo, IPO's squared distance of the margin "
        "from 1 / (2 beta).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="dpo with loss_type sigmoid: the share of pairs assumed mislabelled (conservative DPO); 0: none.",
    )
    sft_weight: float = Field(
        0.0,
        ge=0,
        description="dpo: the weight of the chosen answer's mean NLL added to each pair's loss (RPO; TRL's "
        "loss_type [sigmoid, sft] with this weight, LLaMA-Factory's pref_ftx): the policy keeps learning the chosen "
        "answers while it learns to prefer them, which helps where the model does not yet write them. 0: plain DPO.",
    )
    simpo_gamma: float = Field(
        0.5, ge=0, description="simpo: the target reward margin gamma (TRL's simpo_gamma), in units of beta's reward."
    )
    orpo_lambda: float = Field(
        0.1,
        gt=0,
        description="orpo: the weight of the odds-ratio term beside the chosen answer's NLL (TRL's ORPO beta).",
    )
    kto_desirable_weight: float = Field(1.0, gt=0, description="kto: the weight of the desirable records' losses.")
    kto_undesirable_weight: float = Field(1.0, gt=0, description="kto: the weight of the undesirable records' losses.")
    reference: Literal["auto", "adapters_off", "precomputed", "none"] = Field(
        "auto",
        description="The reference model of dpo and kto: adapters_off, the model itself with its LoRA adapters "
        "disabled (no second copy; needs model.lora); precomputed, the initial model's log-probabilities of every pair "
        "computed in one pass before training and stored beside the token cache (one model in memory); none: no "
        "reference (orpo and simpo, which need none). auto: none for orpo and simpo, adapters_off under LoRA, "
        "precomputed for a full fine-tune.",
    )

    def beta_for(self, objective: str) -> float:
        """beta, or the objective's usual value when it is not set."""
        return self.beta if self.beta is not None else DEFAULT_BETA.get(objective, 0.1)

    def reference_for(self, objective: str, lora: bool) -> str:
        """The reference the run uses: 'adapters_off' | 'precomputed' | 'none' (auto resolved)."""
        if self.reference != "auto":
            return self.reference
        if objective in ("orpo", "simpo", "sft"):
            return "none"
        return "adapters_off" if lora else "precomputed"


class Recipe(Section):
    """A memtrain recipe. Every section has defaults; `model` and `data` must say what to train on."""

    # a recipe that `extends:` another may leave model/data to its base, so editors must not demand them
    model_config = ConfigDict(**Section.model_config, json_schema_extra=lambda schema: schema.pop("required", None))

    name: str | None = Field(None, description="Run name (default: the recipe file's stem).")
    extends: str | None = Field(None, description="A recipe file this one extends (its keys are the defaults).")
    model: Model = Field(
        ..., description="What to fine-tune: a shape preset or a local model directory, and optional LoRA."
    )
    data: Data = Field(..., description="Training and validation text, sequence length, packing.")
    hardware: Hardware = Field(default_factory=Hardware, description="GPUs, target card, host memory, NVMe directory.")
    checkpointing: Checkpointing = Field(
        default_factory=Checkpointing, description="Which activations are kept and which recomputed."
    )
    precision: Precision = Field(
        default_factory=Precision, description="Compute and master dtypes, fp16 loss scaling, modules kept in fp32."
    )
    offload: Offload = Field(
        default_factory=Offload, description="ZeRO stage and where optimizer states and parameters live."
    )
    batch: Batch = Field(default_factory=Batch, description="Global batch, micro-batch and the adaptive batch policy.")
    optimizer: Optimizer = Field(default_factory=Optimizer, description="AdamW settings and gradient clipping.")
    schedule: Schedule = Field(default_factory=Schedule, description="Learning-rate warmup and decay.")
    train: Train = Field(
        default_factory=Train,
        description="Run length, evaluation, checkpoint and logging cadence, seed, output directory.",
    )
    preference: Preference | None = Field(
        None,
        description="Settings of a preference objective (train.objective dpo, orpo, simpo or kto): beta, the loss "
        "variant, the reference model. Read only with such an objective; absent: the objective's defaults.",
    )

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage this runs with: offload.zero_stage, or for 'auto'
        - 3 when parameters are offloaded or the optimizer states go to NVMe: DeepSpeed's ZeRO-1/2 optimizer has no
          NVMe swapper and keeps states offloaded to any device in host memory (stage_1_and_2.py, 0.19.8);
        - 1 for LoRA on one process with everything on its GPU: a single rank has nothing to partition, and ZeRO-1
          reduces the gradients once a step at the accumulation boundary, where ZeRO-2's per-parameter hooks reduce
          them at every micro-batch (7B LoRA at 16 micro-batches of 1 x 1024 tokens: docs/BENCHMARKS.md, "ZeRO's
          hooks"). The same optimizer as ZeRO-2 with the same numbers (tests/train/test_deepspeed_engine.py). Not for a
          full fine-tune: ZeRO-1 keeps the accumulated gradients in the parameters and copies them into its partition
          at the boundary, a second copy of every gradient that the adapters' few do not make count. Not 0: DeepSpeed's
          stage-0 bf16 optimizer took Adam steps 0.75x as long as ZeRO's on the same gradients (same test file);
        - else 2."""
        o = self.offload
        if o.zero_stage != "auto":
            return int(o.zero_stage)
        if o.params != "none" or o.optimizer == "nvme":
            return 3
        if self.model.lora is not None and self.hardware.world_size == 1 and o.optimizer == "none":
            return 1
        return 2

    @property
    def preference_settings(self) -> Preference:
        """The preference section, or its defaults when the recipe has none."""
        return self.preference if self.preference is not None else Preference()
