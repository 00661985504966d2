"""One process of a lockstep-engine run (tests/engine/test_lockstep.py starts N of these).

    python lockstep_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON [die] [paged]

Process p runs the agentic trajectories i with i % N == p (three turns each: generate, append an
observation, generate, append, generate) inside `engine.session()`, and writes their completions.
"""
import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from process_run import join_run  # noqa: E402

pid, nproc, (out_path, *flags) = join_run()
die_after_first, paged = "die" in flags, "paged" in flags
from lockstep_common import make_engine, trajectories, run_trajectory  # noqa: E402
from sfrrl_jax.engine.lockstep import KeyValueExchange, LockstepEngine  # noqa: E402

engine = make_engine(LockstepEngine, paged=paged, exchange=KeyValueExchange(timeout_s=20.0))


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
               "occupancy": engine.occupancy, "prefix_hit_tokens": engine.stats.prefix_hit_tokens,
               "page_table": engine._pt.table.tolist() if paged else None}, f)
