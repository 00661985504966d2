"""Shared fixtures for model tests: meshes, randomised params, tiny config variants."""
import functools
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import sfrrl_jax as S
from sfrrl_jax.learner import make_train_step
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.rl.config import LossConfig

TINY = S.ModelConfig.preset("tiny-moe")
# GPT-OSS-like variant: biases, sinks, alternating sliding window, YaRN, clamped SwiGLU,
# top-k-then-softmax routing with a router bias; odd d_ff to catch shape slips.
TINY_GPT_OSS = S.ModelConfig.preset(
    "tiny-moe", family="gpt_oss", n_layers=2, qk_norm=False, attention_bias=True, attn_sinks=True,
    sliding_window=4, layer_types=("sliding", "full"), router="topk_softmax", router_bias=True,
    expert_bias=True, expert_act="gptoss_swiglu", swiglu_limit=0.5, rope_type="yarn",
    rope_factor=8.0, rope_original_max_len=64, rope_truncate=False, d_ff_expert=48, top_k=3,
)
TINY_MIXTRAL = S.ModelConfig.preset(
    "tiny-moe", family="mixtral", qk_norm=False, router="topk_softmax", n_heads=8, n_kv_heads=2,
    tie_embeddings=True,
)

# Dense (Qwen2-like): no experts, a SwiGLU MLP of odd width, q/k/v biases without an output
# bias, a window on the second layer.
TINY_DENSE = S.ModelConfig.preset(
    "tiny-moe", family="qwen2", n_experts=0, d_ff=40, qk_norm=False, attention_bias=True,
    attention_out_bias=False, sliding_window=4, layer_types=("full", "sliding"),
)

# Mixed stack (Qwen3-MoE mlp_only_layers): layer 1 dense (SwiGLU of odd width 40), 0 and 2 MoE,
# so the layers run as three scans (MoE row 0, dense row 0, MoE row 1); a sliding window on
# layers 1 and 2 only checks that each scan gets its own layers' windows. The MoE layers also
# have a gated shared expert of odd width 24 (Qwen2-MoE's), split over `tensor` as a dense MLP.
TINY_MIXED = S.ModelConfig.preset(
    "tiny-moe", n_layers=3, d_ff=40, dense_layers=(1,), sliding_window=4,
    layer_types=("full", "sliding", "sliding"), d_ff_shared=24, shared_expert_gate=True,
)

# Gemma 3-like (dense): norms whose weights are offsets from one, sandwich norms, GeGLU of odd
# width, scaled embeddings, a query scale other than 1/sqrt(head_dim), and a sliding layer with
# its own unscaled RoPE beside a full one with a linearly scaled RoPE; tied embeddings.
TINY_GEMMA = S.ModelConfig.preset(
    "tiny-moe", family="gemma3_text", n_experts=0, d_ff=40, qk_norm=True, sliding_window=4,
    layer_types=("sliding", "full"), norm_offset=1.0, sandwich_norms=True, mlp_act="gelu_tanh", embed_scale=8.0,
    query_scale=0.3, rope_local_theta=500.0, rope_type="linear", rope_factor=4.0, tie_embeddings=True,
)

# Phi-4-mini-like (dense): RoPE on half of each head, longrope short factors (the original length
# 64 is past every test sequence, so the long ones never apply), a window on every layer.
TINY_PHI = S.ModelConfig.preset(
    "tiny-moe", family="phi3", n_experts=0, d_ff=40, qk_norm=False, rope_partial_factor=0.5, rope_type="longrope",
    rope_short_factor=(1.0, 1.3, 1.9, 2.6), rope_long_factor=(1.0, 2.0, 4.0, 8.0), rope_original_max_len=64,
    rope_attention_factor=1.1, sliding_window=6, layer_types=("sliding", "sliding"),
)

# OLMo 3-like (dense): the post-norm block (no input norms), q/k norms over the whole projection,
# a sliding layer with its own unscaled RoPE beside a full one with YaRN (its attention factor
# given), norms multiplying in fp32.
TINY_OLMO = S.ModelConfig.preset(
    "tiny-moe", family="olmo3", n_experts=0, d_ff=40, qk_norm=True, qk_norm_over_heads=True, pre_norms=False,
    sandwich_norms=True, norm_scale_fp32=True, sliding_window=4, layer_types=("sliding", "full"),
    rope_type="yarn", rope_factor=4.0, rope_original_max_len=8, rope_attention_factor=1.3, rope_local_theta=10000.0,
)

# SmolLM3-like (dense): a NoPE layer, windowed (as transformers windows SmolLM3's NoPE layers),
# beside a full one with RoPE; tied embeddings.
TINY_SMOLLM3 = S.ModelConfig.preset(
    "tiny-moe", family="smollm3", n_experts=0, d_ff=40, qk_norm=False, nope_layers=(1,), sliding_window=4,
    layer_types=("full", "sliding"), tie_embeddings=True,
)

# OLMoE-like: softmax-then-top-k routing without renormalisation, q/k norms over the whole
# projection, q/k/v/o biases.
TINY_OLMOE = S.ModelConfig.preset("tiny-moe", family="olmoe", qk_norm=True, qk_norm_over_heads=True,
                                  norm_topk_prob=False, attention_bias=True)

# GLM-4.5-like: a dense first layer, then sigmoid routing with a selection bias ('score_bias')
# among 2 of 4 expert groups, scaled by 2.5, an ungated shared expert; RoPE on half of each head,
# q/k/v biases without the output's, per-head q/k norms.
TINY_GLM = S.ModelConfig.preset(
    "tiny-moe", family="glm4_moe", router="sigmoid_topk", router_groups=4, router_topk_groups=2, router_scale=2.5,
    d_ff_shared=32, dense_layers=(0,), d_ff=40, attention_bias=True, attention_out_bias=False,
    rope_partial_factor=0.5, qk_norm=True,
)

