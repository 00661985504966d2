"""load_hf / save_hf against transformers: logits parity, export, bit-identical round trips.

Each tiny random model (see hf_fixtures.CONFIGS) is built with transformers, saved with
`save_pretrained`, loaded with `load_hf` on a data=2 x expert=4 mesh and run with our forward.
"""
import json

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import sfrrl_jax as S
from sfrrl_jax.checkpoints.hf import load_hf, save_hf
from sfrrl_jax.checkpoints.hf.safetensors_io import INDEX_FILE, CheckpointFiles
from sfrrl_jax.models.api import param_shardings

import hf_fixtures as F
from model_fixtures import TINY_DEEPSEEK, randomize


@pytest.fixture(scope="module")
def mesh():
    return S.make_mesh(data=2, expert=4)


@pytest.fixture(scope="module", params=sorted(F.CONFIGS))
def loaded(request, tmp_path_factory, mesh):
    name = request.param
    model = F.build_model(name)
    directory = F.save_model(model, tmp_path_factory.mktemp(name) / "hf")
    tokens = F.tokens_for(model.config.vocab_size)
    cfg, params = load_hf(directory, mesh)
    return dict(name=name, model=model, dir=directory, tokens=tokens, ref=F.hf_logits(model, tokens),
                cfg=cfg, params=params)


def _leaves(params):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_logits_match_transformers_fp32(loaded):
    ours = np.asarray(S.forward(loaded["cfg"], loaded["params"], loaded["tokens"]))
    ref = loaded["ref"]
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4, loaded["name"]
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))  # greedy next tokens agree


