"""One process of a multi-process checkpoint round trip (tests/trainer/test_checkpoint_processes.py).

    python checkpoint_worker.py PROCESS_ID NUM_PROCESSES PORT CKPT_DIR save|restore OUT_NPZ

`save` writes checkpoint_common's state as step 3; `restore` reads the newest step and process 0
writes every leaf, gathered to full arrays, and the host state to OUT_NPZ.
"""
import json
import os
import sys

pid, nproc, port, ckpt_dir, mode, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                        sys.argv[5], sys.argv[6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sfrrl_jax.launch.distributed import DistributedConfig, initialize  # noqa: E402

initialize(DistributedConfig(coordinator=f"localhost:{port}", num_processes=nproc, process_id=pid,
                             heartbeat_timeout_s=10))
import numpy as np  # noqa: E402

import checkpoint_common  # noqa: E402

if mode == "save":
    checkpoint_common.save(ckpt_dir)
else:
    step, host, leaves = checkpoint_common.restore(ckpt_dir)
    if pid == 0:
        np.savez(out, __step=step, __host=json.dumps(host), **leaves)
