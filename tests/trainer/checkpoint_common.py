"""The state, save and restore of the cross-process checkpoint test (test_checkpoint_processes.py
runs them in its own process and in checkpoint_worker.py's N processes)."""
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

import sfrrl_jax as S
from sfrrl_jax.checkpoints.orbax_store import Checkpointer, abstract_of, leaf_name
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.rl.config import LossConfig

from model_fixtures import TINY, host_randomize


def state_and_mesh():
    """A tiny MoE's params and Adam state on a (data=2, expert=4) mesh of the 8 global devices,
    plus a PRNG key; every leaf a global array (a key made outside the mesh would live on one
    device of one process)."""
    cfg = TINY.replace(max_seq_len=64)
    mesh = S.make_mesh(data=2, expert=4, devices=jax.devices())
    params = host_randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)
    ts = make_train_step(cfg, LossConfig(), OptimizerConfig(learning_rate=1e-3))
    rng = jax.jit(lambda: jax.random.key(11), out_shardings=NamedSharding(mesh, P()))()
    return {"params": params, "opt_state": ts.init_opt_state(params), "rng": rng}, mesh


def save(ckpt_dir) -> None:
    state, _ = state_and_mesh()
    with Checkpointer(ckpt_dir, save_every=1, keep=2) as ckpt:
        ckpt.maybe_save(3, state, {"data_index": 17, "note": f"written by {jax.process_count()} processes"},
                        force=True)
        ckpt.wait()


def restore(ckpt_dir) -> tuple[int, dict, dict]:
    """(step, host state, every leaf gathered to a full host array by name); all processes call it."""
    state, mesh = state_and_mesh()
    zeros = jax.tree.map(lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x * 0, state)
    with Checkpointer(ckpt_dir, save_every=1, keep=2) as ckpt:
        step, restored, host = ckpt.restore_latest(abstract_of(zeros))
    leaves = {}
    for path, x in jax.tree_util.tree_flatten_with_path(restored)[0]:
        assert x.sharding.mesh.shape == mesh.shape   # laid out as the abstract state asked
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        leaves[leaf_name(path)] = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return step, host, leaves
