"""A recipe read and checked in full: its own fields and rules, then the files, models and packages it names."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from memtrain.checks.environment import Environment, check_environment, current_environment
from memtrain.errors import Problem
from memtrain.recipe.load import load_recipe, load_recipe_text
from memtrain.recipe.rules import check_rules
from memtrain.recipe.sources import LoadedRecipe


def load_checked(
    path: str | Path,
    overrides: list[str] | None = None,
    env: Environment | None = None,
    weights_fit: bool = True,
    packages: bool = True,
) -> LoadedRecipe:
    """load_recipe with the second validation phase: every problem of both phases is raised together,
    in reading order, as one RecipeError. weights_fit and packages: see check_environment."""
    env = env or current_environment()
    return load_recipe(
        path,
        overrides,
        more_checks=lambda loaded, bad: check_environment(
            loaded, env, skip_sections=bad, weights_fit=weights_fit, packages=packages
        ),
    )


def load_checked_text(
    text: str, file: str = "<recipe>", overrides: list[str] | None = None, env: Environment | None = None
) -> LoadedRecipe:
    """load_checked for recipe text held in memory (tests, tools)."""
    env = env or current_environment()
    return load_recipe_text(
        text, file, overrides, more_checks=lambda loaded, bad: check_environment(loaded, env, skip_sections=bad)
    )


def recipe_checks(env: Environment, packages: bool = True) -> Callable[[LoadedRecipe], list[Problem]]:
    """Every problem of an already loaded recipe on this machine: its cross-field rules, then its files, models
    and (unless `packages` is False, as for `plan`) packages: what `plan --fit` and a run's host-memory hint ask
    of each candidate change."""
    return lambda loaded: check_rules(loaded) + check_environment(loaded, env, packages=packages)
