"""The train step on the real tiny MoE over the (data=2, expert=4) mesh of 8 fake devices."""
import jax
import numpy as np
import pytest

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.models import init_params
from sfrrl_jax.rl import LossConfig
from sfrrl_jax.learner import OptimizerConfig, make_train_step

B, T = 8, 16


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.preset("tiny-moe")
    mesh = make_mesh(data=2, expert=4)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    for b in range(B):
        mask[b, 2 + b % 3: T - b % 4] = 1.0
    return cfg, mesh, tokens, mask


def test_sft_steps_reduce_the_loss_and_keep_shardings(setup):
    cfg, mesh, tokens, mask = setup
    params = init_params(cfg, mesh, seed=0)
    shardings = jax.tree.map(lambda p: p.sharding, params)
    ts = make_train_step(cfg, LossConfig(objective="sft", vocab_chunk=128, seq_chunk=8),
                         OptimizerConfig(learning_rate=3e-3, warmup_steps=1, total_steps=10))
    opt = ts.init_opt_state(params)
    # ZeRO-1: the moments add the 'data' axis (embedding [vocab, embed]: embed dim split over data)
    mu = opt["inner"][1][0].mu
    assert "data" in tuple(mu["embed"]["embedding"].sharding.spec)
    assert "data" not in tuple(params["embed"]["embedding"].sharding.spec)
    batch = {"tokens": tokens, "loss_mask": mask}
    losses = []
    for _ in range(4):
        params, opt, m = ts.step(params, opt, batch)
        assert float(m["update_skipped"]) == 0.0
        losses.append(float(m["loss"]))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses
    assert int(opt["step"]) == 4
    assert jax.tree.map(lambda p: p.sharding, params) == shardings
    assert float(m["router_aux_loss"]) > 0.0
