"""MXFP4 expert weights (as published GPT-OSS checkpoints store them): dequantisation and loading.

The reference dequantiser in hf_fixtures is written element by element from the format
definition; the library's vectorised one must agree with it, and with transformers' own.
"""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import sfrrl_jax as S
from sfrrl_jax.checkpoints.hf import CheckpointError, dequantize_mxfp4, load_hf, save_hf

import hf_fixtures as F


@pytest.fixture(scope="module")
def mesh():
    return S.make_mesh(data=2, expert=4)


def _random_packed(rng, lead=(3, 5), groups=2):
    blocks = rng.integers(0, 256, (*lead, groups, 16), dtype=np.uint8)
    blocks.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)  # every byte value occurs
    scales = rng.integers(110, 145, (*lead, groups), dtype=np.uint8)
    scales.reshape(-1)[:3] = (127, 0, 200)  # unit scale, the smallest and a large exponent
    return blocks, scales


def test_dequantize_matches_the_format_reference():
    blocks, scales = _random_packed(np.random.default_rng(0))
    ours = dequantize_mxfp4(blocks, scales)
    ref = F.reference_dequantize(blocks, scales)
    assert ours.dtype == np.float32 and ours.shape == (3, 5, 64)
    np.testing.assert_array_equal(ours, ref.astype(np.float32))
    np.testing.assert_array_equal(np.signbit(ours), np.signbit(ref))  # -0.0 codes stay negative zero


def test_dequantize_matches_transformers():
    blocks, scales = _random_packed(np.random.default_rng(1), lead=(4, 6), groups=3)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32).numpy()  # [E, in, out]
    np.testing.assert_array_equal(np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2), theirs)


def test_reference_quantizer_is_exact_on_representable_values():
    rng = np.random.default_rng(2)
    mags = np.array(F.E2M1_MAGNITUDES)
    values = rng.choice(mags, (4, 64)) * rng.choice([-1, 1], (4, 64))
    values[:, 0] = 6.0  # each block's max sets the scale exactly
    values[:, 32] = -6.0
    values *= 2.0 ** rng.integers(-5, 5, (4, 1))
    blocks, scales = F.reference_quantize(values)
    np.testing.assert_array_equal(F.reference_dequantize(blocks, scales), values)


def _quantize_directory(model, directory):
    """save_pretrained, then replace the dense experts by *_blocks/*_scales (gpt-oss layout)."""
    F.save_model(model, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    dequantized = {}
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = tensors.pop(name)                                 # [E, in, out]
            blocks, scales = F.reference_quantize(np.swapaxes(w, 1, 2))  # quantised along `in`
            e, n_in, n_out = w.shape
            assert (blocks.shape, scales.shape) == F.expected_mxfp4_shapes(e, n_out, n_in)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            dequantized[name] = np.swapaxes(F.reference_dequantize(blocks, scales), 1, 2).astype(np.float32)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    model = F.build_model("gptoss_gqa4", seed=5)
    directory = tmp_path_factory.mktemp("mxfp4") / "hf"
    dequantized = _quantize_directory(model, directory)
    # The reference model: the same network with the experts set to their dequantised values.
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                getattr(block.mlp.experts, proj).copy_(
                    torch.from_numpy(dequantized[f"model.layers.{layer}.mlp.experts.{proj}"]))
    tokens = F.tokens_for(model.config.vocab_size, seed=4)
    return dict(dir=directory, deq=dequantized, tokens=tokens, ref=F.hf_logits(model, tokens))


def test_load_mxfp4_gpt_oss_matches_dequantized_transformers(quantized, mesh, tmp_path):
    cfg, params = load_hf(quantized["dir"], mesh)
    moe = params["layers"]["moe"]
    for layer in range(cfg.n_layers):
        gate_up = quantized["deq"][f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(np.asarray(moe["w_gate"][layer]), gate_up[..., 0::2])
        np.testing.assert_array_equal(np.asarray(moe["w_up"][layer]), gate_up[..., 1::2])
        np.testing.assert_array_equal(np.asarray(moe["w_down"][layer]),
                                      quantized["deq"][f"model.layers.{layer}.mlp.experts.down_proj"])
    ours = np.asarray(S.forward(cfg, params, quantized["tokens"]))
    assert np.abs(ours - quantized["ref"]).max() <= 1e-4
    np.testing.assert_array_equal(ours.argmax(-1), quantized["ref"].argmax(-1))
    # Export writes dense experts; transformers loads them and computes the very same logits.
    out = save_hf(cfg, params, tmp_path / "dense")
    assert not any(n.endswith("_blocks") for n in load_file(str(out / "model.safetensors")))
    np.testing.assert_array_equal(F.hf_logits(F.load_transformers(out), quantized["tokens"]), quantized["ref"])


def test_mxfp4_values_are_exact_in_bfloat16(quantized, mesh):
    _, params = load_hf(quantized["dir"], mesh, dtype="bfloat16")
    w = np.asarray(params["layers"]["moe"]["w_down"][1])
    assert w.dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(w.astype(np.float32), quantized["deq"]["model.layers.1.mlp.experts.down_proj"])


@pytest.mark.parametrize("edit, message", [
    (lambda t, n: t.update({n + "_blocks": t[n + "_blocks"][:, :, :1]}),
     r"'model.layers.0.mlp.experts.gate_up_proj_blocks' in model.safetensors: expected shape \(8, 64, 2, 16\), "
     r"found \(8, 64, 1, 16\)"),
    (lambda t, n: t.update({n + "_scales": t[n + "_scales"].astype(np.float32)}),
     r"'model.layers.0.mlp.experts.gate_up_proj_scales': dtype F32, expected U8"),
    (lambda t, n: t.pop(n + "_scales"),
     r"missing tensor 'model.layers.0.mlp.experts.gate_up_proj_scales' \(expected shape \(8, 64, 2\)\)"),
])
def test_bad_mxfp4_tensors_are_named(quantized, mesh, tmp_path, edit, message):
    directory = shutil.copytree(quantized["dir"], tmp_path / "hf")
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors, "model.layers.0.mlp.experts.gate_up_proj")
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_hf(directory, mesh)
