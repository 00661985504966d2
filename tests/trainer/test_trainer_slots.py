"""The trainer's engine decodes every sample of a step together by default (issue #44 point 5):
`TrainerConfig.max_slots=None` is one slot per sample the step launches at first, fitted to the
KV-cache budget with a warning that names the figures. It used to be 8 slots: a step of 64
samples decoded in eight silent waves."""
import importlib
import warnings

import jax
import pytest

import sfrrl_jax as S
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream

generate_module = importlib.import_module("sfrrl_jax.engine.generate")
CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=64, n_layers=1)
WL = WorkloadConfig(num_prompts=4, response_median=4, max_response=8)


def _trainer(tc):
    params = S.init_params(CFG, S.make_mesh(devices=jax.devices()[:1]), seed=0)
    return RLTrainer(CFG, params, tc, LossConfig(), OptimizerConfig(), WorkloadAgent(WL),
                     TaskStream(make_tasks(WL)))


def test_engine_slots_default_to_every_sample_launched():
    assert TrainerConfig(groups_per_step=8, group_size=8).engine_slots == 64
    assert TrainerConfig(groups_per_step=2, group_size=4, overprovision_groups=1).engine_slots == 12
    assert TrainerConfig(groups_per_step=8, group_size=8, max_slots=16).engine_slots == 16
    with pytest.raises(ValueError, match="TrainerConfig.max_slots"):
        TrainerConfig(max_slots=0)


def test_the_trainer_engine_has_a_slot_per_sample_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = _trainer(TrainerConfig(groups_per_step=3, group_size=4, max_len=32, buckets=(16,), seq_bucket=16))
    assert trainer.engine.steps.max_slots == 12


def test_a_budget_too_small_caps_the_slots_and_says_so(monkeypatch):
    one_slot = S.Engine(CFG, S.init_params(CFG, S.make_mesh(devices=jax.devices()[:1]), seed=0),
                        max_slots=1, max_len=32).steps.cache_bytes()
    # a budget of 5.5 slots' cache: the trainer asks for 12, gets 5
    monkeypatch.setattr(generate_module, "_budget", lambda kv_budget_bytes: 5.5 * one_slot)
    with pytest.warns(UserWarning, match=r"RLTrainer \(TrainerConfig.max_slots=None\) at max_len=32 need a KV "
                                         r"cache .* for 12 slots, .* decoding 5 at a time"):
        trainer = _trainer(TrainerConfig(groups_per_step=3, group_size=4, max_len=32, buckets=(16,), seq_bucket=16))
    assert trainer.engine.steps.max_slots == 5
    # an explicit max_slots is the user's: never second-guessed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = _trainer(TrainerConfig(groups_per_step=3, group_size=4, max_slots=12, max_len=32,
                                         buckets=(16,), seq_bucket=16))
    assert trainer.engine.steps.max_slots == 12
