"""The recipe registry: the Job kinds that `sfrrl-train` runs besides the built-in 'rl'.

A recipe is experiment code, not library code (the shipped ones live in `experiments/recipes/`):
a frozen config class plus a function that runs it. Its module registers it when imported,

    register_recipe("quickstart", QuickstartRecipe, run_quickstart)

and from then on a gin file can say

    Job.kind = 'quickstart'
    Job.quickstart = @QuickstartRecipe()
    Job.run_dir = '/tmp/runs/quickstart'

`gin_bindings` makes each registered class a gin configurable (module 'sfrrl') at its next
`load_job`, and the Job takes the recipe's config under the parameter named after its kind.
Nothing in the library imports a recipe: whoever runs one imports its module first
(`experiments/train.py` imports `experiments.recipes`; the `sfrrl-train` CLI the modules of
`sfrrl_jax.recipes` entry points and of its --recipe_module flags).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

#: Job kinds the launch room runs itself ('rl': `run_experiment(Job.experiment)`).
BUILTIN_KINDS = ("rl",)
# Job's own parameters: a recipe kind of the same name could not be told apart from them.
_RESERVED = frozenset({"kind", "experiment", "run_dir", "recipe"})

RunFn = Callable[..., dict]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One registered Job kind.

    recipe_cls: the recipe's config class (a gin configurable once registered; `Job.<kind>` must
      be an instance of it).
    run: `run(recipe, run_dir, log=print) -> dict` runs the recipe into `run_dir` (created by the
      caller) and returns a JSON-able summary; `log` takes one line of text.
    validate: optional `validate(recipe) -> None`, raising ValueError when the recipe cannot run;
      called by `sfrrl-train --validate_only`, which must allocate nothing.
    """

    kind: str
    recipe_cls: type
    run: RunFn
    validate: Callable[[Any], None] | None = None


_RECIPES: dict[str, Recipe] = {}


def register_recipe(kind: str, recipe_cls: type, run_fn: RunFn,
                    validate_fn: Callable[[Any], None] | None = None) -> Recipe:
    """Registers `recipe_cls` / `run_fn` as Job kind `kind` (see `Recipe`); returns the entry.

    Registering the same (kind, class, functions) objects again is a no-op.

    Args:
      kind: the Job kind, an identifier (it names the Job parameter that takes the recipe's config).
      recipe_cls: the recipe's config class (a gin configurable once registered).
      run_fn: `run(recipe, run_dir, log=print) -> dict`, runs the recipe (see `Recipe.run`).
      validate_fn: optional `validate(recipe) -> None`, raising ValueError when the recipe cannot run (see
        `Recipe.validate`).
    Returns:
      The registered `Recipe`.
    Raises:
      ValueError: when a different class or function is already registered under `kind` (two recipes would
        answer to one gin name), or `kind` is not an identifier, is a built-in kind or one of Job's own
        parameter names.
      TypeError: when `recipe_cls` is not a class, or `run_fn` / `validate_fn` is not callable.
    """
    if not isinstance(kind, str) or not kind.isidentifier():
        raise ValueError(f"register_recipe: kind must be an identifier (it names a Job parameter), got {kind!r}")
    if kind in BUILTIN_KINDS or kind in _RESERVED:
        raise ValueError(f"register_recipe: kind {kind!r} is taken by the Job itself "
                         f"(built-in kinds {list(BUILTIN_KINDS)}, Job parameters {sorted(_RESERVED)})")
    if not isinstance(recipe_cls, type):
        raise TypeError(f"register_recipe({kind!r}): recipe_cls must be a class, got {recipe_cls!r}")
    if not callable(run_fn) or (validate_fn is not None and not callable(validate_fn)):
        raise TypeError(f"register_recipe({kind!r}): run_fn and validate_fn must be callables")
    entry = Recipe(kind, recipe_cls, run_fn, validate_fn)
    old = _RECIPES.get(kind)
    if old is not None and old != entry:
        raise ValueError(f"register_recipe: kind {kind!r} is already registered to "
                         f"{old.recipe_cls.__module__}.{old.recipe_cls.__qualname__}")
    _RECIPES[kind] = entry
    return entry


def unregister_recipe(kind: str) -> None:
    """Removes a registered kind (for tests that register throwaway recipes); unknown kinds are ignored."""
    _RECIPES.pop(kind, None)


def recipe_kinds() -> tuple[str, ...]:
    """Every Job kind that can run now.

    Returns:
      The built-in kinds (`BUILTIN_KINDS`), then the registered recipes' kinds in registration order.
    """
    return BUILTIN_KINDS + tuple(_RECIPES)


def registered_recipes() -> tuple[Recipe, ...]:
    return tuple(_RECIPES.values())


def get_recipe(kind: str) -> Recipe:
    """The registered recipe of `kind`.

    Args:
      kind: a Job kind.
    Returns:
      Its `Recipe` entry.
    Raises:
      ValueError: naming the valid kinds (and how recipes get registered) when `kind` has no registered recipe.
    """
    try:
        return _RECIPES[kind]
    except KeyError:
        raise ValueError(unknown_kind_message(kind)) from None


def unknown_kind_message(kind: str) -> str:
    return (f"Job.kind={kind!r}; valid: {list(recipe_kinds())} (a recipe's kind exists once its module is "
            f"imported and calls sfrrl_jax.launch.recipes.register_recipe; the shipped recipes are in "
            f"experiments/recipes/, which experiments/train.py imports; sfrrl-train imports --recipe_module "
            f"modules and sfrrl_jax.recipes entry points)")
