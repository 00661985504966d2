"""Test set-up: 8 fake CPU devices, fp32 matmuls, set before jax is imported anywhere."""
import os
import sys

# The repo root on sys.path: recipes are experiment code, not part of the installed package
# (`from experiments.recipes.quickstart import ...`), and `pytest` run as a script (or from
# another directory) does not put the root there the way `python -m pytest` from the root does.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# Tests compile at XLA's backend optimisation level 0 (process_run.TEST_OPT_FLAG): on CPU most of
# a tiny-model test's time is compiling, and most of a compile is LLVM optimising machine code
# (measured: the suite ~30 % shorter). The programs are the same HLO, only their machine code is
# less optimised, so a test whose work runs long (the quickstart's learning run) runs it in a
# subprocess at XLA's default level (process_run.default_opt_env). They also compile fusions with
# XLA:CPU's loop emitters (process_run.TEST_FUSION_FLAG), about half the backend time again.
# SFRRL_TEST_XLA_OPT=default keeps XLA's defaults throughout; the suite passes either way.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from process_run import TEST_XLA_FLAGS  # noqa: E402

if os.environ.get("SFRRL_TEST_XLA_OPT", "0") != "default":
    os.environ["XLA_FLAGS"] += "".join(f" {f}" for f in TEST_XLA_FLAGS if f not in os.environ["XLA_FLAGS"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent XLA compilation cache for the whole test run: its pytest workers, the processes
# tests launch and the notebooks' kernels inherit it through the environment. Many tests compile
# the same programs (the same tiny models, meshes and batch shapes, each through its own jitted
# closure), and on CPU compiling is most of a test's time; a hit loads the executable the first
# compile produced, so results are the same. The directory lives for one run: the process that
# made it (pytest's controller) removes it at the end. SFRRL_TEST_XLA_CACHE=0 turns it off.
_OWN_XLA_CACHE = None
if os.environ.get("SFRRL_TEST_XLA_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile
    _OWN_XLA_CACHE = tempfile.mkdtemp(prefix="sfrrl_jax_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_XLA_CACHE
    # the default (1 s) leaves out most of a tiny model's compiles
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    """The tiny tokenizer's HF directory (read-only for tests), built once per test process."""
    from sfrrl_jax.tokenizer import build_tiny_tokenizer
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


# Each XLA:CPU executable maps its JIT code in ~7 memory regions, and jit caches keep every
# executable a test process ever compiled. A worker that runs several hundred tests reaches the
# kernel's vm.max_map_count (65,530 by default); the next mmap fails inside LLVM and the process
# dies with SIGSEGV in whatever compiles next (seen: the quickstart test at 99 % of the suite,
# in the optimizer's compile or the engine's decode compile, never alone). Past a threshold the
# caches are dropped between tests: tests that follow recompile what they use, nothing else.
def _map_count_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except (OSError, ValueError):
        return 30_000


_MAP_COUNT_LIMIT = _map_count_limit()


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to guard
        return 0


@pytest.fixture(autouse=True)
def _bounded_executable_caches():
    yield
    if _mapped_regions() > _MAP_COUNT_LIMIT:
        import gc
        jax.clear_caches()
        gc.collect()


def pytest_sessionfinish(session, exitstatus):
    if _OWN_XLA_CACHE is not None and not hasattr(session.config, "workerinput"):
        import shutil
        shutil.rmtree(_OWN_XLA_CACHE, ignore_errors=True)


# The files that take longest (a minute or more on a 2-core machine; `pytest --durations=50`),
# longest first. The suite runs with `-n 2 --dist loadfile` (a file's tests stay on one worker, so
# its module fixtures and cached setups are built once), and xdist queues the files by their
# number of tests, most first: this order only settles ties there. Making it the queue's order
# (`--no-loadscope-reorder`, stop 36) measured slower, 1244 s against 1156 s for the suite on one
# machine: the multi-process files then run at the same time and oversubscribe the two cores.
_LONG_FILES_FIRST = (
    "trainer/test_rl_processes.py", "launch/test_launch_local.py", "trainer/test_trainer_quickstart.py",
    "trainer/test_routing_replay_training.py", "models/test_forward_transforms.py", "engine/test_lockstep.py",
    "trainer/test_rl_trainer.py", "models/test_mixed_stack.py", "trainer/test_checkpoint_processes.py",
    "trainer/test_early_samples.py", "learner/test_process_rows.py", "engine/test_engine_routes.py",
    "trainer/test_rl_trainer_parts.py", "learner/test_train_deferred.py", "models/test_forward_parallel.py",
    "tests/test_gpu_suite.py", "quickstart.ipynb",
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        return next((i for i, name in enumerate(_LONG_FILES_FIRST) if path.endswith(name)), len(_LONG_FILES_FIRST))
    items.sort(key=rank)  # stable: within a file, and among the rest, collection order
