"""Packed micro-batches (TrainerConfig.pack_rows, trainer.batching.pack_rows): several trajectories
per row give the loss and gradient of the same trajectories one per row, for every loss
aggregation and under routing replay, with far less padding; the layout is deterministic, the
token accounting of split micro-steps exact, and every shape a step forms is compiled up front."""
import dataclasses
import functools

import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.trajectory import Trajectory
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.models.transformer import default_positions_and_segments, route_dims
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.loss_fn import policy_loss
from sfrrl_jax.testing.workload import WorkloadAgent, WorkloadConfig, make_tasks
from sfrrl_jax.trainer.batching import (
    Group, RowLayout, RowShapes, batch_fields, bucket_widths, first_fit_decreasing, microbatch_from_layout,
    microbatch_from_trajectories, pack_rows, row_shapes,
)
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.early_samples import GroupProgress
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
from sfrrl_jax.trainer.microsteps import make_units

from model_fixtures import TINY_GPT_OSS, randomize

CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=64)
# fp32 throughout (conftest: highest matmul precision): the two layouts sum the same products in
# another order, so they agree to ~1e-6 relative; held to 1e-4 (CI runs on other CPU models)
RTOL = 1e-4
# a mix of lengths like an agentic rollout's (prompt, generated turns, tool observations), in
# rows of 64 with seq_bucket 16: one per row pads to 64, packed rows hold several
LENGTHS = (61, 9, 33, 17, 48, 5, 26, 40, 12, 21)


def _trajectory(rng, length: int, index: int, dims=None) -> Trajectory:
    """prompt | generated | observation | generated, of `length` tokens (the shortest: one turn)."""
    prompt = min(4, length - 1)
    mask = np.zeros(length, np.int32)
    gen = length - prompt
    first = max(1, gen // 2)
    mask[prompt:prompt + first] = 1
    if gen - first > 3:
        mask[prompt + first + 2:] = 1   # a 2-token observation between the turns
    logp = np.where(mask > 0, -rng.random(length) * 3, 0.0)
    routes = None if dims is None else rng.integers(0, CFG.n_experts, (length - 1,) + dims).astype(np.int16)
    return Trajectory(task_id=f"t{index}", group_id=f"g{index}", sample_index=index, prompt_len=prompt,
                      tokens=rng.integers(3, CFG.vocab_size, length).tolist(), loss_mask=mask.tolist(),
                      rollout_logprobs=logp.tolist(), reward=float(rng.random()), routes=routes)


def _trajectories(lengths=LENGTHS, dims=None, seed=0):
    rng = np.random.default_rng(seed)
    return [_trajectory(rng, n, i, dims) for i, n in enumerate(lengths)]


@functools.lru_cache(maxsize=None)
def _params(model_cfg, devices: int):
    mesh = S.make_mesh(devices=jax.devices()[:1]) if devices == 1 else S.make_mesh(data=2, expert=4)
    # random weights larger than the init: routers with clear preferences, gradients well above 0
    return randomize(S.init_params(model_cfg, mesh, seed=0), seed=3, scale=0.3)


def _accumulate(ts, params, batch):
    acc = ts.grad_microstep(params, ts.init_accumulator(params), batch)
    return jax.device_get(acc)


def _compare(unpacked, packed, what: str) -> dict:
    """Largest relative differences of the loss, the other sums and the gradient sums (printed)."""
    su, sp = unpacked.scalars, packed.scalars
    for k in ("denominator", "num_tokens", "num_seqs"):
        assert float(getattr(su, k)) == float(getattr(sp, k)), (what, k)
    loss_u, loss_p = float(su.numerator / su.denominator), float(sp.numerator / sp.denominator)
    diffs = {"loss": abs(loss_p - loss_u) / abs(loss_u)}
    for k, v in unpacked.sums.items():
        np.testing.assert_allclose(packed.sums[k], v, rtol=RTOL, atol=RTOL * 1e-3, err_msg=f"{what}: sum {k}")
    worst = 0.0
    flat_p = jax.tree.leaves(packed.grads)
    for (path, gu), gp in zip(jax.tree_util.tree_flatten_with_path(unpacked.grads)[0], flat_p, strict=True):
        scale = float(np.abs(gu).max())
        if scale == 0.0:   # e.g. an expert no token routed to: zero in both
            assert float(np.abs(gp).max()) == 0.0, (what, jax.tree_util.keystr(path))
            continue
        rel = float(np.abs(gp - gu).max()) / scale
        worst = max(worst, rel)
        assert rel <= RTOL, (what, jax.tree_util.keystr(path), rel)
    diffs["grad"] = worst
    print(f"{what}: loss {loss_u:.6f}, |packed - one per row| / scale: loss {diffs['loss']:.2e}, "
          f"gradient (worst leaf, relative to its largest entry) {worst:.2e}")
    assert diffs["loss"] <= RTOL, (what, loss_u, loss_p)
    return diffs


def _layouts(trajs, seq_bucket=16, max_len=64):
    lengths = [len(t.tokens) for t in trajs]
    packed = pack_rows(lengths, RowShapes(bucket_widths(seq_bucket, max_len), len(trajs)))
    return RowLayout.one_per_row(lengths, seq_bucket, max_len), packed


# -- the same loss and gradient -------------------------------------------------------------------
@pytest.mark.parametrize("loss_cfg", [
    LossConfig(aggregation="token_mean"),
    LossConfig(aggregation="seq_mean_token_sum"),
    LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01),
    LossConfig(aggregation="seq_mean_token_sum_norm", norm_length=64),
    LossConfig(aggregation="seq_mean_token_mean", policy_loss="gspo", is_correction="tis", is_level="sequence"),
], ids=["token_mean", "seq_mean_token_sum", "seq_mean_token_mean+entropy", "seq_mean_token_sum_norm",
        "gspo+sequence_tis"])
