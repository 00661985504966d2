"""What keeping N processes in lockstep costs the engine (issue #20): 2 processes x 4 devices vs
1 process x 8 devices on the same global mesh, same trajectories, tool-bound.

    python experiments/bench/lockstep.py [--trajectories 24] [--tool_ms 20] [--out bench_out/lockstep.json]

Each trajectory is a few turns of generation with a tool call between turns (an asyncio sleep of
a seeded, long-tailed duration around --tool_ms: the tool runs on the host that owns it). Rows:
  engine 1x8        the plain engine in one process (the baseline)
  lockstep 1x8      the lockstep engine over the identity exchange (one chunk per tick)
  lockstep 2x4      two processes, each running its own half of the trajectories and its tools;
                    ticks agreed through the jax.distributed key-value store
Columns: wall seconds, wall / baseline, device seconds (inside device steps: on CPU the 2x4
row's collectives cross processes over gloo/TCP, which is what dominates it there), ticks, exchange ms per tick (mean wall inside the
all-gather, including waiting for the slower process) and the share of wall spent exchanging.
Every row runs once warm-up first (compiles), then the timed run; the same tokens are checked.
"""
import argparse
import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve()


def _worker(args) -> None:
    nproc, pid = args.nproc, args.pid
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from sfrrl_jax.launch.distributed import DistributedConfig, initialize
    if nproc > 1:
        initialize(DistributedConfig(coordinator=f"localhost:{args.port}", num_processes=nproc, process_id=pid))
    import jax
    import numpy as np
    import sfrrl_jax as S
    from sfrrl_jax.agents.protocols import GenerationRequest
    from sfrrl_jax.config import PRESETS
    from sfrrl_jax.engine import Engine
    from sfrrl_jax.engine.lockstep import LocalExchange, LockstepEngine

    cfg = PRESETS["tiny-moe"].replace(max_seq_len=256)
    params = S.init_params(cfg, S.make_mesh(data=2, expert=4, devices=jax.devices()), seed=0)
    kw = dict(max_slots=8, max_len=256, buckets=(32, 64), decode_steps=4)
    lockstep = args.kind == "lockstep"
    engine = (LockstepEngine(cfg, params, exchange=None if nproc > 1 else LocalExchange(), **kw)
              if lockstep else Engine(cfg, params, **kw))
    rng = np.random.default_rng(0)
    trajs = [(rng.integers(1, 500, size=int(rng.integers(8, 40))).tolist(), int(rng.integers(2, 5)))
             for _ in range(args.trajectories)]
    tool_s = [float(rng.lognormal(np.log(args.tool_ms / 1000), 0.8)) for _ in range(args.trajectories * 8)]

    async def one(i):
        prompt, turns = trajs[i]
        handle, tokens, out = None, prompt, []
        for k in range(turns):
            c = await engine.complete(GenerationRequest(tokens=tokens, max_new_tokens=24, temperature=1.0,
                                                        seed=1000 * i + k, slot_handle=handle))
            out += c.tokens
            handle, tokens = c.slot_handle, [7, 8, 9]
            await asyncio.sleep(tool_s[8 * i + k])  # the tool, on the host that owns the trajectory
        await engine.release(handle)
        return out

    async def run():
        mine = [i for i in range(len(trajs)) if i % nproc == pid]
        ctx = engine.session() if lockstep else _null()
        async with ctx:
            return dict(zip(mine, await asyncio.gather(*(one(i) for i in mine))))

    asyncio.run(run())  # warm-up: compiles
    ticks0, ex0 = getattr(engine, "ticks", 0), getattr(engine, "exchange_seconds", 0.0)
    dev0 = engine.stats.device_seconds
    t0 = time.perf_counter()
    tokens = asyncio.run(run())
    wall = time.perf_counter() - t0
    print("RESULT " + json.dumps({"wall_s": wall, "ticks": getattr(engine, "ticks", 0) - ticks0,
                                  "exchange_s": getattr(engine, "exchange_seconds", 0.0) - ex0,
                                  "device_s": engine.stats.device_seconds - dev0,
                                  "tokens": {str(k): v for k, v in tokens.items()}}), flush=True)


class _null:
    async def __aenter__(self):
        return None

    async def __aexit__(self, *exc):
        return False


def _launch(kind, nproc, args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(HERE), "--worker", "--kind", kind, "--nproc", str(nproc),
                               "--pid", str(p), "--port", str(port), "--trajectories", str(args.trajectories),
                               "--tool_ms", str(args.tool_ms)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for p in range(nproc)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{kind} x{nproc} process failed:\n{err[-3000:]}")
        outs.append(json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT "))))
    return outs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--trajectories", type=int, default=24)
    p.add_argument("--tool_ms", type=float, default=20.0)
    p.add_argument("--out", default="bench_out/lockstep.json")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--kind", default="engine")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--pid", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    rows, reference = [], None
    for kind, nproc in (("engine", 1), ("lockstep", 1), ("lockstep", 2)):
        outs = _launch(kind, nproc, args)
        tokens = {k: v for o in outs for k, v in o["tokens"].items()}
        reference = reference or tokens
        wall = max(o["wall_s"] for o in outs)
        ticks = outs[0]["ticks"]
        ex = max(o["exchange_s"] for o in outs)
        rows.append({"row": f"{kind} 1x8" if nproc == 1 else f"{kind} {nproc}x{8 // nproc}", "wall_s": wall,
                     "device_s": max(o["device_s"] for o in outs),
                     "ticks": ticks, "exchange_ms_per_tick": 1000 * ex / ticks if ticks else 0.0,
                     "exchange_share": ex / wall, "same_tokens": tokens == reference})
    base = rows[0]["wall_s"]
    print(f"{'row':<14} {'wall s':>7} {'x base':>7} {'device s':>8} {'ticks':>6} {'ms/tick':>8} {'exch share':>10} same")
    for r in rows:
        r["vs_baseline"] = r["wall_s"] / base
        print(f"{r['row']:<14} {r['wall_s']:7.2f} {r['vs_baseline']:7.2f} {r['device_s']:8.2f} {r['ticks']:6d} "
              f"{r['exchange_ms_per_tick']:8.3f} {r['exchange_share']:10.2%} {r['same_tokens']}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "cpu_count": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
