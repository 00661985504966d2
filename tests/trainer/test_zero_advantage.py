"""Zero-advantage trajectories train forward only (TrainerConfig.skip_zero_advantage_backward,
Loss.zero_advantage_zero_gradient, TrainStep.stats_microstep): their gradient is exactly 0, so the
step accumulates the same gradient, loss, counts and metrics, and updates to the same params,
with their backward pass skipped; it refuses a loss (or router coefficients) that would not."""
import functools

import jax
import numpy as np
import optax
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.checkpoints.trainer_state import HOST_FORMAT, check_resumable, config_fingerprint, diff_fingerprints
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.objective import ROUTER_METRICS
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.loss_fn import Loss, policy_loss, sft_loss
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks
from sfrrl_jax.trainer.batching import Group, batch_fields
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.early_samples import GroupProgress
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
from sfrrl_jax.trainer.microsteps import make_units
from sfrrl_jax.trainer.step_schedule import RLStep

CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=64)
OPT = OptimizerConfig(learning_rate=1e-4)
# rewards per group: two of them all equal (advantage exactly 0 under GRPO), two mixed
REWARDS = ((1.0, 1.0, 1.0, 1.0), (0.2, 0.9, 0.4, 0.7), (0.0, 0.0, 0.0, 0.0), (1.0, 0.0, 0.5, 0.25))
LENGTHS = ((61, 9, 33, 17), (48, 5, 26, 40), (12, 21, 30, 7), (44, 15, 19, 28))


@functools.lru_cache(maxsize=None)
def _params():
    return S.init_params(CFG, S.make_mesh(devices=jax.devices()[:1]), seed=0)


def _fresh_params():
    return jax.tree.map(lambda x: x.copy(), _params())  # `apply` donates its params


def _groups() -> list[Group]:
    rng = np.random.default_rng(0)
    out = []
    for g, (rewards, lengths) in enumerate(zip(REWARDS, LENGTHS)):
        trajs = []
        for i, (n, r) in enumerate(zip(lengths, rewards)):
            mask = np.zeros(n, np.int32)
            mask[min(4, n - 1):] = 1
            logp = np.where(mask > 0, -rng.random(n) * 3, 0.0)
            trajs.append(Trajectory(task_id=f"g{g}", group_id=f"g{g}", sample_index=i, prompt_len=min(4, n - 1),
                                    tokens=rng.integers(3, CFG.vocab_size, n).tolist(), loss_mask=mask.tolist(),
                                    rollout_logprobs=logp.tolist(), reward=r))
        out.append(Group(f"g{g}", trajs, params_version=0, launch_index=g))
    return out


def _run(ts, params, units):
    acc = ts.init_accumulator(params)
    for u in units:
        acc = (ts.stats_microstep if u.forward_only else ts.grad_microstep)(params, acc, u.batch)
    return acc


def _assert_same_acc(a, b):
    """Counts exactly; sums, maxima, minima and gradients to 1e-5 of the largest entry (a micro-step
    split changes the float summation order, never what is summed). The router metrics are left
    out: a micro-step's router losses are its own batch's load statistics (not a sum over rows), so
    they follow the split whatever runs it, as with any other `microbatch_rows`."""
    for k in ("denominator", "num_tokens", "num_seqs"):
        assert float(a.scalars[k]) == float(b.scalars[k]), k
    close = lambda x, y, what: np.testing.assert_allclose(  # noqa: E731
        y, x, rtol=0, atol=1e-5 * max(float(np.abs(x).max()), 1e-30), err_msg=what)
    close(a.scalars.numerator, b.scalars.numerator, "numerator")
    for part in ("sums", "maxes", "mins"):
        assert sorted(getattr(a, part)) == sorted(getattr(b, part))
        for k, v in getattr(a, part).items():
            if k in ROUTER_METRICS:
                continue
            close(v, getattr(b, part)[k], f"{part}[{k}]")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a.grads)[0], jax.tree.leaves(b.grads), strict=True):
        close(x, y, jax.tree_util.keystr(path))


