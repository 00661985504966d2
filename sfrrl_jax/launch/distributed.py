"""Starting a run as N processes (one per host, or several on one machine) under `jax.distributed`.

    cfg = DistributedConfig.from_env(coordinator="host0:1234", num_processes=2, process_id=0)
    initialize(cfg)   # before anything else touches the devices

Flags win over the environment: JAX_COORDINATOR_ADDRESS (JAX's own), JAX_NUM_PROCESSES and
JAX_PROCESS_ID. On CPU the processes' collectives go through gloo. `heartbeat_timeout_s` is how
long the coordination service waits for a silent process before it fails the others: a killed
process then ends the run within that time instead of leaving its peers blocked in a collective.
"""
from __future__ import annotations

import dataclasses
import os

from sfrrl_jax.checks import check_int


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str | None = None      # "host:port" of process 0's coordination service
    num_processes: int = 1
    process_id: int = 0
    cpu_collectives: str = "gloo"       # jax_cpu_collectives_implementation for CPU meshes
    heartbeat_timeout_s: int = 30
    initialization_timeout_s: int = 120

    def __post_init__(self):
        check_int("DistributedConfig.num_processes", self.num_processes, 1)
        check_int("DistributedConfig.process_id", self.process_id, 0, self.num_processes, hi_open=True)
        if self.num_processes > 1 and not self.coordinator:
            raise ValueError("DistributedConfig.coordinator ('host:port' of process 0) is required with "
                             f"num_processes={self.num_processes} (or set JAX_COORDINATOR_ADDRESS)")
        if self.coordinator and ":" not in self.coordinator:
            raise ValueError(f"DistributedConfig.coordinator must be 'host:port', got {self.coordinator!r}")

    @classmethod
    def from_env(cls, coordinator: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, **kw) -> "DistributedConfig":
        """Flags given here win; the rest come from the environment (one process if unset)."""
        def env_int(name):
            raw = os.environ.get(name)
            if raw is None:
                return None
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer") from None
        return cls(coordinator=coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   num_processes=num_processes if num_processes is not None else (env_int("JAX_NUM_PROCESSES") or 1),
                   process_id=process_id if process_id is not None else (env_int("JAX_PROCESS_ID") or 0), **kw)


def initialize(cfg: DistributedConfig) -> bool:
    """Joins the N-process run (a no-op for one process); True when it did. Call it before any
    device is touched: JAX binds its backends to the distributed client when they start."""
    if cfg.num_processes == 1:
        return False
    import jax
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("sfrrl_jax.launch.distributed.initialize must run before JAX starts its backends "
                           "(before the first jax.devices(), array or jit call)")
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    jax.distributed.initialize(cfg.coordinator, num_processes=cfg.num_processes, process_id=cfg.process_id,
                               initialization_timeout=cfg.initialization_timeout_s,
                               heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    return True