def test_packed_rows_give_the_loss_and_gradient_of_one_trajectory_per_row(loss_cfg):
    trajs = _trajectories()
    adv = np.random.default_rng(1).normal(size=len(trajs)).astype(np.float32)
    one, packed = _layouts(trajs)
    assert len(packed.rows) < len(one.rows) and any(len(r) > 1 for r in packed.rows)
    ts = make_train_step(CFG, loss_cfg, OptimizerConfig())
    fields = batch_fields(ts.loss)
    params = _params(CFG, 1)
    acc_one = _accumulate(ts, params, microbatch_from_layout(trajs, adv, one, fields))
    acc_packed = _accumulate(ts, params, microbatch_from_layout(trajs, adv, packed, fields))
    _compare(acc_one, acc_packed, loss_cfg.aggregation)


@pytest.mark.parametrize("model", ["tiny-moe", "gpt-oss-like"])
def test_packed_rows_replay_routing_and_shard_as_one_per_row(model):
    """R3 on the MoE preset, on 8 devices (rows over data, experts over expert); the GPT-OSS-like
    variant adds sinks, a sliding window (positions restart per trajectory) and a router bias."""
    model_cfg = CFG if model == "tiny-moe" else TINY_GPT_OSS.replace(max_seq_len=64)
    dims = route_dims(model_cfg)
    trajs = _trajectories(dims=dims)
    adv = np.random.default_rng(2).normal(size=len(trajs)).astype(np.float32)
    one, packed = _layouts(trajs)
    ts = make_train_step(model_cfg, LossConfig(routing_replay="r3"), OptimizerConfig())
    fields = batch_fields(ts.loss)
    assert fields[-2:] == ("routes", "routes_mask")
    params = _params(model_cfg, 8)
    b_one = microbatch_from_layout(trajs, adv, one, fields, dims)
    b_packed = microbatch_from_layout(trajs, adv, packed, fields, dims)
    assert b_packed.routes_mask.sum() == b_one.routes_mask.sum() == sum(len(t.routes) for t in trajs)
    acc_one, acc_packed = _accumulate(ts, params, b_one), _accumulate(ts, params, b_packed)
    _compare(acc_one, acc_packed, f"r3 {model}")
    agreement = [float(a.sums["routing_agreement"] / a.scalars.denominator) for a in (acc_one, acc_packed)]
    np.testing.assert_allclose(agreement[1], agreement[0], rtol=RTOL)


