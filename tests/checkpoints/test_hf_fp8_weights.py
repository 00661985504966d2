"""FP8 checkpoints, dequantised on load: DeepSeek-V3's block scales (`quant_method: "fp8"`) and
compressed-tensors' float-quantized format (GLM-4.5-FP8, llm-compressor's FP8-dynamic releases).

The reference quantiser and dequantiser here are written tile by tile from the formats'
definitions, independent of the library. Transformers' own loaders (which dequantise on a machine
without a GPU; the compressed-tensors package for its format) are the outside reference.
"""
import json
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import sfrrl_jax as S
from sfrrl_jax.checkpoints.hf import CheckpointError, dequantize_fp8, load_hf, save_hf
from sfrrl_jax.checkpoints.hf.fp8_weights import Fp8Scheme, Fp8WeightFiles
from sfrrl_jax.checkpoints.hf.safetensors_io import CheckpointFiles, ShardedWriter

import hf_fixtures as F

E4M3_MAX = 448.0
# kept in bf16 by DeepSeek's and Qwen's FP8 releases: embeddings, norms, the router, the head
_KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "e_score_correction_bias")


def reference_quantize(w: np.ndarray, tile, scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """w [..., out, in] -> (float8_e4m3fn values, scales [..., ceil(out/tile[0]), ceil(in/tile[1])] in
    `scale_dtype`): each tile divided by its stored scale, which maps its largest magnitude to
    e4m3's largest, 448."""
    bo, bi = tile
    rows, cols = w.shape[-2:]
    grid = w.shape[:-2] + (-(-rows // bo), -(-cols // bi))
    q, scale = np.zeros(w.shape, ml_dtypes.float8_e4m3fn), np.ones(grid, scale_dtype)
    for lead in np.ndindex(*w.shape[:-2]):
        for i in range(grid[-2]):
            for j in range(grid[-1]):
                at = lead + (slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi))
                peak = np.abs(w[at].astype(np.float32)).max()
                scale[lead + (i, j)] = peak / E4M3_MAX if peak > 0 else 1.0
                q[at] = (w[at].astype(np.float32) / np.float32(scale[lead + (i, j)])).astype(q.dtype)
    return q, scale


def reference_dequantize(q: np.ndarray, scale: np.ndarray, tile) -> np.ndarray:
    bo, bi = tile
    out = np.empty(q.shape, np.float32)
    for index in np.ndindex(*q.shape):
        *lead, r, c = index
        out[index] = np.float32(q[index]) * np.float32(scale[tuple(lead) + (r // bo, c // bi)])
    return out


def compressed_tensors_config(weights: dict) -> dict:
    """quantization_config as llm-compressor writes an FP8-dynamic model's (GLM-4.5-FP8's shape)."""
    return {"config_groups": {"group_0": {
        "input_activations": {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "float"},
        "output_activations": None, "targets": ["Linear"],
        "weights": {"dynamic": False, "num_bits": 8, "observer": "minmax", "symmetric": True, "type": "float",
                    **weights}}},
        "format": "float-quantized", "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed"}


_STRATEGY_TILE = {"tensor": (None, None), "channel": (1, None), "group": (1, 6), "block": (8, 16)}


def quantize_directory(model, directory, block=None, strategy=None) -> dict:
    """save_pretrained, then every linear weight but the kept ones as FP8: with `block`, DeepSeek's
    float32 `weight_scale_inv` tiles; with `strategy`, compressed-tensors' bf16 `weight_scale`.
    Returns {name: the dense float32 value each quantised weight stands for}."""
    F.save_model(model, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    dense = {}
    for name in sorted(tensors):
        w = tensors[name]
        if w.ndim < 2 or any(k in name for k in _KEPT):
            continue
        if block:
            q, scale = reference_quantize(w, block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            dense[name] = reference_dequantize(q, scale, block)
        else:
            rows, cols = _STRATEGY_TILE[strategy]
            tile = (rows or w.shape[-2], cols or w.shape[-1])
            q, scale = reference_quantize(w, tile, ml_dtypes.bfloat16)
            tensors[name] = q
            tensors[name + "_scale"] = scale.reshape(1) if strategy == "tensor" else scale   # as published
            dense[name] = reference_dequantize(q, scale, tile)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    rows, cols = _STRATEGY_TILE.get(strategy, (None, None))
    extra = {"group": {"group_size": cols}, "block": {"block_structure": [rows, cols]}}.get(strategy, {})
    config["quantization_config"] = (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
        if block else compressed_tensors_config({"strategy": strategy, **extra}))
    (directory / "config.json").write_text(json.dumps(config))
    return dense


def read_all(directory) -> dict:
    """Every tensor of a checkpoint (safetensors' numpy reader has no FP8 dtypes)."""
    files = CheckpointFiles(directory)
    return {n: files.read(n) for n in files.tensors}


def dense_twin(directory, dense, target):
    """The same checkpoint with the quantised weights written as their float32 values."""
    tensors = {n: t for n, t in read_all(directory).items() if not n.endswith(("_scale_inv", "_scale"))}
    tensors.update(dense)
    target.mkdir()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def mesh():
    return S.make_mesh(data=2, expert=4)


def _leaves(params):
    return {"/".join(p): np.asarray(v) for p, v in S.checkpoints.hf.loader.flatten_tree(params)}


def assert_loads_alike(a, b, mesh, dtypes=(None,)):
    """load_hf of directories a and b gives bit-identical params, in each of `dtypes`."""
    for dtype in dtypes:
        ours, theirs = _leaves(load_hf(a, mesh, dtype=dtype)[1]), _leaves(load_hf(b, mesh, dtype=dtype)[1])
        assert ours.keys() == theirs.keys()
        for path, value in ours.items():
            assert value.dtype == theirs[path].dtype, path
            np.testing.assert_array_equal(value, theirs[path], err_msg=path)


def _experts_fused(state: dict, name: str, f: int):
    """transformers' in-memory tensor for HF name `name`: it holds experts fused, down_proj
    [E, D, F] and gate_up_proj [E, 2F, D]; `f` is the expert's rows (F, or D for down_proj)."""
    expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
    if not expert:
        return state[name]
    prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
    if proj == "down":
        return state[prefix + ".down_proj"][e]
    gate_up = state[prefix + ".gate_up_proj"][e]
    return gate_up[:f] if proj == "gate" else gate_up[f:]


def test_dequantize_matches_the_format_reference():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (3, 13, 21), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C                  # e4m3fn's NaN codes are not weights
    codes.reshape(-1)[:2] = (0x7E, 0xFE)                  # +-448
    q = codes.view(ml_dtypes.float8_e4m3fn)
    block = (4, 8)                                        # neither divides: the last tiles are cut short
    scale = rng.uniform(1e-4, 3.0, (3, 4, 3)).astype(np.float32)
    ours = dequantize_fp8(q, scale, block)
    assert ours.dtype == np.float32 and ours.shape == (3, 13, 21)
    np.testing.assert_array_equal(ours, reference_dequantize(q, scale, block))
    with pytest.raises(ValueError, match=r"needs scales of shape \(3, 4, 3\), got \(3, 4, 2\)"):
        dequantize_fp8(q, scale[..., :2], block)


def test_reads_of_rows_and_every_scale_dtype(tmp_path):
    rng = np.random.default_rng(1)
    block = (4, 8)
    w2, w3 = rng.normal(size=(13, 21)).astype(np.float32), rng.normal(size=(5, 9, 16)).astype(np.float32)
    q2, s2 = reference_quantize(w2, block)
    q3, s3 = reference_quantize(w3, block)
    s2 = 2.0 ** np.round(np.log2(s2))                     # powers of two, exact in UE8M0 (DeepSeek-V3.1)
    specs = {"a.weight": q2, "a.weight_scale_inv": s2.astype(ml_dtypes.float8_e8m0fnu),
             "experts.down_proj": q3, "experts.down_proj_scale_inv": s3.astype(ml_dtypes.bfloat16),
             "norm.weight": np.ones(7, np.float32)}
    writer = ShardedWriter(tmp_path, [(n, a.shape, S.checkpoints.hf.safetensors_io.dtype_code(a.dtype))
                                      for n, a in specs.items()], 1 << 30)
    for n, a in specs.items():
        writer.write(n, a)
    writer.finish()
    files = Fp8WeightFiles(CheckpointFiles(tmp_path), Fp8Scheme("_scale_inv", block))
    assert sorted(files.tensors) == ["a.weight", "experts.down_proj", "norm.weight"]
    assert (files.tensors["a.weight"].dtype, files.tensors["a.weight"].shape) == ("F32", (13, 21))
    full2 = files.read("a.weight")
    np.testing.assert_array_equal(full2, reference_dequantize(q2, s2, block))
    full3 = files.read("experts.down_proj")
    np.testing.assert_array_equal(full3, reference_dequantize(q3, s3.astype(ml_dtypes.bfloat16).astype(np.float32),
                                                              block))
    for rows in (slice(0, 4), slice(3, 9), slice(5, 13), slice(12, 13)):   # within, across, to the cut tile
        np.testing.assert_array_equal(files.read("a.weight", rows), full2[rows])
    np.testing.assert_array_equal(files.read("experts.down_proj", slice(1, 3)), full3[1:3])
    np.testing.assert_array_equal(files.read("norm.weight"), np.ones(7, np.float32))


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    """DeepSeek-V3 in small, every linear FP8 with 2x2 tiles (transformers' dequantiser needs the
    block to divide each dim); its transformers model loaded from the FP8 files."""
    model = F.build_model("deepseek_v3_mla", seed=7)
    directory = tmp_path_factory.mktemp("fp8") / "hf"
    dense = quantize_directory(model, directory, (2, 2))
    tokens = F.tokens_for(model.config.vocab_size, seed=2)
    theirs = F.load_transformers(directory)
    return dict(dir=directory, dense=dense, tokens=tokens, theirs=theirs, ref=F.hf_logits(theirs, tokens))


def test_transformers_dequantises_to_the_format_reference(deepseek_fp8):
    state = {n: t.numpy() for n, t in deepseek_fp8["theirs"].state_dict().items()}
    assert len(deepseek_fp8["dense"]) > 20
    for name, value in deepseek_fp8["dense"].items():
        np.testing.assert_array_equal(_experts_fused(state, name, value.shape[0]), value, err_msg=name)


def test_load_fp8_deepseek_v3_matches_transformers_and_a_dense_checkpoint(deepseek_fp8, mesh, tmp_path):
    cfg, params = load_hf(deepseek_fp8["dir"], mesh)
    ours = np.asarray(S.forward(cfg, params, deepseek_fp8["tokens"]))
    assert np.abs(ours - deepseek_fp8["ref"]).max() <= 1e-4
    np.testing.assert_array_equal(ours.argmax(-1), deepseek_fp8["ref"].argmax(-1))
    # exactly the params of the same weights stored dense
    assert_loads_alike(deepseek_fp8["dir"], dense_twin(deepseek_fp8["dir"], deepseek_fp8["dense"], tmp_path / "dense"),
                       mesh)
    # Kimi K2's checkpoints are these, under model_type kimi_k2: the same config and params
    kimi = shutil.copytree(deepseek_fp8["dir"], tmp_path / "kimi")
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    kimi_cfg, _ = load_hf(kimi, mesh)
    assert kimi_cfg == cfg.replace(name=kimi_cfg.name) and kimi_cfg.family == "deepseek_v3"
    assert_loads_alike(kimi, deepseek_fp8["dir"], mesh)
    # Export writes the dense weights and no quantization_config; transformers reads them back.
    out = save_hf(cfg, params, tmp_path / "export")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not any(n.endswith("_scale_inv") for n in load_file(str(out / "model.safetensors")))
    back = F.hf_logits(F.load_transformers(out), deepseek_fp8["tokens"])
    assert np.abs(back - deepseek_fp8["ref"]).max() <= 1e-4


def test_fp8_moe_with_cut_tiles_equals_its_dense_twin_expert_sharded(mesh, tmp_path):
    """Qwen3-MoE, experts one tensor each, tiles of 8x16 that divide no dim: the load (each device's
    experts read alone) equals the dense checkpoint's, in float32 and in bfloat16."""
    model = F.build_model("qwen3_gqa3", seed=4)
    dense = quantize_directory(model, tmp_path / "fp8", (8, 16))
    assert_loads_alike(tmp_path / "fp8", dense_twin(tmp_path / "fp8", dense, tmp_path / "dense"), mesh,
                       (None, "bfloat16"))



@pytest.mark.parametrize("fixture, strategy", [("glm4_moe_groups", "tensor"), ("glm4_moe_groups", "channel"),
                                               ("qwen3_dense", "group"), ("qwen3_dense", "block")])
def test_compressed_tensors_fp8_equals_its_dense_twin_and_the_package(fixture, strategy, mesh, tmp_path):
    """bf16 scales per tensor, output channel, group of 6 inputs or 8x16 block (cut at the edges).
    GLM-4.5 in small (GLM-4.5-FP8 is a compressed-tensors release), experts one tensor each; a
    dense Qwen3 for groups and blocks (transformers' merge of per-expert tensors mis-broadcasts
    group scales)."""
    from transformers import CompressedTensorsConfig
    model = F.build_model(fixture, seed=2)
    dense = quantize_directory(model, tmp_path / "fp8", strategy=strategy)
    assert_loads_alike(tmp_path / "fp8", dense_twin(tmp_path / "fp8", dense, tmp_path / "dense"), mesh,
                       (None, "bfloat16"))
    # compressed-tensors' own dequantisation multiplies in the scale's dtype (bf16): our bf16 values
    _, cls = F.FAMILY_CLASSES[F.CONFIGS[fixture][0]]
    package = cls.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, attn_implementation="eager",
                                  quantization_config=CompressedTensorsConfig(dequantize=True))
    state = {n: t.float().numpy() for n, t in package.state_dict().items()}
    for name, value in dense.items():
        np.testing.assert_array_equal(_experts_fused(state, name, value.shape[0]),
                                      value.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=name)


@pytest.fixture(scope="module")
def small_fp8(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fp8_small") / "hf"
    quantize_directory(F.build_model("qwen3_dense", seed=1), directory, (4, 4))
    return directory


_Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(_Q + "_scale_inv"), rf"FP8 tensor '{_Q}' has no scale '{_Q}_scale_inv'"),
    (lambda t: t.update({_Q + "_scale_inv": t[_Q + "_scale_inv"][:, :-1]}),
     rf"scale '{_Q}_scale_inv' has shape \(15, 8\); weight '{_Q}' \(60, 36\) needs \(15, 9\)"),
    (lambda t: t.update({_Q: t[_Q].astype(np.float32)}), rf"tensor '{_Q}' has a scale but dtype F32, expected F8_E4M3"),
    (lambda t: t.update({_Q + "_scale_inv": t[_Q + "_scale_inv"].astype(np.float16)}),
     rf"scale '{_Q}_scale_inv': dtype F16, expected one of \['F32', 'BF16', 'F8_E8M0'\]"),
    (lambda t: t.pop(_Q), rf"scale '{_Q}_scale_inv' has no weight '{_Q}'"),
])
def test_bad_fp8_tensors_are_named(small_fp8, mesh, tmp_path, edit, message):
    directory = shutil.copytree(small_fp8, tmp_path / "hf")
    tensors = read_all(directory)
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_hf(directory, mesh)


def _with_group(quant: dict, key: str, value) -> dict:
    """quant with group_0's `key` set to value, or (for key 'group_1') a second group."""
    quant = json.loads(json.dumps(quant))
    if key == "group_1":
        quant["config_groups"]["group_1"] = value
    else:
        quant["config_groups"]["group_0"][key] = value
    return quant


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method='awq' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [4, 4], "activation_scheme": "static"},
     r"activation_scheme='static' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [4, 4], "fmt": "e5m2"}, r"fmt='e5m2' is not supported"),
    ({"quant_method": "fp8"}, r"weight_block_size=None must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, r"weight_block_size=\[128, 0\] must be"),
    ({**compressed_tensors_config({"strategy": "channel"}), "format": "pack-quantized"},
     r"format='pack-quantized' is not supported"),
    ({**compressed_tensors_config({"strategy": "channel"}), "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
     r"kv_cache_scheme=.* is not supported"),
    ({**compressed_tensors_config({"strategy": "channel"}), "transform_config": {"config_groups": {"u": {}}}},
     r"transform_config=.* is not supported"),
    (compressed_tensors_config({"strategy": "channel", "type": "int"}),
     r"config_groups.group_0.weights.type='int' is not supported"),
    (compressed_tensors_config({"strategy": "group"}), r"config_groups.group_0.weights.strategy='group' is not"),
    (_with_group(compressed_tensors_config({"strategy": "channel"}), "input_activations",
                 {"dynamic": False, "num_bits": 8, "strategy": "tensor", "type": "float"}),
     r"config_groups.group_0.input_activations=.* is not supported \(supported: none, or dynamic input"),
    (_with_group(compressed_tensors_config({"strategy": "channel"}), "group_1",
                 compressed_tensors_config({"strategy": "tensor"})["config_groups"]["group_0"]),
     r"config_groups scale weights in 2 ways"),
])
def test_unsupported_quantization_configs_are_named(small_fp8, mesh, tmp_path, quant, message):
    directory = shutil.copytree(small_fp8, tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quant
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config.*" + message):
        load_hf(directory, mesh)

