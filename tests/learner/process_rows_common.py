"""Model, train step and per-process rows shared by test_process_rows.py and its workers."""
import jax
import numpy as np
import optax

import sfrrl_jax as S
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.rl.config import LossConfig

from model_fixtures import TINY, host_randomize

STEPS = 3
SGD_LR = 0.1


def setup():
    cfg = TINY.replace(max_seq_len=64)
    mesh = S.make_mesh(data=2, expert=4, devices=jax.devices())
    params = host_randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)
    # Plain SGD: the params move by lr x the gradient, so comparing 1 process with 2 sees the
    # computation's own agreement (Adam's normalised step scales a last-bit difference of a
    # near-zero gradient up to a sizeable share of its step).
    ts = make_train_step(cfg, LossConfig(), optax.sgd(SGD_LR))
    return ts, params, ts.init_opt_state(params), mesh


def rows_for(step: int, process: int) -> dict:
    """Process `process`'s rows at `step`: its own count (3 or 5) and width (24 or 40)."""
    rng = np.random.default_rng([step, process])
    n, width = (3, 24) if (step + process) % 2 == 0 else (5, 40)
    lengths = rng.integers(width // 2, width + 1, size=n)
    tokens = rng.integers(1, 500, size=(n, width)).astype(np.int32)
    mask = np.zeros((n, width), np.float32)
    for i, length in enumerate(lengths):
        tokens[i, length:] = 0
        mask[i, 4:length] = 1.0
    logprobs = (-rng.random((n, width)) * mask).astype(np.float32)
    return {"tokens": tokens, "loss_mask": mask, "advantages": rng.normal(size=n).astype(np.float32),
            "rollout_logprobs": logprobs}
