"""The RL run of tests/trainer/test_rl_processes.py, built alike in 1 process x 8 devices and in
each of 2 processes x 4 (the workload's seeded tool-bound trajectories, tiny MoE; plain SGD in
sync mode, Adam in the others; the early mode also swaps the KV cache and the gradient sums
through host memory)."""
import jax
import numpy as np
import optax

import sfrrl_jax as S
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream

CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=128)
# 2 prompts drawn twice over 2 steps of 2 groups: revisits, on the other process than the first
# visit (the stream's seed 3 draws them in the order 1, 0 and then 0, 1)
WL = WorkloadConfig(num_prompts=2, response_median=5, response_sigma=0.8, max_response=16,
                    tool_latency_median_s=0.02, tool_latency_sigma=0.5, max_turns=3)
STEPS = 2
STREAM_SEED = 3
MODES = ("sync", "pipelined", "early")   # early: pipelined with early_groups=2 (early samples)
# overprovision: pipelined, 3 groups launched for 2 (which one is surplus depends on timing, so it
# is checked for what it must do, not against one process)
WORKER_MODES = MODES + ("overprovision",)
# sync trains with plain SGD: the params then move by lr x the gradient, so the comparison with one
# process sees the computation's own agreement; Adam's normalised step (the other modes) scales a
# last-bit difference of a near-zero gradient up to a sizeable share of the step.
SYNC_SGD_LR = 0.1


def make_trainer(mode: str, engine_cls=None, early_groups: int = 0, overprovision_groups: int = 0) -> RLTrainer:
    """engine_cls None: the trainer's own choice (a LockstepEngine on N processes). With early
    groups, idle work runs beside any decode batch (underfull_slots = max_slots), so a sample that
    finishes before its group trains early at the next tick (the path under test)."""
    # decode_steps=4: a quarter of the device calls, each one lockstep tick (an exchange and
    # gloo collectives across processes): the same run, a fraction of the wall time
    # early groups also swap: the KV cache waits in host memory while each micro-step runs and
    # the gradient sums between micro-steps (global arrays moved across memory kinds, N processes)
    swap = bool(early_groups)
    tc = TrainerConfig(mode=mode, groups_per_step=2, group_size=4, max_slots=8, max_len=64,
                       buckets=(16, 32), seq_bucket=32, decode_steps=4, early_groups=early_groups,
                       overprovision_groups=overprovision_groups,
                       underfull_slots=8 if early_groups else 0, swap_cache=swap)
    mesh = S.make_mesh(data=2, expert=4)
    params = S.init_params(CFG, mesh, seed=0)
    engine = None
    if engine_cls is not None:
        engine = engine_cls(CFG, params, max_slots=tc.engine_slots, max_len=tc.max_len, buckets=tc.buckets,
                            decode_steps=tc.decode_steps, swap_cache=swap)
    optimizer = (optax.sgd(SYNC_SGD_LR) if mode == "sync"
                 else OptimizerConfig(learning_rate=1e-3, offload_accumulator=swap))
    return RLTrainer(CFG, params, tc, LossConfig(), optimizer, WorkloadAgent(WL),
                     TaskStream(make_tasks(WL), seed=STREAM_SEED), engine=engine)


KEYS = ("train/loss", "reward/mean", "rollout/generated_tokens", "train/trained_tokens", "train/microsteps",
        "policy/on_policy_fraction")


def run(mode: str, engine_cls=None) -> tuple[list[dict], dict]:
    """STEPS steps: each step's metrics (KEYS) and the final params as full host arrays."""
    from jax.experimental import multihost_utils
    trainer = (make_trainer("pipelined", engine_cls, early_groups=2) if mode == "early"
               else make_trainer("pipelined", engine_cls, overprovision_groups=1) if mode == "overprovision"
               else make_trainer(mode, engine_cls))
    metrics = []
    for _ in range(STEPS):
        m = trainer.step()
        metrics.append({k: float(m[k]) for k in KEYS} | {"hidden": float(m["time/hidden_train_share"]),
                                                         "early": float(m["train/early_microsteps"]),
                                                         "swaps": float(m["engine/cache_swaps"]),
                                                         "surplus": float(m["rollout/groups_surplus"])})
    params = {jax.tree_util.keystr(p): np.asarray(multihost_utils.process_allgather(x, tiled=True))
              for p, x in jax.tree_util.tree_flatten_with_path(trainer.params)[0]}
    return metrics, params
