"""The pipelined-synchronous trainer: same result as sync, on-policy accounting, robustness."""
import asyncio
import functools

import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.tools import ToolRunner, ToolRunnerConfig
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
from sfrrl_jax.trainer.run_logger import RunLogger, read_metrics
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks

CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=128)
WL = WorkloadConfig(num_prompts=6, response_median=5, response_sigma=0.8, max_response=16,
                    tool_latency_median_s=0.02, tool_latency_sigma=0.5, max_turns=3)
LOSS = LossConfig()
OPT = OptimizerConfig(learning_rate=1e-4)


@functools.lru_cache(maxsize=None)
def _mesh():
    return S.make_mesh(data=2, expert=4)


# max_len 64: WL's longest trajectory is 60 tokens, so nothing of WL is cut, and the train widths
# are 32 and 64 (each width is one compile per micro-step shape)
MAX_LEN = 64


def _trainer(mode, agent=None, opt=OPT, **kw):
    kw = {"seq_bucket": 32, **kw}
    tc = TrainerConfig(mode=mode, groups_per_step=2, group_size=4, max_slots=8, max_len=MAX_LEN,
                       buckets=(16, 32), **kw)
    params = S.init_params(CFG, _mesh(), seed=0)
    return RLTrainer(CFG, params, tc, LOSS, opt, agent or WorkloadAgent(WL), TaskStream(make_tasks(WL), seed=1))


def test_pipelined_equals_sync_after_a_step_and_both_are_on_policy(tmp_path):
    sync, pipe = _trainer("sync"), _trainer("pipelined")
    m_sync, m_pipe = sync.step(), pipe.step()
    for k in ("reward/mean", "rollout/generated_tokens", "train/trained_tokens"):
        assert m_sync[k] == m_pipe[k], k  # the same trajectories were generated and trained
    flat_s = jax.tree_util.tree_flatten_with_path(jax.device_get(sync.params))[0]
    flat_p = dict(jax.tree_util.tree_flatten_with_path(jax.device_get(pipe.params))[0])
    moved = 0.0
    init = dict(jax.tree_util.tree_flatten_with_path(jax.device_get(S.init_params(CFG, _mesh(), 0)))[0])
    for path, a in flat_s:
        np.testing.assert_allclose(a, flat_p[path], atol=2e-6, rtol=1e-5, err_msg=str(path))
        moved = max(moved, float(np.abs(a - init[path]).max()))
    assert moved > 1e-5  # the update really happened
    assert m_sync["policy/on_policy_fraction"] == 1.0 and m_pipe["policy/on_policy_fraction"] == 1.0
    assert m_pipe["train/microsteps"] == m_sync["train/microsteps"] == 2
    assert m_sync["time/hidden_train_share"] == 0.0
    # each group's G samples were admitted together: its prompt computed once, served to the others
    for m in (m_sync, m_pipe):
        assert m["engine/prefill_tokens"] > 0 and 0.0 < m["engine/prefix_hit_rate"] < 1.0
    for m in (m_sync, m_pipe):  # idle split: starved idle (nothing trainable) is part of all idle
        assert 0.0 <= m["time/idle_starved_s"] <= m["time/idle_s"] < m["time/wall_s"]
        assert m["perf/busy_ceiling_on_policy"] == 1.0 - m["time/idle_starved_s"] / m["time/wall_s"]
    # sync idles with finished groups waiting: idle a pipelined schedule could fill
    assert m_sync["time/idle_starved_s"] < m_sync["time/idle_s"]
    # (sync repeats bitwise over steps, whatever finished first: tests/trainer/test_determinism.py)
    # metrics, TensorBoard, Chrome trace and the busy/idle PNG land in the run dir
    log = RunLogger(tmp_path)
    log.log(0, m_pipe)
    out = log.write_timeline(pipe.timeline)
    log.close()
    assert read_metrics(tmp_path)[0]["reward/mean"] == m_pipe["reward/mean"]
    assert (tmp_path / "busy_idle.png").stat().st_size > 1000
    assert '"grad_microstep"' in open(out["trace"]).read()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("mode", ["pipelined", "one_step_off"])