def test_params_land_in_their_target_shardings(loaded, mesh):
    want = _leaves(param_shardings(loaded["cfg"], mesh))
    got = _leaves(loaded["params"])
    assert set(got) == set(want)
    for key, x in got.items():
        assert x.sharding.is_equivalent_to(want[key], x.ndim), key
        assert x.dtype == np.float32, key
    if loaded["cfg"].is_moe:  # experts really are split over the expert axis: 1/4 on each device
        w = loaded["params"]["layers"]["moe"]["w_gate"]
        assert {s.data.shape[1] for s in w.addressable_shards} == {loaded["cfg"].n_experts // 4}
    else:                     # a dense family's MLP, with nothing under 'moe'
        assert set(loaded["params"]["layers"]) >= {"mlp"} and "moe" not in loaded["params"]["layers"]
    cfg, hf_layers = loaded["cfg"], loaded["model"].model.layers
    dense = tuple(i for i, layer in enumerate(hf_layers)
                  if type(layer.mlp).__name__ in ("Qwen3MoeMLP", "Qwen2MoeMLP", "Glm4MoeMLP", "DeepseekV3MLP",
                                                 "DeepseekV2MLP", "Glm4MoeLiteMLP"))
    # mlp_only_layers / decoder_sparse_step / first_k_dense_replace read as transformers does
    assert cfg.dense_layers == dense
    if dense:  # a mixed stack: the dense layers' MLPs alone under 'dense_layers', in layer order
        stack = loaded["params"]["dense_layers"]
        assert "moe" not in stack and "mlp" not in loaded["params"]["layers"]
        assert stack["mlp"]["w_gate"].shape == (len(dense), cfg.d_model, cfg.d_ff)
        assert loaded["params"]["layers"]["moe"]["router"].shape[0] == cfg.n_layers - len(dense)
        for row, i in enumerate(dense):
            np.testing.assert_array_equal(np.asarray(stack["mlp"]["w_down"][row]),
                                          hf_layers[i].mlp.down_proj.weight.detach().numpy().T)
    if cfg.d_ff_shared:   # Qwen2-MoE / GLM-4.5: the shared expert (and Qwen2's gate) in every MoE layer
        moe_layers = [layer for i, layer in enumerate(hf_layers) if i not in dense]
        shared = loaded["params"]["layers"]["shared_expert"]
        assert shared["w_up"].shape == (len(moe_layers), cfg.d_model, cfg.d_ff_shared)
        assert ("shared_gate" in loaded["params"]["layers"]) == cfg.shared_expert_gate
        for row, layer in enumerate(moe_layers):
            theirs = layer.mlp.shared_expert if cfg.shared_expert_gate else layer.mlp.shared_experts
            np.testing.assert_array_equal(np.asarray(shared["w_up"][row]), theirs.up_proj.weight.detach().numpy().T)
            if cfg.shared_expert_gate:
                np.testing.assert_array_equal(np.asarray(loaded["params"]["layers"]["shared_gate"][row]),
                                              layer.mlp.shared_expert_gate.weight.detach().numpy().T)


def test_export_loads_in_transformers_with_identical_logits(loaded, tmp_path):
    cfg, params = loaded["cfg"], loaded["params"]
    out = save_hf(cfg, params, tmp_path / "export", max_shard_bytes=40_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1, shards  # the size threshold splits the tensors over several files
    index = json.loads((out / INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    reloaded = F.load_transformers(out)
    np.testing.assert_array_equal(F.hf_logits(reloaded, loaded["tokens"]), loaded["ref"])


def test_import_export_import_is_bit_identical(loaded, tmp_path, mesh):
    cfg, params = loaded["cfg"], loaded["params"]
    out = save_hf(cfg, params, tmp_path / "export", max_shard_bytes=60_000)
    cfg2, params2 = load_hf(out, mesh)
    assert cfg2.replace(name=cfg.name) == cfg
    a, b = _leaves(params), _leaves(params2)
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    # And every exported tensor is bit-for-bit the tensor transformers saved.
    original = load_file(str(loaded["dir"] / "model.safetensors"))
    exported = {n: load_file(str(info.file))[n] for n, info in CheckpointFiles(out).tensors.items()}
    if cfg.tie_embeddings:
        original.pop("lm_head.weight", None)
    if not getattr(loaded["model"].config, "rope_interleave", True):
        # DeepSeek's export pairs adjacent RoPE dims (rope_interleave, its checkpoints' layout): a
        # checkpoint that rotates halves comes back with its RoPE rows 0..r/2-1 at the even rows
        assert json.loads((out / "config.json").read_text())["rope_interleave"] is True
        r = cfg.mla_rope_dim
        for n in [n for n in original if n.endswith(("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight"))]:
            w = original[n].reshape(-1, cfg.mla_nope_dim + r, original[n].shape[-1]) if "q_" in n else original[n]
            rope = w[..., -r:, :].copy()
            w[..., -r:, :][..., 0::2, :], w[..., -r:, :][..., 1::2, :] = rope[..., :r // 2, :], rope[..., r // 2:, :]
            original[n] = w.reshape(original[n].shape)
    assert set(exported) == set(original)
    for n in original:
        np.testing.assert_array_equal(exported[n], original[n], err_msg=n)


def test_bfloat16_load_and_roundtrip(tmp_path, mesh):
    model = F.build_model("gptoss_odd", seed=3)
    directory = F.save_model(model, tmp_path / "hf")
    cfg, params = load_hf(directory, mesh, dtype="bfloat16")
    assert cfg.param_dtype == cfg.compute_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("bfloat16")}
    # The cast is round-to-nearest-even, as torch's .to(torch.bfloat16).
    ref = model.model.layers[1].mlp.experts.down_proj.detach().to(torch.bfloat16)
    np.testing.assert_array_equal(np.asarray(params["layers"]["moe"]["w_down"][1]).view(np.uint16),
                                  ref.view(torch.int16).numpy().view(np.uint16))
    out = save_hf(cfg, params, tmp_path / "bf16")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    _, params2 = load_hf(out, mesh)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        assert y.dtype == np.dtype("bfloat16")
        np.testing.assert_array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))


@pytest.mark.parametrize("fixture", ["glm4_moe_groups", "deepseek_v3_mla", "deepseek_v2_lite"])
def test_router_stays_fp32_in_a_bfloat16_model_both_ways(tmp_path, mesh, fixture):
    """GLM's and DeepSeek's router weight and (sigmoid routing's) e_score_correction_bias, which
    transformers keeps in fp32 (`_keep_in_fp32_modules_strict`): a bf16 load keeps them exact (the
    sigmoid scores the bias shifts differ by less than bf16 resolves) and exports them as F32;
    the rest is bf16."""
    from safetensors import safe_open
    model = F.build_model(fixture, seed=2)
    directory = F.save_model(model, tmp_path / "hf")
    cfg, params = load_hf(directory, mesh, dtype="bfloat16")
    moe, gate = params["layers"]["moe"], model.model.layers[1].mlp.gate
    assert cfg.router_fp32 and moe["w_up"].dtype == np.dtype("bfloat16")
    kept = {"model.layers.1.mlp.gate.weight": (moe["router"], gate.weight.detach().numpy().T)}
    if cfg.router == "sigmoid_topk":
        kept["model.layers.1.mlp.gate.e_score_correction_bias"] = (moe["score_bias"],
                                                                    gate.e_score_correction_bias.numpy())
    for ours, theirs in kept.values():
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(ours[0]), theirs)
    out = save_hf(cfg, params, tmp_path / "bf16")
    with safe_open(str(out / "model.safetensors"), "np") as f:
        for name, (ours, _) in kept.items():
            assert f.get_slice(name).get_dtype() == "F32"
            np.testing.assert_array_equal(f.get_tensor(name), np.asarray(ours[0]).T if ours.ndim == 3 else ours[0])
        assert f.get_slice("model.layers.1.mlp.experts.0.up_proj.weight").get_dtype() == "BF16"


def test_longrope_takes_the_long_factors_from_the_original_length_on_as_transformers_does(tmp_path, mesh):
    """Phi-3.5 / Phi-4-mini: the short factors while every position of the call is below
    original_max_position_embeddings (16 here), the long ones once one reaches it."""
    model = F.build_model("phi4_mini_like")
    cfg, params = load_hf(F.save_model(model, tmp_path / "hf"), mesh)
    assert (cfg.rope_type, cfg.rope_original_max_len, cfg.rope_partial_factor) == ("longrope", 16, 0.75)
    for seq in (16, 17, 24):
        tokens = F.tokens_for(model.config.vocab_size, seq=seq)
        ours = np.asarray(S.forward(cfg, params, tokens))
        assert np.abs(ours - F.hf_logits(model, tokens)).max() <= 1e-4, seq
    short_only = cfg.replace(rope_long_factor=cfg.rope_short_factor)
    assert np.abs(np.asarray(S.forward(short_only, params, tokens)) - ours).max() > 0.1   # the switch is real


def test_the_language_model_of_a_multimodal_gemma3_loads_and_exports_as_a_text_model(tmp_path, mesh):
    """Gemma 3 4B and up are Gemma3ForConditionalGeneration: the language model's tensors
    (`language_model.model.*`) load, the vision tower is left unread, logits equal the multimodal
    model's on text, and the export is a Gemma3ForCausalLM with the same logits."""
    import transformers
    text = dict(vocab_size=83, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
                max_position_embeddings=128, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=82, boi_token_index=80, eoi_token_index=81)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    F.randomize_(model, seed=3)
    model.tie_weights()
    model.save_pretrained(tmp_path / "hf")
    names = CheckpointFiles(tmp_path / "hf").tensors
    assert any(n.startswith("vision_tower.") for n in names) and "language_model.model.embed_tokens.weight" in names
    cfg, params = load_hf(tmp_path / "hf", mesh)
    assert cfg.family == "gemma3_text" and cfg.layer_types == ("sliding", "full", "sliding")
    tokens = F.tokens_for(80)   # no image tokens
    ref = F.hf_logits(model, tokens)
    ours = np.asarray(S.forward(cfg, params, tokens))
    assert np.abs(ours - ref).max() <= 1e-4
    save_hf(cfg, params, tmp_path / "out")
    text_model = F.load_transformers(tmp_path / "out")
    assert type(text_model).__name__ == "Gemma3ForCausalLM"
    assert np.abs(F.hf_logits(text_model, tokens) - ref).max() <= 1e-4


def test_a_latent_attention_model_built_here_exports_to_transformers(tmp_path, mesh):
    """A DeepSeek-V3-like model made with our config (router in the param dtype, the rope rows in
    our halves layout) exports in DeepSeek's layout: transformers computes our logits."""
    cfg = TINY_DEEPSEEK
    params = randomize(S.init_params(cfg, mesh, seed=0), seed=3, scale=0.2)
    model = F.load_transformers(save_hf(cfg, params, tmp_path / "export"))
    assert model.config.rope_interleave and model.config.q_lora_rank == cfg.mla_q_rank
    tokens = F.tokens_for(cfg.vocab_size, seq=20)
    assert np.abs(np.asarray(S.forward(cfg, params, tokens)) - F.hf_logits(model, tokens)).max() <= 1e-4
