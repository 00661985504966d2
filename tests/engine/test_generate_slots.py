"""`S.generate` decodes every prompt it is given at once (issue #44 point 5): one slot per prompt,
bounded by a KV-cache budget it computes and names when it must split. Before, it ran 32 prompts
in silent waves of 8 (`max_slots=8`)."""
import importlib
import warnings

import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.engine.generate import slots_within_budget

# the module (sfrrl_jax.engine.generate is also the name of its function in the package)
generate_module = importlib.import_module("sfrrl_jax.engine.generate")

CFG = S.ModelConfig.preset("tiny-moe", max_seq_len=64, n_layers=1)


@pytest.fixture(scope="module")
def params():
    return S.init_params(CFG, S.make_mesh(devices=jax.devices()[:1]), seed=0)


def _prompts(n):
    rng = np.random.default_rng(0)
    return [list(rng.integers(1, CFG.vocab_size, size=3 + i % 4)) for i in range(n)]


def _slots_built(monkeypatch):
    built = []
    real = generate_module.Engine

    def spy(*args, **kw):
        built.append(kw["max_slots"])
        return real(*args, **kw)
    monkeypatch.setattr(generate_module, "Engine", spy)
    return built


def test_every_prompt_gets_a_slot_by_default(params, monkeypatch):
    built = _slots_built(monkeypatch)
    out = S.generate(CFG, params, _prompts(11), max_new_tokens=4)
    assert built == [11] and len(out) == 11   # was: 8 slots, a second wave of 3
    assert all(len(c.tokens) == 4 for c in out)


def test_a_budget_too_small_for_all_splits_them_and_says_so(params, monkeypatch):
    prompts = _prompts(6)
    reference = [c.tokens for c in S.generate(CFG, params, prompts, max_new_tokens=4)]
    built = _slots_built(monkeypatch)
    # the cache of one slot at this max_len, times 2.5: two slots fit
    per_slot = S.Engine(CFG, params, max_slots=1, max_len=16).steps.cache_bytes()
    with pytest.warns(UserWarning, match=r"6 prompts at max_len=16 need a KV cache .* \(kv_budget_bytes\): "
                                         r"decoding 2 at a time"):
        out = S.generate(CFG, params, prompts, max_new_tokens=4, max_len=16, kv_budget_bytes=2.5 * per_slot)
    assert built == [6, 2]   # the engine is rebuilt before anything is allocated
    assert [c.tokens for c in out] == reference   # greedy: the same tokens however they are batched


def test_max_slots_still_caps_and_the_default_budget_warns_nothing(params, monkeypatch):
    built = _slots_built(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        S.generate(CFG, params, _prompts(5), max_new_tokens=2, max_slots=3)
        S.generate(CFG, params, _prompts(5), max_new_tokens=2)
    assert built == [3, 5]
    with pytest.raises(ValueError, match="max_slots"):
        S.generate(CFG, params, _prompts(2), max_new_tokens=2, max_slots=0)


def test_slots_within_budget():
    assert slots_within_budget(100.0, 32, kv_budget_bytes=1000.0) == 10
    assert slots_within_budget(100.0, 4, kv_budget_bytes=1000.0) == 4
    assert slots_within_budget(5000.0, 4, kv_budget_bytes=1000.0) == 1   # at least one: it runs, slowly
