"""A loss and an optimizer the library does not have, passed as values to the train step.

The loss (REINFORCE, token mean: -sum(A * logp * mask) / sum(mask), no ratio, no clip, no
rollout log-probs needed) is written here against the `rl.Loss` contract only; its gradient must
equal `jax.grad` of the same loss written directly on `sfrrl_jax.models.forward`'s logits. The
optimizer is a plain optax chain (clip + SGD with momentum); its update must equal optax applied
by hand to the accumulated, normalised gradient.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.models import forward, init_params
from sfrrl_jax.rl import Loss, LossConfig, LossInputs, ObjectiveParts
from sfrrl_jax.learner import (
    Accumulator, OptimizerConfig, OptState, TrainStep, make_train_step, validate_microbatch,
)
from sfrrl_jax.learner.deferred import check_deferrable

CFG = ModelConfig.preset("tiny-moe", max_seq_len=32, n_layers=1)
B, T = 8, 16


def reinforce(x: LossInputs) -> ObjectiveParts:
    """-(A * logp), summed over the loss tokens; the train step divides by the token count."""
    m = x.mask
    num = jnp.sum(-x.fields["advantages"] * x.logp * m)
    sg = jax.lax.stop_gradient
    return ObjectiveParts(
        numerator=num, denominator=jnp.sum(m), num_tokens=jnp.sum(m),
        num_seqs=jnp.sum((jnp.sum(m, axis=1) > 0).astype(jnp.float32)),
        sums={"agg/reinforce": sg(num), "tok/logp": sg(jnp.sum(x.logp * m))},
        maxes={"logp_max": sg(jnp.max(jnp.where(m > 0, x.logp, -jnp.inf)))}, mins={},
        advantage_term=num)


REINFORCE = Loss(fn=reinforce, required_fields=("tokens", "loss_mask", "advantages"),
                 linear_in_advantages=True, has_advantage_free_terms=False,
                 advantage_metrics=("agg/reinforce",), name="reinforce", vocab_chunk=128, seq_chunk=8,
                 router_aux_coef=0.0, router_z_coef=0.0)


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    for b in range(B):
        mask[b, 2 + b % 3: T - b % 4] = 1.0
    mask[5] = 0.0  # a fully masked row
    return {"tokens": tokens, "loss_mask": mask,
            "advantages": (rng.normal(size=(B, T)) * mask).astype(np.float32)}


def reference_loss(params, batch):
    """The same loss, written directly on the model's logits (aligned to the token scored)."""
    tokens = jnp.asarray(batch["tokens"])
    logits = forward(CFG, params, tokens)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
    mask = jnp.asarray(batch["loss_mask"])[:, 1:]
    return jnp.sum(-jnp.asarray(batch["advantages"])[:, 1:] * logp * mask) / jnp.sum(mask)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(devices=jax.devices()[:1])  # one device: compiles fast; sharding is tested elsewhere


def test_custom_loss_and_optax_optimizer_train_a_step(mesh):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9))
    ts = make_train_step(CFG, REINFORCE, tx)
    assert ts.loss is REINFORCE and ts.loss_cfg is None and ts.optimizer_cfg is None and ts.tx is tx
    params = init_params(CFG, mesh, seed=0)
    p0 = jax.tree.map(np.asarray, params)
    batch = make_batch()
    l_ref, g_ref = jax.jit(jax.value_and_grad(reference_loss))(params, batch)
    l_ref, g_ref = float(l_ref), jax.tree.map(np.asarray, g_ref)

    opt = ts.init_opt_state(params)
    assert isinstance(opt, OptState) and int(opt.step) == 0
    # momentum (param-shaped state) is sharded like its param; the rest replicated
    trace = opt.inner[1][0].trace
    for t, p in zip(jax.tree.leaves(trace), jax.tree.leaves(params)):
        assert t.sharding.is_equivalent_to(p.sharding, p.ndim)
    acc = ts.init_accumulator(params)
    for rows in (slice(0, 4), slice(4, 8)):  # two micro-batches: the sums are exact over the split
        acc = ts.grad_microstep(params, acc, {k: v[rows] for k, v in batch.items()})
    assert isinstance(acc, Accumulator)
    den = float(acc.scalars.denominator)
    assert den == float(batch["loss_mask"][:, 1:].sum()) and float(acc.scalars.num_microbatches) == 2.0
    grads = jax.tree.map(lambda g: np.asarray(g) / den, acc.grads)

    # the gradient of the loss value equals jax.grad of the loss written directly
    num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref)))
    scale = sum(float(np.sum(b ** 2)) for b in jax.tree.leaves(g_ref))
    assert scale > 0 and (num / scale) ** 0.5 < 1e-5, (num / scale) ** 0.5

    # the update equals optax applied by hand to the accumulated, normalised gradient
    updates, _ = tx.update(grads, tx.init(p0), p0)
    want = optax.apply_updates(p0, updates)
    params, opt, metrics = ts.apply(params, opt, acc)
    for path, w in jax.tree_util.tree_flatten_with_path(want)[0]:
        got = np.asarray(dict(jax.tree_util.tree_flatten_with_path(params)[0])[path])
        np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6, err_msg=str(path))
    assert int(opt.step) == 1 and float(metrics["update_skipped"]) == 0.0
    assert float(metrics["loss"]) == pytest.approx(l_ref, rel=1e-5)
    assert float(metrics["reinforce"]) == pytest.approx(l_ref, rel=1e-5)  # 'agg/' metric / den
    assert "learning_rate" not in metrics  # a raw transformation without an injected rate
    assert float(metrics["router_aux_loss"]) > 0  # measured, coefficient 0


