"""One process of tests/trainer/test_rl_processes.py: the RL run of rl_processes_common, each
process rolling out and training its share of the groups.

    python rl_processes_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_PREFIX

For each mode, process 0 writes OUT_PREFIX<mode>.npz: the per-step metrics and the final params.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from process_run import join_run  # noqa: E402

pid, nproc, (out,) = join_run()
import numpy as np  # noqa: E402

from rl_processes_common import WORKER_MODES, run  # noqa: E402

for mode in WORKER_MODES:
    metrics, params = run(mode)
    if pid == 0:
        np.savez(f"{out}{mode}.npz", __metrics=json.dumps(metrics), **params)
