"""The quickstart: SFT warm start + pipelined GRPO of the tiny MoE on the calculator-tool task.

A recipe (experiment code built on the library, not part of it). From a checkout's root:

    python experiments/train.py --gin_file=experiments/configs/quickstart.gin   # Job.kind = 'quickstart'

or in Python (with the checkout root on sys.path):

    from experiments.recipes.quickstart import QuickstartRecipe, run_quickstart
    result = run_quickstart(QuickstartRecipe(), "runs/quickstart")          # the full recipe
    result = run_quickstart(QuickstartRecipe.reduced(), "runs/quickstart")  # the CI-size one

Importing this module registers Job kind 'quickstart' (`sfrrl_jax.launch.register_recipe`).

1. the tiny tokenizer is built (or loaded from `tokenizer_dir`), the model initialised on a
   small mesh (`mesh_devices` CPU devices: as many on `expert` as divide the experts, the rest on
   `data`; default 1: fake CPU devices share the same cores, so splitting gives no speed-up);
2. SFT on demonstrations of `sft_tasks` tasks (`sft_demonstrations`), until the warm start
   solves the tool-route probe (`sft_target_accuracy`, checked every `sft_probe_every` steps) or
   `sft_steps` have run;
3. greedy evaluation on `eval_tasks` held-out tasks (none of them in the SFT or RL sets):
   `success_before`;
4. `rl_steps` steps of `RLTrainer` in `mode` ('pipelined') with GRPO advantages and the real
   agent loop (`AgentRollout`: engine decode, calculator calls on the event loop, observation
   deltas appended to the parked slot);
5. the same greedy evaluation: `success_after`.

Everything is seeded: the tasks, the init, the SFT order, the sampling of every rollout.
Per-step metrics go to `run_dir/metrics.jsonl` (rows carry `phase` = 'sft' | 'sft_probe' |
'eval' | 'rl') and TensorBoard (`run_dir/tensorboard`), the RL timeline to
`timeline.trace.json` (Chrome trace) and `busy_idle.png`, the recipe to `recipe.json`, the
result to `result.json`.

Why RL has something to learn, on every machine (docs/DESIGN.md section 7 has the diagnosis):
- 75 % of the demonstrations answer at once (`sft_direct_answer_fraction`), 25 % call the
  calculator. Greedy, the warm-started policy takes the direct route on every task and, unable
  to compute, scores near 0. Sampled at temperature 0.7, a group of 8 still holds a tool sample
  most of the time, and those mostly succeed: GRPO groups hold both routes with different
  rewards, and the policy learns that calling the tool is what pays.
- A direct answer's content is masked out of the SFT loss (`mask_answer_content`): the model
  learns the route and its form, not digits it cannot compute. Fitting those digits trains the
  `<answer>` digit predictions against the copy of the tool's result; with them, the tool route
  plateaued near 20 % exact on held-out tasks and RL's outcome hung on the float path.
- SFT stops on what the model does, not after a fixed count: the share of held-out tool
  demonstrations it reproduces exactly (teacher-forced, route decision excluded) must reach
  `sft_target_accuracy`. When that happens varies with seed and machine; the stopping point
  absorbs it.
`experiments/bench/quickstart_seeds.py` measures the gain over seeds and device counts.

Shapes are kept few on purpose (compiling costs tens of seconds per shape on CPU): SFT rows are
padded to one width, the engine has fixed buckets and one max_len shared by evaluation and RL,
and the RL micro-batches are padded to multiples of `rl_seq_bucket`.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import time
from typing import Callable

import jax
import numpy as np

from sfrrl_jax.agents.tasks.demos import calculator_demonstration, render_sft_example
from sfrrl_jax.agents.tasks.environments import CALCULATOR_SYSTEM_PROMPT, ToolEnvironment
from sfrrl_jax.agents.loop import AgentConfig
from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.tools import CalculatorTool
from sfrrl_jax.agents.tasks.builtin_kinds import generate_arithmetic_tasks
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.launch.recipes import register_recipe
from sfrrl_jax.mesh import make_mesh
from sfrrl_jax.models import init_params
from sfrrl_jax.rl.config import AdvantageConfig, LossConfig
from sfrrl_jax.tokenizer import build_tiny_tokenizer, load_tokenizer
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.agent_rollout import AgentRollout
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.evaluate import evaluate
from sfrrl_jax.trainer.rl_trainer import RLTrainer, TaskStream
from sfrrl_jax.trainer.run_logger import RunLogger
from sfrrl_jax.trainer.sft import run_sft, teacher_forced_accuracy


@dataclasses.dataclass(frozen=True)
class QuickstartRecipe:
    """Every knob of the quickstart; the defaults are the full (<= 10 min on 2 CPU cores) recipe.

    Model: `model_preset` with the listed fields overridden (n_experts, top_k, d_ff_expert,
    d_model, n_layers, max_seq_len). Tasks: `generate_arithmetic_tasks` with `min_ops..max_ops`
    operations over numbers of up to `max_digits` digits; the SFT, RL and evaluation sets come
    from different seeds and evaluation tasks that also occur in a training set are dropped.
    Engine: `max_slots` decode slots, `engine_max_len` tokens per slot, prefill `engine_buckets`.
    """

    # model and mesh
    model_preset: str = "tiny-moe"
    d_model: int = 64
    n_layers: int = 2
    n_experts: int = 4
    top_k: int = 2
    d_ff_expert: int = 64
    max_seq_len: int = 192
    mesh_devices: int = 1
    seed: int = 0
    # tasks
    min_ops: int = 1
    max_ops: int = 1
    max_digits: int = 2
    sft_tasks: int = 1000
    rl_tasks: int = 256
    eval_tasks: int = 200
    show_tool_schemas: bool = False  # see CalculatorEnvironment
    use_system_prompt: bool = False  # CALCULATOR_SYSTEM_PROMPT: ~50 more tokens in every row
    # SFT
    # share of SFT demonstrations that answer directly, without the tool (see sft_demonstrations)
    sft_direct_answer_fraction: float = 0.75
    sft_steps: int = 2000             # at most; the warm start stops once it solves the probe
    sft_probe_tasks: int = 64         # tool-route probe: RL tasks (unseen in SFT), see tool_route_probe
    sft_probe_every: int = 100
    sft_target_accuracy: float = 0.75  # probe sequence accuracy that ends SFT (0: run all sft_steps)
    sft_batch_size: int = 16
    sft_learning_rate: float = 3e-3
    sft_warmup_steps: int = 20
    sft_seq_bucket: int = 32
    # RL (GRPO in the pipelined trainer)
    mode: str = "pipelined"
    rl_steps: int = 20
    group_size: int = 8
    groups_per_step: int = 8
    rl_learning_rate: float = 5e-4
    rl_warmup_steps: int = 0
    rl_reuse_sft_moments: bool = False  # start RL from SFT's Adam moments (see _run)
    temperature: float = 0.7
    max_turns: int = 4
    max_new_tokens_per_turn: int = 32
    max_total_tokens: int = 192
    rl_seq_bucket: int = 64
    advantage_estimator: str = "grpo"
    # engine (shared by evaluation and RL)
    max_slots: int = 16
    engine_max_len: int = 192
    engine_buckets: tuple[int, ...] = (16, 32, 128)
    decode_steps: int = 4
    # evaluation / output
    eval_every: int = 0           # also evaluate every this many RL steps (0: only before and after)
    # Held-out scoring: greedy by default; eval_temperature > 0 scores the sampled policy
    # (None: the RL temperature) with eval_samples samples per task.
    eval_temperature: float | None = 0.0
    eval_samples: int = 4
    tokenizer_dir: str = ""       # '' builds the tiny tokenizer into run_dir/tokenizer
    tensorboard: bool = True

    def __post_init__(self):
        own = "QuickstartRecipe"
        for k in ("d_model", "n_layers", "n_experts", "top_k", "d_ff_expert", "max_seq_len", "mesh_devices",
                  "min_ops", "max_digits", "sft_tasks", "rl_tasks", "eval_tasks", "sft_batch_size",
                  "sft_seq_bucket", "group_size", "groups_per_step", "max_turns", "max_new_tokens_per_turn",
                  "max_total_tokens", "rl_seq_bucket", "max_slots", "engine_max_len", "decode_steps"):
            if getattr(self, k) < 1:
                raise ValueError(f"{own}.{k} must be >= 1, got {getattr(self, k)!r}")
        for k in ("sft_steps", "rl_steps", "eval_every", "sft_warmup_steps", "rl_warmup_steps", "sft_probe_tasks",
                  "sft_probe_every"):
            if getattr(self, k) < 0:
                raise ValueError(f"{own}.{k} must be >= 0, got {getattr(self, k)!r}")
        if not 0.0 <= self.sft_direct_answer_fraction <= 1.0:
            raise ValueError(f"{own}.sft_direct_answer_fraction must be in [0, 1], got "
                             f"{self.sft_direct_answer_fraction!r}")
        if not 0.0 <= self.sft_target_accuracy <= 1.0:
            raise ValueError(f"{own}.sft_target_accuracy must be in [0, 1], got {self.sft_target_accuracy!r}")
        if self.sft_target_accuracy > 0 and not (self.sft_probe_tasks and self.sft_probe_every):
            raise ValueError(f"{own}.sft_target_accuracy={self.sft_target_accuracy} needs sft_probe_tasks >= 1 "
                             f"and sft_probe_every >= 1")
        if self.sft_probe_tasks > self.rl_tasks:
            raise ValueError(f"{own}.sft_probe_tasks={self.sft_probe_tasks} > rl_tasks={self.rl_tasks}: the "
                             f"probe is drawn from the RL tasks")
        if self.max_ops < self.min_ops:
            raise ValueError(f"{own}: max_ops={self.max_ops} < min_ops={self.min_ops}")
        if self.max_total_tokens > self.engine_max_len:
            raise ValueError(f"{own}.max_total_tokens={self.max_total_tokens} > engine_max_len="
                             f"{self.engine_max_len}: a trajectory must fit its KV cache slot")
        if self.engine_max_len > self.max_seq_len:
            raise ValueError(f"{own}.engine_max_len={self.engine_max_len} > max_seq_len={self.max_seq_len}")
        object.__setattr__(self, "engine_buckets", tuple(int(b) for b in self.engine_buckets))

    @classmethod
    def reduced(cls, **overrides) -> "QuickstartRecipe":
        """The CI-size recipe; `overrides` replace any field.

        SFT and RL are the full ones: SFT ends at the probe whatever the size (a shorter cap
        would stop some seeds before the tool route works, see the module doc), and an RL step
        costs about a second. The task sets and the evaluation are smaller.
        """
        base = dict(eval_tasks=96, rl_tasks=128)
        return cls(**{**base, **overrides})

    def model_config(self) -> ModelConfig:
        return ModelConfig.preset(self.model_preset, d_model=self.d_model, n_layers=self.n_layers,
                                  n_experts=self.n_experts, top_k=self.top_k, d_ff_expert=self.d_ff_expert,
                                  max_seq_len=self.max_seq_len)

    def agent_config(self, temperature: float, seed: int = 0) -> AgentConfig:
        return AgentConfig(max_turns=self.max_turns, max_new_tokens_per_turn=self.max_new_tokens_per_turn,
                           max_total_tokens=self.max_total_tokens, temperature=temperature, seed=seed)


class CalculatorEnvironment(ToolEnvironment):
    """The calculator environment (system prompt, calculator tool, exact-answer verifier), with the
    tool's JSON schema optionally left out of the prompt.

    The schema is ~115 of the ~190 prompt tokens; a model trained from scratch on this one tool
    never needs to read it, and leaving it out makes every prefill and train row ~2.5x shorter.
    Tool calls still go through the same `ToolRunner` (name and argument checks included).
    """

    def __init__(self, show_tool_schemas: bool = True, system_prompt: str | None = CALCULATOR_SYSTEM_PROMPT):
        super().__init__([CalculatorTool()], system_prompt)
        self.show_tool_schemas = show_tool_schemas

    def tool_schemas(self) -> list[dict]:
        return super().tool_schemas() if self.show_tool_schemas else []


def direct_answer_demonstration(task: Task, system_prompt: str | None) -> list[dict]:
    """A transcript that states the (correct) answer at once, without calling the tool."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": task.prompt},
                       {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]


