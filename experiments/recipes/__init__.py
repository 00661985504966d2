"""The shipped recipes. Importing this package registers their Job kinds with
`sfrrl_jax.launch.recipes` (experiments/train.py and the `sfrrl-train` CLI import it before
reading a gin file, so `Job.kind = 'quickstart'` resolves)."""
from experiments.recipes import quickstart  # noqa: F401  (registers Job kind 'quickstart')
from experiments.recipes import smollm2_rl  # noqa: F401  (registers Job kind 'smollm2_rl')
from experiments.recipes import smollm2_tool_rl  # noqa: F401  (registers Job kind 'smollm2_tool_rl')
