"""Activation checkpointing strategies applied to Hugging Face causal LMs."""
from __future__ import annotations


def rule_problems(rules: dict[str, str]) -> list[tuple[str, str]]:
    """(pattern, message) for each rule that would cut inside a residual block."""
    return []