def sft_demonstrations(tasks: list[Task], direct_fraction: float, system_prompt: str | None, seed: int) -> list[list[dict]]:
    """One transcript per task: a calculator demonstration, or (a seeded `direct_fraction` of the
    tasks) a direct answer.

    The direct answers are right, but a model of this size cannot compute them in its head: it
    imitates their form, not their content. The warm-started policy therefore sometimes calls the
    tool and sometimes guesses; RL is what learns that calling the tool is the route that pays.
    """
    rng = np.random.default_rng([seed, 17])
    direct = rng.random(len(tasks)) < direct_fraction
    return [direct_answer_demonstration(t, system_prompt) if d else calculator_demonstration(t, system_prompt)
            for t, d in zip(tasks, direct)]


def mask_answer_content(tokenizer, tokens: list[int], loss_mask: list[int]) -> list[int]:
    """`loss_mask` with the tokens between the last assistant turn's `<answer>` and `</answer>`
    set to 0 (the tags and the end-of-turn token stay trained).

    Used on direct-answer demonstrations: the model learns to take that route and its form, but
    is not fitted to digits it cannot compute. Fitting them (memorising each answer) trains the
    same `<answer>` digit predictions that a tool demonstration trains to copy the tool's result:
    measured, the tool route's remaining teacher-forced errors sat almost all in the answer's
    digits, and held-out sequence accuracy plateaued near 0.2.
    """
    mask = list(loss_mask)
    start = len(mask)  # the last assistant turn: the trailing run of loss tokens
    while start > 0 and mask[start - 1]:
        start -= 1
    # token i of the turn spans characters ends[i - 1]..ends[i] of its text
    ends = list(itertools.accumulate(len(tokenizer.decode([t])) for t in tokens[start:]))
    turn = tokenizer.decode(tokens[start:])
    open_at, close_at = len("<answer>"), turn.rfind("</answer>")
    if (not turn.startswith("<answer>") or close_at < open_at or ends[-1] != len(turn) or open_at not in ends
            or close_at not in [0] + ends):
        raise ValueError(f"mask_answer_content: the last assistant turn is not '<answer>...</answer>' on token "
                         f"boundaries: {turn!r}")
    first, stop = start + ends.index(open_at) + 1, start + ([0] + ends).index(close_at)
    mask[first:stop] = [0] * (stop - first)
    return mask


