"""A checkpoint written by 2 processes restores in 1 process, and one written by 1 restores in 2
(issue #20): every leaf of params, Adam state and PRNG key bit-exact, host state once."""
import json
from pathlib import Path

import numpy as np

import checkpoint_common
from process_run import finish, launch

WORKER = Path(__file__).with_name("checkpoint_worker.py")


def _run(nproc, ckpt_dir, mode, out):
    finish(launch(WORKER, nproc, str(ckpt_dir), mode, str(out)))


def _load(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def test_checkpoints_cross_process_counts_both_ways(tmp_path):
    _run(2, tmp_path / "by2", "save", "")
    checkpoint_common.save(tmp_path / "by1")              # this process: 1 x 8 devices
    step, host, leaves = checkpoint_common.restore(tmp_path / "by2")
    a = {"__step": np.array(step), "__host": np.array(json.dumps(host)), **leaves}
    _run(2, tmp_path / "by1", "restore", tmp_path / "by1_in2.npz")
    b = _load(tmp_path / "by1_in2.npz")
    assert int(a["__step"]) == int(b["__step"]) == 3
    assert json.loads(str(a["__host"])) == {"data_index": 17, "note": "written by 2 processes"}
    assert json.loads(str(b["__host"])) == {"data_index": 17, "note": "written by 1 processes"}
    names = sorted(k for k in a if not k.startswith("__"))
    assert names == sorted(k for k in b if not k.startswith("__"))
    assert any(n.startswith("params.") for n in names) and any("opt_state" in n for n in names) and "rng" in names
    for name in names:   # the same state, saved by 2 and by 1 processes, restored by the other count
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert all(np.abs(a[n]).sum() > 0 for n in names if n.startswith("params"))   # real values, not zeros