# -- the layout -----------------------------------------------------------------------------------
def test_a_packed_row_holds_trajectories_in_order_with_their_own_segments_positions_and_routes():
    dims = route_dims(CFG)
    trajs = _trajectories((30, 20, 12, 10), dims=dims)
    layout = RowLayout(64, ((0, 1, 2), (3,)))
    fields = batch_fields(policy_loss(LossConfig(routing_replay="r3")))
    b = microbatch_from_layout(trajs, [1.0, -2.0, 3.0, 0.5], layout, fields, dims)
    assert b.present == fields and b.positions is None   # the fields asked for, the rest None
    seg = b.segment_ids[0]
    np.testing.assert_array_equal(seg, [1] * 30 + [2] * 20 + [3] * 12 + [0] * 2)
    np.testing.assert_array_equal(b.segment_ids[1], [1] * 10 + [0] * 54)
    np.testing.assert_array_equal(b.tokens[0, 30:50], trajs[1].tokens)
    np.testing.assert_array_equal(b.advantages[0, 30:50], -2.0 * np.asarray(trajs[1].loss_mask, np.float32))
    np.testing.assert_array_equal(b.routes[0, 50:61], trajs[2].routes)
    np.testing.assert_array_equal(b.routes_mask[0], [1] * 29 + [0] + [1] * 19 + [0] + [1] * 11 + [0] * 3)
    # the forward's default positions restart at 0 in every trajectory (and in the padding)
    _, pos = default_positions_and_segments(b.tokens, b.segment_ids)
    np.testing.assert_array_equal(np.asarray(pos)[0], list(range(30)) + list(range(20)) + list(range(12)) + [0, 1])
    # one per row (early samples, pack_rows=False) is the layout of one trajectory in each row
    one = microbatch_from_trajectories(trajs, [1.0, -2.0, 3.0, 0.5], 16, 64, fields, dims)
    by_layout = microbatch_from_layout(trajs, [1.0, -2.0, 3.0, 0.5], RowLayout(32, ((0,), (1,), (2,), (3,))),
                                       fields, dims)
    assert one.present == by_layout.present == fields
    assert all(np.array_equal(one.get(k), by_layout.get(k)) for k in fields)
    with pytest.raises(ValueError, match="not each of 0..3 once"):
        microbatch_from_layout(trajs, np.zeros(4), RowLayout(64, ((0, 1), (3,))))
    with pytest.raises(ValueError, match="more than its width 64"):
        microbatch_from_layout(trajs, np.zeros(4), RowLayout(64, ((0, 1, 2, 3),)))


