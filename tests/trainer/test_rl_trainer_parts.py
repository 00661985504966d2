"""RLTrainer's parts as values: the engine's hooks (idle work, trace: constructor / setter, not
attributes set from outside; the idle hook gone after a failed step), one length budget checked
when the trainer is built, prebuilt engine= and train_step= (a custom rl.Loss and an optax
transformation included), reward functions logged as reward/<name>."""
import asyncio
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents import ToolEnvironment, named
from sfrrl_jax.agents.loop import AgentConfig
from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
from sfrrl_jax.engine import Engine
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.rl import Loss, LossInputs, ObjectiveParts
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks
from sfrrl_jax.tokenizer import load_tokenizer
from sfrrl_jax.trainer.agent_rollout import AgentRollout
from sfrrl_jax.trainer.batching import (
    TRAJECTORY_FIELDS, batch_fields, microbatch_from_trajectories, zero_microbatch,
)
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream, shared_train_step
from sfrrl_jax.trainer.rollout_fn import declared_token_budget
from sfrrl_jax.trainer.run_logger import RunLogger, read_metrics
from sfrrl_jax.trainer.timeline import Timeline

CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=128)
WL = WorkloadConfig(num_prompts=4, response_median=4, response_sigma=0.5, max_response=8,
                    tool_latency_median_s=0.01, tool_latency_sigma=0.5, max_turns=2)
LOSS, OPT = LossConfig(), OptimizerConfig(learning_rate=1e-3)


@functools.lru_cache(maxsize=None)
def _params():
    return S.init_params(CFG, S.make_mesh(devices=jax.devices()[:1]), seed=0)


def _fresh_params():
    """Params of their own, for a trainer that steps (the optimizer update donates them)."""
    return S.init_params(CFG, S.make_mesh(devices=jax.devices()[:1]), seed=0)


def _tc(**kw):
    return TrainerConfig(**{**dict(mode="pipelined", groups_per_step=2, group_size=2, max_slots=4, max_len=64,
                                   buckets=(16, 32), seq_bucket=32), **kw})


# -- the engine's idle hook -------------------------------------------------------------------------
def test_idle_work_is_a_constructor_argument_and_a_setter_not_an_attribute():
    ran = []
    jobs = [lambda: ran.append("a"), lambda: ran.append("b")]
    hook = lambda: jobs.pop(0) if jobs else None  # noqa: E731
    engine = Engine(CFG, _params(), max_slots=2, max_len=64, idle_work=hook, underfull_slots=1)
    assert engine.idle_work is hook and engine.underfull_slots == 1

    async def drive():
        engine.notify_idle_work()
        await engine.wait_idle()  # the driver runs idle jobs until the hook has none

    asyncio.run(drive())
    assert ran == ["a", "b"] and engine.idle_seconds >= 0.0
    with pytest.raises(AttributeError):
        engine.idle_work = hook  # read-only: the hook is set through the engine's own API
    with pytest.raises(AttributeError):
        engine.underfull_slots = 3
    engine.set_idle_work(None)  # removes the hook, keeps underfull_slots
    assert engine.idle_work is None and engine.underfull_slots == 1
    engine.set_idle_work(hook, underfull_slots=0)
    assert engine.idle_work is hook and engine.underfull_slots == 0
    with pytest.raises(TypeError, match="idle_work must be callable"):
        engine.set_idle_work(42)
    with pytest.raises(ValueError, match="underfull_slots must be an int >= 0, got -1"):
        engine.set_idle_work(hook, underfull_slots=-1)
    with pytest.raises(ValueError, match="underfull_slots must be an int >= 0"):
        Engine(CFG, _params(), max_slots=2, max_len=64, underfull_slots=-2)


# -- one length budget -------------------------------------------------------------------------------
class _Declares:
    def __init__(self, max_total_tokens):
        self.max_total_tokens = max_total_tokens

    async def __call__(self, engine, task, sample_index):
        raise AssertionError("not called")


class _HasAgentCfg(_Declares):
    def __init__(self, agent_cfg):
        self.agent_cfg = agent_cfg


async def _plain_rollout(engine, task, sample_index):
    raise AssertionError("not called")


