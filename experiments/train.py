"""Train with gin configs: `python experiments/train.py --gin_file=experiments/configs/quickstart.gin`.

Same as the installed `sfrrl-train` console script (sfrrl_jax/launch/cli.py holds the flags and the
job), run from this checkout: the shipped recipes (experiments/recipes/) are imported first, which
registers their Job kinds (Job.kind = 'quickstart'). Importing them starts no JAX backend, so
--cpu_devices still applies.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import experiments.recipes  # noqa: E402,F401  (registers the recipes' Job kinds)
from sfrrl_jax.launch.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
