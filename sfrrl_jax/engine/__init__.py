"""Rollout engine: KV cache, sampling, JetStream-shaped jitted steps, continuous batching."""
from sfrrl_jax.engine.driver import Engine
from sfrrl_jax.engine.jobs import EngineStats, SlotHandle
from sfrrl_jax.engine.generate import generate
from sfrrl_jax.engine.lockstep import KeyValueExchange, LocalExchange, LockstepEngine, LockstepError
from sfrrl_jax.engine.slot_state import DecodeState, Prefix, ResultTokens, SlotRequest
from sfrrl_jax.engine.steps import EngineSteps
from sfrrl_jax.generation_types import Completion, EngineError, EngineProtocol, GenerationRequest

__all__ = ["Engine", "EngineStats", "SlotHandle", "generate", "DecodeState", "EngineSteps",
           "Prefix", "ResultTokens", "SlotRequest", "Completion", "EngineError", "EngineProtocol",
           "GenerationRequest", "LockstepEngine", "LockstepError", "KeyValueExchange", "LocalExchange"]