def test_the_declared_token_budget_is_duck_typed():
    assert declared_token_budget(AgentRollout(None, None, AgentConfig(max_total_tokens=77))) == 77
    assert AgentRollout(None, None, AgentConfig(max_total_tokens=77)).max_total_tokens == 77
    assert declared_token_budget(_Declares(50)) == 50
    assert declared_token_budget(_HasAgentCfg(AgentConfig(max_total_tokens=60))) == 60
    assert declared_token_budget(_plain_rollout) is None
    assert declared_token_budget(WorkloadAgent(WL)) is None
    with pytest.raises(TypeError, match="max_total_tokens must be an int"):
        declared_token_budget(_Declares("64"))


@pytest.mark.parametrize("rollout", [
    AgentRollout(None, None, AgentConfig(max_total_tokens=4096)),   # AgentConfig's default
    _Declares(65),
    _HasAgentCfg(AgentConfig(max_total_tokens=100)),
])
def test_a_budget_over_max_len_fails_when_the_trainer_is_built(rollout):
    budget = declared_token_budget(rollout)
    with pytest.raises(ValueError) as e:
        RLTrainer(CFG, _params(), _tc(max_len=64), LOSS, OPT, rollout, TaskStream(make_tasks(WL)))
    msg = str(e.value)
    for field in (f"AgentConfig.max_total_tokens={budget}", "TrainerConfig.max_len=64",
                  "ModelConfig.max_seq_len=128"):
        assert field in msg, (field, msg)


# -- prebuilt parts ---------------------------------------------------------------------------------
def test_prebuilt_engine_and_train_step_are_used_and_checked():
    params, tc = _fresh_params(), _tc()
    engine = Engine(CFG, params, max_slots=4, max_len=64, buckets=(16, 32))
    ts = shared_train_step(CFG, LOSS, OPT)
    agent = AgentRollout(None, None, AgentConfig(max_total_tokens=64))  # == max_len: fits
    built = RLTrainer(CFG, params, tc, LOSS, OPT, agent, TaskStream(make_tasks(WL)))
    assert built.train_step is ts and isinstance(built.engine, Engine)  # the defaults
    tr = RLTrainer(CFG, params, tc, None, None, WorkloadAgent(WL), TaskStream(make_tasks(WL), seed=1),
                   engine=engine, train_step=ts)
    assert tr.engine is engine and tr.train_step is ts and tr.loss_cfg == ts.loss_cfg
    assert engine.trace is tr.timeline  # set through the engine's own API
    with pytest.raises(ValueError, match="not the prebuilt train step's loss"):
        RLTrainer(CFG, params, tc, LossConfig(clip_high=0.5), None, WorkloadAgent(WL),
                  TaskStream(make_tasks(WL)), train_step=ts)
    with pytest.raises(ValueError, match="not both"):
        RLTrainer(CFG, params, tc, LOSS, OPT, WorkloadAgent(WL), TaskStream(make_tasks(WL)), train_step=ts)
    with pytest.raises(ValueError, match="needs optimizer_cfg"):
        RLTrainer(CFG, params, tc, LOSS, None, WorkloadAgent(WL), TaskStream(make_tasks(WL)))
    with pytest.raises(ValueError, match=r"prebuilt engine's max_len=64 != TrainerConfig.max_len=96"):
        RLTrainer(CFG, params, _tc(max_len=96), LOSS, OPT, WorkloadAgent(WL), TaskStream(make_tasks(WL)),
                  engine=engine)
    with pytest.raises(ValueError, match="another ModelConfig"):
        RLTrainer(CFG.replace(max_seq_len=256), params, tc, LOSS, OPT, WorkloadAgent(WL),
                  TaskStream(make_tasks(WL)), engine=engine)
    # a step on the prebuilt parts: the trainer sets the engine's idle hook for the step only
    m = tr.step()
    assert m["train/microsteps"] >= 1 and m["rollout/generated_tokens"] > 0
    assert 0.0 < m["train/padding_share"] < 1.0   # rows of unequal length pad to one width
    # the computed positions hold every trained token, and the padding is their padding share
    assert m["train/positions"] > m["train/trained_tokens"] > 0
    assert engine.idle_work is None and engine.underfull_slots == tc.underfull_slots
    assert engine.occupancy == {"running": 0, "parked": 0, "free": 4, "queued": 0}


