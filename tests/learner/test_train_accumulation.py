"""Exact micro-batch accumulation, NaN skipping and the update, on a small stand-in forward.

The stand-in (defined here, test-only) is a one-layer token-wise network with the train step's
forward contract: (params, tokens, segment_ids, positions) -> (hidden, unembedding, aux).
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.rl import LossConfig
from sfrrl_jax.learner import OptimizerConfig, TrainStep

V, D, B, T = 48, 8, 8, 12


def standin_forward(params, tokens, segment_ids, positions):
    x = params["embed"][tokens]
    hidden = jnp.tanh(x @ params["w"]) + x
    aux = {"router_aux_loss": jnp.mean(jnp.square(hidden)), "router_z_loss": jnp.mean(jnp.abs(hidden))}
    return hidden, params["head"], aux


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(devices=jax.devices()[:1])


def make_params(mesh, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    rep = NamedSharding(mesh, P())
    p = {"embed": jax.random.normal(k[0], (V, D)), "w": jax.random.normal(k[1], (D, D)) * 0.5,
         "head": jax.random.normal(k[2], (D, V)) * 0.5}
    return jax.device_put(p, rep)


def make_batch(seed=0, packed=False):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    lengths = rng.integers(3, T + 1, B)  # uneven lengths
    prompt = rng.integers(1, 4, B)
    pos = np.arange(T)[None]
    mask = ((pos >= prompt[:, None]) & (pos < lengths[:, None])).astype(np.float32)
    mask[5] = 0.0  # one fully masked row
    batch = {
        "tokens": tokens,
        "loss_mask": mask,
        "advantages": rng.normal(size=(B, T)).astype(np.float32) * mask,
        "rollout_logprobs": (-rng.random((B, T)) * 3).astype(np.float32),
        "ref_logprobs": (-rng.random((B, T)) * 3).astype(np.float32),
    }
    if packed:
        seg = np.ones((B, T), np.int32)
        seg[:, T // 2:] = 2
        seg[np.arange(B) % 3 == 0, -2:] = 0  # padding tail
        batch["segment_ids"] = seg
        mask[:, T // 2] = 0.0  # a sequence's first token is a prompt token
    return batch


def split_rows(batch, sizes, pad_to):
    """Row groups of the given sizes, each padded with fully masked rows to `pad_to` rows."""
    out, start = [], 0
    for n in sizes:
        mb = {}
        for k, v in batch.items():
            part = v[start:start + n]
            pad = np.zeros((pad_to - n,) + v.shape[1:], v.dtype)
            mb[k] = np.concatenate([part, pad]) if pad_to > n else part
        out.append(mb)
        start += n
    assert start == B
    return out


SPLITS = {1: [8], 2: [3, 5], 4: [1, 3, 2, 2], 8: [1] * 8}


def accumulated(ts, params, microbatches):
    acc = ts.init_accumulator(params)
    for mb in microbatches:
        acc = ts.grad_microstep(params, acc, mb)
    den = float(acc["scalars"]["denominator"])
    return jax.tree.map(lambda g: np.asarray(g) / max(den, 1.0), acc["grads"]), acc


def rel_err(a, b):
    num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    den = sum(float(np.sum(y ** 2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
def test_any_split_gives_the_full_batch_gradient(mesh, aggregation):
    params = make_params(mesh)
    cfg = LossConfig(aggregation=aggregation, norm_length=T, behavior="rollout", clip_low=0.2,
                     clip_high=0.28, kl_coef=0.05, entropy_coef=0.01, is_correction="tis",
                     vocab_chunk=16, seq_chunk=8)
    ts = TrainStep(standin_forward, cfg, OptimizerConfig(learning_rate=1e-2))
    batch = make_batch(packed=aggregation == "seq_mean_token_mean")
    full, acc_full = accumulated(ts, params, [batch])
    assert np.abs(jax.tree.leaves(full)[0]).max() > 0
    for n, sizes in SPLITS.items():
        # one micro-batch shape (a shape bucket): rows beyond the group are fully masked padding
        got, acc = accumulated(ts, params, split_rows(batch, sizes, B))
        assert rel_err(got, full) <= 1e-6, (n, rel_err(got, full))
        for k in ("numerator", "denominator", "num_tokens", "num_seqs"):
            assert float(acc["scalars"][k]) == pytest.approx(float(acc_full["scalars"][k]), rel=1e-6), k
        assert float(acc["maxes"]["ratio_max"]) == pytest.approx(float(acc_full["maxes"]["ratio_max"]), rel=1e-6)


def test_sft_split_and_fused_step_match_microsteps(mesh):
    cfg = LossConfig(objective="sft", vocab_chunk=16, seq_chunk=8)
    ts = TrainStep(standin_forward, cfg, OptimizerConfig(learning_rate=1e-2, max_grad_norm=None))
    batch = {k: v for k, v in make_batch().items() if k in ("tokens", "loss_mask")}
    full, _ = accumulated(ts, make_params(mesh), [batch])
    got, _ = accumulated(ts, make_params(mesh), split_rows(batch, SPLITS[4], 4))
    assert rel_err(got, full) <= 1e-6

    # fused step == microsteps + apply (fresh params each: both donate them)
    p1, p2 = make_params(mesh), make_params(mesh)
    o1, o2 = ts.init_opt_state(p1), ts.init_opt_state(p2)
    p1, o1, m1 = ts.step(p1, o1, batch)
    acc = ts.init_accumulator(p2)
    for mb in split_rows(batch, SPLITS[4], 4):
        acc = ts.grad_microstep(p2, acc, mb)
    p2, o2, m2 = ts.apply(p2, o2, acc)
    chex.assert_trees_all_close(p1, p2, rtol=1e-5, atol=1e-6)
    assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-6)
    assert float(m2["num_microbatches"]) == 4 and float(m1["update_skipped"]) == 0.0
    assert int(o1["step"]) == 1
    # the loss is the masked NLL: check against a direct computation
    mask = batch["loss_mask"][:, 1:]
    h, w, _ = standin_forward(make_params(mesh), jnp.asarray(batch["tokens"]), None, None)
    logp = jax.nn.log_softmax(h @ w)[:, :-1]
    nll = -np.take_along_axis(np.asarray(logp), batch["tokens"][:, 1:, None], -1)[..., 0]
    assert float(m1["loss"]) == pytest.approx(float(np.sum(nll * mask) / np.sum(mask)), rel=1e-5)


def test_nonfinite_gradient_skips_the_update(mesh):
    cfg = LossConfig(objective="sft", vocab_chunk=16, seq_chunk=8)
    ts = TrainStep(standin_forward, cfg, OptimizerConfig(learning_rate=1e-2))
    params = make_params(mesh)
    before = jax.tree.map(np.asarray, params)
    opt = ts.init_opt_state(params)
    opt_before = jax.tree.map(np.asarray, opt)
    acc = ts.init_accumulator(params)
    batch = {k: v for k, v in make_batch().items() if k in ("tokens", "loss_mask")}
    acc = ts.grad_microstep(params, acc, batch)
    acc["grads"]["w"] = acc["grads"]["w"].at[0, 0].set(jnp.nan)
    params, opt, m = ts.apply(params, opt, acc)
    assert float(m["update_skipped"]) == 1.0
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), before)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, opt), opt_before)
    assert int(opt["step"]) == 0
    # params kept their sharding
    assert params["w"].sharding == NamedSharding(mesh, P())


def test_router_losses_join_the_loss_with_their_coefficients(mesh):
    batch = {k: v for k, v in make_batch().items() if k in ("tokens", "loss_mask")}
    cfg = LossConfig(objective="sft", vocab_chunk=16, seq_chunk=8)
    base = TrainStep(standin_forward, cfg, OptimizerConfig())
    with_router = TrainStep(standin_forward, cfg, OptimizerConfig(), router_coefs=(0.5, 0.25))
    params = make_params(mesh)
    a0 = base.grad_microstep(params, base.init_accumulator(params), batch)
    a1 = with_router.grad_microstep(params, with_router.init_accumulator(params), batch)
    h, _, aux = standin_forward(params, jnp.asarray(batch["tokens"]), None, None)
    den = float(a0["scalars"]["denominator"])
    extra = 0.5 * float(aux["router_aux_loss"]) + 0.25 * float(aux["router_z_loss"])
    assert float(a1["scalars"]["numerator"]) / den == pytest.approx(float(a0["scalars"]["numerator"]) / den + extra, rel=1e-6)
    assert float(a1["sums"]["router_aux_loss"]) / den == pytest.approx(float(aux["router_aux_loss"]), rel=1e-6)


def test_bad_microbatch_is_rejected_with_the_tensor_name(mesh):
    ts = TrainStep(standin_forward, LossConfig(), OptimizerConfig(), vocab_size=V)
    params = make_params(mesh)
    acc = ts.init_accumulator(params)
    batch = make_batch()
    with pytest.raises(KeyError, match="rollout_logprobs"):
        ts.grad_microstep(params, acc, {k: v for k, v in batch.items() if k != "rollout_logprobs"})
    with pytest.raises(ValueError, match="'loss_mask' has shape"):
        ts.grad_microstep(params, acc, {**batch, "loss_mask": batch["loss_mask"][:, :-1]})
    with pytest.raises(ValueError, match="tokens"):
        ts.grad_microstep(params, acc, {**batch, "tokens": batch["tokens"] + V})
    with pytest.raises(ValueError, match="per-row"):
        ts.grad_microstep(params, acc, {**batch, "advantages": batch["advantages"][:, 0],
                                        "segment_ids": np.ones((B, T), np.int32)})
    with pytest.raises(KeyError, match="unknown keys"):
        ts.grad_microstep(params, acc, {**batch, "advantage": batch["advantages"]})


def test_on_policy_ppo_gradient_equals_vanilla_policy_gradient(mesh):
    """Rollout log-probs equal to the current ones: ratio 1, IS weight 1, no clipping, and the
    PPO-clip gradient equals the vanilla policy gradient -sum(A * grad logp) / #tokens."""
    params = make_params(mesh, seed=3)
    batch = make_batch(seed=3)
    tokens = jnp.asarray(batch["tokens"])
    mask = jnp.asarray(batch["loss_mask"]).at[:, 0].set(0.0)  # position 0 is never a target

    def logp_of(p):  # aligned to the token they score
        h, w, _ = standin_forward(p, tokens, None, None)
        lp = jnp.take_along_axis(jax.nn.log_softmax(h @ w)[:, :-1], tokens[:, 1:, None], -1)[..., 0]
        return jnp.concatenate([jnp.zeros((B, 1)), lp], axis=1)

    vanilla = lambda p: -jnp.sum(jnp.asarray(batch["advantages"]) * logp_of(p) * mask) / jnp.sum(mask)
    rollout = np.asarray(jax.jit(logp_of)(params))
    g_ref = jax.jit(jax.grad(vanilla))(params)
    cfg = LossConfig(behavior="rollout", is_correction="tis", clip_low=0.2, clip_high=0.28,
                     vocab_chunk=16, seq_chunk=8)
    ts = TrainStep(standin_forward, cfg, OptimizerConfig())
    got, acc = accumulated(ts, params, [{**batch, "rollout_logprobs": rollout}])
    den = float(acc["scalars"]["denominator"])
    assert den == float(jnp.sum(mask))
    assert float(acc["sums"]["tok/ratio"]) == pytest.approx(den, rel=1e-5)
    assert float(acc["maxes"]["ratio_max"]) == pytest.approx(1.0, abs=1e-5)
    assert float(acc["sums"]["tok/is_weight"]) == pytest.approx(den, rel=1e-5)
    assert float(acc["sums"]["tok/clip_frac"]) == 0.0
    assert rel_err(got, jax.tree.map(np.asarray, g_ref)) < 1e-5