def test_packing_is_first_fit_decreasing_on_the_smallest_area_of_the_menu():
    assert first_fit_decreasing([5, 9, 5, 3], 10) == [[1], [0, 2], [3]]   # ties: the lower index first
    menu = RowShapes(bucket_widths(16, 64), 8)          # every row count up to 8 at widths 16..64
    assert menu.shapes == tuple((r, w) for w in (16, 32, 48, 64) for r in range(1, 9))
    lay = pack_rows([40, 30, 20, 10, 5], menu)          # 105 tokens: 2 x 64 = 128 beats 3 x 48 = 144
    assert (lay.width, lay.rows) == (64, ((0, 2), (1, 3, 4)))
    assert pack_rows([40, 30, 20, 10, 5], menu) == lay  # a pure function of the lengths
    ladder = RowShapes((16, 32, 48, 64), 8, ladder=True)
    assert ladder.rows_at(32) == (1, 2, 3, 4, 6, 8) and ladder.rows_at(64) == tuple(range(1, 9))
    assert len(ladder.shapes) == 3 * 6 + 8
    assert RowShapes((16, 64), 20, ladder=True).rows_at(16) == (1, 2, 3, 4, 6, 8, 12, 16, 20)
    # 5 bins of 16 round up to 6 rows at width 16 (one row empty), smaller than two rows of 64 ...
    assert pack_rows([16] * 5, RowShapes((16, 64), 8, ladder=True)) == RowLayout(
        16, ((0,), (1,), (2,), (3,), (4,), ()))
    # ... 3 bins of 16 fill 3 rows of 16, as small as one row of 48, and the narrower wins the tie
    assert pack_rows([16, 16, 16], ladder) == RowLayout(16, ((0,), (1,), (2,)))
    # ... and a width between the longest and the widest can win: 2 rows of 48 (96) beat 2 rows of 64
    assert pack_rows([40, 8, 8, 8, 8, 8], ladder) == RowLayout(48, ((0, 1), (2, 3, 4, 5)))
    pairs = RowShapes((16, 32, 48, 64), 8, row_multiple=2, ladder=True)
    assert pairs.rows_at(16) == (2, 4, 6, 8) == pairs.rows_at(64)
    assert pack_rows([60], pairs) == RowLayout(64, ((0,), ()))   # rows split over data=2
    # off the menu: longer than max_len (its own width), more trajectories than max_rows
    assert pack_rows([70, 10], menu) == RowLayout(70, ((0,), (1,)))
    assert len(pack_rows([64] * 9, menu).rows) == 9
    with pytest.raises(ValueError, match="at least one trajectory"):
        pack_rows([], menu)
    # the trainer's menu: a ladder unless micro-steps split rows or early samples train
    tc = TrainerConfig(groups_per_step=2, group_size=4, groups_per_microbatch=2, max_len=64, seq_bucket=32)
    assert row_shapes(tc) == RowShapes((32, 64), 8, ladder=True)
    assert row_shapes(tc, row_multiple=2).row_multiple == 2
    assert not row_shapes(TrainerConfig(max_len=64, microbatch_rows=2), row_multiple=2).ladder
    assert row_shapes(TrainerConfig(max_len=64, microbatch_rows=2), row_multiple=2).row_multiple == 1


