"""Engine steps against the training forward: greedy decode, append-prefill, logprobs, sampling."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.engine import EngineSteps, SlotRequest
from sfrrl_jax.engine.sampling import SamplingParams, sample

from model_fixtures import (TINY, TINY_DENSE, TINY_GEMMA, TINY_GPT_OSS, TINY_GRANITE, TINY_MIXED, TINY_OLMO, TINY_PHI,
                            TINY_DEEPSEEK, TINY_GLM, TINY_MINIMAX, TINY_OLMOE, TINY_SMOLLM3, host, randomize)

MESH = None
# jitted as in the engine's steps: one compile serves every call (eagerly, each call re-traces
# and recompiles its lax.cond, ~0.1 s a call)
_sample = jax.jit(sample)
# the reference forward, jitted: one compile per model for its one padded shape, where eager
# dispatch of every op cost each family's test 5-15 s
_forward = jax.jit(S.forward, static_argnums=0)


def _mesh():
    global MESH
    MESH = MESH or S.make_mesh(data=2, expert=4)
    return MESH


@functools.lru_cache(maxsize=None)
def _setup(name):
    cfg = {"qwen3": TINY, "gpt_oss": TINY_GPT_OSS, "dense": TINY_DENSE, "mixed": TINY_MIXED, "gemma": TINY_GEMMA,
           "phi": TINY_PHI, "granite": TINY_GRANITE, "olmo": TINY_OLMO, "smollm3": TINY_SMOLLM3,
           "olmoe": TINY_OLMOE, "glm": TINY_GLM, "deepseek": TINY_DEEPSEEK, "minimax": TINY_MINIMAX}[name]
    cfg = cfg.replace(max_seq_len=64)
    params = randomize(S.init_params(cfg, _mesh(), seed=0), seed=11, scale=0.3)
    return cfg, params, EngineSteps(cfg, _mesh(), max_slots=8, max_len=48, buckets=(8, 16, 32))


def _teacher_forced_greedy(cfg, params, prompt, n):
    seq = list(prompt)
    raw = []
    for _ in range(n):
        # one padded shape (one compile): causal attention ignores the padding after the end
        padded = np.zeros((1, 32), np.int32)
        padded[0, :len(seq)] = seq
        logits = host(_forward(cfg, params, padded))[0, len(seq) - 1]
        tok = int(np.argmax(logits))
        raw.append(float(jax.nn.log_softmax(logits)[tok]))
        seq.append(tok)
    return seq[len(prompt):], raw


# Phi (fused projections, split on load) and Granite (scalar multipliers) decode through the dense
# path as loaded: their forward parity is tests/models/test_dense_family.py's and the HF parity tests'.
@pytest.mark.parametrize("name", ["qwen3", "gpt_oss", "dense", "mixed", "gemma", "olmo", "smollm3",
                                  "olmoe", "glm", "deepseek", "minimax"])
def test_greedy_decode_with_cache_equals_full_forward_argmax(name):
    cfg, params, eng = _setup(name)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, cfg.vocab_size, n).tolist() for n in (5, 11)]  # window 4 < lengths
    state = eng.init_decode_state()
    req = SlotRequest.make(temperature=0.0, max_new=9)
    outs = {0: [], 3: []}
    raws = {0: [], 3: []}
    for slot, prompt in zip(outs, prompts):
        prefix, first = eng.prefill(params, eng.pad(prompt), len(prompt), req)
        state = eng.insert(prefix, state, slot, req, first)
        outs[slot].append(int(first.tokens))
        raws[slot].append(float(first.raw_logprobs))
    for _ in range(8):
        state, res = eng.generate(params, state)
        for slot in outs:
            assert bool(res.valid[0, slot])
            outs[slot].append(int(res.tokens[0, slot]))
            raws[slot].append(float(res.raw_logprobs[0, slot]))
        assert not bool(np.any(host(res.valid[0])[[1, 2, 4, 5, 6, 7]]))  # empty slots stay idle
    for slot, prompt in zip(outs, prompts):
        want, want_raw = _teacher_forced_greedy(cfg, params, prompt, 9)
        assert outs[slot] == want
        # train/inference mismatch of the same tokens, fp32
        np.testing.assert_allclose(raws[slot], want_raw, atol=1e-5)
    assert bool(res.done[0, 0]) and not bool(np.any(host(state.active)))  # max_new reached


def test_append_prefill_equals_prefilling_the_concatenation():
    cfg, params, eng = _setup("gpt_oss")
    rng = np.random.RandomState(1)
    prompt, obs = rng.randint(0, cfg.vocab_size, 7).tolist(), rng.randint(0, cfg.vocab_size, 5).tolist()
    req = SlotRequest.make(temperature=0.0, max_new=3)
    state = eng.init_decode_state()
    prefix, first = eng.prefill(params, eng.pad(prompt), len(prompt), req)
    state = eng.insert(prefix, state, 2, req, first)
    gen = [int(first.tokens)]
    for _ in range(2):
        state, res = eng.generate(params, state)
        gen.append(int(res.tokens[0, 2]))
    # turn 2: the last generated token (not cached yet) leads the observation
    append = [gen[-1]] + obs
    state, first2 = eng.append_prefill(params, state, 2, eng.pad(append), len(append), req)
    whole = prompt + gen + obs
    _, want_first = eng.prefill(params, eng.pad(whole), len(whole), req)
    assert int(first2.tokens) == int(want_first.tokens)
    np.testing.assert_allclose(float(first2.raw_logprobs), float(want_first.raw_logprobs), atol=1e-5)
    assert int(state.lengths[2]) == len(whole)
    # and the cache rows written by the append equal those of prefilling everything
    pre_whole, _ = eng.prefill(params, eng.pad(whole), len(whole), req)
    np.testing.assert_allclose(host(state.cache_k)[:, 2, :len(whole)], host(pre_whole.cache_k)[:, 0, :len(whole)],
                               atol=1e-5)


def test_prompt_buckets_bound_compilations():
    cfg, params, eng = _setup("qwen3")
    req = SlotRequest.make(max_new=2)
    state = eng.init_decode_state()
    before = eng.compile_counts()["prefill"]
    for n in (1, 3, 8, 9, 15, 16, 17, 30):
        prefix, first = eng.prefill(params, eng.pad(list(range(1, n + 1))), n, req)
    assert eng.compile_counts()["prefill"] - before <= 3  # buckets 8, 16, 32
    with pytest.raises(ValueError, match="49 tokens exceed the engine's max_len=48"):
        eng.pad(list(range(49)))
    with pytest.raises(ValueError, match="empty token list"):
        eng.pad([])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        eng.pad([1, 512])


def test_sampling_filters_and_logprobs_hand_computed():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4, jnp.float32))
    sp = SamplingParams(temperature=jnp.array([0.0, 1.0, 1.0, 0.5]), top_k=jnp.array([0, 2, 0, 0]),
                        top_p=jnp.array([1.0, 1.0, 0.7, 1.0]), seed=jnp.arange(4, dtype=jnp.uint32))
    draws = [_sample(logits, sp, jnp.full((4,), i)) for i in range(300)]
    toks = np.stack([host(d[0]) for d in draws])
    assert set(toks[:, 0]) == {0}                       # greedy
    assert set(toks[:, 1]) <= {0, 1} and set(toks[:, 2]) <= {0, 1}  # top-k 2; top-p 0.7 keeps 0.5+0.3
    t0, lp, raw = draws[0]
    p = np.array([0.5, 0.3, 0.15, 0.05])
    for row, probs in ((1, p[:2] / p[:2].sum()), (2, p[:2] / p[:2].sum()), (3, p ** 2 / (p ** 2).sum())):
        tok = int(t0[row])
        np.testing.assert_allclose(float(lp[row]), np.log(probs[tok]), rtol=1e-5)
        np.testing.assert_allclose(float(raw[row]), np.log(p[tok]), rtol=1e-5)
    assert float(lp[0]) == 0.0
    # temperature 0.5 sharpens: token 0 dominates in frequency (p0 = .25/.3525 = 0.709)
    assert 0.6 < np.mean(toks[:, 3] == 0) < 0.82
    # same seed and index -> same token, whatever the row
    again = _sample(logits[::-1], SamplingParams(*(getattr(sp, f)[::-1] for f in ("temperature", "top_k", "top_p", "seed"))),
                   jnp.zeros((4,), jnp.int32))
    assert host(again[0])[::-1].tolist() == host(t0).tolist()


def test_unfiltered_rows_sample_the_same_whether_or_not_a_neighbour_filters():
    """The vocabulary sort runs only when some row uses top-k/top-p; rows that use neither get
    the same tokens and log-probs on both paths (top_p 1 keeps the whole tail on the sort path)."""
    logits = jax.random.normal(jax.random.key(0), (3, 512)) * 3.0
    plain = SamplingParams(temperature=jnp.array([1.0, 0.7, 1.0]), top_k=jnp.zeros(3, jnp.int32),
                           top_p=jnp.ones(3), seed=jnp.arange(3, dtype=jnp.uint32))
    mixed = SamplingParams(plain.temperature, jnp.array([0, 0, 5], jnp.int32), jnp.array([1.0, 1.0, 0.9]), plain.seed)
    for i in range(20):
        a = _sample(logits, plain, jnp.full((3,), i))
        b = _sample(logits, mixed, jnp.full((3,), i))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(host(x)[:2], host(y)[:2])
        assert int(b[0][2]) in set(np.argsort(-np.asarray(logits[2]))[:5].tolist())


def test_slot_request_validation():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SlotRequest.make(temperature=-0.1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SlotRequest.make(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SlotRequest.make(max_new=0)
