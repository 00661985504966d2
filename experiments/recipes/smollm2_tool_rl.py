"""The agentic variant of the real-model recipe (issue #45, point 2): SmolLM2-135M-Instruct learns to
call a calculator in a multi-turn loop.

    python experiments/train.py --gin_file=experiments/configs/smollm2_tools.gin   # Job.kind = 'smollm2_tool_rl'

SmolLM2's chat template renders no tools, so the recipe gives the model one that does
(`experiments/templates/smollm2_tools.jinja`): SmolLM2's ChatML unchanged, plus a "# Tools" section in
the system message listing each tool's JSON schema inside <tools></tools> and saying how to call
one, a JSON object inside <tool_call></tool_call> (the Hermes / Qwen convention; the library's
'qwen3' tool-call format reads it back), and tool results as user turns inside
<tool_response></tool_response>. Without tools it renders exactly what SmolLM2's own renders.

1. The weights are converted (as in `smollm2_rl`) and a warm-start directory `run_dir/warm_start`
   gets the tokenizer with that template.
2. `base`: the held-out set scored greedily on the base weights, tools described in the prompt:
   success and tool-call rate of a model nobody taught the format.
3. SFT warm start on demonstrations of `sft_tasks` training tasks, as the quickstart does: a
   seeded `sft_direct_answer_fraction` of them answer at once (their digits masked out of the
   loss: the route and form are taught, not digits a 135M model cannot compute), the rest call
   the calculator once with the task's expression and answer with its result. Greedy, the
   warm-started model mostly answers directly and mostly fails; sampled, a group holds both
   routes with different rewards, and RL learns that calling the tool pays.
4. The warm-started weights are saved there (HF format), and the RL run
   (`SmolLM2ToolRL.experiment`, the `rl` path with its held-out evaluations before, during and
   after) starts from them. Its summary gets `base_success`, `base_tool_calls` and
   `tool_calls_before` / `tool_calls_after` (calls per held-out task, greedy).

A resumed run (`--resume`) finds the warm start saved and goes on with RL.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time
from fractions import Fraction
from typing import Callable

import numpy as np

from experiments.recipes.quickstart import direct_answer_demonstration, mask_answer_content
from experiments.recipes.smollm2_rl import ensure_weights
from sfrrl_jax.agents.tasks.demos import render_sft_example
from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.tools import evaluate_arithmetic, format_number
from sfrrl_jax.launch.recipes import register_recipe
from sfrrl_jax.launch.runner import ExperimentConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "experiments" / "templates" / "smollm2_tools.jinja"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


@dataclasses.dataclass(frozen=True)
class SmolLM2ToolRL:
    """experiment: the RL run; its `hf_path` names the base weights (converted there if missing), its
    rollout a tool environment (e.g. @calculator_environment()) with `tool_format = 'qwen3'`.
    chat_template: the template file the warm-start directory gets.
    sft_tasks: training tasks demonstrated; sft_direct_answer_fraction: the share of them that
    answer at once; sft_steps / sft_batch_size / sft_learning_rate / sft_seq_bucket: the SFT run.
    evaluate_base: score the held-out set on the base weights first (one more engine compile)."""

    experiment: ExperimentConfig = None  # type: ignore[assignment]
    chat_template: str = str(TEMPLATE)
    sft_tasks: int = 320
    sft_direct_answer_fraction: float = 0.75
    sft_steps: int = 40
    sft_batch_size: int = 8
    sft_learning_rate: float = 5e-5
    sft_seq_bucket: int = 32
    evaluate_base: bool = True

    def __post_init__(self):
        if not isinstance(self.experiment, ExperimentConfig):
            raise TypeError(f"SmolLM2ToolRL.experiment must be an ExperimentConfig (@ExperimentConfig() in gin), "
                            f"got {type(self.experiment).__name__}")
        if not self.experiment.hf_path:
            raise ValueError("SmolLM2ToolRL.experiment.hf_path must name the directory of the base weights")
        if not 0.0 <= self.sft_direct_answer_fraction < 1.0:
            raise ValueError(f"SmolLM2ToolRL.sft_direct_answer_fraction must lie in [0, 1), got "
                             f"{self.sft_direct_answer_fraction}")
        for name in ("sft_tasks", "sft_batch_size", "sft_seq_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"SmolLM2ToolRL.{name} must be >= 1, got {getattr(self, name)}")
        if self.sft_steps < 0:
            raise ValueError(f"SmolLM2ToolRL.sft_steps must be >= 0, got {self.sft_steps}")


def task_expression(task: Task) -> str:
    """The arithmetic expression of a reasoning-gym 'Calculate X.' task (X)."""
    problem = str(task.metadata.get("problem", task.prompt.split("\n")[0])).strip()
    if not problem.startswith("Calculate ") or not problem.endswith("."):
        raise ValueError(f"task {task.task_id}: not a 'Calculate <expression>.' problem: {problem!r}")
    return problem[len("Calculate "):-1].strip()


def calculator_call_demonstration(task: Task, system_prompt: str | None) -> list[dict] | None:
    """One calculator call with the task's expression, then the answer; None where the calculator's
    value is not the task's gold answer (the transcript would teach a wrong answer)."""
    expression = task_expression(task)
    value = format_number(evaluate_arithmetic(expression))
    try:
        if Fraction(value) != Fraction(str(task.answer)):
            return None
    except ValueError:
        return None
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expression}}}
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": task.prompt},
                       {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": value},
                       {"role": "assistant", "content": f"<answer>{value}</answer>"}]


