"""ExperimentConfig.model_overrides with an HF directory: run-time fields (remat, a longer
max_seq_len, MoE chunking) apply on top of its config.json; fields that shape or define the
weights are refused, named; keys that are no ModelConfig field are refused with or without one."""
import pytest
import transformers

from sfrrl_jax.launch.runner import RUNTIME_MODEL_FIELDS, ExperimentConfig, resolve_model_config


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_tiny")
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def _config(tmp_path, hf_dir, overrides):
    return ExperimentConfig(run_dir=str(tmp_path), model=None, hf_path=str(hf_dir), model_overrides=overrides)


def test_run_time_overrides_apply_on_top_of_the_directory_config(tmp_path, hf_dir):
    plain, _ = resolve_model_config(_config(tmp_path, hf_dir, {}))
    cfg, where = resolve_model_config(_config(tmp_path, hf_dir, {"remat": "full", "max_seq_len": 4096,
                                                                 "grouped_matmul": "tiled"}))
    assert where.endswith("config.json")
    assert (plain.remat, plain.max_seq_len) == ("none", 1024)
    assert (cfg.remat, cfg.max_seq_len, cfg.grouped_matmul) == ("full", 4096, "tiled")
    assert cfg.replace(remat="none", max_seq_len=1024, grouped_matmul=plain.grouped_matmul) == plain


def test_weight_shaping_overrides_are_refused_by_name(tmp_path, hf_dir):
    with pytest.raises(ValueError, match=r"model_overrides sets \['d_model', 'n_layers'\], which the HF directory"):
        _config(tmp_path, hf_dir, {"d_model": 16, "n_layers": 1, "remat": "full"})
    assert "d_model" not in RUNTIME_MODEL_FIELDS and "param_dtype" not in RUNTIME_MODEL_FIELDS


@pytest.mark.parametrize("with_hf", [True, False])
def test_unknown_override_keys_are_refused(tmp_path, hf_dir, with_hf):
    kw = dict(hf_path=str(hf_dir), model=None) if with_hf else dict(model="tiny-moe")
    with pytest.raises(ValueError, match=r"no ModelConfig field: \['remmat'\]"):
        ExperimentConfig(run_dir=str(tmp_path), model_overrides={"remmat": "full"}, **kw)