# -- (a) the same accumulator and update with and without the backward of zero-advantage rows -------
@pytest.mark.parametrize("loss_cfg,microbatch_rows", [
    (LossConfig(), 0),
    (LossConfig(policy_loss="gspo", behavior="rollout", is_correction="tis", dual_clip=3.0,
                aggregation="seq_mean_token_mean"), 2),
], ids=["ppo", "gspo+rollout+tis+dual_clip,rows=2"])
def test_forward_only_rows_give_the_same_accumulator_and_update(loss_cfg, microbatch_rows):
    # plain SGD: the update is the gradient's multiple (Adam's first step, g / |g|, would magnify
    # the float summation order of gradient entries near 0)
    ts = make_train_step(CFG, loss_cfg, optax.sgd(0.1))
    assert ts.loss.zero_advantage_zero_gradient and ts.forward_only_refusal() is None
    tc = TrainerConfig(mode="sync", groups_per_step=4, group_size=4, groups_per_microbatch=4, max_len=64,
                       seq_bucket=32, microbatch_rows=microbatch_rows)
    groups, fields = _groups(), batch_fields(ts.loss)
    off = make_units(groups, tc, {}, fields, forward_only=False)
    on = make_units(groups, tc, {}, fields, forward_only=True)
    assert not any(u.forward_only for u in off)
    fo = [u for u in on if u.forward_only]
    assert fo and on[:len(fo)] == fo    # forward-only micro-steps first, then the gradient ones
    # exactly the zero-variance groups' trajectories are in them, every token counted once
    assert {s.group_id for u in fo for s in u.groups} == {"g0", "g2"}
    assert {s.group_id for u in on[len(fo):] for s in u.groups} == {"g1", "g3"}
    assert sum(s.num_generated for u in on for s in u.groups) == sum(g.num_generated for g in groups)
    assert all(not np.any(u.batch.advantages) for u in fo)
    params = _params()
    # what makes it exact: the gradient of those rows is exactly zero, bit for bit
    zero = jax.device_get(ts.grad_microstep(params, ts.init_accumulator(params), fo[0].batch))
    assert all(not np.any(g) for g in jax.tree.leaves(zero.grads)) and float(zero.scalars.num_tokens) > 0
    acc_off, acc_on = jax.device_get(_run(ts, params, off)), jax.device_get(_run(ts, params, on))
    _assert_same_acc(acc_off, acc_on)
    assert float(acc_on.scalars.num_microbatches) == len(on) and float(acc_off.scalars.num_microbatches) == len(off)
    new, old = {}, jax.device_get(params)
    for name, units in (("off", off), ("on", on)):
        p = _fresh_params()
        acc = _run(ts, p, units)
        p, _, metrics = ts.apply(p, ts.init_opt_state(p), acc)
        new[name] = (jax.device_get(p), jax.device_get(metrics))
    assert new["on"][1]["update_skipped"] == 0.0
    np.testing.assert_allclose(new["on"][1]["loss"], new["off"][1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(new["on"][1]["grad_norm"], new["off"][1]["grad_norm"], rtol=1e-5)
    for p0, a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new["off"][0]), jax.tree.leaves(new["on"][0]),
                        strict=True):
        step = np.abs(a - p0).max()
        np.testing.assert_allclose(b - p0, a - p0, rtol=0, atol=1e-5 * step + 1e-7)


def test_make_units_keeps_merges_in_a_gradient_micro_step():
    tc = TrainerConfig(mode="pipelined", groups_per_step=4, group_size=4, max_len=64, seq_bucket=16, early_groups=1)
    groups = _groups()
    # a zero-variance group whose samples 0 and 2 trained early: the rest are forward-only rows,
    # but the micro-step that merges its buffer stays a gradient one
    prog = GroupProgress(0, claimed=[0, 2], reference=0, buffer=object())
    units = make_units(groups[:1], tc, {0: prog}, forward_only=True)
    assert len(units) == 1 and not units[0].forward_only and units[0].merges[0][0] is prog
    prog = GroupProgress(0, claimed=[1], reference=0, buffer=object())
    units = make_units(groups[:2], tc, {0: prog}, forward_only=True)
    assert units[0].forward_only and not units[0].merges
    assert not units[-1].forward_only and units[-1].merges[0][0] is prog
    assert sum(s.num_generated for u in units for s in u.groups) == groups[0].num_generated + groups[1].num_generated
    # without zero-advantage rows, or with the switch off: the former micro-steps, whole groups
    for forward_only, gs in ((True, groups[1:2]), (False, groups[:1])):
        units = make_units(gs, tc, {}, forward_only=forward_only)
        assert len(units) == 1 and not units[0].forward_only and units[0].groups == gs


