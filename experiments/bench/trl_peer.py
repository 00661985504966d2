"""TRL's side of the real-model benches (`real_model_step.py`, `real_model_learning.py`): our loss and
optimizer configs as `GRPOConfig` fields, our reward functions as TRL reward functions (scored on
the trajectory our agent loop would build), and a quiet `trainer.train()`."""
from __future__ import annotations

import asyncio
import inspect
import shutil
import time
from typing import Callable, Sequence


_AGGREGATION_TO_TRL = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
_ESTIMATOR_TO_TRL = {"grpo": "group", "dr_grpo": "none"}


def trl_loss_kwargs(loss_cfg, advantage_cfg) -> dict:
    """GRPOConfig's loss fields for our LossConfig / AdvantageConfig; raises ValueError naming a field
    TRL cannot match (the bench then would compare different objectives)."""
    if loss_cfg.objective != "policy":
        raise ValueError(f"LossConfig.objective={loss_cfg.objective!r}: only the policy loss has a TRL twin")
    if loss_cfg.aggregation not in _AGGREGATION_TO_TRL:
        raise ValueError(f"LossConfig.aggregation={loss_cfg.aggregation!r} has no TRL loss_type "
                         f"(matched: {sorted(_AGGREGATION_TO_TRL)})")
    if advantage_cfg.estimator not in _ESTIMATOR_TO_TRL:
        raise ValueError(f"AdvantageConfig.estimator={advantage_cfg.estimator!r} has no TRL scale_rewards "
                         f"(matched: {sorted(_ESTIMATOR_TO_TRL)})")
    for name in ("dual_clip",):
        if getattr(loss_cfg, name) is not None:
            raise ValueError(f"LossConfig.{name}={getattr(loss_cfg, name)!r} has no TRL twin")
    if loss_cfg.entropy_coef or loss_cfg.is_correction != "none":
        raise ValueError("LossConfig.entropy_coef / is_correction have no TRL twin in this bench")
    if loss_cfg.behavior != "current":
        raise ValueError(f"LossConfig.behavior={loss_cfg.behavior!r}: TRL's one-update-per-batch ratio is "
                         "against the current policy ('current')")
    kw = {"beta": float(loss_cfg.kl_coef), "epsilon": float(loss_cfg.clip_low),
          "epsilon_high": float(loss_cfg.clip_high), "loss_type": _AGGREGATION_TO_TRL[loss_cfg.aggregation],
          "scale_rewards": _ESTIMATOR_TO_TRL[advantage_cfg.estimator],
          "importance_sampling_level": "sequence" if loss_cfg.policy_loss == "gspo" else "token",
          "num_iterations": 1}
    if loss_cfg.aggregation == "seq_mean_token_sum_norm" and loss_cfg.norm_length is not None:
        raise ValueError("LossConfig.norm_length: TRL's dr_grpo normalises by max_completion_length")
    return kw


def trl_config_kwargs(setting: dict, optimizer_cfg, loss_kwargs: dict, max_steps: int, output_dir: str,
                      seed: int = 0) -> dict:
    """GRPOConfig(**these): the setting's group shape and sampling, our optimizer, float32 on CPU,
    no checkpoints or reports. One generation per optimizer step of `groups_per_step` prompts x
    `group_size` completions, trained one group's worth of rows per micro-batch."""
    g, n = setting["group_size"], setting["groups_per_step"]
    return {
        "output_dir": output_dir, "max_steps": max_steps, "seed": seed, "use_cpu": True,
        "bf16": False, "fp16": False, "activation_checkpointing": False, "gradient_checkpointing": False,
        "per_device_train_batch_size": g, "gradient_accumulation_steps": n, "steps_per_generation": n,
        "num_generations": g, "max_completion_length": setting["max_new_tokens"],
        "temperature": float(setting["temperature"]), "top_p": 1.0, "top_k": 0,
        "learning_rate": float(optimizer_cfg.learning_rate), "lr_scheduler_type": "constant", "warmup_steps": 0,
        "adam_beta1": float(optimizer_cfg.b1), "adam_beta2": float(optimizer_cfg.b2),
        "adam_epsilon": float(optimizer_cfg.eps), "weight_decay": float(optimizer_cfg.weight_decay),
        "max_grad_norm": float(optimizer_cfg.max_grad_norm or 0.0),
        "reward_weights": None,   # set by the caller: our environment's weights
        "mask_truncated_completions": False, "log_completions": False,
        "logging_steps": 1, "report_to": "none", "save_strategy": "no", "remove_unused_columns": False,
        "dataloader_num_workers": 0, "disable_tqdm": True,
        **loss_kwargs,
    }


# -- our reward functions as TRL reward functions ------------------------------------------------------
def scoring_trajectory(task, prompt_ids: Sequence[int], completion_ids: Sequence[int], tokenizer, fmt,
                       messages: Sequence[dict] = ()):
    """The Trajectory our agent loop would hand the reward functions for a single-turn completion:
    the prompt then the generated ids (mask 1), final_text = the tool format's parse of our
    tokenizer's decode (special tokens kept, as the loop decodes), finish 'answer' or 'length'."""
    from sfrrl_jax.agents.trajectory import TrajectoryBuilder
    builder = TrajectoryBuilder(task.task_id, task.task_id, 0, list(prompt_ids))
    builder.append_generated(list(completion_ids), [0.0] * len(completion_ids))
    traj = builder.trajectory
    parsed = fmt.parse(tokenizer.decode(list(completion_ids)))
    traj.final_text = parsed.content
    traj.messages = [*messages, {"role": "assistant", "content": parsed.content}]
    stops = set(getattr(tokenizer, "stop_token_ids", ()))
    traj.finish_reason = "answer" if completion_ids and completion_ids[-1] in stops else "length"
    return traj


def _settle(value):
    return asyncio.run(_await(value)) if inspect.isawaitable(value) else value


async def _await(value):
    return await value


def trl_reward_funcs(reward_fns: Sequence[Callable], names: Sequence[str], tasks: Sequence, prompt_ids: Sequence,
                     tokenizer, fmt, prompt_messages: Sequence = ()) -> list[Callable]:
    """One TRL reward function per our reward function (TRL sums them with `reward_weights`, ours):
    `fn(prompts, completions, completion_ids, task_index, **kwargs) -> list[float]`, where the
    dataset's `task_index` column names the item, so each completion is scored by our function on
    the `scoring_trajectory` our loop would build (an async function is awaited)."""
    out = []
    for fn, name in zip(reward_fns, names):
        def reward(prompts=None, completions=None, completion_ids=None, task_index=None, _fn=fn, **kwargs):
            values = []
            for ids, i in zip(completion_ids, task_index):
                msgs = prompt_messages[i] if prompt_messages else ()
                traj = scoring_trajectory(tasks[i], prompt_ids[i], ids, tokenizer, fmt, msgs)
                values.append(float(_settle(_fn(tasks[i], traj))))
            return values
        reward.__name__ = reward.__qualname__ = name
        out.append(reward)
    return out



def train_quietly(trainer, out_dir: str) -> float:
    """`trainer.train()` without TRL's printing callbacks (the bench prints its own), its output dir
    removed after; returns the wall seconds."""
    import transformers
    for quiet in (transformers.PrinterCallback, transformers.ProgressCallback):
        trainer.remove_callback(quiet)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return time.perf_counter() - t0
