"""Start an N-process run on one machine (what a cluster scheduler does across hosts).

    python experiments/launch_local.py --num_processes 2 [--cpu_devices 4] [--port 0] -- \\
        python experiments/train.py --gin_file=experiments/configs/stragglers.gin --validate_only

Each process gets JAX_COORDINATOR_ADDRESS (localhost:port, process 0 serves it),
JAX_NUM_PROCESSES and JAX_PROCESS_ID, which `sfrrl-train` (launch.distributed) reads; with
--cpu_devices each process sees that many fake CPU devices (a CPU rehearsal of N hosts), with
--gpus_per_process it sees its own slice of CUDA_VISIBLE_DEVICES. Output lines are prefixed
with "[p<i>]". When one process fails, the others are stopped (SIGTERM, then SIGKILL after
--grace_s) and the launcher exits with the first failure's status: no process is left waiting
in a collective for a peer that is gone.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _pump(prefix: str, stream, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            sys.stdout.write(f"{prefix} {line}")
            sys.stdout.flush()


def launch(command: list[str], num_processes: int, port: int = 0, cpu_devices: int | None = None,
           gpus_per_process: int | None = None, grace_s: float = 10.0) -> int:
    """Runs `command` as `num_processes` processes; returns 0, or the first failing status."""
    if num_processes < 1:
        raise ValueError(f"--num_processes must be >= 1, got {num_processes}")
    if not command:
        raise ValueError("no command to launch (put it after --)")
    port = port or _free_port()
    lock = threading.Lock()
    procs, pumps = [], []
    for p in range(num_processes):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(num_processes),
                   JAX_PROCESS_ID=str(p), PYTHONUNBUFFERED="1")
        if cpu_devices is not None:
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cpu_devices}").strip()
        if gpus_per_process is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(p * gpus_per_process + i) for i in range(gpus_per_process))
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        procs.append(proc)
        pumps.append(threading.Thread(target=_pump, args=(f"[p{p}]", proc.stdout, lock), daemon=True))
        pumps[-1].start()
    status = 0
    while any(proc.poll() is None for proc in procs):
        failed = [proc for proc in procs if proc.poll() not in (None, 0)]
        if failed:
            status = failed[0].returncode
            _stop(procs, grace_s)
            break
        time.sleep(0.05)
    for t in pumps:
        t.join(timeout=5)
    if status == 0:
        status = next((proc.returncode for proc in procs if proc.returncode), 0)
    return status


def _stop(procs, grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("launch_local: put the command after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="launch_local", description=__doc__.split("\n\n")[0])
    p.add_argument("--num_processes", type=int, required=True)
    p.add_argument("--port", type=int, default=0, help="the coordinator's port (0: a free one)")
    p.add_argument("--cpu_devices", type=int, default=None, help="fake CPU devices per process")
    p.add_argument("--gpus_per_process", type=int, default=None)
    p.add_argument("--grace_s", type=float, default=10.0)
    args = p.parse_args(argv[:cut])
    return launch(argv[cut + 1:], args.num_processes, args.port, args.cpu_devices, args.gpus_per_process, args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
