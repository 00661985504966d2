"""The fault-injection soak (issue #24 E): the straggler workload trained while device steps raise,
tools crash and hang, the tool pool dies and rollouts raise; prints a table and writes JSON.

    python experiments/soak/fault_soak.py --steps 200 --out /tmp/fault_soak.json

Every step must complete with nothing held (slots, token logs, rollouts in limbo); at the end no
thread or child process may be left. Exit status 0 when all of that held, 1 otherwise.
"""
import argparse
import dataclasses
import json
import logging
import sys

from sfrrl_jax.testing.fault_soak import SoakConfig, run_fault_soak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(SoakConfig):
        p.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    p.add_argument("--out", default="fault_soak.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the injected faults' warnings would drown the table
    cfg = SoakConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SoakConfig)})
    try:
        figures = run_fault_soak(cfg, log=lambda s: print(s, flush=True))
    except AssertionError as e:
        print(f"SOAK FAILED: {e}", file=sys.stderr)
        return 1
    width = max(len(k) for k in figures)
    print("\n" + "\n".join(f"{k:<{width}}  {v:.1f}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                           for k, v in figures.items()))
    with open(args.out, "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "figures": figures}, f, indent=1)
    leaks = figures["leaked_slots"] + figures["leaked_threads"] + figures["leaked_child_processes"]
    return 0 if leaks == 0 and figures["rollouts_in_limbo"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