# -- the engine's trace ------------------------------------------------------------------------------
def test_trace_is_a_constructor_argument_and_a_setter_not_an_attribute():
    tl = Timeline()
    engine = Engine(CFG, _params(), max_slots=2, max_len=64, trace=tl)
    assert engine.trace is tl
    with pytest.raises(AttributeError):
        engine.trace = Timeline()
    engine.set_trace(None)
    assert engine.trace is None
    with pytest.raises(TypeError, match="add"):
        engine.set_trace(42)
    with pytest.raises(TypeError, match="add"):
        Engine(CFG, _params(), max_slots=2, max_len=64, trace=object())


# -- a failed step leaves no idle hook behind ------------------------------------------------------------
class _ConstantReward:
    """WorkloadAgent's trajectories with reward 0: every group is dropped by dynamic sampling."""

    def __init__(self):
        self.agent = WorkloadAgent(WL)

    async def __call__(self, engine, task, sample_index):
        traj = await self.agent(engine, task, sample_index)
        traj.reward = 0.0
        return traj


def test_a_failed_step_leaves_the_engine_without_idle_work():
    params = _fresh_params()
    engine = Engine(CFG, params, max_slots=4, max_len=64, buckets=(16, 32))
    tr = RLTrainer(CFG, params, _tc(dynamic_sampling=True, max_refill_groups=0), LOSS, OPT, _ConstantReward(),
                   TaskStream(make_tasks(WL)), engine=engine)
    seen = []
    orig = engine.set_idle_work
    engine.set_idle_work = lambda hook, **kw: (seen.append(hook), orig(hook, **kw))[1]  # observe the step's hook
    with pytest.raises(RuntimeError, match="survived dynamic sampling"):
        tr.step()
    assert seen and seen[0] is not None  # the step installed its hook ...
    assert engine.idle_work is None      # ... and removed it when it failed
    assert engine.occupancy["running"] == 0 and engine.occupancy["parked"] == 0
    assert engine.state is None          # the KV cache was freed as after a finished rollout


# -- a custom loss and an optax transformation ------------------------------------------------------------
def _reinforce(x: LossInputs) -> ObjectiveParts:
    """-(A * logp) over the loss tokens (token mean); the optional rollout log-probs only feed a metric."""
    m, f = x.mask, x.fields
    num = jnp.sum(-f["advantages"] * x.logp * m)
    rollout = f.get("rollout_logprobs", jnp.zeros_like(x.logp))
    sg = jax.lax.stop_gradient
    return ObjectiveParts(
        numerator=num, denominator=jnp.sum(m), num_tokens=jnp.sum(m),
        num_seqs=jnp.sum((jnp.sum(m, axis=1) > 0).astype(jnp.float32)),
        sums={"agg/reinforce": sg(num), "tok/logp_gap": sg(jnp.sum((x.logp - rollout) * m))},
        maxes={}, mins={}, advantage_term=num)


REINFORCE = Loss(fn=_reinforce, required_fields=("tokens", "loss_mask", "advantages"),
                 optional_fields=("rollout_logprobs", "old_logprobs"), linear_in_advantages=True,
                 has_advantage_free_terms=False, advantage_metrics=("agg/reinforce",), name="reinforce",
                 router_aux_coef=0.0, router_z_coef=0.0)


def test_a_custom_loss_and_an_optax_transformation_train_a_step():
    params = _fresh_params()
    p0 = jax.tree.map(np.asarray, params)
    ts = make_train_step(CFG, REINFORCE, optax.sgd(1e-2))
    tr = RLTrainer(CFG, params, _tc(), None, None, WorkloadAgent(WL), TaskStream(make_tasks(WL)), train_step=ts)
    assert tr.loss is REINFORCE and tr.loss_cfg is None
    # the loss's required fields, the optional one trajectories supply, the padding layout
    assert tr.batch_fields == ("tokens", "loss_mask", "advantages", "rollout_logprobs", "segment_ids")
    assert tr.compile_train_shapes() == 4  # widths 32, 64; a group's 2 samples packed in 1 or 2 rows
    compiled = ts.jitted_microstep(tr.params)._cache_size()
    m = tr.step()
    assert ts.jitted_microstep(tr.params)._cache_size() == compiled  # the warm-up had the step's batches
    assert m["train/microsteps"] == 2 and m["train/trained_tokens"] > 0
    assert math.isfinite(m["train/loss"]) and m["train/update_skipped"] == 0.0
    assert "train/reinforce" in m and "train/logp_gap" in m and "train/learning_rate" not in m
    assert any(not np.array_equal(a, np.asarray(b))
               for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(tr.params)))