def test_swapped_cache_and_offloaded_sums_train_as_without(mode):
    """TrainerConfig.swap_cache + OptimizerConfig.offload_accumulator (what the 1M-token config
    needs to fit): micro-steps run during the rollout with the KV cache in host memory, the sums
    wait there between them; two steps train the same trajectories to the same params as
    without. one_step_off trains step 1's groups as idle work during step 2's rollout (before
    its first decode chunk, underfull_slots = max_slots): two swaps for certain."""
    import dataclasses
    plain = _trainer(mode, underfull_slots=8)
    swapped = _trainer(mode, underfull_slots=8, swap_cache=True,
                       opt=dataclasses.replace(OPT, offload_accumulator=True))
    kinds = []
    run = swapped.engine._run_with_cache_away

    def watched(job):
        def wrapped():
            kinds.append(swapped.engine.state.cache_k.sharding.memory_kind)
            job()
        run(wrapped)
    swapped.engine._run_with_cache_away = watched
    for _ in range(2):
        m_plain, m_swapped = plain.step(), swapped.step()
        for k in ("reward/mean", "rollout/generated_tokens", "train/trained_tokens", "train/microsteps"):
            assert m_plain[k] == m_swapped[k], k
    assert set(kinds) <= {"pinned_host"} and len(kinds) == swapped.engine.stats.cache_swaps
    assert plain.engine.stats.cache_swaps == 0
    if mode == "one_step_off":
        assert swapped.engine.stats.cache_swaps >= 2
    for a, b in zip(jax.tree.leaves(jax.device_get(plain.params)), jax.tree.leaves(jax.device_get(swapped.params))):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


def test_a_paged_cache_with_shared_and_cached_prompt_pages_trains_as_the_dense_one():
    """TrainerConfig.page_size + prefix_cache_pages: a group's samples hold their prompt's pages
    once and the engine keeps released pages for later prompts; the step trains what the dense
    engine's does."""
    dense, paged = _trainer("sync"), _trainer("sync", page_size=8, num_pages=96, prefix_cache_pages=32)
    assert paged.engine.prefix_cache_pages == 32
    m_dense, m_paged = dense.step(), paged.step()
    for k in ("reward/mean", "rollout/generated_tokens", "train/trained_tokens", "engine/prefill_tokens",
              "engine/prefix_hit_rate"):
        assert m_dense[k] == m_paged[k], k
    # sync mode frees the cache to train: what it held is forgotten with it
    assert len(paged.engine._pt.allocator.cache) == 0 and paged.engine.state is None
    with pytest.raises(ValueError, match="TrainerConfig.prefix_cache_pages=8 keeps pages of a paged cache"):
        TrainerConfig(prefix_cache_pages=8)


@pytest.mark.parametrize("pack_rows", [False, True])
def test_row_split_micro_steps_give_the_same_update(pack_rows):
    # one width (seq_bucket 64): a compile per row count, not per row count and width
    whole = _trainer("pipelined", seq_bucket=64, pack_rows=pack_rows)
    split = _trainer("pipelined", seq_bucket=64, microbatch_rows=2, pack_rows=pack_rows)
    m_whole, m_split = whole.step(), split.step()
    assert m_whole["train/microsteps"] == 2
    if pack_rows:   # a packed row holds one or more samples: 1 or 2 micro-steps per 4-sample group
        assert 2 < m_split["train/microsteps"] <= 4
    else:           # 4-row groups
        assert m_split["train/microsteps"] == 4
    assert m_split["train/trained_tokens"] == m_whole["train/trained_tokens"]
    for a, b in zip(jax.tree.leaves(jax.device_get(whole.params)), jax.tree.leaves(jax.device_get(split.params))):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


def test_one_step_off_is_measured_off_policy():
    tr = _trainer("one_step_off")
    m = [tr.step() for _ in range(3)]
    assert m[0]["train/microsteps"] == 0            # nothing to train yet
    assert m[1]["policy/on_policy_fraction"] == 1.0  # batch 0 trained before any update
    assert m[2]["policy/on_policy_fraction"] == 0.0  # batch 1 (version 0) trained by version 1
    assert tr.params_version == 2


