"""Dense families (n_experts=0: llama, mistral, qwen2, qwen3, gemma3_text, phi3, granite, olmo2/3, smollm3): the
same transformer with a GLU MLP in every layer, sharded over `tensor`, trained by the same train step as the MoE
families."""
import jax
import numpy as np
import pytest

import sfrrl_jax as S

from model_fixtures import (TINY_DENSE, TINY_GEMMA, TINY_GRANITE, TINY_OLMO, TINY_PHI, TINY_SMOLLM3,
                            check_mesh_step_equals_one_device, host, randomize, single_device_mesh)


@pytest.mark.parametrize("cfg", [TINY_DENSE, TINY_GEMMA, TINY_PHI, TINY_GRANITE, TINY_OLMO, TINY_SMOLLM3],
                         ids=["qwen2_like", "gemma3_like", "phi3_like", "granite_like", "olmo3_like", "smollm3_like"])
def test_dense_forward_and_train_step_on_a_mesh_equal_one_device(cfg):
    mesh = S.make_mesh(data=2, expert=2, tensor=2)
    params = randomize(S.init_params(cfg, mesh, seed=3), seed=4)
    mlp = params["layers"]["mlp"]
    assert "moe" not in params["layers"] and set(mlp) == {"w_gate", "w_up", "w_down"}
    assert mlp["w_gate"].shape == (2, 64, 40) and mlp["w_gate"].sharding.spec[2] == "tensor"
    assert mlp["w_down"].sharding.spec[1] == "tensor"
    assert ("q_bias" in params["layers"]["attn"]) == cfg.attention_bias and "o_bias" not in params["layers"]["attn"]
    assert ("post_attn_norm" in params["layers"]) == ("post_mlp_norm" in params["layers"]) == cfg.sandwich_norms
    assert ("attn_norm" in params["layers"]) == ("mlp_norm" in params["layers"]) == cfg.pre_norms
    assert S.models.transformer.count_params(params) == cfg.param_count()
    before, new = check_mesh_step_equals_one_device(cfg, params)
    assert np.abs(host(new["layers"]["mlp"]["w_down"]) - before["layers"]["mlp"]["w_down"]).max() > 1e-5   # trains


def test_dense_config_errors_name_the_field():
    with pytest.raises(ValueError, match="n_experts=0 .* needs d_ff >= 1"):
        S.ModelConfig.preset("tiny-moe", n_experts=0)
    with pytest.raises(ValueError, match="attention_out_bias"):
        S.ModelConfig.preset("tiny-moe", attention_out_bias="yes")
    with pytest.raises(ValueError, match=r"nope_layers\[0\]"):
        S.ModelConfig.preset("tiny-moe", nope_layers=(2,))   # two layers: 0 and 1
    with pytest.raises(ValueError, match="repeats a layer index"):
        S.ModelConfig.preset("tiny-moe", nope_layers=(1, 1))
    with pytest.raises(ValueError, match="pre_norms=False needs sandwich_norms=True"):
        S.ModelConfig.preset("tiny-moe", pre_norms=False)
    with pytest.raises(ValueError, match="qk_norm_over_heads=True needs qk_norm=True"):
        S.ModelConfig.preset("tiny-moe", qk_norm=False, qk_norm_over_heads=True)
    assert S.ModelConfig.preset("tiny-moe", nope_layers=[1, 0]).nope_layers == (0, 1)   # gin and JSON give lists


def test_the_train_steps_logprobs_are_the_forwards_with_granites_logits_divisor():
    """The train step reads log-probs from (hidden, unembedding) in tiles, not from the forward's
    logits: Granite's logits_scaling must reach both."""
    from sfrrl_jax.models import transformer as tfm
    from sfrrl_jax.rl.logprobs import token_logprobs_and_entropy
    mesh = single_device_mesh()
    params = randomize(S.init_params(TINY_GRANITE, mesh, seed=5), seed=6)
    tokens = np.random.RandomState(2).randint(0, TINY_GRANITE.vocab_size, (2, 9)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)

    def both(cfg):
        hidden, _ = tfm.forward_hidden(cfg, params, tokens)
        tiled, _ = token_logprobs_and_entropy(hidden, tfm.unembedding(cfg, params), targets)
        full = jax.nn.log_softmax(S.forward(cfg, params, tokens), axis=-1)
        return host(tiled), np.take_along_axis(host(full), targets[..., None], axis=-1)[..., 0]

    tiled, full = both(TINY_GRANITE)
    np.testing.assert_allclose(tiled, full, atol=1e-5, rtol=0)
    undivided, _ = both(TINY_GRANITE.replace(logits_divisor=1.0))
    assert np.abs(undivided - tiled).max() > 0.05
