"""PEFT LoRA directories <-> our LoraAdapter, against peft 0.22 on transformers: an adapter peft made
and applied gives the logits our forward gives with `load_adapter` of its directory, and one we
made (`save_adapter`) gives ours when `PeftModel.from_pretrained` applies it; `load_adapter` of
`save_adapter` is the adapter again, bit for bit. Dense (all seven targets), Qwen3-MoE (peft's fused
`target_parameters` experts and router; our per-expert and fused writes), Mixtral (per-expert
w1/w3/w2, read back from what peft saves after converting them), Phi-3 (fused qkv_proj /
gate_up_proj), DeepSeek-V3's latent attention and GPT-OSS (fused [E, in, out] experts, gate / up
interleaved). Unsupported PEFT features are refused by name."""
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import sfrrl_jax as S
from sfrrl_jax.checkpoints.hf import config_from_hf, load_adapter, load_hf, save_adapter
from sfrrl_jax.models.lora import LoraAdapter, LoraConfig, init_adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))
import hf_fixtures as F  # noqa: E402

peft = pytest.importorskip("peft")

ATOL = 1e-4


@pytest.fixture(scope="module")
def mesh():
    return S.make_mesh(data=2, expert=2, tensor=2)


def _base(name, tmp_path, mesh):
    """(HF model, our cfg, our params, tokens) of the tiny fixture `name`, loaded with load_hf."""
    model = F.build_model(name)
    cfg, params = load_hf(F.save_model(model, tmp_path / "base"), mesh)
    return model, cfg, params, F.tokens_for(model.config.vocab_size)