def test_missing_declared_field_is_named(mesh):
    batch = make_batch()
    with pytest.raises(KeyError, match=r"missing \['advantages'\], required by the loss reinforce"):
        validate_microbatch({k: v for k, v in batch.items() if k != "advantages"}, REINFORCE)
    validate_microbatch(batch, REINFORCE)  # no rollout_logprobs needed
    # a field no built-in reads is valid for a loss that declares it, unknown otherwise
    weighted = Loss(fn=reinforce, required_fields=("tokens", "loss_mask", "advantages", "token_weights"),
                    name="weighted")
    with pytest.raises(KeyError, match="token_weights"):
        validate_microbatch(batch, weighted)
    validate_microbatch({**batch, "token_weights": batch["loss_mask"]}, weighted)
    with pytest.raises(KeyError, match="unknown keys \\['token_weights'\\]"):
        validate_microbatch({**batch, "token_weights": batch["loss_mask"]}, REINFORCE)
    # declarations are checked when the Loss is made
    with pytest.raises(ValueError, match="loss_mask"):
        Loss(fn=reinforce, required_fields=("tokens", "advantages"))
    with pytest.raises(ValueError, match="advantages"):
        Loss(fn=reinforce, linear_in_advantages=True)
    # what it declares replaces the string checks of the deferred path
    check_deferrable(REINFORCE)
    with pytest.raises(ValueError, match="linear_in_advantages"):
        check_deferrable(weighted)
    with pytest.raises(ValueError, match="behavior='current'"):
        check_deferrable(LossConfig(behavior="rollout"))


def test_injected_learning_rate_is_reported():
    """A transformation exposing its rate via optax.inject_hyperparams reports it (stand-in model)."""
    V, D = 24, 8
    mesh1 = make_mesh(devices=jax.devices()[:1])
    k = jax.random.split(jax.random.key(0), 2)
    params = jax.device_put({"embed": jax.random.normal(k[0], (V, D)), "head": jax.random.normal(k[1], (D, V))},
                            NamedSharding(mesh1, P()))

    def standin(p, tokens, segment_ids, positions):
        return p["embed"][tokens], p["head"], {}

    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(0.5, 0.1, 4))
    ts = TrainStep(standin, REINFORCE, tx)
    rng = np.random.default_rng(1)
    batch = {"tokens": rng.integers(0, V, (2, 6)).astype(np.int32), "loss_mask": np.ones((2, 6), np.float32),
             "advantages": rng.normal(size=(2, 6)).astype(np.float32)}
    opt = ts.init_opt_state(params)
    lrs = []
    for _ in range(2):
        params, opt, m = ts.step(params, opt, batch)
        lrs.append(float(m["learning_rate"]))
    assert lrs == pytest.approx([0.5, 0.4], rel=1e-6)  # the rate each update used
    assert int(opt["step"]) == 2  # the former dict keys still read the fields
    with pytest.raises(TypeError, match="OptimizerConfig or an optax.GradientTransformation"):
        TrainStep(standin, REINFORCE, "adamw")
    assert TrainStep(standin, LossConfig(objective="sft"), OptimizerConfig()).loss.name.startswith("sft")
