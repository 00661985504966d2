"""Paged decode through the Pallas kernel (`Engine(paged_attention='pallas')`, interpret mode on
CPU) against the gather path, on the long-tail agentic batch of test_paged_cache.py: the same
greedy tokens, raw logprobs equal within float rounding (the kernel sums in another order), and
the same page accounting. The model has sinks and a window layer whose pool keeps only its
window, so the kernel reads window pages and skips returned ones."""
import asyncio

import numpy as np
import pytest

from sfrrl_jax.engine import Engine
from sfrrl_jax.engine.paged import engine_steps, use_paged_kernel
from sfrrl_jax.engine.pages import check_paging
from sfrrl_jax.trainer.config import TrainerConfig

from test_paged_cache import ENGINE, _run_trajectory, _setup, _trajectory_specs


def _engine(paged_attention):
    cfg, _, params = _setup()
    return Engine(cfg, params, **ENGINE, page_size=4, num_pages=24, paged_attention=paged_attention)


def test_kernel_engine_equals_gather_engine_on_a_long_tail_agentic_batch():
    specs = _trajectory_specs(10, seed=1)  # 10 trajectories on 4 slots: they queue, tool turns append

    async def main(engine):
        return await asyncio.gather(*(_run_trajectory(engine, p, t, hold=0.003 * (i % 3))
                                      for i, (p, t) in enumerate(specs)))

    gather, kernel = _engine("gather"), _engine("pallas")
    assert kernel.steps.kernel and not gather.steps.kernel
    want, got = asyncio.run(main(gather)), asyncio.run(main(kernel))
    assert kernel.stats.appends > 0 and kernel.stats.slot_steps_active > 30
    assert [len(t) for t in got] == [len(t) for t in want]
    for traj_want, traj_got in zip(want, got):
        for (tokens_want, raw_want), (tokens_got, raw_got) in zip(traj_want, traj_got):
            assert tokens_got == tokens_want
            np.testing.assert_allclose(raw_got, raw_want, atol=2e-5, rtol=0)
    assert kernel.occupancy == gather.occupancy   # every page back
    for e in (gather, kernel):
        e.release_memory()


def test_paged_attention_choice_is_checked_by_name():
    cfg, mesh, _ = _setup()
    paging = check_paging(4, 24, 32, 4, cfg.layer_windows)
    assert use_paged_kernel("pallas", paging, cfg) and not use_paged_kernel("gather", paging, cfg)
    assert not use_paged_kernel("auto", paging, cfg)   # a CPU backend: the gather path
    with pytest.raises(ValueError, match="paged_attention='flash' must be one of"):
        use_paged_kernel("flash", paging, cfg)
    with pytest.raises(ValueError, match="page_size=6 is not a power of two"):
        use_paged_kernel("pallas", check_paging(6, 24, 32, 4, cfg.layer_windows), cfg)
    with pytest.raises(ValueError, match="set page_size"):
        engine_steps(cfg, mesh, 4, 32, paged_attention="pallas")
    with pytest.raises(ValueError, match="TrainerConfig.paged_attention='fast'"):
        TrainerConfig(paged_attention="fast")
    with pytest.raises(ValueError, match="TrainerConfig.page_size"):
        TrainerConfig(paged_attention="pallas")
