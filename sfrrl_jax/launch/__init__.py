"""The launch layer: the `sfrrl-train` CLI, gin bindings of the config dataclasses, the experiment
runner, and the recipe registry (`register_recipe`: the Job kinds that experiment code adds)."""
from sfrrl_jax.launch.recipes import Recipe, get_recipe, recipe_kinds, register_recipe

__all__ = ["Recipe", "get_recipe", "recipe_kinds", "register_recipe"]