def sft_examples(tokenizer, demos: list[list[dict]], tools) -> list[dict]:
    """{'tokens', 'loss_mask'} per transcript; a direct answer's content is masked (`mask_answer_content`)."""
    out = []
    for demo in demos:
        tokens, mask = render_sft_example(tokenizer, demo, tools)
        if not any(m.get("tool_calls") for m in demo):
            mask = mask_answer_content(tokenizer, tokens, mask)
        out.append({"tokens": tokens, "loss_mask": mask})
    return out


def tool_route_probe(tokenizer, tasks: list[Task], system_prompt: str | None, tools) -> list[dict]:
    """Tool demonstrations of `tasks` with the first generated token (the route decision: call
    the tool or answer at once) out of the loss mask: teacher-forced, the share of these solved
    exactly is the share the greedy policy solves once it has chosen the tool."""
    out = []
    for task in tasks:
        tokens, mask = render_sft_example(tokenizer, calculator_demonstration(task, system_prompt), tools)
        mask = list(mask)
        mask[mask.index(1)] = 0
        out.append({"tokens": tokens, "loss_mask": mask})
    return out


def quickstart_tasks(recipe: QuickstartRecipe) -> tuple[list[Task], list[Task], list[Task]]:
    """(sft, rl, eval) task lists; eval holds no expression that occurs in sft or rl."""
    gen = lambda n, salt: generate_arithmetic_tasks(n, seed=recipe.seed * 1000 + salt, min_ops=recipe.min_ops,
                                                    max_ops=recipe.max_ops, max_digits=recipe.max_digits)
    sft, rl = gen(recipe.sft_tasks, 1), gen(recipe.rl_tasks, 2)
    seen = {t.metadata["expression"] for t in sft + rl}
    held, extra = [], 0
    while len(held) < recipe.eval_tasks:  # draw more until enough unseen ones remain
        batch = gen(recipe.eval_tasks + extra, 3)
        held = [t for t in batch if t.metadata["expression"] not in seen][:recipe.eval_tasks]
        extra += recipe.eval_tasks
        if extra > 50 * recipe.eval_tasks:
            raise ValueError("quickstart: cannot draw enough held-out tasks; raise max_digits or lower the set sizes")
    return sft, rl, held


