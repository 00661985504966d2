"""Checkpointer: exact round trip, resharding restore, corruption fallback, retention, async, SIGTERM."""
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.models.api import init_params, param_shardings
from sfrrl_jax.rl import LossConfig
from sfrrl_jax.learner import OptimizerConfig, make_train_step
from sfrrl_jax.learner.optimizer import opt_state_shardings
from sfrrl_jax.checkpoints.orbax_store import (
    MANIFEST_NAME, CheckpointFallbackWarning, CheckpointMismatchError, Checkpointer, NoRestorableCheckpointError,
    abstract_of,
    python_random_state_from_json, python_random_state_to_json,
)
from sfrrl_jax.trainer.stop_signal import install_sigterm_handler, should_stop

REPO = Path(__file__).resolve().parents[2]
CFG = ModelConfig.preset("tiny-moe")


def _fill_random(tree, seed):
    """Same structure, dtypes and shardings, with non-trivial values (zeros would hide swaps)."""
    rs = np.random.RandomState(seed)

    def fill(x):
        if np.issubdtype(x.dtype, np.integer):
            val = rs.randint(1, 1000, size=x.shape).astype(x.dtype)
        else:
            val = rs.standard_normal(x.shape).astype(x.dtype)
        return jax.device_put(val, x.sharding)

    return jax.tree.map(fill, tree)


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh(data=2, expert=4)
    params = init_params(CFG, mesh, seed=0)
    ts = make_train_step(CFG, LossConfig(objective="sft", vocab_chunk=128, seq_chunk=8), OptimizerConfig())
    opt_state = _fill_random(ts.init_opt_state(params), seed=1)
    rep = NamedSharding(mesh, P())
    state = {
        "params": params,
        "opt_state": opt_state,
        "rng": jax.device_put(jax.random.key(42), rep),
        "sampler_keys": jax.device_put(jax.random.split(jax.random.key(7), 8), NamedSharding(mesh, P("data"))),
    }
    host = {
        "data_position": 123,
        "python_random": python_random_state_to_json(random.Random(3).getstate()),
        "numpy_rng": np.random.default_rng(0).bit_generator.state,  # dict of str / big ints
        "metrics": {"reward": [0.1, 0.25, 1e-300], "loss": [2.5]},
        "done": False, "note": None,
    }
    return {"mesh": mesh, "ts": ts, "state": state, "host": host}


def _assert_bit_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        name = jax.tree_util.keystr(path)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), name


def _with_step(state, step):
    """A distinct state per step: the rng differs, so a restore shows which step it read."""
    return {**state, "rng": jax.random.fold_in(state["rng"], step)}


@pytest.fixture(scope="module")
def golden(setup, tmp_path_factory):
    """A checkpoint directory with steps 1 and 2 (saved asynchronously, then finished)."""
    d = tmp_path_factory.mktemp("golden") / "ckpt"
    ckpt = Checkpointer(d, save_every=1, keep=3)
    for step in (1, 2):
        assert ckpt.maybe_save(step, _with_step(setup["state"], step), {**setup["host"], "data_position": step})
    ckpt.close()
    return d


def _copy(golden, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(golden, d)
    return d


def _largest_data_file(step_dir):
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def test_checkpoint_roundtrip_is_bit_exact(setup, tmp_path):
    state, host = setup["state"], setup["host"]
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=5, keep=3)
    assert not ckpt.maybe_save(4, state, host)  # not due
    assert ckpt.maybe_save(10, state, host)
    ckpt.wait()
    metrics = ckpt.last_save_metrics
    assert metrics["step"] == 10 and 0 <= metrics["blocking_s"] <= metrics["total_s"]
    assert not ckpt.maybe_save(10, state, host, force=True)  # already saved (exit right after a save)
    ckpt.close()

    restored = Checkpointer(tmp_path / "ckpt", save_every=5).restore_latest(abstract_of(state))
    assert restored is not None
    step, got, got_host = restored
    assert step == 10
    _assert_bit_equal(got, state)
    assert got_host == host
    assert type(got["opt_state"]["inner"][1][0]) is type(state["opt_state"]["inner"][1][0])  # ScaleByAdamState
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
    # The restored Python and numpy RNGs continue the saved streams.
    r = random.Random()
    r.setstate(python_random_state_from_json(got_host["python_random"]))
    assert r.random() == random.Random(3).random()
    # The restored key draws the same numbers.
    assert np.array_equal(jax.random.normal(got["rng"], (4,)), jax.random.normal(state["rng"], (4,)))


