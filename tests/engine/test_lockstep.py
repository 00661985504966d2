"""The engine across processes (engine.lockstep): 2 processes x 4 devices generate exactly what
one process x 8 devices does, and a process that dies fails its peers fast, naming it."""
import asyncio
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from sfrrl_jax.engine import Engine
from sfrrl_jax.engine.lockstep import LockstepEngine, LocalExchange

from lockstep_common import make_engine, run_trajectory, trajectories
from process_run import finish, launch, outputs

WORKER = Path(__file__).with_name("lockstep_worker.py")


def _reference(paged=False):
    """The same trajectories on one process's 8 devices through the plain engine."""
    engine = make_engine(Engine, paged=paged)

    async def main():
        return await asyncio.gather(*(run_trajectory(engine, i) for i in range(len(trajectories()))))
    return asyncio.run(main())


def _assert_same(got, want):
    for (toks, lps, routes), (ref_toks, ref_lps, ref_routes) in zip(got, want):
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, rtol=0, atol=1e-5)
        # the experts of every fed token, recorded in the session like on one process (a router
        # near-tie may flip with the collectives' other summation order: a share, not bitwise)
        if ref_routes is None:
            assert routes is None
            continue
        routes, ref_routes = np.asarray(routes), np.asarray(ref_routes)
        assert routes.shape == ref_routes.shape
        assert np.mean(routes == ref_routes) > 0.99


@pytest.mark.parametrize("paged", [False, True], ids=["dense_routes", "paged_prefix_cache"])
def test_two_processes_generate_what_one_process_does(tmp_path, paged):
    """paged: a paged cache whose shared and cached pages every process decides alike (the same
    page tables at the end, the same prefix hits)."""
    procs = launch(WORKER, 2, str(tmp_path / "out{process}.json"), *(["paged"] if paged else []))
    reference = _reference(paged)   # meanwhile, here
    finish(procs)
    runs = [json.loads((tmp_path / f"out{p}.json").read_text()) for p in range(2)]
    seen = {}
    for run in runs:
        seen.update({int(i): r for i, r in run["results"].items()})
        assert run["occupancy"] == {"running": 0, "parked": 0, "free": 3, "queued": 0,
                                    **({"pages_free": 36, "evicted": 0} if paged else {})}
    assert sorted(seen) == list(range(len(trajectories())))   # each process ran its own share
    for i, got in seen.items():
        _assert_same(got, reference[i])
    assert runs[0]["ticks"] == runs[1]["ticks"] > 0               # one exchange per tick, in lockstep
    if paged:
        assert runs[0]["page_table"] == runs[1]["page_table"]
        assert runs[0]["prefix_hit_tokens"] == runs[1]["prefix_hit_tokens"] > 0
    # one process: the lockstep engine over the identity exchange is the plain engine
    engine = make_engine(LockstepEngine, paged=paged, exchange=LocalExchange())

    async def local():
        async with engine.session():
            return await asyncio.gather(*(run_trajectory(engine, i) for i in range(len(trajectories()))))
    for got, want in zip(asyncio.run(local()), reference):
        _assert_same(got, want)


def test_a_process_that_dies_fails_its_peer_fast_naming_it(tmp_path):
    procs = launch(WORKER, 2, str(tmp_path / "out{process}.json"), "die")
    t0 = time.monotonic()
    outs = outputs(procs, timeout=240)
    assert procs[1].returncode == 17
    assert procs[0].returncode != 0, outs[0][-3000:]
    assert time.monotonic() - t0 < 200
    # named by our tick timeout, or by the coordination service's heartbeat check, whichever is first
    assert (re.search(r"process 1 of 2 sent nothing", outs[0])
            or re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b", outs[0])), outs[0][-3000:]


def test_distributed_config_reads_flags_over_the_environment_and_names_bad_values(monkeypatch):
    from sfrrl_jax.launch.distributed import DistributedConfig, initialize
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert DistributedConfig.from_env() == DistributedConfig("host0:1234", 4, 3)
    assert DistributedConfig.from_env(process_id=1, coordinator="h:9") == DistributedConfig("h:9", 4, 1)
    monkeypatch.setenv("JAX_PROCESS_ID", "three")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID='three' is not an integer"):
        DistributedConfig.from_env()
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\), got 2"):
        DistributedConfig("h:1", 2, 2)
    with pytest.raises(ValueError, match="coordinator .* is required with num_processes=2"):
        DistributedConfig(None, 2, 0)
    with pytest.raises(ValueError, match="'host:port', got 'nohost'"):
        DistributedConfig("nohost", 2, 0)
    assert initialize(DistributedConfig()) is False          # one process: nothing to join
    import jax
    jax.devices()                                              # this test process's backends run now
    with pytest.raises(RuntimeError, match="before JAX starts its backends"):
        initialize(DistributedConfig("h:1", 2, 0))


def test_lockstep_engine_refuses_unagreeable_idle_work_and_sessionless_multi_process_requests():
    class TwoProcesses(LocalExchange):
        process_count = 2

    engine = make_engine(LockstepEngine, exchange=TwoProcesses())
    with pytest.raises(TypeError, match="has_work= and filler="):   # idle work no peer could join
        engine.set_idle_work(lambda: None)
    engine.set_idle_work(lambda: None, has_work=lambda: False, filler=lambda: (lambda: None))
    engine.set_idle_work(None)
    from sfrrl_jax.agents.protocols import GenerationRequest
    with pytest.raises(RuntimeError, match=r"outside engine.session\(\)"):
        asyncio.run(engine.complete(GenerationRequest(tokens=[1, 2], max_new_tokens=2)))