def quickstart_mesh(recipe: QuickstartRecipe, devices):
    """The recipe's mesh over `devices`: as many on the `expert` axis as divide the experts, the
    rest on `data` (8 devices, 4 experts -> data 2 x expert 4)."""
    expert = math.gcd(len(devices), recipe.n_experts)
    return make_mesh(data=len(devices) // expert, expert=expert, devices=devices)


def _round(metrics: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}


def run_quickstart(recipe: QuickstartRecipe, run_dir, log: Callable[[str], None] = print) -> dict:
    """Runs the recipe (module doc) -> {'success_before', 'success_after', 'wall_s', 'metrics_path',
    'tensorboard_dir', 'trace_path', 'png_path', 'sft_s', 'rl_s', 'eval_before', 'eval_after',
    'rl_reward_first', 'rl_reward_last', ...}."""
    t_start = time.perf_counter()
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.json").write_text(json.dumps(dataclasses.asdict(recipe), indent=2, sort_keys=True) + "\n")
    logger = RunLogger(run_dir, tensorboard=recipe.tensorboard)
    try:
        return _run(recipe, run_dir, logger, log, t_start)
    finally:
        logger.close()


def _run(recipe: QuickstartRecipe, run_dir: pathlib.Path, logger: RunLogger, log, t_start: float) -> dict:
    tokenizer = load_tokenizer(recipe.tokenizer_dir or build_tiny_tokenizer(run_dir / "tokenizer"))
    model_cfg = recipe.model_config()
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens > ModelConfig.vocab_size={model_cfg.vocab_size}")
    devices = jax.devices()
    if recipe.mesh_devices > len(devices):
        raise ValueError(f"QuickstartRecipe.mesh_devices={recipe.mesh_devices} > {len(devices)} available devices")
    mesh = quickstart_mesh(recipe, devices[:recipe.mesh_devices])
    params = init_params(model_cfg, mesh, seed=recipe.seed)
    env = CalculatorEnvironment(recipe.show_tool_schemas,
                                CALCULATOR_SYSTEM_PROMPT if recipe.use_system_prompt else None)
    tools = env.tool_schemas() or None
    sft_tasks, rl_tasks, eval_tasks = quickstart_tasks(recipe)
    demos = sft_demonstrations(sft_tasks, recipe.sft_direct_answer_fraction, env.system_prompt, recipe.seed)
    examples = sft_examples(tokenizer, demos, tools)
    probe = tool_route_probe(tokenizer, rl_tasks[:recipe.sft_probe_tasks], env.system_prompt, tools)
    log(f"quickstart: {model_cfg.name} ({model_cfg.param_count():,} params, {recipe.n_experts} experts, top-{recipe.top_k}) "
        f"on {recipe.mesh_devices} {devices[0].platform} device(s); {len(sft_tasks)} SFT / {len(rl_tasks)} RL / "
        f"{len(eval_tasks)} held-out tasks ({recipe.min_ops}-{recipe.max_ops} ops, <= {recipe.max_digits} digits)")
    engine_kw = dict(max_slots=recipe.max_slots, max_len=recipe.engine_max_len, buckets=recipe.engine_buckets,
                     decode_steps=recipe.decode_steps)
    eval_temp = recipe.temperature if recipe.eval_temperature is None else recipe.eval_temperature
    eval_cfg = recipe.agent_config(temperature=eval_temp, seed=recipe.seed + 1)
    eval_samples = recipe.eval_samples if eval_temp > 0 else 1

    def held_out_eval(params, rl_step: int, tag: str) -> dict:
        result = evaluate(model_cfg, params, env, tokenizer, eval_tasks, eval_cfg,
                          samples_per_task=eval_samples, **engine_kw)
        logger.log(rl_step, {"phase": "eval", "tag": tag, **{f"eval/{k}": v for k, v in result.items()}})
        log(f"eval ({tag}): success {result['success_rate']:.3f}  mean reward {result['mean_reward']:.3f}  "
            f"tool calls/traj {result['mean_tool_calls']:.2f}  [{result['wall_s']:.1f}s]")
        return result

    # -- SFT warm start ------------------------------------------------------------------------
    t_sft = time.perf_counter()
    sft_opt = OptimizerConfig(learning_rate=recipe.sft_learning_rate, warmup_steps=recipe.sft_warmup_steps,
                              total_steps=max(recipe.sft_steps, 1), end_lr_ratio=0.1, weight_decay=0.0)
    probe_history = []

    def probe_solved(steps_done: int, live_params) -> bool:
        acc = teacher_forced_accuracy(model_cfg, live_params, probe, seq_bucket=recipe.sft_seq_bucket)
        probe_history.append({"step": steps_done, **acc})
        log(f"sft probe after {steps_done} steps: tool route solved {acc['sequence_accuracy']:.3f} "
            f"(token accuracy {acc['token_accuracy']:.3f}; target {recipe.sft_target_accuracy})")
        return acc["sequence_accuracy"] >= recipe.sft_target_accuracy > 0

    params, sft_opt_state, sft_history = run_sft(model_cfg, params, sft_opt, examples, recipe.sft_steps, recipe.sft_batch_size,
                                     seed=recipe.seed, seq_bucket=recipe.sft_seq_bucket,
                                     log_every=max(recipe.sft_steps // 10, 1), log=log,
                                     stop_when=probe_solved if probe and recipe.sft_probe_every else None,
                                     check_every=recipe.sft_probe_every)
    for m in sft_history:
        logger.log(m["step"], {"phase": "sft", **{f"sft/{k}": v for k, v in m.items() if k != "step"}})
    for m in probe_history:
        logger.log(m["step"], {"phase": "sft_probe", **{f"sft_probe/{k}": v for k, v in m.items() if k != "step"}})
    sft_s = time.perf_counter() - t_sft
    eval_before = held_out_eval(params, 0, "after_sft")

    # -- pipelined GRPO ------------------------------------------------------------------------
    t_rl = time.perf_counter()
    trainer_cfg = TrainerConfig(mode=recipe.mode, groups_per_step=recipe.groups_per_step,
                                group_size=recipe.group_size, max_slots=recipe.max_slots,
                                max_len=recipe.engine_max_len, decode_steps=recipe.decode_steps,
                                buckets=recipe.engine_buckets, seq_bucket=recipe.rl_seq_bucket,
                                advantage=AdvantageConfig(estimator=recipe.advantage_estimator), seed=recipe.seed)
    rl_opt = OptimizerConfig(learning_rate=recipe.rl_learning_rate, warmup_steps=recipe.rl_warmup_steps,
                             total_steps=max(recipe.rl_steps, 1), end_lr_ratio=1.0, weight_decay=0.0)
    rollout = AgentRollout(env, tokenizer, recipe.agent_config(recipe.temperature, seed=recipe.seed))
    # Adam's moments from SFT, with the schedule's step count restarted: a fresh Adam state makes
    # the first RL updates sign-like (every weight moves by ~lr whatever its gradient), which from
    # a handful of rewarded samples is mostly noise, and the momentum then keeps the policy
    # drifting for tens of steps in which every reward is 0. The SFT second moments scale the RL
    # updates by their gradients instead.
    rl_opt_state = None
    if recipe.rl_reuse_sft_moments and sft_history:
        rl_opt_state = {"step": jax.numpy.zeros_like(sft_opt_state["step"]), "inner": sft_opt_state["inner"]}
    trainer = RLTrainer(model_cfg, params, trainer_cfg, LossConfig(), rl_opt, rollout,
                        TaskStream(rl_tasks, seed=recipe.seed), opt_state=rl_opt_state)
    rl_history = []
    for step in range(recipe.rl_steps):
        metrics = trainer.step()
        metrics["phase"] = "rl"
        logger.log(step, metrics)
        rl_history.append(metrics)
        log(f"rl step {step:3d}/{recipe.rl_steps}  reward {metrics['reward/mean']:.3f}  "
            f"success {metrics['reward/success_rate']:.3f}  busy {metrics['perf/device_busy']:.2f}  "
            f"hidden-train {metrics['time/hidden_train_share']:.2f}  {metrics['time/wall_s']:.1f}s")
        if recipe.eval_every and (step + 1) % recipe.eval_every == 0 and step + 1 < recipe.rl_steps:
            held_out_eval(trainer.params, step + 1, f"rl_step_{step + 1}")
    rl_s = time.perf_counter() - t_rl
    eval_after = held_out_eval(trainer.params, recipe.rl_steps, "after_rl")
    outputs = logger.write_timeline(trainer.timeline)
    env.close()

    wall = time.perf_counter() - t_start
    result = {
        "success_before": eval_before["success_rate"],
        "success_after": eval_after["success_rate"],
        "success_gain": eval_after["success_rate"] - eval_before["success_rate"],
        "wall_s": wall,
        "sft_s": sft_s,
        "rl_s": rl_s,
        "sft_final_loss": sft_history[-1]["loss"] if sft_history else float("nan"),
        "sft_steps": len(sft_history),
        "sft_probe_accuracy": probe_history[-1]["sequence_accuracy"] if probe_history else float("nan"),
        "rl_reward_first": rl_history[0]["reward/mean"] if rl_history else float("nan"),
        "rl_reward_last": rl_history[-1]["reward/mean"] if rl_history else float("nan"),
        "eval_before": _round(eval_before),
        "eval_after": _round(eval_after),
        "metrics_path": str(logger.metrics_path),
        "tensorboard_dir": str(run_dir / "tensorboard") if recipe.tensorboard else "",
        "trace_path": outputs["trace"],
        "png_path": outputs["png"],
        "run_dir": str(run_dir),
    }
    (run_dir / "result.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    log(f"quickstart done in {wall:.0f}s (SFT {sft_s:.0f}s, RL {rl_s:.0f}s): held-out success "
        f"{result['success_before']:.3f} -> {result['success_after']:.3f} ({100 * result['success_gain']:+.1f} points)")
    log(f"  metrics: {result['metrics_path']}\n  tensorboard: {result['tensorboard_dir']}\n"
        f"  timeline: {result['trace_path']}\n  busy/idle plot: {result['png_path']}")
    return result


register_recipe("quickstart", QuickstartRecipe, run_quickstart)
