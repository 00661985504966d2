"""The memory planner (issue #19): will this model, at this context, fit on these devices?

`plan_memory` lowers and compiles the run's real step functions (train micro-step, optimizer
update, engine prefill / append / decode) on abstract inputs that carry the run's shardings,
reads XLA's per-device memory analysis, adds what lives between calls, and reports a per-phase
peak with a breakdown and a verdict. `search` enumerates meshes, remat policies and micro-batch
sizes. The CLI is `sfrrl-plan` (`sfrrl_jax.launch.plan_cli`: it reads the same gin config a run
uses and builds the mesh over fake CPU devices).
"""
from sfrrl_jax.plan.planner import ALL_PHASES, GB, Phase, Plan, PlanConfig, PlanInputs, plan_memory

__all__ = ["ALL_PHASES", "GB", "Phase", "Plan", "PlanConfig", "PlanInputs", "plan_memory"]