# -- micro-steps of packed rows: exact token accounting -----------------------------------------------
def _groups(lengths_per_group, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g, lengths in enumerate(lengths_per_group):
        trajs = [_trajectory(rng, n, i) for i, n in enumerate(lengths)]
        for t in trajs:
            t.group_id = t.task_id = f"g{g}"
        out.append(Group(f"g{g}", trajs, params_version=g, launch_index=g))
    return out


def _generated(unit) -> int:
    return sum(g.num_generated for g in unit.groups)


@pytest.mark.parametrize("microbatch_rows", [0, 1, 2])
def test_split_packed_micro_steps_count_every_generated_token_once(microbatch_rows):
    groups = _groups([(61, 9, 33, 17), (48, 5, 26, 40)])
    tc = TrainerConfig(mode="sync", groups_per_step=2, group_size=4, groups_per_microbatch=2, max_len=64,
                       seq_bucket=16, microbatch_rows=microbatch_rows)
    units = make_units(groups, tc, {})
    for u in units:   # a unit's shares are exactly the trajectories in its rows
        assert _generated(u) == int(u.batch.loss_mask.sum())
        assert u.batch.tokens.shape[0] <= (microbatch_rows or 8)
    assert sum(_generated(u) for u in units) == sum(g.num_generated for g in groups)
    if microbatch_rows:   # shares keep each trajectory's group's params version (on-policy counts)
        shares = [s for u in units for s in u.groups]
        assert sorted((s.group_id, s.params_version) for s in shares) == sorted(
            [("g0", 0)] * 4 + [("g1", 1)] * 4)
    else:
        assert len(units) == 1 and units[0].groups == groups   # whole groups
    # early samples: those already in their group's buffer are left out of the rows, and count in
    # the last micro-step that merges the buffer
    prog = GroupProgress(1, claimed=[0, 2], reference=0, buffer=object())
    units = make_units(groups, tc, {1: prog})
    assert units[-1].merges and units[-1].merges[0][0] is prog
    assert int(sum(u.batch.loss_mask.sum() for u in units)) == sum(g.num_generated for g in groups) - sum(
        groups[1].trajectories[i].num_generated for i in (0, 2))
    assert sum(_generated(u) for u in units) == sum(g.num_generated for g in groups)


# -- padding: before and after ---------------------------------------------------------------------
def _agentic_lengths(rng, n, max_len):
    """Lengths like agentic rollouts: a prompt, log-normal turns of generated text and tool
    observations, a long tail cut at max_len."""
    turns = np.clip(np.round(rng.lognormal(np.log(2.0), 0.6, n)), 1, 6).astype(int)
    return [int(min(40 + sum(rng.lognormal(np.log(60), 0.9, k).astype(int) + 20), max_len - 1)) for k in turns]


def _padding_share(units) -> float:
    seg = [u.batch.segment_ids for u in units]
    return sum(int((s == 0).sum()) for s in seg) / sum(s.size for s in seg)


def test_packing_leaves_at_most_a_tenth_of_a_mixed_length_step_to_padding():
    rng = np.random.default_rng(0)
    max_len, g = 1024, 8
    groups = _groups([_agentic_lengths(rng, g, max_len) for _ in range(8)])
    shares = {}
    for pack in (False, True):
        tc = TrainerConfig(mode="sync", groups_per_step=8, group_size=g, groups_per_microbatch=2, max_len=max_len,
                           seq_bucket=64, pack_rows=pack)
        units = [u for i in range(0, 8, 2) for u in make_units(groups[i:i + 2], tc, {})]
        assert sum(_generated(u) for u in units) == sum(gr.num_generated for gr in groups)
        shares[pack] = _padding_share(units)
    lengths = sorted(len(t.tokens) for gr in groups for t in gr.trajectories)
    print(f"64 trajectories of {lengths[0]}-{lengths[-1]} tokens (median {lengths[32]}), max_len {max_len}: "
          f"padding share one per row {shares[False]:.1%}, packed {shares[True]:.1%}")
    assert shares[False] > 0.3 and shares[True] <= 0.10


# -- a trainer step: every shape compiled up front, less padding, the same tokens trained -------------
WL = WorkloadConfig(num_prompts=4, response_median=5, response_sigma=0.8, max_response=16,
                    tool_latency_median_s=0.005, tool_latency_sigma=0.5, max_turns=3)


def _trainer(pack: bool) -> RLTrainer:
    tc = TrainerConfig(mode="pipelined", groups_per_step=2, group_size=4, max_slots=8, max_len=64,
                       buckets=(16, 32), seq_bucket=32, pack_rows=pack)
    params = S.init_params(CFG, S.make_mesh(devices=jax.devices()[:1]), seed=0)
    return RLTrainer(CFG, params, tc, LossConfig(), OptimizerConfig(learning_rate=1e-4), WorkloadAgent(WL),
                     TaskStream(make_tasks(WL), seed=1))


def test_a_packed_step_compiles_nothing_new_and_trains_the_same_tokens_with_less_padding():
    one, packed = _trainer(False), _trainer(True)
    assert packed.train_shapes() == [(r, w) for w in (32, 64) for r in (1, 2, 3, 4)]
    # one per row: a micro-batch's zero-advantage rows train apart (forward only), so any count of rows
    assert one.train_shapes() == [(r, w) for w in (32, 64) for r in (1, 2, 3, 4)]
    one.cfg = dataclasses.replace(one.cfg, skip_zero_advantage_backward=False)
    assert one.train_shapes() == [(4, 32), (4, 64)]
    assert packed.compile_train_shapes() == 8
    compiled = packed.train_step.compile_count()
    m_packed, m_one = packed.step(), one.step()
    assert packed.train_step.compile_count() == compiled + 1   # `apply` only
    for k in ("reward/mean", "rollout/generated_tokens", "train/trained_tokens", "train/num_tokens"):
        assert m_packed[k] == m_one[k], k
    assert m_packed["train/padding_share"] < m_one["train/padding_share"]
    print(f"workload step: padding share one per row {m_one['train/padding_share']:.1%}, "
          f"packed {m_packed['train/padding_share']:.1%}")
    np.testing.assert_allclose(m_packed["train/loss"], m_one["train/loss"], rtol=RTOL)
    for a, b in zip(jax.tree.leaves(jax.device_get(one.params)), jax.tree.leaves(jax.device_get(packed.params))):
        np.testing.assert_allclose(b, a, atol=2e-6, rtol=1e-5)
