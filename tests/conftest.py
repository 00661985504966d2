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
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
