"""Runs that cannot learn, and damaged checkpoints (issue #48 points 4 and 6), as they were tried.

- `OptimizerConfig.learning_rate = 1e30`: from the second step the loss was nan and every update
  skipped, forever, exit 0. Now `max_nonfinite_steps` skips in a row end the run with
  `TrainingDivergedError` (`sfrrl-train` exit 4), the checkpoints written before kept.
- `TrainerConfig.group_size = 1` with a group-relative advantage validated, then trained nothing
  (loss 0, gradient 0) every step. Now refused by name.
- every group with equal rewards, step after step: nothing said it. Now warned, and counted.
- a newest checkpoint with a flipped bit in a weight restored silently (finite garbage), or, as
  nan, was refused outright instead of falling back like every other damage. Now both fall back to
  the newest intact step, the damaged one renamed; `--resume=strict` refuses instead.
"""
import json
import logging
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.checkpoints.orbax_store import QUARANTINE_SUFFIX, CheckpointFallbackWarning, Checkpointer
from sfrrl_jax.launch import cli, gin_bindings
from sfrrl_jax.launch.runner import abstract_params_and_opt_state, validate_experiment
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.trainer.health import EXIT_DIVERGED, TrainingDivergedError, TrainingHealth
from sfrrl_jax.trainer.rl_trainer import shared_train_step
from sfrrl_jax.trainer.run_logger import read_metrics

from test_silent_config import TINY_GIN


# -- a trainer over the tiny model, one device ------------------------------------------------------

def _trainer(reward, trainer_cfg: S.TrainerConfig, lr: float = 1e-4) -> S.RLTrainer:
    tokenizer = S.load_tokenizer(S.build_tiny_tokenizer(tempfile.mkdtemp()))
    tasks = [S.Task(f"t{i}", "arithmetic", f"What is {i} + 1?", answer=str(i + 1)) for i in range(4)]
    env = S.ToolEnvironment([S.CalculatorTool()], "Answer in <answer></answer>.", reward_fns=[reward])
    model_cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=256, n_layers=1)
    params = S.init_params(model_cfg, S.make_mesh(devices=jax.devices()[:1]), seed=0)
    rollout = S.AgentRollout(env, tokenizer, S.AgentConfig(max_turns=1, max_new_tokens_per_turn=8,
                                                           max_total_tokens=192, temperature=1.0))
    return S.RLTrainer(model_cfg, params, trainer_cfg, S.LossConfig(), S.OptimizerConfig(learning_rate=lr),
                       rollout, S.TaskStream(tasks))


def _even_share(task, trajectory) -> float:
    """A reward that varies between samples (so every group has a signal)."""
    ids = np.asarray(trajectory.tokens[trajectory.prompt_len:])
    return float(np.mean(ids % 2 == 0)) if ids.size else 0.0


def test_learning_rate_1e30_ends_the_run_after_max_nonfinite_steps_skips():
    cfg = S.TrainerConfig(mode="sync", groups_per_step=1, group_size=4, max_slots=4, max_len=192,
                          max_nonfinite_steps=2)
    trainer = _trainer(_even_share, cfg, lr=1e30)
    seen = []
    with pytest.raises(TrainingDivergedError) as e:
        for _ in range(8):   # was: every step skipped, forever
            seen.append(trainer.step())
    msg = str(e.value)
    assert "training cannot learn" in msg and "max_nonfinite_steps=2" in msg and "learning_rate" in msg
    assert len(e.value.steps) == 2 and e.value.steps == sorted(e.value.steps)
    # the steps before the error: an applied update, then skips counted in the metrics
    assert [m["train/update_skipped"] for m in seen][-1:] == [1.0]
    assert seen[-1]["train/nonfinite_streak"] == 1
    assert not any(m["train/update_skipped"] for m in seen[:-1])


def test_max_nonfinite_steps_0_never_stops_and_a_good_step_resets_the_streak():
    health = TrainingHealth(S.TrainerConfig(max_nonfinite_steps=0))
    for step in range(20):
        assert health.observe({"step": step, "train/update_skipped": 1.0})["train/nonfinite_streak"] == step + 1
    health = TrainingHealth(S.TrainerConfig(max_nonfinite_steps=3))
    for step, skipped in enumerate([1, 1, 0, 1, 1, None, 0]):   # None: no update ran (every group failed)
        metrics = {"step": step} if skipped is None else {"step": step, "train/update_skipped": float(skipped)}
        health.observe(metrics)
    assert health.skipped_steps == []