# DeepSeek-V3-like: latent attention (a query latent; value dims apart from the key's), cached
# as one KV head of kv_rank + rope = 32 dims; GLM's MoE (groups, scale, shared expert, dense first layer).
TINY_DEEPSEEK = S.ModelConfig.preset(
    "tiny-moe", family="deepseek_v3", router="sigmoid_topk", router_groups=4, router_topk_groups=2, router_scale=2.5,
    d_ff_shared=64, dense_layers=(0,), d_ff=40, qk_norm=False, n_kv_heads=1, head_dim=32, mla_kv_rank=24,
    mla_rope_dim=8, mla_nope_dim=12, mla_v_dim=10, mla_q_rank=20,
)

# MiniMax-M2-like: every layer's experts chosen by sigmoid + a selection bias, renormalised, no
# groups or scale; q/k norms over the whole projection; RoPE on half of each head.
TINY_MINIMAX = S.ModelConfig.preset("tiny-moe", family="minimax_m2", router="sigmoid_topk", qk_norm=True,
                                    qk_norm_over_heads=True, rope_partial_factor=0.5)

# Granite-like (dense): its four multipliers, none 1 or a power of two.
TINY_GRANITE = S.ModelConfig.preset(
    "tiny-moe", family="granite", n_experts=0, d_ff=40, qk_norm=False, embed_scale=3.5, query_scale=0.11,
    residual_scale=0.4, logits_divisor=2.5, tie_embeddings=True,
)


def single_device_mesh():
    return S.make_mesh(devices=jax.devices()[:1])


def host_randomize(params, seed=0, scale=0.2):
    """Like `randomize`, but drawn by numpy on the host and laid out in each leaf's sharding
    (`jax.make_array_from_callback`, which each process fills with its own shards): the same
    values bit for bit whatever the process count or the compiled code (tests that compare runs
    on 1 and 2 processes start from exactly the same state)."""
    rng = np.random.default_rng(seed)

    def draw(x):
        host = (scale * rng.standard_normal(x.shape)).astype(x.dtype)
        return jax.make_array_from_callback(x.shape, x.sharding, lambda index: host[index])
    return jax.tree.map(draw, params)


def randomize(params, seed=0, scale=0.2):
    """Every leaf replaced by N(0, scale^2) noise in its own sharding (biases and sinks too)."""
    leaves, treedef = jax.tree.flatten(params)
    spec = tuple((x.shape, x.dtype, x.sharding) for x in leaves)
    return jax.tree.unflatten(treedef, _randomizer(spec, float(scale))(jax.random.key(seed)))


@functools.lru_cache(maxsize=None)
def _randomizer(spec, scale):
    # One compile per param layout (drawing leaf by leaf compiled once per distinct shape).
    def draw(key):
        keys = jax.random.split(key, len(spec))
        return [scale * jax.random.normal(k, shape, dtype) for k, (shape, dtype, _) in zip(keys, spec)]
    return jax.jit(draw, out_shardings=[sharding for _, _, sharding in spec])


def replicate_on(params, mesh):
    return jax.device_put(params, jax.tree.map(lambda _: NamedSharding(mesh, P()), params))


def host(x):
    return np.asarray(jax.device_get(x))


def check_mesh_step_equals_one_device(cfg, params):
    """Asserts that `params` (sharded on a mesh) give one device's forward and, after one Adam
    step (lr 1e-3) of the RL loss on a random batch, one device's params. Returns (the params
    before, on the host; the mesh's new params): `params` are donated to the step."""
    rng = np.random.RandomState(1)
    tokens = rng.randint(1, cfg.vocab_size, (4, 12)).astype(np.int32)
    before = jax.tree.map(host, params)
    one = replicate_on(before, single_device_mesh())   # no buffer shared with params (donated below)
    np.testing.assert_allclose(host(S.forward(cfg, params, tokens)), host(S.forward(cfg, one, tokens)),
                               atol=1e-5, rtol=0)
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens, np.float32),
             "advantages": rng.normal(size=4).astype(np.float32),
             "rollout_logprobs": np.full(tokens.shape, -2.0, np.float32)}
    ts = make_train_step(cfg, LossConfig(), OptimizerConfig(learning_rate=1e-3))
    new, _, metrics = ts.step(params, ts.init_opt_state(params), batch)     # params donated
    new_one, _, metrics_one = ts.step(one, ts.init_opt_state(one), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(metrics_one["loss"]), rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(new_one)):
        # one Adam step turns the mesh's other summation order into up to 1.8e-6 on the dense
        # families' test; 5e-5 (5 % of a step) leaves room for another CPU's rounding
        np.testing.assert_allclose(host(a), host(b), atol=5e-5, rtol=0, err_msg=jax.tree_util.keystr(path))
    return before, new


def teacher_forced_logprobs(cfg, params, sequences):
    """log p(token t | tokens < t) under the params, for every position t >= 1 of each sequence."""
    width = max(len(s) for s in sequences)
    tokens = np.zeros((len(sequences), width), np.int32)
    segments = np.zeros_like(tokens)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)] = s
        segments[i, :len(s)] = 1
    logits = np.asarray(S.forward(cfg, params, tokens, segment_ids=segments))
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return [logp[i, np.arange(len(s) - 1), s[1:]] for i, s in enumerate(sequences)]
