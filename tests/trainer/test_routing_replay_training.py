"""Routing replay (R3) end to end: the engine records the experts, the trajectory keeps them through
the agent loop, the micro-batch carries them, the train forward replays them (bf16, batches of
other shapes than the engine's), the router still learns, and the trainer reports agreement."""
import asyncio
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.engine import Engine
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.models.transformer import forward_hidden, logits_from_hidden, moe_layer_ids
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.loss_fn import policy_loss
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks
from sfrrl_jax.trainer.batching import batch_fields, microbatch_from_trajectories
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream

from model_fixtures import randomize

R3 = LossConfig(routing_replay="r3")
WL = WorkloadConfig(num_prompts=4, response_median=6, response_sigma=0.6, max_response=12,
                    tool_latency_median_s=0.001, tool_latency_sigma=0.1, max_turns=3)


@functools.lru_cache(maxsize=None)
def _setup(dtype):
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=64, param_dtype=dtype, compute_dtype=dtype)
    mesh = S.make_mesh(data=2, expert=4)
    # larger random weights than the init: routers with clear (not tied) preferences
    return cfg, mesh, randomize(S.init_params(cfg, mesh, seed=0), seed=5, scale=0.3)


def _rollouts(cfg, params, n_groups=3, group=3):
    """Multi-turn workload trajectories (tool observations appended) from an engine recording routes,
    many in flight at once (each decode step's batch holds several trajectories)."""
    engine = Engine(cfg, params, max_slots=8, max_len=64, buckets=(16, 32), decode_steps=2,
                    max_consecutive_faults=0, record_routes=True)
    agent = WorkloadAgent(WL, temperature=1.0)
    tasks = make_tasks(WL)[:n_groups]

    async def main():
        return await asyncio.gather(*(agent(engine, t, s) for t in tasks for s in range(group)))
    return asyncio.run(main())


def test_bf16_engine_routes_are_replayed_exactly_in_a_batch_of_another_shape():
    cfg, mesh, params = _setup("bfloat16")
    trajs = _rollouts(cfg, params)
    dims = (len(moe_layer_ids(cfg)), cfg.top_k)
    assert any(len(t.turns) > 1 for t in trajs)  # observations were fed too (append-prefill)
    for t in trajs:
        t.check()
        assert t.routes.shape == (len(t.tokens) - 1,) + dims and t.routes.dtype == np.int16
    loss = policy_loss(R3)
    fields = batch_fields(loss)
    assert fields[-2:] == ("routes", "routes_mask")
    mb = microbatch_from_trajectories(trajs, np.linspace(-1, 1, len(trajs)), 32, 64, fields, dims)
    held = mb.routes_mask.astype(bool)
    assert mb.routes.shape == mb.tokens.shape + dims
    assert held.sum() == sum(len(t.tokens) - 1 for t in trajs)

    def forward(p, tokens, segments, routes, routes_mask):
        """(log p(token t) from position t - 1 [rows, T], aux, experts used)."""
        hidden, aux, used = forward_hidden(cfg, p, tokens, segments, routes=routes, routes_mask=routes_mask,
                                           return_routes=True)
        logp = jax.nn.log_softmax(logits_from_hidden(cfg, p, hidden), -1)
        picked = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
        return jnp.pad(picked, ((0, 0), (1, 0))), aux, used

    with jax.set_mesh(mesh):
        fwd = jax.jit(forward)
        logp_own, _, own = fwd(params, mb.tokens, mb.segment_ids, mb.routes, np.zeros_like(held))
        logp_replay, aux, used = fwd(params, mb.tokens, mb.segment_ids, mb.routes, mb.routes_mask)
    own, used = np.asarray(own), np.asarray(used)
    engine_choice = mb.routes[held]                                           # [held tokens, layers, k]
    differ = np.mean(np.sort(own[held], -1) != np.sort(engine_choice, -1))
    touched = np.mean(np.any(np.sort(own[held], -1) != np.sort(engine_choice, -1), axis=(1, 2)))
    print(f"bf16, train batch {mb.tokens.shape} vs the engine's slots: without replay {differ:.2%} of "
          f"(token, layer, choice) decisions differ, {touched:.2%} of tokens touched in some layer")
    # with replay the train forward uses exactly the engine's experts wherever they were recorded
    np.testing.assert_array_equal(used[held], engine_choice)
    # layer 0 sees the same embeddings either way: its agreement is the share of the engine's
    # choices that the train router's own top-k holds
    own0, eng0 = own[held][:, 0], engine_choice[:, 0]
    expected0 = np.mean(np.any(eng0[:, :, None] == own0[:, None, :], axis=-1))
    assert abs(float(aux["routing_agreement/layer_0"]) - expected0) < 1e-6

    # the train step: gradients reach the router; metrics report agreement per MoE layer and the
    # logprob mismatch to the engine (with replay here; the run without replay is the baseline)
    ts = make_train_step(cfg, loss, OptimizerConfig(learning_rate=1e-3))
    acc = ts.grad_microstep(params, ts.init_accumulator(params), mb)
    assert float(jnp.max(jnp.abs(acc.grads["layers"]["moe"]["router"]))) > 0
    copy = lambda: jax.tree.map(jnp.copy, params)  # apply donates its params (cached here)
    _, _, metrics = ts.apply(copy(), ts.init_opt_state(params), acc)
    for i in moe_layer_ids(cfg):
        assert 0.0 <= float(metrics[f"routing_agreement/layer_{i}"]) <= 1.0
    # the train step's forward is another program (under grad): in bf16 its deeper layers may
    # round differently and flip a near-tied choice of the router's own top-k, so the metric
    # agrees with the plain forward's to a few choices, not bitwise on every CPU
    assert abs(float(metrics["routing_agreement"]) - float(aux["routing_agreement"])) < 0.05
    assert "layer_0" not in metrics  # the per-layer agreement is not read as a 'tok/' metric
    generated = mb.loss_mask.astype(bool)
    mismatch = {name: np.abs(np.asarray(lp) - mb.rollout_logprobs)[generated]
                for name, lp in (("without", logp_own), ("with", logp_replay))}
    print("logprob |train - engine| of the generated tokens: " + ", ".join(
        f"{name} replay mean {d.mean():.3e} max {d.max():.3e}" for name, d in mismatch.items())
        + f"; the train step's own metric (with replay): {float(metrics['mismatch']):.3e}")


