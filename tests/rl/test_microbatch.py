"""`rl.MicroBatch`, the typed pytree a train micro-step reads: a pytree of its present fields, built
from a mapping at the edge, checked against the loss with messages naming the field, and the same
accumulators through `TrainStep.grad_microstep` whether a dict or the MicroBatch goes in."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.learner import OptimizerConfig, TrainStep
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.rl import Loss, LossConfig, LossInputs, MicroBatch, ObjectiveParts, as_microbatch, policy_loss
from sfrrl_jax.rl.microbatch import validate_microbatch

V, D, B, T = 48, 8, 4, 6


def _batch(seed=0, **extra):
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), np.float32)
    mask[:, 2:] = 1.0
    mask[3] = 0.0   # a fully masked row
    return MicroBatch(rng.integers(0, V, (B, T)).astype(np.int32), loss_mask=mask,
                      advantages=(rng.normal(size=(B, T)) * mask).astype(np.float32),
                      rollout_logprobs=(-rng.random((B, T)) * 3).astype(np.float32), **extra)


# -- the pytree -----------------------------------------------------------------------------------
def test_a_microbatch_is_a_pytree_of_its_present_fields():
    mb = _batch(extras={"token_weights": np.ones((B, T), np.float32)})
    assert mb.present == ("tokens", "loss_mask", "advantages", "rollout_logprobs", "token_weights")
    assert (mb.rows, mb.width) == (B, T)
    leaves = jax.tree.leaves(mb)   # the present fields' arrays themselves, in `present` order
    assert len(leaves) == 5 and all(x is mb.get(k) for x, k in zip(leaves, mb.present))
    # tree.map keeps the type, the absent fields (None) and the extras' names
    doubled = jax.tree.map(lambda v: v * 2, mb)
    assert isinstance(doubled, MicroBatch) and doubled.present == mb.present and doubled.segment_ids is None
    np.testing.assert_array_equal(doubled.tokens, mb.tokens * 2)
    np.testing.assert_array_equal(doubled.get("token_weights"), 2 * np.ones((B, T)))
    # flatten / unflatten round trip
    flat, tree = jax.tree.flatten(mb)
    back = jax.tree.unflatten(tree, flat)
    assert back.present == mb.present and all(back.get(k) is mb.get(k) for k in mb.present)
    # jit takes and returns it; which fields are present is part of the structure it keys on
    traces = []

    @jax.jit
    def f(b):
        traces.append(b.present)
        return b.replace(loss_mask=b.loss_mask * 3, segment_ids=jnp.ones_like(b.tokens))

    out = f(mb)
    assert isinstance(out, MicroBatch) and out.present == ("tokens", "loss_mask", "advantages", "rollout_logprobs",
                                                           "segment_ids", "token_weights")
    np.testing.assert_array_equal(out.loss_mask, mb.loss_mask * 3)
    np.testing.assert_array_equal(out.tokens, mb.tokens)
    f(jax.tree.map(lambda v: v + 1, mb))
    assert len(traces) == 1       # same fields, shapes, dtypes: one trace
    f(mb.replace(rollout_logprobs=None))
    assert len(traces) == 2 and traces[-1] == ("tokens", "loss_mask", "advantages", "token_weights")


def test_from_mapping_routes_unknown_names_to_extras_and_drops_none():
    tokens = np.zeros((2, 3), np.int32)
    w = np.ones((2, 3), np.float32)
    mb = MicroBatch.from_mapping({"tokens": tokens, "loss_mask": w, "token_weights": w, "positions": None,
                                  "values": None})
    assert mb.tokens is tokens and mb.loss_mask is w and mb.positions is None
    assert mb.extras == {"token_weights": w} and mb.get("token_weights") is w
    assert mb.present == ("tokens", "loss_mask", "token_weights")
    assert mb.get("values") is None and mb.get("values", 0) == 0 and mb.get("positions", "none") == "none"
    assert mb.fields() == {"tokens": tokens, "loss_mask": w, "token_weights": w}
    with pytest.raises(KeyError, match="no 'tokens'"):
        MicroBatch.from_mapping({"loss_mask": w, "tokens": None})
    with pytest.raises(ValueError, match=r"extras holds \['advantages'\], which are built-in"):
        MicroBatch(tokens, extras={"advantages": w})


def test_as_microbatch_takes_a_microbatch_or_a_mapping_and_nothing_else():
    mb = _batch()
    assert as_microbatch(mb) is mb
    from_dict = as_microbatch(mb.fields())
    assert from_dict.present == mb.present and all(from_dict.get(k) is mb.get(k) for k in mb.present)
    for bad in ([mb.tokens], mb.tokens, None, (("tokens", mb.tokens),)):
        with pytest.raises(TypeError, match="a micro-batch is a MicroBatch"):
            as_microbatch(bad)


def test_replace_select_and_row_slice():
    mb = _batch(extras={"token_weights": np.ones((B, T), np.float32)})
    seg = np.ones((B, T), np.int32)
    r = mb.replace(segment_ids=seg, advantages=None, my_field=seg, token_weights=None)
    assert r.segment_ids is seg and r.advantages is None and r.extras == {"my_field": seg}
    assert mb.advantages is not None and mb.segment_ids is None and "token_weights" in mb.extras  # unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        mb.tokens = seg
    s = r.select(("loss_mask", "my_field", "positions"))
    assert s.present == ("tokens", "loss_mask", "my_field")    # tokens always kept
    assert s.tokens is mb.tokens and s.get("my_field") is seg
    assert mb.select(()).present == ("tokens",)
    rows = r.row_slice(1, 3)
    assert rows.present == r.present and (rows.rows, rows.width) == (2, T)
    for k in r.present:
        np.testing.assert_array_equal(rows.get(k), r.get(k)[1:3])
    # per-row advantages [rows] slice with the rows
    per_row = MicroBatch(mb.tokens, loss_mask=mb.loss_mask, advantages=np.arange(B, dtype=np.float32))
    np.testing.assert_array_equal(per_row.row_slice(2, 4).advantages, [2.0, 3.0])


# -- validate_microbatch: the edge check ------------------------------------------------------------
def test_validate_names_the_field():
    loss = policy_loss(LossConfig())
    mb = _batch()
    validate_microbatch(mb, loss, vocab_size=V)
    validate_microbatch(mb.fields(), loss, vocab_size=V)   # a mapping too
    with pytest.raises(KeyError, match=r"missing \['rollout_logprobs'\], required by the loss"):
        validate_microbatch(mb.replace(rollout_logprobs=None), loss)
    with pytest.raises(KeyError, match=r"unknown keys \['advantage'\]"):
        validate_microbatch(mb.replace(advantage=mb.advantages), loss)
    with pytest.raises(ValueError, match=r"'loss_mask' has shape \(4, 5\), expected \(4, 6\) like 'tokens'"):
        validate_microbatch(mb.replace(loss_mask=mb.loss_mask[:, :-1]), loss)
    with pytest.raises(ValueError, match=r"'tokens' must be \[rows, width\] with width >= 2"):
        validate_microbatch(mb.replace(tokens=mb.tokens[:, :1]), loss)
    with pytest.raises(TypeError, match="'tokens' must be integer ids"):
        validate_microbatch(mb.replace(tokens=mb.tokens.astype(np.float32)), loss)
    # per-row advantages: fine on unpacked rows, refused with segment_ids
    per_row = mb.replace(advantages=np.ones(B, np.float32))
    validate_microbatch(per_row, loss)
    with pytest.raises(ValueError, match=r"'advantages' is per-row \[rows\] but rows are packed "
                                         r"\('segment_ids' given\)"):
        validate_microbatch(per_row.replace(segment_ids=np.ones((B, T), np.int32)), loss)
    with pytest.raises(ValueError, match=rf"'tokens' must lie in \[0, {V}\); found min 0, max {V}"):
        validate_microbatch(mb.replace(tokens=np.where(mb.tokens == mb.tokens.max(), V, 0).astype(np.int32)),
                            loss, vocab_size=V)
    # a custom loss's own field is known to it, unknown to the built-in
    weighted = Loss(fn=_weighted, required_fields=("tokens", "loss_mask", "advantages", "token_weights"))
    with pytest.raises(KeyError, match=r"missing \['token_weights'\]"):
        validate_microbatch(mb, weighted)
    validate_microbatch(mb.replace(token_weights=mb.loss_mask), weighted)
    with pytest.raises(KeyError, match=r"unknown keys \['token_weights'\]"):
        validate_microbatch(mb.replace(token_weights=mb.loss_mask), loss)
    with pytest.raises(TypeError, match="a micro-batch is a MicroBatch"):
        validate_microbatch([mb.tokens], loss)


def test_validate_routing_replay_routes():
    loss = policy_loss(LossConfig(routing_replay="r3"))
    mb = _batch()
    with pytest.raises(KeyError, match=r"missing \['routes', 'routes_mask'\].*record_routes=True"):
        validate_microbatch(mb, loss)
    held = np.ones((B, T), np.int32)
    validate_microbatch(mb.replace(routes=np.zeros((B, T, 2, 2), np.int16), routes_mask=held), loss)
    for routes in (np.zeros((B, T - 1, 2, 2), np.int16), np.zeros((B, T, 2), np.int16),
                   np.zeros((B, T, 2, 2), np.float32)):
        with pytest.raises(ValueError, match=r"'routes' must be int \[rows, width, moe layers, top_k\]"):
            validate_microbatch(mb.replace(routes=routes, routes_mask=held), loss)


# -- the train step's edge: a dict and the MicroBatch train alike, bit for bit ----------------------
def standin_forward(params, tokens, segment_ids, positions):
    """One token-wise layer with the train step's forward contract (tests/learner/test_train_accumulation.py)."""
    x = params["embed"][tokens]
    hidden = jnp.tanh(x @ params["w"]) + x
    return hidden, params["head"], {"router_aux_loss": jnp.mean(jnp.square(hidden)), "router_z_loss": 0.0}