def test_a_loss_value_and_an_optax_transformation_go_in_the_config_slots():
    tx = optax.sgd(1e-2)
    tr = RLTrainer(CFG, _params(), _tc(), REINFORCE, tx, WorkloadAgent(WL), TaskStream(make_tasks(WL)))
    assert tr.loss is REINFORCE and tr.loss_cfg is None and tr.train_step.tx is tx
    tr = RLTrainer(CFG, _params(), _tc(), LOSS, tx, WorkloadAgent(WL), TaskStream(make_tasks(WL)))
    assert tr.loss_cfg == LOSS and tr.train_step.tx is tx  # a LossConfig with an optax optimizer
    args = (WorkloadAgent(WL), TaskStream(make_tasks(WL)))
    with pytest.raises(TypeError, match="optimizer must be an OptimizerConfig or an optax GradientTransformation, got str"):
        RLTrainer(CFG, _params(), _tc(), LOSS, "adam", *args)
    with pytest.raises(TypeError, match="loss must be a LossConfig or a sfrrl_jax.rl.Loss, got str"):
        RLTrainer(CFG, _params(), _tc(), "grpo", OPT, *args)
    with pytest.raises(ValueError, match="not both"):
        RLTrainer(CFG, _params(), _tc(), REINFORCE, tx, *args, train_step=make_train_step(CFG, REINFORCE, tx))
    with pytest.raises(ValueError, match="needs both a loss and an optimizer"):
        RLTrainer(CFG, _params(), _tc(), REINFORCE, None, *args)


def test_a_loss_needing_a_field_trajectories_lack_fails_naming_it():
    needs_ref = Loss(fn=_reinforce, required_fields=("tokens", "loss_mask", "advantages", "ref_logprobs"))
    needs_own = Loss(fn=_reinforce, required_fields=("tokens", "loss_mask", "advantages", "values"),
                     name="critic")
    for loss, field in ((needs_ref, "ref_logprobs"), (needs_own, "values")):
        with pytest.raises(ValueError, match=rf"requires \['{field}'\].*do not carry"):
            batch_fields(loss)
        with pytest.raises(ValueError, match=rf"requires \['{field}'\]"):
            RLTrainer(CFG, _params(), _tc(), None, None, WorkloadAgent(WL), TaskStream(make_tasks(WL)),
                      train_step=make_train_step(CFG, loss, optax.sgd(1e-2)))
    with pytest.raises(ValueError, match=r"\['values'\] cannot be built from trajectories"):
        zero_microbatch(("tokens", "values"), 1, 32)
    with pytest.raises(ValueError, match=r"\['values'\] cannot be built from trajectories"):
        microbatch_from_trajectories([], [], 32, 64, fields=("tokens", "values"))
    zero = zero_microbatch(batch_fields(REINFORCE), 3, 32)
    assert zero.present == batch_fields(REINFORCE) and zero.positions is None   # the rest None
    assert {k: (v.shape, v.dtype) for k, v in zero.fields().items()} == {
        k: ((3, 32), np.dtype(TRAJECTORY_FIELDS[k])) for k in batch_fields(REINFORCE)}


# -- reward functions logged as reward/<name> --------------------------------------------------------------
def generated_share(task, trajectory):
    """Share of the trajectory's tokens the policy generated."""
    return sum(trajectory.loss_mask) / len(trajectory.tokens)


