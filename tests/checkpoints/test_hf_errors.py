"""Bad HF checkpoints fail loudly, naming the family, the tensor, the shapes or the file."""
import json
import shutil
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import sfrrl_jax as S
from sfrrl_jax.checkpoints.hf import CheckpointError, HFConfigError, load_hf, save_hf
from sfrrl_jax.checkpoints.hf.safetensors_io import SafetensorsFile

import hf_fixtures as F

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"
UP_3 = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def mesh():
    return S.make_mesh(data=2, expert=4)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return F.save_model(F.build_model("qwen3_gqa3"), tmp_path_factory.mktemp("pristine") / "hf")


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A fresh, editable copy of the tiny Qwen3-MoE directory."""
    return shutil.copytree(pristine, tmp_path / "hf")


def _edit_tensors(directory, edit):
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(directory, **changes):
    file = directory / "config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def test_unsupported_family_names_model_type_and_supported_ones(ckpt, mesh):
    _edit_config(ckpt, model_type="falcon")
    with pytest.raises(HFConfigError) as e:
        load_hf(ckpt, mesh)
    msg = str(e.value)
    assert "'falcon'" in msg and all(f in msg for f in ("qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "llama",
                                                      "mistral", "qwen2", "qwen3"))
    # a MoE checkpoint that says it is a dense family: the MLP tensors it lacks are named
    _edit_config(ckpt, model_type="llama", intermediate_size=48)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.0.mlp.down_proj.weight'"):
        load_hf(ckpt, mesh)


def test_missing_tensor_is_named_with_its_expected_shape(ckpt, mesh):
    _edit_tensors(ckpt, lambda t: t.pop(UP_3))
    with pytest.raises(CheckpointError, match=rf"missing tensor '{UP_3}' \(expected shape \(20, 48\)\)"):
        load_hf(ckpt, mesh)


def test_wrong_shape_names_tensor_expected_and_found(ckpt, mesh):
    _edit_tensors(ckpt, lambda t: t.update({Q_PROJ: np.zeros((48, 40), np.float32)}))
    with pytest.raises(CheckpointError) as e:
        load_hf(ckpt, mesh)
    assert f"'{Q_PROJ}'" in str(e.value)
    assert "expected shape (48, 48), found (48, 40)" in str(e.value)


def test_extra_tensor_is_named(ckpt, mesh):
    name = "model.layers.0.mlp.shared_expert.gate_proj.weight"
    _edit_tensors(ckpt, lambda t: t.update({name: np.zeros((8, 48), np.float32)}))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor '{name}' with shape \(8, 48\)"):
        load_hf(ckpt, mesh)


def test_integer_weight_is_refused(ckpt, mesh):
    _edit_tensors(ckpt, lambda t: t.update({Q_PROJ: np.zeros((48, 48), np.int32)}))
    with pytest.raises(CheckpointError, match=rf"'{Q_PROJ}': dtype I32"):
        load_hf(ckpt, mesh)


def _rewrite_header(file, header_bytes, declared_len=None):
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    data = raw[8 + n:]
    length = len(header_bytes) if declared_len is None else declared_len
    file.write_bytes(struct.pack("<Q", length) + header_bytes + data)


@pytest.mark.parametrize("kind, message", [
    ("length", "header length 1099511627776 exceeds the file size"),
    ("json", "header is not valid UTF-8 JSON"),
    ("offsets", "do not fit shape"),
    ("dtype", "unknown dtype 'F12'"),
    ("tiny", "fewer than the 8-byte header length"),
])
def test_corrupt_safetensors_header_names_the_file(ckpt, mesh, kind, message):
    file = ckpt / "model.safetensors"
    info = SafetensorsFile(file).tensors
    base = min(i.begin for i in info.values())
    header = {n: {"dtype": i.dtype, "shape": list(i.shape), "data_offsets": [i.begin - base, i.end - base]}
              for n, i in info.items()}
    if kind == "length":
        _rewrite_header(file, json.dumps(header).encode(), declared_len=1 << 40)
    elif kind == "json":
        _rewrite_header(file, json.dumps(header).encode()[:-7])
    elif kind == "offsets":
        header[Q_PROJ]["data_offsets"][1] += 4
        _rewrite_header(file, json.dumps(header).encode())
    elif kind == "dtype":
        header[Q_PROJ]["dtype"] = "F12"
        _rewrite_header(file, json.dumps(header).encode())
    else:
        file.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError) as e:
        load_hf(ckpt, mesh)
    assert str(file) in str(e.value) and "corrupt safetensors file" in str(e.value)
    assert message in str(e.value)


def test_truncated_data_is_reported(ckpt, mesh):
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt safetensors file.*data_offsets"):
        load_hf(ckpt, mesh)


def test_index_pointing_at_a_missing_shard(ckpt, mesh):
    names = list(load_file(str(ckpt / "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[UP_3] = "model-00002-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"names file 'model-00002-of-00002.safetensors' \(for '{UP_3}'\)"):
        load_hf(ckpt, mesh)


@pytest.mark.parametrize("changes, message", [
    (dict(mlp_only_layers=[2]), "mlp_only_layers=[2] names layer(s) [2] outside [0, 2)"),
    (dict(mlp_only_layers=[-1]), "mlp_only_layers=[-1] names layer(s) [-1] outside"),
    (dict(mlp_only_layers="0"), "mlp_only_layers='0' must be a list"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0 must be an int >= 1"),
    (dict(mlp_only_layers=[0, 1]), "leaves no MoE layer"),
    (dict(decoder_sparse_step=3), "decoder_sparse_step=3 leaves no MoE layer"),
    (dict(mlp_only_layers=[0], intermediate_size=None), "lacks required key 'intermediate_size'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     "llama3 rope needs ['low_freq_factor', 'high_freq_factor']"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "rope_theta": 1e4, "beta_fast": 3.0}), "llama3 rope parameter(s) ['beta_fast']"),
    (dict(hidden_size=None), "lacks required key 'hidden_size'"),
    # values of the wrong type or range: named, never cast (int(2.5) would build 2 layers)
    (dict(num_hidden_layers=2.5), "num_hidden_layers=2.5 must be an integer"),
    (dict(num_hidden_layers=True), "num_hidden_layers=True must be an integer"),
    (dict(num_attention_heads=0), "num_attention_heads=0 must be >= 1"),
    (dict(vocab_size="97"), "vocab_size='97' must be an integer"),
    (dict(num_experts=0), "num_experts=0 must be >= 1"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings='yes' must be true or false"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps='1e-6' must be a number"),
    (dict(dtype="complex64"), "dtype 'complex64' is not supported"),
    (dict(rope_parameters="yarn"), "rope_parameters='yarn' must be an object"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": "4", "rope_theta": 1e4}), "factor='4' must be a number"),
])
def test_unsupported_variants_name_the_key(ckpt, mesh, changes, message):
    _edit_config(ckpt, **changes)
    with pytest.raises(HFConfigError) as e:
        load_hf(ckpt, mesh)
    assert message in str(e.value)


def test_dense_layers_the_checkpoint_lacks_are_named(ckpt, mesh):
    # mlp_only_layers is read: layer 1's dense MLP is expected, its experts are not
    _edit_config(ckpt, mlp_only_layers=[1])
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.down_proj.weight'"):
        load_hf(ckpt, mesh)


def test_unsupported_yarn_parameter(tmp_path, mesh):
    directory = F.save_model(F.build_model("gptoss_odd"), tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    # YaRN's own code names this; transformers does not (attention_factor, mscale are read)
    config["rope_parameters"]["extrapolation_factor"] = 1.3
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConfigError, match=r"yarn rope parameter\(s\) \['extrapolation_factor'\]"):
        load_hf(directory, mesh)


def test_no_config_and_no_weights(tmp_path, mesh, ckpt):
    with pytest.raises(HFConfigError, match="no config.json"):
        load_hf(tmp_path, mesh)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json and no"):
        load_hf(ckpt, mesh)


def test_mesh_that_cannot_split_the_experts(ckpt):
    mesh = S.make_mesh(data=1, expert=8)  # 8 experts split fine; make one that does not divide
    _edit_config(ckpt, num_experts=12, num_local_experts=12)
    with pytest.raises(ValueError, match="n_experts=12 is not divisible by the mesh's expert axis size 8"):
        load_hf(ckpt, mesh)


def test_save_hf_rejects_params_that_do_not_fit_the_config(ckpt, mesh, tmp_path):
    cfg, params = load_hf(ckpt, mesh)
    del params["layers"]["attn"]["q_norm"]
    with pytest.raises(CheckpointError, match=r"missing \['layers/attn/q_norm/scale'\]"):
        save_hf(cfg, params, tmp_path / "out")
    with pytest.raises(HFConfigError, match="attn_sinks"):
        save_hf(cfg.replace(attn_sinks=True), params, tmp_path / "out2")


@pytest.mark.parametrize("fixture", ["glm4_moe_groups", "deepseek_v3_mla", "minimax_m2_small"])
def test_multi_token_prediction_layers_are_not_read_but_other_extras_are_refused(tmp_path, mesh, fixture):
    """GLM-4.5's and DeepSeek-V3's checkpoints (MiniMax-M2's, by the same convention) carry their
    MTP module as layers past num_hidden_layers (transformers skips them): they load as the model
    without them; a stray tensor elsewhere is still named."""
    directory = F.save_model(F.build_model(fixture), tmp_path / "hf")
    cfg_before, params_before = load_hf(directory, mesh)
    shard = sorted(directory.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["model.layers.3.eh_proj.weight"] = np.ones((4, 8), np.float32)
    tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = np.ones((4, 8), np.float32)
    save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    cfg, params = load_hf(directory, mesh)
    assert cfg == cfg_before
    np.testing.assert_array_equal(np.asarray(params["layers"]["moe"]["score_bias"]),
                                  np.asarray(params_before["layers"]["moe"]["score_bias"]))
    tensors["model.layers.1.mlp.extra.weight"] = np.ones((2,), np.float32)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.1.mlp.extra.weight'"):
        load_hf(directory, mesh)