@pytest.mark.parametrize("layout", ["expert8", "replicated"])
def test_checkpoint_restores_into_other_sharding(setup, golden, layout):
    src = _with_step(setup["state"], 2)
    mesh = make_mesh(data=1, expert=8)
    if layout == "expert8":
        p_sh = param_shardings(CFG, mesh)
        abs_params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  src["params"], p_sh)
        o_sh = opt_state_shardings(setup["ts"].tx, abs_params, OptimizerConfig())
        abs_opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                               src["opt_state"], o_sh)
        abstract = {"params": abs_params, "opt_state": abs_opt,
                    "rng": jax.ShapeDtypeStruct((), src["rng"].dtype, sharding=NamedSharding(mesh, P())),
                    "sampler_keys": jax.ShapeDtypeStruct((8,), src["rng"].dtype,
                                                         sharding=NamedSharding(mesh, P("expert")))}
    else:
        rep = NamedSharding(mesh, P())
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), src)
    step, got, host = Checkpointer(golden, save_every=1).restore_latest(abstract)
    assert step == 2 and host["data_position"] == 2
    _assert_bit_equal(got, src)
    for g, a in zip(jax.tree.leaves(got), jax.tree.leaves(abstract)):
        assert g.sharding.is_equivalent_to(a.sharding, g.ndim)
    # The layout really changed: e.g. the moments lose their 'data' split (data=1 now).
    assert any(g.sharding.spec != s.sharding.spec for g, s in zip(jax.tree.leaves(got), jax.tree.leaves(src)))
    if layout == "replicated":
        assert all(g.sharding.is_fully_replicated for g in jax.tree.leaves(got))


@pytest.mark.parametrize("damage, reason", [
    ("truncate_data", "truncated"),              # manifest catches it
    ("truncate_data_no_manifest", "restore failed"),  # killed before the manifest: orbax's reader catches it
    ("missing_item", "host/"),
    ("garbled_metadata", "metadata unreadable"),  # same size, garbage bytes
])
def test_checkpoint_damaged_latest_falls_back_to_previous(setup, golden, tmp_path, damage, reason):
    d = _copy(golden, tmp_path)
    step_dir = d / "2"
    if damage.startswith("truncate_data"):
        f = _largest_data_file(step_dir)
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
        if damage.endswith("no_manifest"):
            (step_dir / MANIFEST_NAME).unlink()
    elif damage == "missing_item":
        shutil.rmtree(step_dir / "host")
    else:
        f = step_dir / "state" / "_METADATA"
        f.write_bytes(b"\x00" * f.stat().st_size)
    with pytest.warns(CheckpointFallbackWarning) as record:
        restored = Checkpointer(d, save_every=1).restore_latest(abstract_of(setup["state"]))
    messages = [str(w.message) for w in record]
    assert any("step 2" in m and reason in m and "falling back to step 1" in m for m in messages), messages
    step, got, host = restored
    assert step == 1 and host["data_position"] == 1
    _assert_bit_equal(got, _with_step(setup["state"], 1))
    # The damaged step is kept aside, and the resumed run can save step 2 again.
    assert (d / "2.damaged").is_dir() and not (d / "2").exists()
    ckpt = Checkpointer(d, save_every=1)
    assert ckpt.maybe_save(2, _with_step(setup["state"], 2), {"data_position": 2})
    ckpt.close()
    assert ckpt.finished_steps() == [1, 2]