def warm_start_examples(tokenizer, tasks, tools, system_prompt, direct_fraction: float, seed: int,
                        tool_format) -> tuple[list[dict], dict]:
    """SFT rows ({'tokens', 'loss_mask'}) of `tasks`: a seeded `direct_fraction` answer at once (answer
    digits masked), the rest call the calculator. Returns (rows, counts)."""
    direct = np.random.default_rng([seed, 45]).random(len(tasks)) < direct_fraction
    rows, counts = [], {"direct": 0, "tool": 0, "skipped": 0}
    for task, at_once in zip(tasks, direct):
        demo = (direct_answer_demonstration(task, system_prompt) if at_once
                else calculator_call_demonstration(task, system_prompt))
        if demo is None:
            counts["skipped"] += 1
            continue
        tokens, mask = render_sft_example(tokenizer, demo, tools, tool_format)
        if at_once:
            mask = mask_answer_content(tokenizer, tokens, mask)
        counts["direct" if at_once else "tool"] += 1
        rows.append({"tokens": tokens, "loss_mask": mask})
    return rows, counts


def make_warm_start_dir(base_dir: pathlib.Path, out_dir: pathlib.Path, template: pathlib.Path) -> pathlib.Path:
    """`out_dir` with the base model's tokenizer files and `template` as its chat_template.jinja (a
    'chat_template' key of tokenizer_config.json, which would win over the file, is dropped)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            shutil.copy(base_dir / name, out_dir / name)
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    if config.pop("chat_template", None) is not None:
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(template, out_dir / "chat_template.jinja")
    return out_dir


def run_warm_start(recipe: SmolLM2ToolRL, warm_dir: pathlib.Path, log: Callable[[str], None]) -> dict:
    """Steps 2-4 of the module doc: base evaluation, SFT, saved weights in `warm_dir` -> its record."""
    from sfrrl_jax.checkpoints.hf import load_hf, save_hf
    from sfrrl_jax.learner.optimizer import OptimizerConfig
    from sfrrl_jax.launch.runner import build_rollout_source, validate_experiment
    from sfrrl_jax.mesh import make_mesh
    from sfrrl_jax.trainer.evaluate import evaluate
    from sfrrl_jax.trainer.sft import run_sft
    import jax

    exp = recipe.experiment
    # the base weights with the tool template: the rollout reads its tokenizer from warm_dir
    base_exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, tokenizer_path=str(warm_dir)))
    model_cfg = validate_experiment(base_exp, jax.device_count())
    mesh = make_mesh(data=exp.mesh_data, expert=exp.mesh_expert, tensor=exp.mesh_tensor, context=exp.mesh_context)
    source = build_rollout_source(base_exp, model_cfg)
    if source.held_out is None:
        raise ValueError("SmolLM2ToolRL: the rollout has no held-out set (AgenticRollout.eval_tasks)")
    held = source.held_out
    _, params = load_hf(exp.hf_path, mesh, dtype=exp.hf_dtype, scan_layers=model_cfg.scan_layers)
    record: dict = {}
    t0 = time.perf_counter()
    if recipe.evaluate_base:
        base = evaluate(model_cfg, params, held.env, held.tokenizer, held.tasks, held.agent_cfg,
                        max_slots=min(64, len(held.tasks)), max_len=exp.trainer.max_len,
                        buckets=exp.trainer.buckets)
        record.update(base_success=base["success_rate"], base_tool_calls=base["mean_tool_calls"],
                      base_eval_s=round(time.perf_counter() - t0, 1))
        log(f"base weights, tools in the prompt: held-out success {base['success_rate']:.3f}, "
            f"{record['base_tool_calls']:.2f} tool calls per task")
    tools = held.env.tool_schemas()
    system_prompt = getattr(held.env, "system_prompt", None)
    rows, counts = warm_start_examples(held.tokenizer, list(source.tasks)[:recipe.sft_tasks], tools, system_prompt,
                                       recipe.sft_direct_answer_fraction, exp.seed, exp.rollout.tool_format)
    t1 = time.perf_counter()
    optimizer = OptimizerConfig(learning_rate=recipe.sft_learning_rate, warmup_steps=0, end_lr_ratio=1.0,
                                weight_decay=0.0)
    params, _, history = run_sft(model_cfg, params, optimizer, rows, steps=recipe.sft_steps,
                                 batch_size=recipe.sft_batch_size, seed=exp.seed, seq_bucket=recipe.sft_seq_bucket,
                                 log_every=10, log=log)
    record.update(sft_examples=counts, sft_steps=len(history), sft_s=round(time.perf_counter() - t1, 1),
                  sft_loss_first=history[0]["loss"] if history else None,
                  sft_loss_last=history[-1]["loss"] if history else None)
    save_hf(model_cfg, params, warm_dir)
    (warm_dir / "warm_start.json").write_text(json.dumps(record, indent=2))
    return record


def run_smollm2_tool_rl(recipe: SmolLM2ToolRL, run_dir, log: Callable[[str], None] = print) -> dict:
    """Runs the recipe into `run_dir` (module doc) -> the RL run's summary plus the warm start's record."""
    from sfrrl_jax.launch.runner import run_experiment
    run_dir = pathlib.Path(run_dir)
    exp = recipe.experiment
    base_dir = ensure_weights(exp.hf_path, log)
    warm_dir = run_dir / "warm_start"
    make_warm_start_dir(pathlib.Path(base_dir), warm_dir, pathlib.Path(recipe.chat_template))
    if (warm_dir / "warm_start.json").is_file():   # written after the weights: the warm start is whole
        record = json.loads((warm_dir / "warm_start.json").read_text())
        log(f"warm start found in {warm_dir}")
    else:
        record = run_warm_start(recipe, warm_dir, log)
    rl = dataclasses.replace(exp, hf_path=str(warm_dir), run_dir=str(run_dir),
                             rollout=dataclasses.replace(exp.rollout, tokenizer_path=str(warm_dir)))
    summary = run_experiment(rl, log=log)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r.get("phase") == "eval"]
    if evals:
        summary.update(tool_calls_before=evals[0].get("eval/mean_tool_calls"),
                       tool_calls_after=evals[-1].get("eval/mean_tool_calls"))
    summary.update(record)
    return summary


def validate_smollm2_tool_rl(recipe: SmolLM2ToolRL) -> None:
    """`--validate_only`: the RL experiment's configs fit together (when the base weights exist), its
    rollout reading the tokenizer with the recipe's template as the run will."""
    import tempfile
    from sfrrl_jax.launch.runner import validate_experiment
    exp = recipe.experiment
    if not pathlib.Path(recipe.chat_template).is_file():
        raise FileNotFoundError(f"SmolLM2ToolRL.chat_template={recipe.chat_template!r}: no such file")
    if (pathlib.Path(exp.hf_path) / "config.json").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            warm = make_warm_start_dir(pathlib.Path(exp.hf_path), pathlib.Path(tmp), pathlib.Path(recipe.chat_template))
            validate_experiment(dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, tokenizer_path=str(warm))),
                                exp.num_devices or exp.mesh_size)


register_recipe("smollm2_tool_rl", SmolLM2ToolRL, run_smollm2_tool_rl, validate_smollm2_tool_rl)
