"""experiments/bench/gpu_suite.py at toy size on CPU: every section produces its rows (finite,
positive timings), the dispatch paths and attention cores agree with their references (fp32),
and the JSON holds what `main` returned. Speed goals are not asserted (docs/DESIGN.md, section 4)."""
import importlib.util
import json
import math
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench" / "gpu_suite.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_gpu_suite_toy_runs_every_section(tmp_path):
    suite = _load()
    out = tmp_path / "g.json"
    res = suite.main(["--size", "toy", "--out", str(out)])

    assert res["meta"]["size"] == "toy" and res["meta"]["backend"] == "cpu"
    assert res["errors"] == {}
    assert set(res["meta"]["seconds"]) == set(suite.SECTIONS)

    decode = res["decode"]
    assert [r["batch"] for r in decode] == list(suite.SIZES["toy"]["batches"])
    for r in decode:
        assert all(_positive(r[k]) for k in ("tok_s", "ms_step", "bytes_step", "kv_bytes", "bandwidth")), r
        assert 0 < r["experts_touched"] <= 1, r
        assert r["hbm_share"] is None  # no peak for a CPU
    # one token's experts are top_k of them; more slots can only touch as many or more
    assert decode[0]["experts_touched"] == 2 / 8
    assert decode[-1]["experts_touched"] >= decode[0]["experts_touched"]

    (train,) = res["train"]
    assert all(_positive(train[k]) for k in ("ms_step", "tok_s", "model_flops", "model_tflops_s")), train
    assert train["xla_flops"] is None or _positive(train["xla_flops"])
    assert math.isfinite(train["loss"]) and train["update_skipped"] == 0.0
    assert train["mfu"] is None

    moe = {r["dispatch"]: r for r in res["moe"]}
    assert set(moe) == {"padded", "ragged"} and moe["ragged"]["shards"] == 8
    for r in moe.values():
        assert _positive(r["ms"]) and _positive(r["time_vs_padded"]), r
        assert r["out_diff"] < 1e-4 and r["grad_diff"] < 1e-4, r

    att = {(r["dtype"], r["impl"]): r for r in res["attention"]}
    assert set(att) == {("float32", impl) for impl in ("naive", "blockwise", "pallas")}
    for r in att.values():
        assert "error" not in r and _positive(r["ms"]), r
        assert r["logit_rel"] < 1e-4 and r["grad_diff"] < 1e-4, r

    paged = res["paged"]
    assert [r["window"] for r in paged] == [0, 8]
    for r in paged:
        assert all(_positive(r[k]) for k in ("kernel_ms", "gather_ms", "bandwidth", "kv_bytes")), r
        assert r["max_rel"] < 1e-5, r   # the kernel (interpret mode) computes the gather path's function

    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
