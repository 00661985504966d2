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


@pytest.mark.parametrize("mu_dtype", [None, "float32"])
def test_bf16_params_optimizer_state_keeps_its_dtypes_across_updates(mu_dtype):
    """Each state leaf keeps its init dtype across updates (optax computed the first moment in
    float32 from float32 gradient sums and kept it so: the update recompiled at the second step
    and a checkpoint's state no longer matched its restore target). mu_dtype picks mu's dtype."""
    import jax
    import numpy as np
    from sfrrl_jax.config import ModelConfig
    from sfrrl_jax.learner import make_train_step
    from sfrrl_jax.models import init_params
    from sfrrl_jax.rl import LossConfig
    cfg = ModelConfig.preset("tiny-moe", max_seq_len=32, n_layers=1, param_dtype="bfloat16",
                             compute_dtype="bfloat16")
    ts = make_train_step(cfg, LossConfig(), OptimizerConfig(learning_rate=1e-3, mu_dtype=mu_dtype))
    params = init_params(cfg, make_mesh(data=2, devices=jax.devices()[:2]), seed=0)
    opt = ts.init_opt_state(params)
    before = [(x.dtype, x.sharding) for x in jax.tree.leaves(opt)]
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (2, 16)).astype(np.int32),
             "loss_mask": np.ones((2, 16), np.float32), "advantages": np.ones((2, 16), np.float32),
             "rollout_logprobs": -np.ones((2, 16), np.float32)}
    start = jax.tree.map(np.asarray, params)
    for _ in range(2):
        params, opt, _ = ts.apply(params, opt, ts.grad_microstep(params, ts.init_accumulator(params), batch))
        assert [(x.dtype, x.sharding) for x in jax.tree.leaves(opt)] == before
    assert {str(x.dtype) for x in jax.tree.leaves(opt) if x.ndim} == (
        {"bfloat16"} if mu_dtype is None else {"float32", "bfloat16"})   # mu, nu
    assert ts.jitted_apply(params)._cache_size() == 1
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(params)))


def test_mu_dtype_is_checked():
    with pytest.raises(ValueError, match="OptimizerConfig.mu_dtype='int8' is not a float dtype"):
        OptimizerConfig(mu_dtype="int8")
    with pytest.raises(ValueError, match="OptimizerConfig.mu_dtype='fp33' is not a float dtype"):
        OptimizerConfig(mu_dtype="fp33")


def test_weight_decay_skips_norms_biases_and_sinks_of_stacked_layers():
    """decay_matrices_only: a stacked layer's norm scale is [layers, embed] and a q bias
    [layers, heads, head_dim], as many dims as a matrix; neither may decay (HF's Trainer and verl
    exclude norms and biases), while every weight matrix does."""
    import jax
    import numpy as np

    import sfrrl_jax as S
    from sfrrl_jax.learner.optimizer import build_optimizer, decays
    cfg = S.ModelConfig.preset("tiny-moe", attention_bias=True, attn_sinks=True, router_bias=True, expert_bias=True,
                               qk_norm=True)
    params = S.init_params(cfg, S.make_mesh(devices=jax.devices()[:1]), seed=0)
    params = jax.tree.map(lambda p: np.ones(p.shape, np.float32), params)
    opt = build_optimizer(OptimizerConfig(learning_rate=1e-2, weight_decay=0.5, warmup_steps=0, max_grad_norm=None))
    zero = jax.tree.map(np.zeros_like, params)
    updates, _ = opt.update(zero, opt.init(params), params)
    moved = {jax.tree_util.keystr(p): bool(np.any(np.asarray(u) != 0))
             for p, u in jax.tree_util.tree_flatten_with_path(updates)[0]}
    frozen = {k for k, m in moved.items() if not m}
    assert frozen == {k for k in moved if k.endswith(("['scale']", "bias']", "['sinks']", "['b_gate']", "['b_up']",
                                                       "['b_down']"))}
    assert "['layers']['attn_norm']['scale']" in frozen and "['layers']['attn']['q_bias']" in frozen
    assert "['final_norm']['scale']" in frozen and "['layers']['attn']['q_norm']['scale']" in frozen
    for matrix in ("['layers']['attn']['q_proj']", "['layers']['moe']['w_gate']", "['embed']['embedding']",
                   "['layers']['moe']['router']"):
        assert moved[matrix], matrix
    assert decays((jax.tree_util.DictKey("w_up"),), np.ones((2, 2))) and not decays((), np.ones(3))
