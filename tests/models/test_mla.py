"""Multi-head latent attention (models/mla.py; DeepSeek-V3): the training forward's expanded heads
against the engine's absorbed form, tensor-parallel training against one device, the config's
checks. Parity with transformers is in tests/checkpoints (deepseek_v3 fixtures)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from flax import nnx
from sfrrl_jax.models.layers import attend, attention_mask
from sfrrl_jax.models.mla import LatentAttention

from model_fixtures import TINY_DEEPSEEK, check_mesh_step_equals_one_device, host, randomize

VARIANTS = {
    "q_latent": TINY_DEEPSEEK,
    # no query latent, values wider than nope + rope (the keys are padded instead), YaRN's scale
    "wide_values": TINY_DEEPSEEK.replace(mla_q_rank=0, mla_v_dim=24, rope_type="yarn", rope_factor=4.0,
                                         rope_original_max_len=8, query_scale=0.31),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("impl", ["naive", "blockwise"])
def test_expanded_heads_equal_the_absorbed_latent_form(name, impl):
    """The training forward (every head's key and value expanded) and the KV-cache steps' form (k_b
    absorbed into the query, one cached head of [latent, rope key], v_b after the softmax) are the
    same function: two packed segments, a window, fp32."""
    cfg = VARIANTS[name].replace(attention_impl=impl, attention_block_q=4, attention_block_k=4, init_std=0.3)
    module = LatentAttention(cfg, nnx.Rngs(3))
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.normal(size=(2, 11, cfg.d_model)).astype(np.float32))
    positions = jnp.asarray(np.concatenate([np.arange(6), np.arange(5)])[None].repeat(2, 0), jnp.int32)
    segments = jnp.asarray(np.array([1] * 6 + [2] * 5)[None].repeat(2, 0), jnp.int32)
    window = 4
    expanded = module(x, positions, segments, window)
    q, k, v = module.project_qkv(x, positions, window)
    assert k.shape == (2, 11, 1, cfg.head_dim) and q.shape == (2, 11, cfg.n_heads, cfg.head_dim)
    absorbed = module.output(attend(q, k, v, attention_mask(positions, positions, segments, segments, window)))
    assert float(jnp.abs(expanded).max()) > 0.1
    # outputs up to 14 in size; the two summation orders differ by up to 6.4e-6 here
    np.testing.assert_allclose(host(expanded), host(absorbed), atol=1e-4, rtol=0)


def test_latent_attention_on_a_tensor_split_mesh_trains_as_on_one_device():
    """Heads split over `tensor` (the latents replicated), experts over `expert`: the forward and one
    Adam step equal one device's, every latent-attention param moves, and the params count as
    ModelConfig.param_count says."""
    cfg = TINY_DEEPSEEK
    mesh = S.make_mesh(data=2, expert=2, tensor=2)
    params = randomize(S.init_params(cfg, mesh, seed=3), seed=4)
    attn = params["layers"]["attn"]
    assert set(attn) == {"q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "k_b_proj", "v_b_proj",
                         "o_proj"}
    assert attn["q_b_proj"].sharding.spec[2] == "tensor" and attn["v_b_proj"].sharding.spec[2] == "tensor"
    assert S.models.transformer.count_params(params) == cfg.param_count()
    before, new = check_mesh_step_equals_one_device(cfg, params)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new["layers"]["attn"])[0],
                            jax.tree.leaves(before["layers"]["attn"])):
        assert np.abs(host(a) - b).max() > 1e-5, jax.tree_util.keystr(path)   # a gradient reaches it


@pytest.mark.parametrize("changes, message", [
    (dict(n_kv_heads=2), r"one KV head of mla_kv_rank \+ mla_rope_dim = 32 dims; set n_kv_heads=1 \(got 2\)"),
    (dict(head_dim=16), r"head_dim=32 \(got 16\)"),
    (dict(mla_v_dim=0), r"mla_v_dim=0: latent attention \(mla_kv_rank=24\) needs"),
    (dict(mla_rope_dim=7, head_dim=31), "mla_rope_dim=7: RoPE rotates an even number"),
    (dict(qk_norm=True), r"'qk_norm': True.*not supported with latent attention"),
    (dict(rope_partial_factor=0.5), "rope_partial_factor"),
    (dict(mla_kv_rank=0, head_dim=16, n_kv_heads=2), r"'mla_q_rank': 20.*need mla_kv_rank >= 1"),
])
def test_latent_attention_config_errors_name_the_fields(changes, message):
    with pytest.raises(ValueError, match=message):
        TINY_DEEPSEEK.replace(**changes)
