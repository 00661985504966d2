"""One process of a multi-process checkpoint round trip (tests/trainer/test_checkpoint_processes.py).

    python checkpoint_worker.py PROCESS_ID NUM_PROCESSES PORT CKPT_DIR save|restore OUT_NPZ

`save` writes checkpoint_common's state as step 3; `restore` reads the newest step and process 0
writes every leaf, gathered to full arrays, and the host state to OUT_NPZ.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from process_run import join_run  # noqa: E402

pid, nproc, (ckpt_dir, mode, out) = join_run()
import numpy as np  # noqa: E402

import checkpoint_common  # noqa: E402

if mode == "save":
    checkpoint_common.save(ckpt_dir)
else:
    step, host, leaves = checkpoint_common.restore(ckpt_dir)
    if pid == 0:
        np.savez(out, __step=step, __host=json.dumps(host), **leaves)