def test_each_reward_function_is_logged_as_its_mean_over_the_step(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    length = named(lambda task, traj: len(traj.tokens) / 100.0, "length")
    env = ToolEnvironment([], None, reward_fns=[generated_share, length], reward_weights=[1.0, 0.5])
    agent = AgentRollout(env, tok, AgentConfig(max_turns=1, max_new_tokens_per_turn=8, max_total_tokens=64))
    tasks = [arithmetic_task(f"{i} + {i + 1}", f"t{i}") for i in range(4)]
    tr = RLTrainer(CFG, _fresh_params(), _tc(), LOSS, OPT, agent, TaskStream(tasks))
    m = tr.step()
    trajs = [t for g in tr._step.kept for t in g.trajectories]
    assert len(trajs) == 4 and all(t.error is None for t in trajs)
    share = [sum(t.loss_mask) / len(t.tokens) for t in trajs]
    lens = [len(t.tokens) / 100.0 for t in trajs]
    assert m["reward/generated_share"] == pytest.approx(np.mean(share), rel=1e-12)
    assert m["reward/length"] == pytest.approx(np.mean(lens), rel=1e-12)
    assert m["reward/mean"] == pytest.approx(np.mean(share) + 0.5 * np.mean(lens), rel=1e-6)  # float32 sums
    log = RunLogger(tmp_path, tensorboard=False)
    log.log(m["step"], m)
    row = read_metrics(tmp_path)[0]
    assert (row["reward/generated_share"], row["reward/length"]) == (m["reward/generated_share"], m["reward/length"])
    # one RewardFn protocol, re-exported where reward functions live
    from sfrrl_jax.agents import protocols
    from sfrrl_jax.agents.tasks import reward_fns
    assert reward_fns.RewardFn is protocols.RewardFn is S.RewardFn and isinstance(length, reward_fns.RewardFn)
    # the trainer's own reward metrics cannot be shadowed by a reward function's name
    def mean(task, trajectory):
        return 0.0

    for bad in (lambda: ToolEnvironment([], None, reward_fns=[mean]),
                lambda: named(generated_share, "success_rate")):
        with pytest.raises(ValueError, match=r"reward/(mean|success_rate), which the trainer logs itself"):
            bad()


# -- a paged KV cache from the trainer's config ------------------------------------------------------------
def test_trainer_config_pages_the_engines_cache_and_sets_its_decode_buckets():
    """The config reaches the engine (the paged engine itself, and its equality with the dense one,
    are tested in tests/engine; a step here would only add compiles to the suite)."""
    tc = _tc(page_size=8, num_pages=20, decode_buckets=(16, 32))   # 160 tokens of cache for 4 slots x 64 (256 dense)
    tr = RLTrainer(CFG, _params(), tc, LOSS, OPT, WorkloadAgent(WL), TaskStream(make_tasks(WL)))
    assert tr.engine.steps.page_size == 8 and tr.engine.occupancy["pages_free"] == 20
    assert tr.engine.steps.decode_buckets == (16, 32, 64)  # max_len always closes them
    assert tr.engine.steps.cache_bytes() < RLTrainer(CFG, _params(), _tc(), LOSS, OPT, WorkloadAgent(WL),
                                                     TaskStream(make_tasks(WL))).engine.steps.cache_bytes()
    with pytest.raises(ValueError, match="TrainerConfig.page_size must be >= 1, got 0"):
        _tc(page_size=0)


# -- the step as a value: explicit inputs in, a StepResult out ------------------------------------------
def test_a_step_runs_from_explicit_inputs_and_the_trainer_applies_its_result():
    """`RLStep(trainer.step_inputs()).run()` writes nothing back into the trainer: it returns the next
    state as a `StepResult`; applied, it is bitwise what `trainer.step()` gives a trainer built alike."""
    from sfrrl_jax.aio import run_sync
    from sfrrl_jax.trainer.step_rules import OneProcessRules
    from sfrrl_jax.trainer.step_schedule import RLStep, StepResult

    def build():
        return RLTrainer(CFG, _fresh_params(), _tc(mode="sync"), LOSS, OPT, WorkloadAgent(WL),
                         TaskStream(make_tasks(WL), seed=3))

    ref, tr = build(), build()
    ref_metrics = ref.step()
    inputs = tr.step_inputs()
    assert inputs.step_index == 0 and inputs.params_version == 0 and inputs.params is tr.params
    result = run_sync(RLStep(inputs, OneProcessRules()).run())
    assert isinstance(result, StepResult)
    assert tr.step_index == 0 and tr.params_version == 0 and tr.carry_over == []   # nothing written back
    assert result.step_index == 1 and result.params_version == 1 and len(result.kept) == 2
    tr.apply_step_result(result)
    assert (tr.step_index, tr.params_version) == (ref.step_index, ref.params_version) == (1, 1)
    for a, b in zip(jax.tree.leaves(jax.device_get(ref.params)), jax.tree.leaves(jax.device_get(tr.params)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    for k in ("train/loss", "train/grad_norm", "reward/mean", "train/trained_tokens"):
        assert result.metrics[k] == ref_metrics[k], k