def test_checkpoint_unfinished_tmp_dir_is_ignored_with_warning(setup, golden, tmp_path):
    d = _copy(golden, tmp_path)
    tmp = d / "3.orbax-checkpoint-tmp"
    shutil.copytree(d / "2", tmp)
    shutil.rmtree(tmp / "meta")  # the interrupted save never got this far
    ckpt = Checkpointer(d, save_every=1)
    with pytest.warns(CheckpointFallbackWarning, match=r"step 3 .*unfinished"):
        step, _, host = ckpt.restore_latest(abstract_of(setup["state"]))
    assert step == 2 and host["data_position"] == 2
    assert not tmp.exists()  # cleaned up; the next save of step 3 can proceed
    assert ckpt.finished_steps() == [1, 2]


def test_checkpoint_none_restorable_raises_naming_each_step_and_moves_nothing(setup, golden, tmp_path):
    d = _copy(golden, tmp_path)
    for step in (1, 2):
        shutil.rmtree(d / str(step) / "state")
    with pytest.warns(CheckpointFallbackWarning) as record, pytest.raises(NoRestorableCheckpointError) as e:
        Checkpointer(d, save_every=1).restore_latest(abstract_of(setup["state"]))
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages
    assert "step 2" in messages[0] and "file state/_METADATA is missing; falling back to step 1" in messages[0]
    assert "step 1" in messages[1] and "no older step left" in messages[1]
    # None here would have let a resume start over at step 0 unnoticed (issue #24 D)
    assert "step 2: file state/_METADATA is missing; step 1: file state/_METADATA is missing" in str(e.value)
    assert [s for s, _ in e.value.failures] == ["2", "1"]
    assert sorted(p.name for p in d.iterdir()) == ["1", "2"]   # nothing renamed: kept as found
    # steps quarantined by an earlier restore, none left: still an error, not a fresh start
    shutil.rmtree(d / "1")
    os.replace(d / "2", d / "2.damaged")
    with pytest.raises(NoRestorableCheckpointError, match=r"step 2: quarantined earlier as 2\.damaged"):
        Checkpointer(d, save_every=1).restore_latest(abstract_of(setup["state"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fresh run (empty directory) is not a fallback
        assert Checkpointer(tmp_path / "empty", save_every=1).restore_latest(abstract_of(setup["state"])) is None


def test_checkpoint_structure_mismatch_raises_not_falls_back(setup, golden):
    abstract = abstract_of(setup["state"])
    fewer = {**abstract, "params": {k: v for k, v in abstract["params"].items() if k != "lm_head"}}
    with pytest.raises(CheckpointMismatchError, match=r"params\.lm_head"):
        Checkpointer(golden, save_every=1).restore_latest(fewer)
    emb = abstract["params"]["embed"]["embedding"]
    wrong = {**abstract, "params": {**abstract["params"], "embed": {"embedding": jax.ShapeDtypeStruct(
        emb.shape, np.float16, sharding=emb.sharding)}}}
    with pytest.raises(CheckpointMismatchError, match=r"params\.embed\.embedding.*float16"):
        Checkpointer(golden, save_every=1).restore_latest(wrong)


def test_checkpoint_keep_retains_newest(setup, tmp_path):
    state = setup["state"]
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=1, keep=2)
    for step in range(1, 5):
        assert ckpt.maybe_save(step, state, {"data_position": step})
    ckpt.close()
    assert ckpt.finished_steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["3", "4"]


def test_checkpoint_async_save_returns_before_files_are_final(setup, tmp_path):
    release, seen = threading.Event(), []

    def hold_writer(step):  # runs in orbax's writer thread once the files are written
        seen.append((step, threading.current_thread() is threading.main_thread()))
        assert release.wait(timeout=60)

    d = tmp_path / "ckpt"
    ckpt = Checkpointer(d, save_every=5, on_save_written=hold_writer)
    assert ckpt.maybe_save(5, setup["state"], setup["host"])
    # maybe_save has returned while the writer is (or will be) held: step 5 is not final yet.
    assert 5 not in ckpt.finished_steps()
    assert not (d / "5").exists()
    assert "total_s" not in ckpt.last_save_metrics and ckpt.last_save_metrics["blocking_s"] >= 0
    release.set()
    ckpt.wait()
    assert seen == [(5, False)]
    assert ckpt.finished_steps() == [5]
    assert (d / "5" / MANIFEST_NAME).exists()
    assert ckpt.last_save_metrics["total_s"] >= ckpt.last_save_metrics["blocking_s"]
    ckpt.close()


def test_checkpoint_bad_inputs_are_named(setup, tmp_path):
    state = setup["state"]
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(tmp_path / "a", save_every=-1)
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path / "a", save_every=1, keep=0)
    ckpt = Checkpointer(tmp_path / "a", save_every=1, async_save=False)
    with pytest.raises(TypeError, match=r"host_state\['sampler'\]\[1\] is a tuple.*list"):
        ckpt.maybe_save(1, state, {"sampler": [0, (1, 2)]})
    with pytest.raises(TypeError, match=r"host_state\['loss'\] is a float32"):
        ckpt.maybe_save(1, state, {"loss": np.float32(1.0)})
    with pytest.raises(TypeError, match=r"leaf 'step' is a int"):
        ckpt.maybe_save(1, {**state, "step": 3}, {})
    assert ckpt.maybe_save(2, state, {})
    assert ckpt.last_save_metrics["total_s"] == ckpt.last_save_metrics["blocking_s"]  # sync save
    assert ckpt.finished_steps() == [2] and (tmp_path / "a" / "2" / MANIFEST_NAME).exists()
    with pytest.raises(ValueError, match="older than the latest saved step 2"):
        ckpt.maybe_save(1, state, {}, force=True)
    no_sharding = {**abstract_of(state), "rng": jax.ShapeDtypeStruct((), state["rng"].dtype)}
    with pytest.raises(ValueError, match="leaf 'rng' has no sharding"):
        ckpt.restore_latest(no_sharding)
    ckpt.close()


def test_stop_request_runs_callback_once_from_loop():
    calls = []
    stop = install_sigterm_handler(calls.append)
    try:
        assert not should_stop() and not stop.stop_if_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs in this thread at the next bytecode boundary
            if stop.should_stop():
                break
        assert should_stop() and calls == []  # nothing ran inside the handler
        assert stop.stop_if_requested() and stop.stop_if_requested()
        assert calls == [signal.SIGTERM]
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not should_stop()


CHILD = textwrap.dedent("""
    import sys, time
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from sfrrl_jax.mesh import make_mesh
    from sfrrl_jax.checkpoints.orbax_store import Checkpointer
    from sfrrl_jax.trainer.stop_signal import install_sigterm_handler

    mesh = make_mesh(data=2, expert=4)
    ckpt = Checkpointer(sys.argv[1], save_every=1000)
    w = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("expert")))
    rng = jax.random.key(0)
    step = 0

    def save_and_exit(signum):
        ckpt.maybe_save(step, {"params": {"w": w}, "rng": rng}, {"step": step, "signal": signum}, force=True)
        ckpt.close()
        print(f"SAVED {step}", flush=True)
        sys.exit(128 + signum)

    stop = install_sigterm_handler(save_and_exit)
    while step < 100000:
        step += 1
        w = w + 1.0
        rng, _ = jax.random.split(rng)
        if step == 1:
            print("READY", flush=True)
        time.sleep(0.01)
        stop.stop_if_requested()
    sys.exit(3)
""")


def test_checkpoint_sigterm_subprocess_saves_then_exits(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    d = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, str(script), str(d)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    watchdog = threading.Timer(180, proc.kill)  # a hung child fails the test instead of hanging it
    watchdog.start()
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    saved = int(out.split("SAVED ")[1].split()[0])
    assert saved >= 1

    mesh = make_mesh(data=1, expert=8)
    rep = NamedSharding(mesh, P())
    abstract = {"params": {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=rep)},
                "rng": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)}
    ckpt = Checkpointer(d, save_every=1000)
    step, got, host = ckpt.restore_latest(abstract)
    assert ckpt.finished_steps() == [saved] and step == saved
    assert host == {"step": saved, "signal": int(signal.SIGTERM)}
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]), np.full((8, 4), float(saved), np.float32))
    want = jax.random.key(0)
    for _ in range(saved):
        want, _ = jax.random.split(want)
    assert np.array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(want))
