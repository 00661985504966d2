"""Learning-rate schedule values, ZeRO-1 state shardings, optimizer config checks."""
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.learner import OptimizerConfig, learning_rate_schedule
from sfrrl_jax.learner.optimizer import _with_extra_axis


@pytest.mark.parametrize("step,lr", [(0, 0.5), (1, 1.0), (2, 1.0), (4, 0.55), (6, 0.1), (100, 0.1)])
def test_warmup_cosine_schedule(step, lr):
    sched = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=2, total_steps=6, end_lr_ratio=0.1))
    assert float(sched(step)) == pytest.approx(lr, rel=1e-6)


def test_no_warmup_starts_at_peak():
    assert float(learning_rate_schedule(OptimizerConfig(learning_rate=0.3, total_steps=10))(0)) == pytest.approx(0.3)


def test_state_sharding_adds_data_axis_on_a_free_divisible_dim():
    mesh = make_mesh(data=2, expert=4)
    sh = NamedSharding(mesh, P(None, "expert"))
    assert _with_extra_axis(sh, (4, 8), "data").spec == P("data", "expert")
    assert _with_extra_axis(sh, (3, 8), "data").spec == P(None, "expert")      # 3 % 2 != 0
    assert _with_extra_axis(NamedSharding(mesh, P("data")), (4,), "data").spec == P("data")
    assert _with_extra_axis(sh, (4, 8), None) is sh


def test_optimizer_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_grad_norm"):
        OptimizerConfig(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="end_lr_ratio"):
        OptimizerConfig(end_lr_ratio=2.0)
