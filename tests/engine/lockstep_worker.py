"""One process of a lockstep-engine run (tests/engine/test_lockstep.py starts N of these).

    python lockstep_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON [die_after_first]

Process p runs the agentic trajectories i with i % N == p (three turns each: generate, append an
observation, generate, append, generate) inside `engine.session()`, and writes their completions.
"""
import asyncio
import json
import os
import sys

pid, nproc, port, out_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
die_after_first = len(sys.argv) > 5
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model_fixtures

from sfrrl_jax.launch.distributed import DistributedConfig, initialize  # noqa: E402

initialize(DistributedConfig(coordinator=f"localhost:{port}", num_processes=nproc, process_id=pid,
                             heartbeat_timeout_s=10))
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
from lockstep_common import make_engine, trajectories, run_trajectory  # noqa: E402
from sfrrl_jax.engine.lockstep import KeyValueExchange, LockstepEngine  # noqa: E402

engine = make_engine(LockstepEngine, exchange=KeyValueExchange(timeout_s=20.0))


async def main():
    async with engine.session():
        mine = [i for i in range(len(trajectories())) if i % nproc == pid]
        if die_after_first:
            await run_trajectory(engine, 0 if pid == 0 else mine[0])
            if pid == 1:
                os._exit(17)  # dies mid-run, without a word to its peers
        return dict(zip(mine, await asyncio.gather(*(run_trajectory(engine, i) for i in mine))))


results = asyncio.run(main())
with open(out_path, "w") as f:
    json.dump({"results": results, "ticks": engine.ticks, "exchange_s": engine.exchange_seconds,
               "occupancy": engine.occupancy}, f)
