"""LoRA runs end to end: gin binds `ExperimentConfig.lora = @LoraConfig()`, a run trains the adapter only, its
checkpoints hold the adapter and its optimizer state (never the base), and a resumed run repeats the uninterrupted
one; bad LoRA settings are refused by name before anything is allocated."""
import dataclasses


import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.checkpoints.orbax_store import Checkpointer
from sfrrl_jax.launch import cli
from sfrrl_jax.launch.runner import ExperimentConfig, comparable_metrics, run_experiment, validate_experiment
from sfrrl_jax.models.lora import LoraConfig
from sfrrl_jax.testing.workload import WorkloadConfig, WorkloadRollout
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.run_logger import read_metrics

WL = WorkloadConfig(num_prompts=3, max_turns=2, response_median=4.0, response_sigma=0.5, max_response=8,
                    tool_latency_median_s=0.01, tool_latency_sigma=0.3)
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "experts.gate_proj", "experts.down_proj"))


def _cfg(run_dir, steps, **kw):
    return ExperimentConfig(
        run_dir=str(run_dir), model="tiny-moe", model_overrides={"max_seq_len": 64}, mesh_data=2, mesh_expert=4,
        rollout=WorkloadRollout(workload=WL), num_steps=steps, checkpoint_every=1, progress_bar=False,
        tensorboard=False, lora=LORA, async_checkpoint=False,
        trainer=TrainerConfig(mode="sync", groups_per_step=1, group_size=2, max_slots=2, max_len=64, buckets=(16,),
                              seq_bucket=64),
        optimizer=OptimizerConfig(learning_rate=1e-2, total_steps=3), **kw)


def test_a_lora_run_checkpoints_the_adapter_only_and_resumes_exactly(tmp_path):
    cfg = S.ModelConfig.preset("tiny-moe", max_seq_len=64)
    full = run_experiment(_cfg(tmp_path / "full", 3), log=lambda s: None)
    assert full["steps_done"] == 3
    # the finished run's adapter, as a PEFT directory: read back, it is the trained one
    assert full["adapter_dir"] == str(tmp_path / "full" / "adapter")
    peft_adapter = S.load_adapter(full["adapter_dir"], cfg, S.make_mesh(data=2, expert=4))
    # peft fuses the experts' gate and up: an adapter of gate alone comes back with a zero up pair beside it
    assert peft_adapter.config.rank == LORA.rank and set(LORA.targets) <= set(peft_adapter.config.targets)
    assert np.abs(np.asarray(peft_adapter.weights["layers"]["moe"]["w_down"]["b"])).max() > 0
    # a checkpoint holds the adapter and its optimizer state: its arrays are adapter-sized
    ckpt = Checkpointer(tmp_path / "full" / "checkpoints", save_every=1)
    stored = sum(p.stat().st_size for p in (tmp_path / "full" / "checkpoints" / "3").rglob("*") if p.is_file())
    ckpt.close()
    base_bytes = 4 * cfg.param_count()   # float32 weights; a full run's checkpoint holds 3x that (+ 2 Adam moments)
    assert stored < base_bytes / 2, (stored, base_bytes)
    # stop after 2 steps, then resume to 3: the same metrics as the uninterrupted run
    run_experiment(_cfg(tmp_path / "cut", 2), log=lambda s: None)
    logs = []
    resumed = run_experiment(_cfg(tmp_path / "cut", 3, resume=True), log=logs.append)
    assert resumed["resumed_from"] == 2 and any("resumed from checkpoint step 2" in line for line in logs)
    want = {r["step"]: comparable_metrics(r) for r in read_metrics(tmp_path / "full")}
    got = {r["step"]: comparable_metrics(r) for r in read_metrics(tmp_path / "cut")}
    assert sorted(got) == [0, 1, 2]
    for step in range(3):
        for k in ("reward/mean", "train/trained_tokens", "rollout/generated_tokens"):
            assert got[step][k] == want[step][k], (step, k)
        np.testing.assert_allclose(got[step]["train/loss"], want[step]["train/loss"], rtol=1e-4, atol=1e-6)
    assert want[2]["train/grad_norm"] > 0


def test_lora_config_is_bound_by_gin_and_refused_by_name(tmp_path):
    gin = tmp_path / "lora.gin"
    gin.write_text(f"""
import sfrrl_jax.testing.workload
Job.kind = 'rl'
Job.experiment = @ExperimentConfig()
ExperimentConfig.run_dir = '{tmp_path / "run"}'
ExperimentConfig.model = 'tiny-moe'
ExperimentConfig.num_devices = 1
ExperimentConfig.rollout = @WorkloadRollout()
WorkloadRollout.workload = @WorkloadConfig()
WorkloadConfig.max_turns = 2
WorkloadConfig.max_response = 8
ExperimentConfig.lora = @LoraConfig()
LoraConfig.rank = 8
LoraConfig.alpha = 16.0
LoraConfig.targets = ['q_proj', 'experts.up_proj', 'router']
""")
    assert cli.main([f"--gin_file={gin}", "--validate_only"]) == 0
    # the CLI trains it: one step on this process's 8 devices, the adapter in the run dir
    assert cli.main([f"--gin_file={gin}", "--gin_param=ExperimentConfig.num_devices = 8",
                     "--gin_param=ExperimentConfig.mesh_data = 2", "--gin_param=ExperimentConfig.mesh_expert = 4",
                     "--gin_param=ExperimentConfig.num_steps = 1", "--gin_param=ExperimentConfig.progress_bar = False",
                     "--gin_param=ExperimentConfig.tensorboard = False", "--gin_param=TrainerConfig.max_len = 128",
                     "--gin_param=TrainerConfig.groups_per_step = 1", "--gin_param=TrainerConfig.group_size = 2",
                     "--gin_param=ExperimentConfig.trainer = @TrainerConfig()"]) == 0
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    assert cli.main([f"--gin_file={gin}", "--gin_param=LoraConfig.targets = ['q_proj', 'gate_proj']",
                     "--validate_only"]) == 2   # tiny-moe has no dense MLP: named below
    with pytest.raises(ValueError, match=r"\['gate_proj'\] adapt no weight of this qwen3_moe model"):
        validate_experiment(dataclasses.replace(_cfg(tmp_path / "x", 1), lora=LoraConfig(targets=("gate_proj",))), 8)
    with pytest.raises(ValueError, match="LoraConfig.dropout=0.1: training with LoRA dropout is not built"):
        validate_experiment(dataclasses.replace(_cfg(tmp_path / "x", 1), lora=LoraConfig(dropout=0.1)), 8)
    with pytest.raises(TypeError, match="ExperimentConfig.lora must be a LoraConfig"):
        dataclasses.replace(_cfg(tmp_path / "x", 1), lora={"rank": 8})
