"""Test set-up: 8 fake CPU devices, fp32 matmuls, set before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (minutes each) run first, so that under xdist they overlap the short
    ones instead of running alone at the end of the suite."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: order kept otherwise