def _weighted(x: LossInputs) -> ObjectiveParts:
    """-(A * w * logp) over the loss tokens: a custom loss reading its own field 'token_weights'."""
    m = x.mask * x.fields["token_weights"]
    num = jnp.sum(-x.fields["advantages"] * x.logp * m)
    sg = jax.lax.stop_gradient
    return ObjectiveParts(numerator=num, denominator=jnp.sum(x.mask), num_tokens=jnp.sum(x.mask),
                          num_seqs=jnp.sum((jnp.sum(x.mask, axis=1) > 0).astype(jnp.float32)),
                          sums={"agg/weighted": sg(num)}, maxes={}, mins={}, advantage_term=num)


@pytest.fixture(scope="module")
def params():
    mesh = make_mesh(devices=jax.devices()[:1])
    k = jax.random.split(jax.random.key(0), 3)
    p = {"embed": jax.random.normal(k[0], (V, D)), "w": jax.random.normal(k[1], (D, D)) * 0.5,
         "head": jax.random.normal(k[2], (D, V)) * 0.5}
    return jax.device_put(p, NamedSharding(mesh, P()))


def _assert_bitwise(a, b):
    fa, ta = jax.tree.flatten(jax.device_get(a))
    fb, tb = jax.tree.flatten(jax.device_get(b))
    assert ta == tb
    for x, y in zip(fa, fb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("which", ["policy", "custom"])
def test_grad_microstep_of_a_dict_equals_that_of_the_microbatch_bitwise(params, which):
    mb = _batch(seed=1, segment_ids=np.ones((B, T), np.int32))
    if which == "policy":   # no advantage-free terms: stats_microstep may run it too
        loss = LossConfig(behavior="rollout", clip_low=0.2, clip_high=0.28, vocab_chunk=16, seq_chunk=4)
    else:
        loss = Loss(fn=_weighted, required_fields=("tokens", "loss_mask", "advantages", "token_weights"),
                    vocab_chunk=16, seq_chunk=4)
        mb = mb.replace(rollout_logprobs=None,
                        token_weights=np.linspace(0, 1, B * T, dtype=np.float32).reshape(B, T))
    ts = TrainStep(standin_forward, loss, OptimizerConfig(), vocab_size=V)
    as_dict = {**mb.fields(), "positions": None}   # a None entry counts as absent
    acc_dict = ts.grad_microstep(params, ts.init_accumulator(params), as_dict)
    acc_typed = ts.grad_microstep(params, ts.init_accumulator(params), mb)
    assert float(acc_typed.scalars.num_tokens) > 0 and float(jnp.abs(acc_typed.grads["w"]).max()) > 0
    _assert_bitwise(acc_dict, acc_typed)
    assert ts.jitted_microstep(params)._cache_size() == 1   # both reach the jit as the same pytree
    # forward only and the fused step too
    assert ts.zero_advantage_forward_only == (which == "policy")
    if which == "policy":
        _assert_bitwise(ts.stats_microstep(params, ts.init_accumulator(params), as_dict),
                        ts.stats_microstep(params, ts.init_accumulator(params), mb))
    copy = lambda: jax.tree.map(jnp.copy, params)   # step donates params
    p1, o1, m1 = ts.step(copy(), ts.init_opt_state(params), as_dict)
    p2, o2, m2 = ts.step(copy(), ts.init_opt_state(params), mb)
    _assert_bitwise((p1, o1, m1), (p2, o2, m2))
