"""Which module boundaries a checkpointing rule may cut at: a pure rule on the recipe's patterns.

Recompute and offload rules name modules by glob; a boundary inside a residual block (between the
split and the addition) saves the very tensors it was meant to free, so such rules are refused
before any model exists.
"""

from __future__ import annotations

import re

# Children of a decoder layer whose output is added to the residual stream as a whole.
RESIDUAL_BRANCHES = frozenset(
    {
        "self_attn",
        "attn",
        "attention",
        "self_attention",
        "cross_attn",
        "mlp",
        "feed_forward",
        "ffn",
        "block_sparse_moe",
    }
)
# Module lists that hold the decoder layers in Hugging Face models (model.layers, transformer.h, ...).
LAYER_CONTAINERS = frozenset({"layers", "layer", "h", "blocks"})
_INDEX = re.compile(r"^(\d+|\*|\?|\[[^\]]*\])$")


def _cut_problem(pattern: str) -> str | None:
    """Why recomputing/offloading the modules `pattern` names would cut inside a residual block, or None.

    The rule: a boundary may sit at a whole decoder layer (`model.layers.*`), at a whole residual
    branch of a layer (its attention or feed-forward block, `*.self_attn`, `*.mlp`), or at a module
    outside the decoder layers (`model.embed_tokens`, `model.norm`, `lm_head`). Anything below a
    branch (a projection, an activation) or beside one (a norm feeding a branch) sits between a
    residual split and its addition, so its boundary saves the same tensors it was meant to free.
    """
    parts = pattern.split(".")
    for i in range(len(parts) - 1):
        if parts[i] in LAYER_CONTAINERS and _INDEX.match(parts[i + 1]):
            tail = parts[i + 2 :]
            if not tail or (len(tail) == 1 and tail[0] in RESIDUAL_BRANCHES):
                return None
            return (
                f"'{'.'.join(tail)}' is inside a decoder layer but is not a whole attention or "
                "feed-forward block, so its boundary would cut inside a residual addition"
            )
    last = parts[-1]
    if last in RESIDUAL_BRANCHES:
        return None
    if "*" not in pattern and "?" not in pattern and "[" not in pattern:
        return None  # a literal name outside any decoder layer (embeddings, final norm, lm_head)
    return (
        f"the pattern can match '{last}' modules inside decoder layers (projections, norms), "
        "which would cut inside a residual addition"
    )


def rule_problems(rules: dict[str, str]) -> list[tuple[str, str]]:
    """(pattern, message) for each recompute/offload rule that would cut inside a residual block.

    `save` rules are always fine (saving cuts nothing). See `_cut_problem` for the exact rule.
    """
    problems = []
    for pattern, action in rules.items():
        if action == "save":
            continue
        message = _cut_problem(pattern)
        if message:
            problems.append((pattern, message))
    return problems