class _CrashTool:
    name, description = "crash", "always raises"
    parameters = {"type": "object", "properties": {"latency": {"type": "number"}}}

    async def __call__(self, latency):
        raise RuntimeError("tool exploded")


class _HangTool(_CrashTool):
    name, description = "hang", "never returns"

    async def __call__(self, latency):
        await asyncio.sleep(3600)


@pytest.mark.parametrize("tool", [_CrashTool, _HangTool])
def test_failing_tools_zero_the_reward_and_lose_nothing(tool):
    wl = WorkloadConfig(**{**WL.__dict__, "tool_name": tool.name})
    runner = ToolRunner([tool()], ToolRunnerConfig(timeout_s=0.2))
    agent = WorkloadAgent(wl, runner=runner)
    tr = _trainer("pipelined", agent=agent)
    m = tr.step()
    trajs = [t for g in tr._step.kept for t in g.trajectories]  # the groups the step trained
    assert len(trajs) == 8 and sorted((t.group_id, t.sample_index) for t in trajs) == sorted(
        {(t.group_id, i) for t in trajs for i in range(4)})
    calls = sum(len(t.turns) - 1 for t in trajs)
    assert calls > 0 and m["rollout/tool_errors"] == calls
    for t in trajs:
        if len(t.turns) > 1:
            assert t.reward == 0.0
            assert all(turn.num_tool_errors == 1 for turn in t.turns[:-1])
        else:
            assert t.reward > 0 or t.reward == 0.0  # single-turn: scored normally
    assert tr.engine.occupancy == {"running": 0, "parked": 0, "free": 8, "queued": 0}


def test_bad_config_fails_before_compiling():
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        TrainerConfig(group_size=0)
    with pytest.raises(ValueError, match="groups_per_step=3 is not divisible into micro-batches of groups_per_microbatch=2"):
        TrainerConfig(groups_per_step=3, groups_per_microbatch=2)
    with pytest.raises(ValueError, match="advantage.estimator='reinforce_pp' normalises over the whole batch"):
        TrainerConfig(mode="pipelined", advantage=S.rl.config.AdvantageConfig(estimator="reinforce_pp"))
    with pytest.raises(ValueError, match="mode='async'"):
        TrainerConfig(mode="async")
    params = S.init_params(CFG, _mesh(), seed=0)
    with pytest.raises(ValueError, match="lower TrainerConfig.max_slots or max_len"):
        RLTrainer(CFG.replace(max_seq_len=1 << 22), params,
                  TrainerConfig(max_slots=1 << 16, max_len=1 << 22), LOSS, OPT, WorkloadAgent(WL),
                  TaskStream(make_tasks(WL)))
    with pytest.raises(ValueError, match="prefix_cache_pages=8 with LossConfig.routing_replay='r3'"):
        RLTrainer(CFG, params, TrainerConfig(max_len=64, page_size=8, prefix_cache_pages=8),
                  LossConfig(routing_replay="r3"),
                  OPT, WorkloadAgent(WL), TaskStream(make_tasks(WL)))
    with pytest.raises(ValueError, match="TrainerConfig.max_len=256 > ModelConfig.max_seq_len=128"):
        RLTrainer(CFG, params, TrainerConfig(max_len=256), LOSS, OPT, WorkloadAgent(WL), TaskStream(make_tasks(WL)))


def test_drawn_work_longer_than_the_context_is_cut_not_crashed():
    long = WorkloadConfig(**{**WL.__dict__, "response_median": 40, "response_sigma": 0.5, "max_response": 80})
    tr = _trainer("sync", agent=WorkloadAgent(long))  # engine max_len 64, prompts of 12 tokens
    m = tr.step()
    trajs = [t for g in tr._step.kept for t in g.trajectories]  # the groups the step trained
    assert len(trajs) == 8 and m["train/trained_tokens"] == m["rollout/generated_tokens"] > 0
    assert all(len(t.tokens) < MAX_LEN for t in trajs)
    assert any(t.finish_reason == "max_tokens" for t in trajs)
    assert all(t.finish_reason in ("answer", "max_tokens") for t in trajs)
