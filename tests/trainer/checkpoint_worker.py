"""One process of a multi-process checkpoint round trip (tests/trainer/test_checkpoint_processes.py).

    python checkpoint_worker.py PROCESS_ID NUM_PROCESSES PORT CKPT_DIR save|restore OUT_NPZ

The state is a tiny MoE's params and Adam state on a (data=2, expert=4) mesh of the 8 global
devices (8 // NUM_PROCESSES per process), plus a PRNG key. `save` writes step 3 with host state;
`restore` reads the newest step into a fresh abstract state and process 0 writes every leaf,
gathered to full arrays, and the host state to OUT_NPZ.
"""
import json
import os
import sys

pid, nproc, port, ckpt_dir, mode, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                        sys.argv[5], sys.argv[6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sfrrl_jax.launch.distributed import DistributedConfig, initialize  # noqa: E402

initialize(DistributedConfig(coordinator=f"localhost:{port}", num_processes=nproc, process_id=pid,
                             heartbeat_timeout_s=10))
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import sfrrl_jax as S  # noqa: E402
from sfrrl_jax.checkpoints.orbax_store import Checkpointer, abstract_of, leaf_name  # noqa: E402
from sfrrl_jax.learner import make_train_step  # noqa: E402
from sfrrl_jax.learner.optimizer import OptimizerConfig  # noqa: E402
from sfrrl_jax.rl.config import LossConfig  # noqa: E402
from model_fixtures import TINY, randomize  # noqa: E402

cfg = TINY.replace(max_seq_len=64)
mesh = S.make_mesh(data=2, expert=4, devices=jax.devices())
params = randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)
ts = make_train_step(cfg, LossConfig(), OptimizerConfig(learning_rate=1e-3))
# every leaf a global array (a key made outside the mesh lives on one device of one process)
rng = jax.jit(lambda: jax.random.key(11), out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))()
state = {"params": params, "opt_state": ts.init_opt_state(params), "rng": rng}
ckpt = Checkpointer(ckpt_dir, save_every=1, keep=2)
if mode == "save":
    ckpt.maybe_save(3, state, {"data_index": 17, "note": f"written by {nproc} processes"}, force=True)
    ckpt.wait()
    ckpt.close()
else:
    zeros = jax.tree.map(lambda x: x * 0 if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, state)
    step, restored, host = ckpt.restore_latest(abstract_of(zeros))
    ckpt.close()
    leaves = {}
    for path, x in jax.tree_util.tree_flatten_with_path(restored)[0]:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        full = multihost_utils.process_allgather(x, tiled=True)   # every process takes part
        leaves[leaf_name(path)] = np.asarray(full)
        # the restored array is laid out as the abstract state asked (this mesh's sharding)
        assert x.sharding.mesh.shape == mesh.shape
    if pid == 0:
        np.savez(out, __step=step, __host=json.dumps(host), **leaves)