def test_trainer_with_routing_replay_records_trains_and_reports_agreement():
    cfg, mesh, _ = _setup("float32")
    # early samples too: rows back-propagated before their group ends (the deferred path) and
    # the rest in plain micro-steps, all replaying; every shape compiled up front
    tc = TrainerConfig(mode="pipelined", groups_per_step=2, group_size=3, max_slots=6, max_len=64,
                       buckets=(16, 32), seq_bucket=32, early_groups=1, underfull_slots=6, microbatch_rows=1)
    params = S.init_params(cfg, mesh, seed=0)
    trainer = RLTrainer(cfg, params, tc, R3, OptimizerConfig(learning_rate=1e-3), WorkloadAgent(WL),
                        TaskStream(make_tasks(WL), seed=1))
    assert trainer.engine.record_routes and trainer.route_dims == (cfg.n_layers, cfg.top_k)
    assert trainer.compile_train_shapes() == 2
    compiled = trainer.train_step.compile_count()
    m = trainer.step()
    assert trainer.train_step.compile_count() == compiled + 1  # `apply` only: every micro-step shape was ready
    assert m["policy/on_policy_fraction"] == 1.0 and m["train/trained_tokens"] > 0
    assert m["train/early_microsteps"] > 0
    # every sample trained once: one row each (microbatch_rows=1), packed rows holding several
    assert m["train/trained_tokens"] == m["rollout/generated_tokens"] and m["train/microsteps"] <= 6
    # fp32, the same layer code: the train router picks the engine's experts (up to rare near-ties)
    assert m["train/routing_agreement"] > 0.95
    for i in moe_layer_ids(cfg):
        assert 0.95 < m[f"train/routing_agreement/layer_{i}"] <= 1.0


def test_replay_is_refused_where_it_cannot_work():
    cfg, mesh, params = _setup("float32")
    dense = S.ModelConfig.preset("tiny-moe", n_experts=0, d_ff=32, max_seq_len=64)
    with pytest.raises(ValueError, match="routing_replay='r3' but the model has no MoE layer"):
        make_train_step(dense, R3, OptimizerConfig())
    tc = TrainerConfig(mode="sync", groups_per_step=1, group_size=2, max_slots=4, max_len=64, buckets=(16,))
    plain_engine = Engine(cfg, params, max_slots=4, max_len=64, buckets=(16,))
    with pytest.raises(ValueError, match="does not record routes"):
        RLTrainer(cfg, params, tc, R3, OptimizerConfig(), WorkloadAgent(WL), TaskStream(make_tasks(WL)),
                  engine=plain_engine)
    with pytest.raises(ValueError, match="routing_replay="):
        LossConfig(routing_replay="yes")
    ts = make_train_step(cfg, R3, OptimizerConfig())
    batch = {"tokens": np.zeros((2, 8), np.int32), "loss_mask": np.ones((2, 8), np.float32),
             "advantages": np.ones((2, 8), np.float32), "rollout_logprobs": np.zeros((2, 8), np.float32)}
    with pytest.raises(KeyError, match=r"missing \['routes', 'routes_mask'\].*record_routes=True"):
        ts.grad_microstep(params, ts.init_accumulator(params), batch)
    bad = {**batch, "routes": np.zeros((2, 7, cfg.n_layers, cfg.top_k), np.int16),
           "routes_mask": np.ones((2, 8), np.int32)}
    with pytest.raises(ValueError, match=r"'routes' must be int \[rows, width, moe layers, top_k\]"):
        ts.grad_microstep(params, ts.init_accumulator(params), bad)