def test_cli_exits_4_and_keeps_the_checkpoints_written_before(tmp_path, capsys):
    gin = tmp_path / "tiny.gin"
    gin.write_text(TINY_GIN + "\nExperimentConfig.optimizer = @OptimizerConfig()\n"
                   "OptimizerConfig.learning_rate = 1e30\nTrainerConfig.max_nonfinite_steps = 2\n")
    run_dir = tmp_path / "run"
    code = cli.main([f"--gin_file={gin}", f"--run_dir={run_dir}", "--gin_param=ExperimentConfig.num_steps = 8"])
    err = capsys.readouterr().err
    assert code == EXIT_DIVERGED == 4, err   # was: exit 0 after 8 skipped updates
    assert "TrainingDivergedError" in err and "training cannot learn" in err
    rows = read_metrics(run_dir)
    logged = [r["step"] for r in rows]
    assert logged == list(range(len(logged))) and len(logged) < 8 and rows[-1]["train/update_skipped"] == 1.0
    # every finished step was saved (checkpoint_every=1, a checkpoint is named by the steps done);
    # the step that ended the run was neither logged nor saved
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir())
    assert saved == [s + 1 for s in logged]


def test_group_size_1_with_a_group_relative_advantage_is_refused_by_name(tmp_path, capsys):
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match=rf"group_size=1 with advantage.estimator='{estimator}'"):
            S.TrainerConfig(mode="sync", group_size=1, advantage=S.AdvantageConfig(estimator=estimator))
    # a batch baseline needs no group
    S.TrainerConfig(mode="sync", group_size=1, advantage=S.AdvantageConfig(estimator="reinforce_pp"))
    gin = tmp_path / "tiny.gin"
    gin.write_text(TINY_GIN)
    code = cli.main([f"--gin_file={gin}", f"--run_dir={tmp_path / 'r'}", "--gin_param=TrainerConfig.group_size = 1",
                     "--validate_only"])
    err = capsys.readouterr().err
    assert code == 2 and "group_size=1" in err and "advantage 0" in err, err   # was: "config valid"


def test_steps_without_signal_warn_and_count(caplog):
    cfg = S.TrainerConfig(mode="sync", groups_per_step=1, group_size=2, max_slots=2, max_len=192,
                          warn_no_signal_steps=2)
    trainer = _trainer(S.named(lambda task, trajectory: 0.5, "constant"), cfg)   # every sample the same reward
    with caplog.at_level(logging.WARNING, logger="sfrrl_jax.trainer.health"):
        metrics = [trainer.step() for _ in range(2)]
    assert [m["rollout/zero_variance_groups"] for m in metrics] == [1, 1]
    assert [m["rollout/kept_groups"] for m in metrics] == [1, 1]
    assert [m["train/no_signal_steps"] for m in metrics] == [1, 2]
    warned = [r.getMessage() for r in caplog.records if "no learning signal for 2 steps" in r.getMessage()]
    assert len(warned) == 1 and "dynamic_sampling" in warned[0]
    # a step with a signal resets the count
    health = TrainingHealth(cfg)
    health.observe({"rollout/kept_groups": 2, "rollout/zero_variance_groups": 2})
    assert health.observe({"rollout/kept_groups": 2, "rollout/zero_variance_groups": 1})["train/no_signal_steps"] == 0


# -- damaged checkpoints ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A finished 2-step run with checkpoints 1 and 2 (the tiny gin, 8 fake devices)."""
    d = tmp_path_factory.mktemp("health")
    gin = d / "tiny.gin"
    gin.write_text(TINY_GIN)
    run_dir = d / "run"
    assert cli.main([f"--gin_file={gin}", f"--run_dir={run_dir}", "--gin_param=ExperimentConfig.num_steps = 2"]) == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]
    return str(gin), run_dir


def _abstract(gin: str, run_dir: Path) -> dict:
    cfg = gin_bindings.load_job([gin], [f"ExperimentConfig.run_dir = '{run_dir}'"]).experiment
    model_cfg = validate_experiment(cfg)
    mesh = make_mesh(data=cfg.mesh_data, expert=cfg.mesh_expert, tensor=cfg.mesh_tensor, context=cfg.mesh_context)
    return dict(zip(("params", "opt_state"), abstract_params_and_opt_state(
        model_cfg, mesh, cfg.optimizer, shared_train_step(model_cfg, cfg.loss, cfg.optimizer))))


