"""The sandbox: untrusted Python run in a fresh, jailed process per call (namespaces, a read-only
filesystem view, rlimits, a memory cgroup, seccomp, a fresh unprivileged uid).

`python_sandbox.py` holds the host side (`PythonSandbox`, `SandboxConfig`, `probe_capabilities`);
`launcher.py` builds the jail, run from its source with `python -I -S -c` (stdlib only: it imports
nothing of ours, and the reward scorers' workers load it by path for its lock-down); `paths.py`
decides which paths the jail covers and exposes; `cgroup.py` the per-call memory cgroups;
`seccomp.py` the hand-assembled BPF filters. This room imports nothing else from `sfrrl_jax`: the
checks in tests/adversarial import it with the `sfrrl_jax` and `agents` `__init__`s skipped (they import jax).
"""
from sfrrl_jax.agents.sandbox.python_sandbox import (PythonSandbox, SandboxCapabilities, SandboxConfig, SandboxResult,
                                                     probe_capabilities)

__all__ = ["PythonSandbox", "SandboxCapabilities", "SandboxConfig", "SandboxResult", "probe_capabilities"]