def _peft_adapter(name, out_dir, seed=0, **lora_kwargs):
    """A peft-made adapter on a fresh fixture model, every LoRA tensor drawn (B nonzero), saved by
    peft; returns the PEFT model (to compute its logits)."""
    model = peft.get_peft_model(F.build_model(name), peft.LoraConfig(**lora_kwargs)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    return model


def _peft_logits(name, adapter_dir, tokens):
    """Logits of a fresh fixture model with the adapter directory applied by peft."""
    return F.hf_logits(peft.PeftModel.from_pretrained(F.build_model(name), adapter_dir).eval(), tokens)


def _ours(cfg, params, tokens, adapter):
    return np.asarray(S.forward(cfg, params, tokens, adapter=adapter))


def _assert_same_adapter(got: LoraAdapter, want: LoraAdapter):
    assert got.config == want.config
    flat_got, flat_want = (dict(jax.tree_util.tree_flatten_with_path(x.weights)[0]) for x in (got, want))
    assert flat_got.keys() == flat_want.keys()
    for path, x in flat_want.items():
        assert flat_got[path].sharding.is_equivalent_to(x.sharding, x.ndim), path
        np.testing.assert_array_equal(np.asarray(flat_got[path]), np.asarray(x), err_msg=jax.tree_util.keystr(path))


def _random_b(adapter, seed=1, scale=0.3):
    """The adapter with every B drawn too (B = 0 at init would make the parity checks vacuous)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(adapter.weights)
    keys = jax.random.split(jax.random.key(seed), len(flat))
    out = [jax.device_put(scale * jax.random.normal(k, x.shape, x.dtype), x.sharding)
           if jax.tree_util.keystr(p).endswith("['b']") else x for (p, x), k in zip(flat, keys)]
    return LoraAdapter(jax.tree.unflatten(treedef, out), adapter.config)


def test_dense_llama_all_seven_targets_both_ways(tmp_path, mesh):
    """A rank_pattern / alpha_pattern of the same scale: down_proj's rank-2 pairs are zero-padded to 4."""
    name = "llama_gqa_tied"
    model, cfg, params, tokens = _base(name, tmp_path, mesh)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = _peft_adapter(name, tmp_path / "peft", r=4, lora_alpha=8, target_modules=targets,
                       rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 4})
    adapter = load_adapter(tmp_path / "peft", cfg, mesh)
    assert adapter.config == LoraConfig(rank=4, alpha=8.0, targets=tuple(targets))
    assert not np.any(np.asarray(adapter.weights["layers"]["mlp"]["w_down"]["b"])[:, 2:])   # the padding
    ref, ours = F.hf_logits(pm, tokens), _ours(cfg, params, tokens, adapter)
    assert np.abs(ref - F.hf_logits(model, tokens)).max() > 0.1          # the adapter matters
    assert np.abs(ours - ref).max() <= ATOL
    out = save_adapter(adapter, cfg, adapter.config, tmp_path / "ours")
    conf = json.loads((out / "adapter_config.json").read_text())
    assert (conf["peft_type"], conf["task_type"], conf["r"], conf["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    assert np.abs(_peft_logits(name, out, tokens) - ours).max() <= ATOL
    _assert_same_adapter(load_adapter(out, cfg, mesh), adapter)


def test_qwen3_moe_fused_experts_and_router_both_save_layouts(tmp_path, mesh):
    """peft's target_parameters layout (gate_up_proj's shared A copied to our gate and up pairs);
    written back per expert (v4 names, converted by peft) and fused (block form, rank 2r)."""
    name = "qwen3_gqa3"
    _, cfg, params, tokens = _base(name, tmp_path, mesh)
    pm = _peft_adapter(name, tmp_path / "peft", r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"])
    adapter = load_adapter(tmp_path / "peft", cfg, mesh)
    assert adapter.config.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_proj",
                                      "experts.up_proj", "experts.down_proj", "router")
    moe = adapter.weights["layers"]["moe"]
    assert moe["w_gate"]["a"].shape == (2, 8, 48, 2) and moe["w_gate"]["a"].sharding.spec[1] == "expert"
    np.testing.assert_array_equal(np.asarray(moe["w_gate"]["a"]), np.asarray(moe["w_up"]["a"]))   # the shared A
    ours = _ours(cfg, params, tokens, adapter)
    assert np.abs(ours - F.hf_logits(pm, tokens)).max() <= ATOL
    for layout in ("per_expert", "fused"):
        out = save_adapter(adapter, cfg, tmp_path / layout, expert_layout=layout)
        keys = json.loads((out / "adapter_config.json").read_text())
        assert ("experts.gate_proj" in keys["target_modules"]) == (layout == "per_expert")
        assert np.abs(_peft_logits(name, out, tokens) - ours).max() <= ATOL, layout
        _assert_same_adapter(load_adapter(out, cfg, mesh), adapter)


def test_mixtral_per_expert_w1_w3_w2_round_trip_through_peft(tmp_path, mesh):
    """Ours (init_adapter + random B) -> per-expert `block_sparse_moe.experts.{e}.w1/w3/w2` -> peft
    (which fuses them) gives our logits; what peft then saves (fused, gate_up in block form) reads
    back as our adapter exactly."""
    name = "mixtral_gqa4"
    _, cfg, params, tokens = _base(name, tmp_path, mesh)
    lora = LoraConfig(rank=2, alpha=5.0, targets=("q_proj", "v_proj", "experts.gate_proj", "experts.up_proj",
                                                  "experts.down_proj", "router"))
    adapter = _random_b(init_adapter(cfg, lora, mesh, seed=3))
    ours = _ours(cfg, params, tokens, adapter)
    assert np.abs(ours - np.asarray(S.forward(cfg, params, tokens))).max() > 0.1
    out = save_adapter(adapter, cfg, lora, tmp_path / "ours")
    pm = peft.PeftModel.from_pretrained(F.build_model(name), out).eval()
    assert np.abs(F.hf_logits(pm, tokens) - ours).max() <= ATOL
    _assert_same_adapter(load_adapter(out, cfg, mesh), adapter)
    pm.save_pretrained(tmp_path / "resaved")
    resaved = json.loads((tmp_path / "resaved" / "adapter_config.json").read_text())
    assert set(resaved["rank_pattern"].values()) == {4}       # peft's own fused gate_up: rank 2r, block diagonal
    _assert_same_adapter(load_adapter(tmp_path / "resaved", cfg, mesh), adapter)


def test_phi3_fused_qkv_and_gate_up_with_rslora(tmp_path, mesh):
    """One HF pair on qkv_proj / gate_up_proj feeds our q, k, v (gate, up) pairs; ours go back in
    block form (rank 3r / 2r, alpha * sqrt(k) under rsLoRA) and peft applies them exactly."""
    name = "phi4_mini_like"
    _, cfg, params, tokens = _base(name, tmp_path, mesh)
    pm = _peft_adapter(name, tmp_path / "peft", r=2, lora_alpha=6, use_rslora=True,
                       target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    adapter = load_adapter(tmp_path / "peft", cfg, mesh)
    assert adapter.config.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ours = _ours(cfg, params, tokens, adapter)
    assert np.abs(ours - F.hf_logits(pm, tokens)).max() <= ATOL
    out = save_adapter(adapter, cfg, tmp_path / "ours")
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["rank_pattern"] == {r"self_attn\.qkv_proj": 6, r"mlp\.gate_up_proj": 4}
    assert np.abs(_peft_logits(name, out, tokens) - ours).max() <= ATOL
    _assert_same_adapter(load_adapter(out, cfg, mesh), adapter)


def test_deepseek_v3_latent_attention_rope_rows(tmp_path, mesh):
    """q_a_proj, q_b_proj, kv_a_proj_with_mqa (RoPE rows interleaved in HF, halves in ours), o_proj."""
    name = "deepseek_v3_mla"
    _, cfg, params, tokens = _base(name, tmp_path, mesh)
    pm = _peft_adapter(name, tmp_path / "peft", r=3, lora_alpha=4,
                       target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"])
    adapter = load_adapter(tmp_path / "peft", cfg, mesh)
    assert set(adapter.config.targets) == {"q_a_proj", "q_b_proj", "kv_a_proj", "o_proj"}
    ours = _ours(cfg, params, tokens, adapter)
    assert np.abs(ours - F.hf_logits(pm, tokens)).max() <= ATOL
    out = save_adapter(adapter, cfg, tmp_path / "ours")
    assert np.abs(_peft_logits(name, out, tokens) - ours).max() <= ATOL
    _assert_same_adapter(load_adapter(out, cfg, mesh), adapter)



def test_gpt_oss_fused_interleaved_experts_router_and_attention_from_peft(tmp_path, mesh):
    """peft's target_parameters on GPT-OSS's [E, in, out] experts (param[e] += s (B_e A_e)^T): the
    shared gate_up A goes to our gate and up pairs, B's even rows (output columns) to the gate's,
    odd to the up's; the router is a parameter; attention Linears keep their biases and sinks."""
    name = "gptoss_odd"
    model, cfg, params, tokens = _base(name, tmp_path, mesh)
    pm = _peft_adapter(name, tmp_path / "peft", r=2, lora_alpha=6,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router.weight"])
    adapter = load_adapter(tmp_path / "peft", cfg, mesh)
    assert adapter.config.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_proj",
                                      "experts.up_proj", "experts.down_proj", "router")
    moe = adapter.weights["layers"]["moe"]
    np.testing.assert_array_equal(np.asarray(moe["w_gate"]["a"]), np.asarray(moe["w_up"]["a"]))   # the shared A
    with torch.no_grad():   # expert 1 of layer 0: B rows [2F, r*E], rank major; gate's the even rows
        b = pm.base_model.model.model.layers[0].mlp.experts.base_layer.lora_B["default"].weight.numpy()
    np.testing.assert_array_equal(np.asarray(moe["w_up"]["b"])[0, 1], b[1::2, 1::cfg.n_experts].T)
    ref, ours = F.hf_logits(pm, tokens), _ours(cfg, params, tokens, adapter)
    assert np.abs(ref - F.hf_logits(model, tokens)).max() > 0.1
    assert np.abs(ours - ref).max() <= ATOL


def test_gpt_oss_save_fused_block_form_through_peft(tmp_path, mesh):
    """Ours (separate gate / up pairs, rsLoRA) -> the fused layout, gate_up in block form (rank 2r,
    B's columns interleaved back) -> peft gives our logits; read back bit for bit; per_expert refused."""
    name = "gptoss_odd"
    _, cfg, params, tokens = _base(name, tmp_path, mesh)
    lora = LoraConfig(rank=2, alpha=3.0, use_rslora=True, targets=("q_proj", "o_proj", "experts.gate_proj",
                                                                     "experts.up_proj", "experts.down_proj", "router"))
    adapter = _random_b(init_adapter(cfg, lora, mesh, seed=4))
    ours = _ours(cfg, params, tokens, adapter)
    assert np.abs(ours - np.asarray(S.forward(cfg, params, tokens))).max() > 0.1
    with pytest.raises(ValueError, match="gpt_oss's experts are fused parameters"):
        save_adapter(adapter, cfg, tmp_path / "pe", expert_layout="per_expert")
    out = save_adapter(adapter, cfg, tmp_path / "ours")
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj", "router.weight"]
    assert conf["rank_pattern"] == {r"experts\.gate_up_proj": 4}
    assert np.abs(_peft_logits(name, out, tokens) - ours).max() <= ATOL
    _assert_same_adapter(load_adapter(out, cfg, mesh), adapter)

# -- refusals: hand-written directories on a tiny Llama (hidden 40, 4 heads of 10, 2 kv heads) -------

def _hand_dir(path, config=None, tensors=None, **extra):
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **(config or {}), **extra}
    if tensors is None:
        tensors = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{s}.weight":
                   np.ones((2, 40) if s == "A" else (40, 2), np.float32) for i in range(2) for s in "AB"}
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize("case,match", [
    (dict(use_dora=True), "use_dora=True"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(layers_to_transform=[0]), "layers_to_transform"),
    (dict(bias="all"), "bias='all'"),
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa' rewrites the base"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
    (dict(target_modules=None), "no target_modules"),
    (dict(target_modules=["q_proj", "lm_head"]), "'lm_head': LoRA on the LM head"),
    (dict(alpha_pattern={r"model\.layers\.1\.self_attn\.q_proj": 8}),
     r"scale 4.0 \(r=2, lora_alpha=8 from alpha_pattern"),
    (dict(rank_pattern={"q_proj": 3}), r"q_proj.lora_A.weight has shape \(2, 40\), expected \(3, 40\)"),
], ids=lambda x: x if isinstance(x, str) else next(iter(x)))
def test_unsupported_peft_features_are_refused_by_name(tmp_path, mesh, case, match):
    with pytest.raises(ValueError, match=match):
        load_adapter(_hand_dir(tmp_path / "a", case), _tiny_llama_cfg(), mesh)


def _tiny_llama_cfg():
    """The ModelConfig of the `llama_gqa_tied` fixture, without building the model."""
    family, kwargs = F.CONFIGS["llama_gqa_tied"]
    return config_from_hf(F.FAMILY_CLASSES[family][0](**kwargs).to_dict())


def test_bad_keys_shapes_and_files_are_refused_by_name(tmp_path, mesh):
    cfg = _tiny_llama_cfg()
    good = lambda i, s: np.ones((2, 40) if s == "A" else (40, 2), np.float32)   # noqa: E731
    q = "base_model.model.model.layers.{i}.self_attn.q_proj.lora_{s}.weight"
    both = {q.format(i=i, s=s): good(i, s) for i in range(2) for s in "AB"}
    cases = {
        "typo": ({**both, "base_model.model.model.layers.0.self_attn.q_prj.lora_A.weight": good(0, "A"),
                  "base_model.model.model.layers.0.self_attn.q_prj.lora_B.weight": good(0, "B")},
                 r"tensor base_model.model.model.layers.0.self_attn.q_prj.lora_A.weight maps to no weight"),
        "shape": ({**both, q.format(i=1, s="B"): np.ones((41, 2), np.float32)},
                  r"layers.1.self_attn.q_proj.lora_B.weight has shape \(41, 2\), expected \(40, 2\)"),
        "prefix": ({k.removeprefix("base_model.model."): v for k, v in both.items()}, "is not a LoRA pair's"),
        "dora": ({**both, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.ones(40)},
                 "DoRA's magnitude"),
        "one layer": ({k: v for k, v in both.items() if ".layers.0." in k},
                      r"has no base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"),
        "kv_b": ({**both, "base_model.model.model.layers.0.self_attn.kv_b_proj.lora_A.weight": good(0, "A"),
                  "base_model.model.model.layers.0.self_attn.kv_b_proj.lora_B.weight": good(0, "B")}, "kv_b_proj"),
    }
    for case, (tensors, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            load_adapter(_hand_dir(tmp_path / case.replace(" ", "_"), tensors=tensors), cfg, mesh)
    pickled = _hand_dir(tmp_path / "bin")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(ValueError, match="only adapter_model.bin.*safetensors"):
        load_adapter(pickled, cfg, mesh)
    # the writer: a lora_cfg other than the adapter's, and what the per-expert layout cannot say
    adapter = init_adapter(cfg, LoraConfig(rank=2), mesh)
    with pytest.raises(ValueError, match="differs from the adapter's own"):
        save_adapter(adapter, cfg, LoraConfig(rank=3), tmp_path / "w")
    moe_cfg = S.ModelConfig.preset("tiny-moe", family="qwen3_moe")
    gate_only = init_adapter(moe_cfg, LoraConfig(rank=2, targets=("experts.gate_proj",)), mesh)
    with pytest.raises(ValueError, match="experts.gate_proj alone; use expert_layout='fused'"):
        save_adapter(gate_only, moe_cfg, tmp_path / "w", expert_layout="per_expert")
    # by default the layout that can say it: fused
    cfg_written = json.loads((save_adapter(gate_only, moe_cfg, tmp_path / "g") / "adapter_config.json").read_text())
    assert cfg_written["target_parameters"]
