"""N-process runs on one machine for the multi-host tests: the test side starts the workers,
each worker joins the run (`jax.distributed`, gloo) before JAX starts.

    procs = launch(WORKER, 2, str(tmp_path / "out{process}.json"))   # in the test
    outs = finish(procs)                                             # all exited 0, or fails
    pid, nproc, args = join_run()                                    # first thing in a worker
"""
import os
import socket
import subprocess
import sys


def launch(script, nproc: int, *args: str) -> list[subprocess.Popen]:
    """`python script PROCESS_ID NUM_PROCESSES PORT *args` for each process ("{process}" in an
    arg becomes its id), with this test process's XLA flags and platform left out."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return [subprocess.Popen([sys.executable, str(script), str(p), str(nproc), str(port),
                              *(a.format(process=p) for a in args)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for p in range(nproc)]


def outputs(procs, timeout: float = 300) -> list[str]:
    """Each process's output once all have exited."""
    return [p.communicate(timeout=timeout)[0] for p in procs]


def finish(procs, timeout: float = 300) -> list[str]:
    """`outputs`, asserting every process exited 0 (its output's tail is the message)."""
    outs = outputs(procs, timeout)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def join_run(heartbeat_timeout_s: int = 10) -> tuple[int, int, list[str]]:
    """Worker side: argv = PROCESS_ID NUM_PROCESSES PORT *rest. Gives the process 8 // N fake
    CPU devices (8 global), joins the run on localhost:PORT, puts tests/ on sys.path (the
    fixtures) and fp32 matmuls on; returns (process id, process count, rest)."""
    pid, nproc, port = (int(a) for a in sys.argv[1:4])
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    tests = os.path.dirname(os.path.abspath(__file__))
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from sfrrl_jax.launch.distributed import DistributedConfig, initialize
    initialize(DistributedConfig(coordinator=f"localhost:{port}", num_processes=nproc, process_id=pid,
                                 heartbeat_timeout_s=heartbeat_timeout_s))
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    return pid, nproc, sys.argv[4:]
