"""Context parallelism (issue #18 point 3): a sequence split over `context=4` with `expert=2` on
the same mesh computes the single-device forward, loss and gradients (fp32, 1e-5); so does one
split over (expert=4, context=2), where the rows do not split over `expert` and it takes a share
of the sequence instead (issue #19: one 1M-token row on expert=16)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.learner.objective import microbatch_objective
from sfrrl_jax.models import transformer as tfm
from sfrrl_jax.rl.loss_fn import as_loss
from sfrrl_jax.mesh import seq_axes
from sfrrl_jax.models.context_parallel import from_zigzag, to_zigzag, zigzag_permutation

from model_fixtures import TINY, TINY_DEEPSEEK, TINY_GPT_OSS, randomize, replicate_on, single_device_mesh

# Small attention blocks so every shard holds several blocks and segments cross block edges.
CASES = {
    # blockwise core; sinks, biases, a 4-token sliding window on layer 0, full attention on layer 1
    "gpt_oss_blockwise": TINY_GPT_OSS.replace(attention_block_q=8, attention_block_k=8),
    # the naive core; qk-norm, no sinks, no window
    "qwen3_naive": TINY.replace(attention_impl="naive"),
    # latent attention (expanded heads, padded values) on the blockwise core, a dense first layer
    "deepseek_mla": TINY_DEEPSEEK.replace(attention_block_q=8, attention_block_k=8),
}


def _batch(cfg, seed=0):
    """Two rows of 50 tokens (padded to 56 = 2 x 4 x 7 inside): row 0 packs segments of 19, 23
    and 8 tokens (crossing chunk and block edges), row 1 is one 45-token segment and 5 padding."""
    rng = np.random.RandomState(seed)
    b, t = 2, 50
    seg = np.ones((b, t), np.int32)
    seg[0, 19:42], seg[0, 42:] = 2, 3
    seg[1, 45:] = 0
    return S.MicroBatch(
        tokens=rng.randint(0, cfg.vocab_size, (b, t)).astype(np.int32),
        segment_ids=seg,
        loss_mask=(rng.rand(b, t) < 0.7).astype(np.int32) * (seg > 0),
        advantages=rng.randn(b, t).astype(np.float32),
    )


def _objective(cfg, params, batch):
    """(the RL objective: token-mean clipped PG + entropy + router losses, the forward's hidden
    states [batch, seq, embed]); one forward serves both (one compile per mesh)."""
    seen = {}

    def forward_fn(p, tokens, segment_ids, positions):
        hidden, aux = tfm.forward_hidden(cfg, p, tokens, segment_ids, positions)
        seen["hidden"] = hidden
        return hidden, tfm.unembedding(cfg, p), aux

    loss = S.LossConfig(router_aux_coef=0.01, router_z_coef=0.001, entropy_coef=0.01)
    num, (parts, _) = microbatch_objective(forward_fn, as_loss(loss), (0.01, 0.001), params, batch)
    return num / jax.lax.stop_gradient(parts.denominator), seen["hidden"]


@functools.partial(jax.jit, static_argnums=(0,))
def _outputs(cfg, params, batch):
    (loss, hidden), grads = jax.value_and_grad(functools.partial(_objective, cfg), has_aux=True)(params, batch)
    return hidden, loss, grads


def _run(cfg, params, batch):
    with jax.set_mesh(S.models.mesh_of(params)):
        return jax.device_get(_outputs(cfg, params, batch))


# (case, mesh sizes, the sequence axes the 2-row batch gets)
SPLITS = [(case, dict(expert=2, context=4), ("context",)) for case in sorted(CASES)] + [
    ("gpt_oss_blockwise", dict(expert=4, context=2), ("expert", "context"))]


@pytest.mark.parametrize("case,sizes,axes", SPLITS, ids=[f"{c}-{'x'.join(map(str, s.values()))}" for c, s, _ in SPLITS])
def test_context_parallel_matches_single_device(case, sizes, axes):
    cfg = CASES[case]
    mesh = S.make_mesh(**sizes)
    assert seq_axes(mesh, 2) == axes
    params = randomize(S.init_params(cfg, mesh, seed=1), seed=2)
    batch = _batch(cfg)
    hidden1, loss1, g1 = _run(cfg, replicate_on(params, single_device_mesh()), batch)
    hidden8, loss8, g8 = _run(cfg, params, batch)
    np.testing.assert_allclose(hidden8, hidden1, atol=1e-5, rtol=0)
    np.testing.assert_allclose(loss8, loss1, rtol=1e-5, atol=1e-6)
    flat1 = dict(jax.tree_util.tree_flatten_with_path(g1)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(g8)[0]:
        np.testing.assert_allclose(a, flat1[path], atol=1e-5, rtol=1e-5, err_msg=str(path))
    # the comparison is not of zeros: attention and experts both receive gradient
    attn = g8["layers"]["attn"]
    if "k_proj" in attn:
        assert np.abs(attn["k_proj"]).max() > 1e-3
    else:   # latent attention's key up-projection (measured 6.1e-4 here)
        assert np.abs(attn["k_b_proj"]).max() > 1e-4
    assert np.abs(g8["layers"]["moe"]["w_down"]).max() > 1e-3


@pytest.mark.parametrize("sizes", [dict(data=2, context=4), dict(data=2, expert=4)], ids=["context", "expert"])
def test_zigzag_balances_causal_work_and_round_trips(sizes):
    """4 sequence shards, over `context` or over `expert` (2 rows do not split over data x expert)."""
    mesh = S.make_mesh(**sizes)
    c, t = 4, 16
    x = np.arange(2 * t, dtype=np.int32).reshape(2, t)
    perm = zigzag_permutation(t, c)
    assert perm == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    with jax.set_mesh(mesh):
        z = jax.jit(to_zigzag)(x)
        back = jax.jit(from_zigzag)(z)
    np.testing.assert_array_equal(np.asarray(z), x[:, perm])
    np.testing.assert_array_equal(np.asarray(back), x)
    # every device holds the same number of causal (query, key) pairs
    shards = np.asarray(perm).reshape(c, t // c)
    assert len({int(np.sum(s + 1)) for s in shards}) == 1


def test_bf16_sequence_split_backward_compiles_and_runs():
    """bf16 params and compute, the sequence over (expert=4, context=2): the backward's sums over
    the shards (the gathered K/V's reduce-scatter, the replicated LM head's and sinks' psums) run
    in f32. In bf16 XLA:CPU aborted the whole process compiling them ("Invalid binary instruction
    opcode copy"); the gradients agree with one device's to bf16 precision."""
    cfg = CASES["gpt_oss_blockwise"].replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    mesh = S.make_mesh(expert=4, context=2)
    params = randomize(S.init_params(cfg, mesh, seed=1), seed=2)
    batch = _batch(cfg)
    _, loss1, g1 = _run(cfg, replicate_on(params, single_device_mesh()), batch)
    _, loss8, g8 = _run(cfg, params, batch)
    assert abs(float(loss8) - float(loss1)) <= 2e-2 * max(1.0, abs(float(loss1)))
    for name in ("k_proj", "q_proj"):
        a = np.asarray(g8["layers"]["attn"][name], np.float32)
        b = np.asarray(g1["layers"]["attn"][name], np.float32)
        assert np.all(np.isfinite(a)) and np.abs(b).max() > 0
        # bf16 rounding of two differently ordered sums: relative to the gradient's scale
        assert np.abs(a - b).max() <= 0.1 * np.abs(b).max(), name
