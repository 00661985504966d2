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
