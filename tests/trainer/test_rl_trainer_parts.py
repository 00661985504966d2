"""RLTrainer's parts as values: the engine's idle hook (constructor / setter, not attributes set
from outside), one length budget checked when the trainer is built, prebuilt engine= and
train_step=."""
import asyncio
import functools

import jax
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.loop import AgentConfig
from sfrrl_jax.engine import Engine
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks
from sfrrl_jax.trainer.agent_rollout import AgentRollout
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream, shared_train_step
from sfrrl_jax.trainer.rollout_fn import declared_token_budget

CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=128)
WL = WorkloadConfig(num_prompts=4, response_median=4, response_sigma=0.5, max_response=8,
                    tool_latency_median_s=0.01, tool_latency_sigma=0.5, max_turns=2)
LOSS, OPT = LossConfig(), OptimizerConfig(learning_rate=1e-3)


@functools.lru_cache(maxsize=None)
def _params():
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
    params, tc = _params(), _tc()
    engine = Engine(CFG, params, max_slots=4, max_len=64, buckets=(16, 32))
    ts = shared_train_step(CFG, LOSS, OPT)
    agent = AgentRollout(None, None, AgentConfig(max_total_tokens=64))  # == max_len: fits
    built = RLTrainer(CFG, params, tc, LOSS, OPT, agent, TaskStream(make_tasks(WL)))
    assert built.train_step is ts and isinstance(built.engine, Engine)  # the defaults
    tr = RLTrainer(CFG, params, tc, None, None, WorkloadAgent(WL), TaskStream(make_tasks(WL), seed=1),
                   engine=engine, train_step=ts)
    assert tr.engine is engine and tr.train_step is ts and tr.loss_cfg == ts.loss_cfg
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
    assert engine.idle_work is None and engine.underfull_slots == tc.underfull_slots
    assert engine.occupancy == {"running": 0, "parked": 0, "free": 4, "queued": 0}
