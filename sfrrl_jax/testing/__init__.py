"""The testing room: fixtures for our tests, benchmarks and users' own tests, shipped with the library.

  faults           fault injection: engines, tools and rollouts that fail the way real ones do
  fault_soak       the fault soak: a long RL run under injected faults, checked for lost work
  workload         the synthetic long-tail agentic workload (`WorkloadConfig`), replayed through
                   the real engine and tools: the benchmarks' and gin experiments' workload
  scripted_engine  `ScriptedEngine`: an `EngineProtocol` that replays scripted model turns, for
                   testing environments, rollout functions and the agent loop without a model

It sits above the trainer (it drives whole runs) and below launch; nothing in the library below
it imports it. Only `ScriptedEngine` is imported here; the others load jax-heavy modules, so
import them from their modules.
"""
from sfrrl_jax.testing.scripted_engine import ScriptedEngine, ScriptedSlot

__all__ = ["ScriptedEngine", "ScriptedSlot"]
