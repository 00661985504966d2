"""Training from every process's own rows (learner.process_rows, issue #20): 2 processes x 4
devices, each passing its rows, train exactly what 1 process x 8 devices trains on all rows."""
from pathlib import Path

import jax
import numpy as np
import pytest

from sfrrl_jax.learner.process_rows import global_microbatch
from sfrrl_jax.rl.microbatch import MicroBatch, as_microbatch

from process_rows_common import STEPS, rows_for, setup
from process_run import finish, launch

WORKER = Path(__file__).with_name("process_rows_worker.py")


def _padded(rows, n, width):
    out = {}
    for k, v in rows.items():
        p = np.zeros((n,) + ((width,) if v.ndim == 2 else ()), v.dtype)
        p[tuple(slice(0, s) for s in v.shape)] = v
        out[k] = p
    return out


def test_two_processes_train_what_one_process_trains_on_all_rows(tmp_path):
    procs = launch(WORKER, 2, str(tmp_path / "out.npz"))
    # one process: the same rows, laid out as the two processes' blocks (each padded alike)
    ts, params, opt_state, mesh = setup()
    init = {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    losses = []
    for step in range(STEPS):
        parts = [rows_for(step, p) for p in range(2)]
        n = max(len(p["tokens"]) for p in parts)
        n = -(-n // 4) * 4                      # 2 processes x n rows over 8 batch shards
        width = max(p["tokens"].shape[1] for p in parts)
        host = {k: np.concatenate([_padded(p, n, width)[k] for p in parts]) for k in parts[0]}
        params, opt_state, metrics = ts.step(params, opt_state, host)
        losses.append(float(metrics["loss"]))
    finish(procs)
    got = np.load(tmp_path / "out.npz")
    np.testing.assert_allclose(got["__losses"], losses, rtol=1e-6, atol=1e-7)
    flat = {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert sorted(flat) == sorted(k for k in got.files if not k.startswith("__"))
    # The gradient sums add the same terms in another order (gloo's all-reduce across processes):
    # plain SGD moves each param by lr x the gradient, so the two differ by rounding (measured
    # 6e-8 at both XLA optimisation levels, held to 1e-6) while the steps moved the params by
    # over 1e-3 (measured 1.7e-2).
    moved = max(float(np.abs(v - init[k]).max()) for k, v in flat.items())
    assert moved > 1e-3, moved
    print(f"params differ by {max(float(np.abs(got[k] - v).max()) for k, v in flat.items()):.2e} after moving {moved:.2e}")
    for k, v in flat.items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=1e-6, err_msg=k)
    assert not np.allclose(losses[0], losses[-1])


def test_one_process_global_microbatch_pads_and_names_bad_rows():
    _, _, _, mesh = setup()
    rows = rows_for(0, 0)                                      # 3 rows of width 24
    batch = global_microbatch(rows, mesh)
    assert isinstance(batch, MicroBatch) and batch.present == as_microbatch(rows).present
    assert batch.tokens.shape == (8, 24) and batch.advantages.shape == (8,)   # rows to the 8 shards
    np.testing.assert_array_equal(np.asarray(batch.tokens)[:3], rows["tokens"])
    assert not np.asarray(batch.loss_mask)[3:].any()            # padding rows hold no loss token
    # a MicroBatch of the rows is the same global batch
    typed = global_microbatch(as_microbatch(rows), mesh)
    assert all(np.array_equal(np.asarray(typed.get(k)), np.asarray(batch.get(k))) for k in batch.present)
    with pytest.raises(ValueError, match=r"'loss_mask' has shape \(2, 24\)"):
        global_microbatch({**rows, "loss_mask": rows["loss_mask"][:2]}, mesh)
    with pytest.raises(KeyError, match="need 'tokens'"):
        global_microbatch({"loss_mask": rows["loss_mask"]}, mesh)
    # routing replay's routes [rows, width, moe layers, top_k] keep their trailing dims
    routes = np.arange(3 * 24 * 2 * 2, dtype=np.int16).reshape(3, 24, 2, 2)
    batch = global_microbatch(as_microbatch(rows).replace(routes=routes), mesh)
    assert batch.routes.shape == (8, 24, 2, 2) and batch.routes.dtype == np.int16
    np.testing.assert_array_equal(np.asarray(batch.routes)[:3], routes)
    assert not np.asarray(batch.routes)[3:].any()
