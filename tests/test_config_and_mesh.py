import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sfrrl_jax as S
from sfrrl_jax.mesh import LOGICAL_AXIS_RULES, logical_to_spec, sharding_for


def test_make_mesh_axes_and_sizes():
    mesh = S.make_mesh(data=2, expert=4)
    assert mesh.axis_names == ("data", "expert", "context", "tensor")
    assert dict(mesh.shape) == {"data": 2, "expert": 4, "context": 1, "tensor": 1}
    mesh = S.make_mesh(expert=2, context=4)
    assert dict(mesh.shape) == {"data": 1, "expert": 2, "context": 4, "tensor": 1}


@pytest.mark.parametrize("sizes", [dict(data=3), dict(data=2, expert=2), dict(expert=16), dict(context=3)])
def test_make_mesh_wrong_product_names_sizes_and_device_count(sizes):
    with pytest.raises(ValueError) as e:
        S.make_mesh(**sizes)
    msg = str(e.value)
    for k, v in sizes.items():
        assert f"{k}={v}" in msg
    assert "8 devices are available" in msg


def test_make_mesh_rejects_non_positive():
    with pytest.raises(ValueError, match="'tensor' must be a positive int"):
        S.make_mesh(data=8, tensor=0)


def test_logical_rules_table_drives_specs():
    assert logical_to_spec(("experts", "embed", "mlp")) == P("expert", None, "tensor")
    # rows over (data, expert), each row's sequence over context
    assert logical_to_spec(("batch", "seq", "embed")) == P(("data", "expert"), "context", None)
    # an axis already used earlier in the spec is not reused
    assert logical_to_spec(("slots", "batch")) == P(("data", "expert", "context"), None)
    with pytest.raises(KeyError, match="logical axis 'nope' has no rule"):
        logical_to_spec(("nope",))


def test_spec_fitted_to_shape_drops_non_dividing_axes():
    mesh = S.make_mesh(data=2, tensor=4)
    # 2 kv heads cannot split over tensor=4: replicated instead of an uneven split
    assert sharding_for(mesh, ("embed", "kv_heads", "head_dim"), (64, 2, 16)).spec == P(None, None, None)
    assert sharding_for(mesh, ("embed", "heads", "head_dim"), (64, 4, 16)).spec == P(None, "tensor", None)


def test_expert_splits_the_sequence_when_the_rows_do_not_split_over_it():
    """One long row on expert=4 x context=2: `batch` cannot use expert, so `seq` takes it (the
    sequence splits 8 ways instead of 4 replicas of a 2-way split); 4 rows keep it for the batch."""
    from sfrrl_jax.mesh import seq_axes
    mesh = S.make_mesh(expert=4, context=2)
    one_row = sharding_for(mesh, ("batch", "seq", "embed"), (1, 64, 8)).spec
    assert one_row == P("data", ("expert", "context"), None)
    assert sharding_for(mesh, ("batch", "seq", "embed"), (4, 64, 8)).spec == P(("data", "expert"), "context", None)
    assert seq_axes(mesh, 1) == ("expert", "context") and seq_axes(mesh, 4) == ("context",)
    assert seq_axes(S.make_mesh(data=8), 1) == ()   # data never splits a sequence


def test_shard_by_logical_places_tree():
    mesh = S.make_mesh(data=2, expert=4)
    tree = {"w": np.zeros((8, 6), np.float32), "b": np.zeros((6,), np.float32)}
    axes = {"w": ("experts", "embed"), "b": ("embed",)}
    out = S.shard_by_logical(tree, axes, mesh)
    assert out["w"].sharding.spec == P("expert", None)
    assert out["b"].sharding.spec == P(None)
    assert out["w"].addressable_shards[0].data.shape == (2, 6)


def test_presets_have_published_sizes():
    # Total parameter counts of the published checkpoints (all experts), from their shapes.
    expect = {
        "qwen3-moe-30b-a3b": 30.53e9,
        "gpt-oss-20b": 20.91e9,
        "gpt-oss-120b": 116.83e9,
        "mixtral-8x7b": 46.70e9,
    }
    for name, n in expect.items():
        got = S.ModelConfig.preset(name).param_count()
        assert abs(got - n) / n < 0.005, (name, got)
    g = S.ModelConfig.preset("gpt-oss-120b")
    assert g.layer_windows[:4] == (128, 0, 128, 0) and g.n_experts == 128 and g.top_k == 4


def test_preset_errors_list_valid_names():
    with pytest.raises(KeyError, match="valid presets: .*tiny-moe"):
        S.ModelConfig.preset("tiny-mo")
    with pytest.raises(TypeError, match=r"unknown ModelConfig field\(s\) \['d_modle'\]; valid fields: .*d_model"):
        S.ModelConfig.preset("tiny-moe", d_modle=3)
    with pytest.raises(ValueError, match="n_heads=6 must be a multiple of n_kv_heads=4"):
        S.ModelConfig.preset("tiny-moe", n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="router='top1'"):
        S.ModelConfig.preset("tiny-moe", router="top1")


def test_config_is_hashable_and_frozen():
    c = S.ModelConfig.preset("tiny-moe")
    assert hash(c) == hash(S.ModelConfig.preset("tiny-moe"))
    with pytest.raises(Exception):
        c.d_model = 3  # type: ignore[misc]
