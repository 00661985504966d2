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

# The optimisation level tests compile at (tests/conftest.py says why); workers keep it.
TEST_OPT_FLAG = "--xla_backend_optimization_level=0"
# XLA:CPU's older loop emitters for fusions instead of its MLIR fusion emitters: the same HLO
# compiles in about half the backend time (measured on the engine's decode tests: 29 s -> 16 s of
# compiling), and a tiny model's run does not notice. Workers and subprocesses keep it.
TEST_FUSION_FLAG = "--xla_cpu_use_fusion_emitters=false"
TEST_XLA_FLAGS = (TEST_OPT_FLAG, TEST_FUSION_FLAG)
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def default_opt_env() -> dict:
    """This process's environment for a subprocess that runs long work at XLA's default
    optimisation level, as the tests' process runs otherwise: its XLA flags (8 fake devices)
    without TEST_OPT_FLAG, and fp32 matmuls (jax's environment variable for the config
    tests/conftest.py sets)."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f != TEST_OPT_FLAG)
    return {**os.environ, "XLA_FLAGS": flags, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}


def launch(script, nproc: int, *args: str) -> list[subprocess.Popen]:
    """`python script PROCESS_ID NUM_PROCESSES PORT *args` for each process ("{process}" in an
    arg becomes its id), with this test process's platform left out (`join_run` sets it and
    the device count)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
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
    CPU devices (8 global; the test process's other XLA flags kept), joins the run on
    localhost:PORT, puts tests/ on sys.path (the fixtures) and fp32 matmuls on; returns
    (process id, process count, rest)."""
    pid, nproc, port = (int(a) for a in sys.argv[1:4])
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{_DEVICE_COUNT_FLAG}={8 // nproc}"])
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
