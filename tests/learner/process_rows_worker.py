"""One process of tests/learner/test_process_rows.py: each process trains its own rows.

    python process_rows_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_NPZ

Three optimizer steps; each step, process p contributes `rows_for(step, p)` (its own row count
and width) through `global_microbatch`. Process 0 writes each step's loss and the final params.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from process_run import join_run  # noqa: E402

pid, nproc, (out,) = join_run()
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from sfrrl_jax.learner.process_rows import global_microbatch  # noqa: E402
from process_rows_common import STEPS, rows_for, setup  # noqa: E402

ts, params, opt_state, mesh = setup()
losses = []
for step in range(STEPS):
    batch = global_microbatch(rows_for(step, pid), mesh)
    params, opt_state, metrics = ts.step(params, opt_state, batch)
    losses.append(float(metrics["loss"]))
flat = {jax.tree_util.keystr(path): np.asarray(multihost_utils.process_allgather(x, tiled=True))
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
if pid == 0:
    np.savez(out, __losses=np.array(losses), **flat)
