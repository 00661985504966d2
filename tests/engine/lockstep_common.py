"""The model, engine and agentic trajectories shared by test_lockstep.py and its worker processes."""
import jax
import numpy as np

import sfrrl_jax as S
from sfrrl_jax.agents.protocols import GenerationRequest

from model_fixtures import TINY, randomize


def make_engine(engine_cls, paged=False, **kw):
    """A tiny MoE on a (data=2, expert=4) mesh of the 8 global devices; fewer slots than
    trajectories, so requests queue and slots are reused. It records routes (routing replay);
    paged: a paged cache with the prefix cache on instead (which records no routes)."""
    cfg = TINY.replace(max_seq_len=128)
    params = randomize(S.init_params(cfg, S.make_mesh(data=2, expert=4, devices=jax.devices()), seed=0),
                       seed=3, scale=0.3)
    mode = (dict(page_size=8, num_pages=36, prefix_cache_pages=36) if paged else dict(record_routes=True))
    return engine_cls(cfg, params, max_slots=3, max_len=96, buckets=(16, 32), decode_steps=2,
                      max_consecutive_faults=0, **mode, **kw)


HEAD = [int(t) for t in np.random.default_rng(1).integers(1, 500, size=17)]


def trajectories():
    """Per trajectory: its prompt, then per turn (max_new, temperature, seed), then observations.
    Trajectories 4..6 start with the same 17-token head (a system prompt: two full pages of 8),
    5 and 6 with the same whole prompt (two samples of one task)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(7):
        prompt = [int(t) for t in rng.integers(1, 500, size=3 + 2 * i)]
        if i >= 4:
            prompt = HEAD + (prompt[:3] if i == 4 else [7, 11])
        turns = [(int(rng.integers(2, 9)), [0.0, 1.0][i % 2], 100 + 10 * i + k) for k in range(3)]
        observations = [[int(t) for t in rng.integers(1, 500, size=1 + (i + k) % 4)] for k in range(2)]
        out.append((prompt, turns, observations))
    return out


async def run_trajectory(engine, i):
    """Three turns in one slot (appends), then release; returns [(tokens, logprobs, routes)] per
    turn (routes: the experts of the tokens the call fed, nested lists)."""
    prompt, turns, observations = trajectories()[i]
    handle, out, tokens = None, [], prompt
    for k, (max_new, temperature, seed) in enumerate(turns):
        c = await engine.complete(GenerationRequest(tokens=tokens, max_new_tokens=max_new, temperature=temperature,
                                                    seed=seed, slot_handle=handle))
        out.append((list(c.tokens), list(c.logprobs), None if c.routes is None else c.routes.tolist()))
        handle = c.slot_handle
        if k < len(observations):
            tokens = observations[k]
    await engine.release(handle)
    return out