# -- (b) the trainer: forward-only micro-steps where the loss allows them, and only there -----------
WL = WorkloadConfig(num_prompts=4, response_median=5, response_sigma=0.8, max_response=12,
                    tool_latency_median_s=0.002, tool_latency_sigma=0.5, max_turns=2)


class _FlatRewards:
    """The workload, with every sample of prompts w0 and w2 rewarded 1 (zero-variance groups)."""

    def __init__(self):
        self.agent = WorkloadAgent(WL)

    async def __call__(self, engine, task, sample_index):
        traj = await self.agent(engine, task, sample_index)
        if task.task_id in ("w0", "w2"):
            traj.reward = 1.0
        return traj


def _trainer(loss=LossConfig(), **kw) -> RLTrainer:
    tc = TrainerConfig(mode="sync", groups_per_step=4, group_size=2, groups_per_microbatch=2, max_slots=8,
                       max_len=64, buckets=(16,), seq_bucket=32, longest_first=False, **kw)
    return RLTrainer(CFG, _fresh_params(), tc, loss, OPT, _FlatRewards(), TaskStream(make_tasks(WL), seed=1))


def test_trainer_runs_zero_advantage_groups_forward_only_where_the_loss_allows():
    runs = {"on": _trainer(), "off": _trainer(skip_zero_advantage_backward=False)}
    # the warm-up compiles the forward-only micro-steps too: the step then compiles no train function
    on = runs["on"]
    on.compile_train_shapes()
    micro_fns = lambda: (on.train_step.jitted_microstep(on.params), on.train_step.jitted_stats_microstep(on.params))  # noqa: E731
    compiled = [f._cache_size() for f in micro_fns()]
    m = {k: tr.step() for k, tr in runs.items()}
    assert [f._cache_size() for f in micro_fns()] == compiled
    assert m["on"]["rollout/zero_variance_groups"] >= 2
    assert m["on"]["train/forward_only_microsteps"] > 0 and m["off"]["train/forward_only_microsteps"] == 0
    assert 0 < m["on"]["train/forward_only_tokens"] < m["on"]["train/positions"] and m["off"]["train/forward_only_tokens"] == 0
    assert runs["on"]._step.forward_only is True and runs["off"]._step.forward_only is False
    # an entropy bonus has a gradient at advantage 0: its steps form no forward-only micro-step
    # (`RLStep.forward_only` False: make_units packs as before, microstep back-propagates every row)
    entropy = _trainer(LossConfig(entropy_coef=0.01))
    assert RLStep(entropy.step_inputs()).forward_only is False and entropy.zero_advantage_forward_only is False
    for k in ("reward/mean", "rollout/generated_tokens", "train/trained_tokens", "train/num_tokens",
              "train/num_seqs", "policy/on_policy_fraction"):
        assert m["on"][k] == m["off"][k], k
    assert m["on"]["train/trained_tokens"] == m["on"]["rollout/generated_tokens"]
    assert m["on"]["train/microsteps"] == m["on"]["train/num_microbatches"] > m["off"]["train/microsteps"]
    assert m["on"]["train/positions"] > 0 and 0.0 <= m["on"]["train/padding_share"] < 1.0
    np.testing.assert_allclose(m["on"]["train/loss"], m["off"]["train/loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(jax.device_get(runs["off"].params)),
                    jax.tree.leaves(jax.device_get(runs["on"].params)), strict=True):
        np.testing.assert_allclose(b, a, atol=2e-6, rtol=1e-5)


# -- (c) refusals, declarations, the switch ----------------------------------------------------------
def test_stats_microstep_refuses_a_loss_whose_zero_advantage_rows_have_a_gradient():
    assert policy_loss(LossConfig()).zero_advantage_zero_gradient
    assert policy_loss(LossConfig(behavior="old", policy_loss="gspo")).zero_advantage_zero_gradient
    assert not policy_loss(LossConfig(kl_coef=0.1)).zero_advantage_zero_gradient
    assert not policy_loss(LossConfig(entropy_coef=0.01)).zero_advantage_zero_gradient
    assert not sft_loss().zero_advantage_zero_gradient
    custom = Loss(fn=policy_loss().fn, required_fields=("tokens", "loss_mask", "advantages"))
    assert not custom.zero_advantage_zero_gradient   # a custom loss must opt in
    with pytest.raises(ValueError, match="zero_advantage_zero_gradient=True needs 'advantages'"):
        Loss(fn=policy_loss().fn, zero_advantage_zero_gradient=True)
    params = _params()
    batch = make_units(_groups()[:1], TrainerConfig(max_len=64, seq_bucket=16), {}, forward_only=True)[0].batch
    for loss, why in ((LossConfig(kl_coef=0.1), "does not declare Loss.zero_advantage_zero_gradient"),
                      (custom, "does not declare Loss.zero_advantage_zero_gradient"),
                      (LossConfig(router_aux_coef=0.01), r"router loss coefficients \{'router_aux_coef': 0.01\}")):
        ts = make_train_step(CFG, loss, OPT)
        assert not ts.zero_advantage_forward_only
        with pytest.raises(ValueError, match=f"stats_microstep .* refused: .*{why}"):
            ts.stats_microstep(params, ts.init_accumulator(params), batch)


def test_the_switch_is_a_checked_bool_that_old_checkpoints_resume_at():
    assert TrainerConfig().skip_zero_advantage_backward is True
    with pytest.raises(ValueError, match="skip_zero_advantage_backward"):
        TrainerConfig(skip_zero_advantage_backward=1)
    old = config_fingerprint(trainer=TrainerConfig())   # a checkpoint from before the switch existed
    old["trainer"].pop("__defaults__")
    del old["trainer"]["skip_zero_advantage_backward"]
    host = {"format": HOST_FORMAT, "tasks": {"num_tasks": 4}}
    check_resumable({**host, "config": old}, config_fingerprint(trainer=TrainerConfig()), 4, "ckpt")
    off = config_fingerprint(trainer=TrainerConfig(skip_zero_advantage_backward=False))
    assert diff_fingerprints(old, off) == ["trainer.skip_zero_advantage_backward: checkpoint '<absent>', now False"]


def test_stats_microstep_leaves_offloaded_gradient_sums_where_they_are():
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=32, n_layers=1)
    ts = make_train_step(cfg, LossConfig(), OptimizerConfig(offload_accumulator=True))
    params = S.init_params(cfg, S.make_mesh(devices=jax.devices()[:1]), seed=0)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(3, cfg.vocab_size, (2, 16)).astype(np.int32),
             "loss_mask": np.ones((2, 16), np.float32), "advantages": np.zeros((2, 16), np.float32),
             "rollout_logprobs": -rng.random((2, 16)).astype(np.float32)}
    acc = ts.init_accumulator(params)
    grads = jax.tree.leaves(acc.grads)
    out = ts.stats_microstep(params, acc, batch)
    assert all(a is b for a, b in zip(jax.tree.leaves(out.grads), grads, strict=True))   # not moved, not copied
    assert {x.sharding.memory_kind for x in grads} == {"pinned_host"}
    ref = ts.grad_microstep(params, ts.init_accumulator(params), batch)
    assert float(out.scalars.num_tokens) == float(ref.scalars.num_tokens) == 30.0
    assert float(out.scalars.num_microbatches) == 1.0
    for k in ("tok/entropy", "tok/mismatch"):
        np.testing.assert_allclose(float(out.sums[k]), float(ref.sums[k]), rtol=1e-5)