def _rewrite(step_dir: Path, abstract, change, under_old_checksums: bool) -> None:
    """Saves step `step_dir` again with one element of the embedding changed by `change`.

    under_old_checksums: then the manifest and checksums of the first save are put back, as a bit
    flipped on disk leaves them: the files are whole and orbax reads them; only the contents
    differ. Else the new values are saved as they are (a run that saved nan weights)."""
    manifest = json.loads((step_dir / "sfrrl_files.json").read_text())
    meta = (step_dir / "meta" / "metadata").read_text()
    ckpt = Checkpointer(step_dir.parent, save_every=1, async_save=False)
    state, host = ckpt.restore(int(step_dir.name), abstract)
    ckpt.close()
    emb = state["params"]["embed"]["embedding"]
    state["params"]["embed"]["embedding"] = jax.device_put(change(np.asarray(emb)), emb.sharding)
    shutil.rmtree(step_dir)
    with Checkpointer(step_dir.parent, save_every=1, async_save=False) as ckpt:
        assert ckpt.maybe_save(int(step_dir.name), state, host)
    if under_old_checksums:
        (step_dir / "meta" / "metadata").write_text(meta)
        manifest["files"] = {rel: (step_dir / rel).stat().st_size for rel in manifest["files"]
                             if (step_dir / rel).exists()}
        (step_dir / "sfrrl_files.json").write_text(json.dumps(manifest))


def _bit_flip(a: np.ndarray) -> np.ndarray:
    b = a.copy()
    b.view(np.uint32)[3, 5] ^= 1 << 12   # a mantissa bit: finite, plausible, wrong
    assert np.isfinite(b).all() and not np.array_equal(a, b)
    return b


def _nan(a: np.ndarray) -> np.ndarray:
    b = a.copy()
    b[3, 5] = np.nan
    return b


@pytest.mark.parametrize("damage,reason", [(_bit_flip, "differ from what was saved (checksums)"),
                                           (_nan, "holds nan/inf in params.embed.embedding")])
def test_damaged_newest_checkpoint_falls_back_and_is_renamed(two_step_run, tmp_path, capsys, damage, reason):
    gin, done = two_step_run
    run_dir = tmp_path / "run"
    shutil.copytree(done, run_dir)
    abstract = _abstract(gin, run_dir)
    _rewrite(run_dir / "checkpoints" / "2", abstract, damage, under_old_checksums=damage is _bit_flip)
    ckpt = Checkpointer(run_dir / "checkpoints", save_every=1, async_save=False)
    with pytest.warns(CheckpointFallbackWarning, match="cannot restore checkpoint step 2"):
        # strict refuses first, moving nothing
        with pytest.raises(S.checkpoints.DamagedCheckpointError, match=f"step 2, is damaged: .*{reason[:20]}"):
            ckpt.restore_latest(abstract, strict=True)
        assert (run_dir / "checkpoints" / "2").is_dir()
        step, state, _ = ckpt.restore_latest(abstract)   # was: step 2, garbage (or NonFiniteStateError)
    ckpt.close()
    assert step == 1 and (run_dir / "checkpoints" / f"2{QUARANTINE_SUFFIX}").is_dir()
    assert not (run_dir / "checkpoints" / "2").exists()


def test_cli_resume_falls_back_past_a_bit_flip_and_strict_refuses(two_step_run, tmp_path, capsys):
    gin, done = two_step_run
    run_dir = tmp_path / "run"
    shutil.copytree(done, run_dir)
    _rewrite(run_dir / "checkpoints" / "2", _abstract(gin, run_dir), _bit_flip, under_old_checksums=True)
    capsys.readouterr()
    args = [f"--gin_file={gin}", f"--run_dir={run_dir}", "--gin_param=ExperimentConfig.num_steps = 3"]
    assert cli.main(args + ["--resume=strict"]) == 3
    err = capsys.readouterr().err
    assert "DamagedCheckpointError" in err and "step 2, is damaged" in err and "checksums" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]   # nothing moved
    with pytest.warns(CheckpointFallbackWarning):
        assert cli.main(args + ["--resume"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.split("SUMMARY ", 1)[1])
    assert summary["resumed_from"] == 1 and summary["steps_done"] == 3
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2", f"2{QUARANTINE_SUFFIX}", "3"]


def test_a_rollout_function_that_always_raises_stops_the_step_past_the_groups_it_launches():
    calls = []

    async def broken(engine, task, sample_index):
        calls.append(task.task_id)
        raise ValueError("always")

    model_cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=64, n_layers=1)
    params = S.init_params(model_cfg, S.make_mesh(devices=jax.devices()[:1]), seed=0)
    tasks = [S.Task(f"t{i}", "arithmetic", "q", answer="1") for i in range(8)]
    cfg = S.TrainerConfig(mode="sync", groups_per_step=2, group_size=2, max_slots=4, max_len=64,
                          overprovision_groups=1)
    assert cfg.failed_groups_limit == 3
    trainer = S.RLTrainer(model_cfg, params, cfg, S.LossConfig(), S.OptimizerConfig(), broken, S.TaskStream(tasks))
    with pytest.raises(RuntimeError, match=r"raised in 4 groups this step \(more than the 3 it launches"):
        trainer.step()
    assert len(calls) >= 4 * 2   # the launched groups and their refills ran, then the step stopped
