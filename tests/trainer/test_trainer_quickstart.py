"""The quickstart learns (reduced recipe), and its parts: AgentRollout, run_sft, evaluate."""
import asyncio
import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import sfrrl_jax as S
from sfrrl_jax.agents import AgentConfig, generate_arithmetic_tasks
from sfrrl_jax.agents.tasks.demos import calculator_demonstration, render_sft_example
from sfrrl_jax.tokenizer import load_tokenizer
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.agent_rollout import AgentRollout
from sfrrl_jax.trainer.evaluate import evaluate
from experiments.recipes.quickstart import (CalculatorEnvironment, QuickstartRecipe, mask_answer_content,
                                           quickstart_tasks, sft_demonstrations, sft_examples,
                                           tool_route_probe)
from sfrrl_jax.trainer.run_logger import read_metrics
from sfrrl_jax.trainer.sft import check_examples, make_batch, padded_width, run_sft, teacher_forced_accuracy
from sfrrl_jax.trainer.rl_trainer import shared_train_step
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.testing import ScriptedEngine

from process_run import default_opt_env

REPO = Path(__file__).resolve().parents[2]



@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return load_tokenizer(tok_dir)


@functools.lru_cache(maxsize=None)
def _one_device_mesh():
    return S.make_mesh(devices=jax.devices()[:1])


def test_agent_rollout_runs_the_loop_sets_the_reward_and_draws_distinct_seeds(tokenizer):
    env = CalculatorEnvironment(show_tool_schemas=False)
    (task,) = generate_arithmetic_tasks(1, seed=5, min_ops=1, max_ops=1, max_digits=2)
    left, op, right, value = task.metadata["steps"][0]
    script = [f'<|call|>calculator{{"expression":"{left}{op}{right}"}}<|/call|><|end|>',
              f"<answer>{value}</answer><|end|>"]
    rollout = AgentRollout(env, tokenizer, AgentConfig(max_turns=3, max_new_tokens_per_turn=32,
                                                       max_total_tokens=192, seed=7))

    def roll(sample_index):
        engine = ScriptedEngine(script, tokenizer=tokenizer)
        traj = asyncio.run(rollout(engine, task, sample_index))
        return traj, [r.seed for r in engine.requests], engine

    t0, seeds0, engine = roll(0)
    assert t0.reward == 1.0 and t0.finish_reason == "answer" and t0.num_tool_calls == 1
    assert t0.group_id == task.task_id and t0.sample_index == 0 and t0.metadata["tool_errors"] == 0
    assert engine.released == [0] and engine.slots[0].turn == 2  # one slot, released once at the end
    t0.check()
    # the observation is the calculator's real result, appended as a delta (mask 0)
    turn = t0.turns[0]
    assert tokenizer.decode(t0.tokens[turn.gen_end:turn.obs_end]) == f"<|tool|>{value}<|end|><|assistant|>"
    assert set(t0.loss_mask[turn.gen_end:turn.obs_end]) == {0}
    _, seeds1, _ = roll(1)
    _, seeds0_again, _ = roll(0)   # second visit of (task, 0): fresh draws
    assert len(set(seeds0 + seeds1 + seeds0_again)) == 6
    assert rollout.visits[(task.task_id, 0)] == 2
    fresh = AgentRollout(env, tokenizer, rollout.agent_cfg)  # a rerun reproduces the draws
    engine = ScriptedEngine(script, tokenizer=tokenizer)
    asyncio.run(fresh(engine, task, 0))
    assert [r.seed for r in engine.requests] == seeds0
    wrong = ScriptedEngine([script[0], "<answer>0</answer><|end|>"], tokenizer=tokenizer)
    assert asyncio.run(rollout(wrong, task, 2)).reward == 0.0
    with pytest.raises(TypeError, match="agent_cfg must be an AgentConfig"):
        AgentRollout(env, tokenizer, {"temperature": 1.0})


def _examples(tokenizer, n, seed=0):
    env = CalculatorEnvironment(show_tool_schemas=False)
    tasks = generate_arithmetic_tasks(n, seed=seed, min_ops=1, max_ops=2, max_digits=2)
    return [dict(zip(("tokens", "loss_mask"), render_sft_example(tokenizer, calculator_demonstration(t, env.system_prompt))))
            for t in tasks]


def test_run_sft_learns_with_one_compile_and_checks_its_input(tokenizer):
    cfg = S.ModelConfig.preset("tiny-moe", n_experts=4, max_seq_len=192)
    params = S.init_params(cfg, _one_device_mesh(), seed=0)
    examples = _examples(tokenizer, 24)
    lengths = {len(e["tokens"]) for e in examples}
    assert len(lengths) > 3  # rows of many lengths ...
    opt = OptimizerConfig(learning_rate=1e-2, warmup_steps=5, total_steps=40)
    params, opt_state, hist = run_sft(cfg, params, opt, examples, steps=40, batch_size=8, seed=0, seq_bucket=32)
    ts = shared_train_step(cfg, LossConfig(objective="sft"), opt)
    assert ts._cache and all(f["step"]._cache_size() == 1 for f in ts._cache.values())  # ... one shape
    assert len(hist) == 40 and [h["step"] for h in hist] == list(range(40))
    assert int(jax.device_get(opt_state["step"])) == 40
    assert hist[-1]["loss"] < 0.35 * hist[0]["loss"], (hist[0]["loss"], hist[-1]["loss"])
    assert hist[0]["num_tokens"] == sum(  # loss tokens of the first batch, padding excluded
        float(np.sum(np.asarray(examples[i]["loss_mask"])[1:]))
        for i in np.random.default_rng([0, 0]).permutation(24)[:8])
    with pytest.raises(KeyError, match="example 1 has no 'loss_mask'"):
        check_examples([examples[0], {"tokens": [1, 2, 3]}], 512, 192)
    with pytest.raises(ValueError, match="example 0: tokens has 3 entries, loss_mask 2"):
        check_examples([{"tokens": [1, 2, 3], "loss_mask": [0, 1]}], 512, 192)
    with pytest.raises(ValueError, match=r"example 0: token ids must lie in \[0, 512\)"):
        check_examples([{"tokens": [1, 600], "loss_mask": [0, 1]}], 512, 192)
    with pytest.raises(ValueError, match="example 0 has 300 tokens > ModelConfig.max_seq_len=192"):
        check_examples([{"tokens": [1] * 300, "loss_mask": [1] * 300}], 512, 192)


def test_sft_batches_pad_to_one_bucketed_width():
    assert padded_width([100, 141, 97], 32, 192) == 160
    batch = make_batch([(np.array([5, 6, 7]), np.array([0, 1, 1.0])), (np.array([8, 9]), np.array([0, 1.0]))], 4)
    assert batch.present == ("tokens", "loss_mask", "segment_ids")
    np.testing.assert_array_equal(batch.tokens, [[5, 6, 7, 0], [8, 9, 0, 0]])
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 1, 1, 0], [0, 1, 0, 0]])


def test_evaluate_scores_every_task_through_the_engine(tokenizer):
    cfg = S.ModelConfig.preset("tiny-moe", n_experts=4, max_seq_len=192)
    params = S.init_params(cfg, _one_device_mesh(), seed=0)
    env = CalculatorEnvironment(show_tool_schemas=False)
    tasks = generate_arithmetic_tasks(6, seed=3, min_ops=1, max_ops=1, max_digits=2)
    agent = AgentConfig(max_turns=2, max_new_tokens_per_turn=8, max_total_tokens=128, temperature=0.0)
    r = evaluate(cfg, params, env, tokenizer, tasks, agent, max_slots=4, max_len=128, buckets=(16, 128),
                 return_trajectories=True)
    trajs = r.pop("trajectories")
    assert r["num_tasks"] == r["num_trajectories"] == 6 and [t.task_id for t in trajs] == [t.task_id for t in tasks]
    assert r["success_rate"] == 0.0  # an untrained model does not produce <answer>N</answer>
    # each reward function's mean, under the trainer's metric names
    assert r["reward/answer_correct"] == np.mean([t.metadata["rewards"]["answer_correct"] for t in trajs])
    assert sum(v for k, v in r.items() if k.startswith("finish/")) == pytest.approx(1.0)
    assert r["mean_generated_tokens"] == np.mean([t.num_generated for t in trajs]) > 0
    again = evaluate(cfg, params, env, tokenizer, tasks, agent, max_slots=4, max_len=128, buckets=(16, 128),
                     return_trajectories=True)["trajectories"]
    assert [t.tokens for t in again] == [t.tokens for t in trajs]  # greedy: deterministic
    with pytest.raises(ValueError, match="max_total_tokens=128 > engine max_len=64"):
        evaluate(cfg, params, env, tokenizer, tasks, agent, max_slots=4, max_len=64)


def test_recipe_validation_and_held_out_tasks_are_unseen():
    with pytest.raises(ValueError, match="QuickstartRecipe.group_size must be >= 1"):
        QuickstartRecipe(group_size=0)
    with pytest.raises(ValueError, match="max_total_tokens=400 > engine_max_len=192"):
        QuickstartRecipe(max_total_tokens=400)
    with pytest.raises(TypeError):
        QuickstartRecipe.reduced(no_such_field=1)
    recipe = QuickstartRecipe.reduced()
    sft, rl, held = quickstart_tasks(recipe)
    assert (len(sft), len(rl), len(held)) == (recipe.sft_tasks, recipe.rl_tasks, recipe.eval_tasks)
    seen = {t.metadata["expression"] for t in sft + rl}
    assert not seen & {t.metadata["expression"] for t in held}
    assert json.loads(json.dumps(dataclasses.asdict(recipe)))  # plain fields only (gin-bindable)


def test_quickstart_learns_and_writes_its_outputs(tok_dir, tmp_path):
    """The CI-size quickstart: SFT to the probe, held-out eval, pipelined GRPO, eval.

    The bound (+15 points) is far below what the recipe gains on any seed and device count
    measured (experiments/bench/quickstart_seeds.py, README): a machine whose float path differs
    changes the figures, not the verdict.
    """
    recipe = QuickstartRecipe.reduced(tokenizer_dir=str(tok_dir))
    # Minutes of training: they run at XLA's default optimisation level, in a subprocess
    # (tests/conftest.py); the recipe writes its result to result.json and logs to stdout.
    script = ("import sys\nfrom experiments.recipes.quickstart import QuickstartRecipe, run_quickstart\n"
              "run_quickstart(QuickstartRecipe.reduced(tokenizer_dir=sys.argv[1]), sys.argv[2],\n"
              "               log=lambda line: print(line, flush=True))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tok_dir), str(tmp_path)], cwd=REPO,
                          env=default_opt_env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    logs = proc.stdout.splitlines()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["success_after"] >= result["success_before"] + 0.15, (result["success_before"],
                                                                        result["success_after"])
    assert result["eval_after"]["mean_tool_calls"] > result["eval_before"]["mean_tool_calls"]
    rows = read_metrics(tmp_path)
    phases = [r["phase"] for r in rows]
    assert phases.count("sft") == result["sft_steps"] <= recipe.sft_steps and phases.count("rl") == recipe.rl_steps
    assert phases.count("eval") == 2
    probes = [r for r in rows if r["phase"] == "sft_probe"]
    assert len(probes) == result["sft_steps"] // recipe.sft_probe_every
    # SFT ran until the probe was solved (or to its cap), and the probe is what the result reports
    assert (result["sft_probe_accuracy"] >= recipe.sft_target_accuracy) or result["sft_steps"] == recipe.sft_steps
    assert probes[-1]["sft_probe/sequence_accuracy"] == result["sft_probe_accuracy"]
    sft = [r["sft/loss"] for r in rows if r["phase"] == "sft"]
    assert np.mean(sft[-10:]) < 0.5 * np.mean(sft[:10])  # the warm start learns the demonstrations
    rl_rows = [r for r in rows if r["phase"] == "rl"]
    assert all(r["policy/on_policy_fraction"] == 1.0 for r in rl_rows)
    assert (tmp_path / "busy_idle.png").stat().st_size > 1000
    assert '"grad_microstep"' in (tmp_path / "timeline.trace.json").read_text()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert any("held-out success" in line for line in logs)


def test_direct_answers_train_the_route_not_the_digits_and_the_probe_excludes_the_route(tokenizer):
    env = CalculatorEnvironment(show_tool_schemas=False, system_prompt=None)
    tasks = generate_arithmetic_tasks(40, seed=11, min_ops=1, max_ops=1, max_digits=2)
    demos = sft_demonstrations(tasks, 0.5, None, seed=3)
    examples = sft_examples(tokenizer, demos, None)
    kinds = set()
    for task, demo, ex in zip(tasks, demos, examples):
        trained = tokenizer.decode([t for t, m in zip(ex["tokens"], ex["loss_mask"]) if m])
        direct = not any(m.get("tool_calls") for m in demo)
        kinds.add(direct)
        if direct:  # tags and end of turn trained, the answer's digits not
            assert trained == "<answer></answer><|end|>", trained
        else:       # a tool demonstration trains everything it generates, digits included
            assert trained.endswith(f"<answer>{task.answer}</answer><|end|>") and "<|call|>" in trained
    assert kinds == {True, False}
    probe = tool_route_probe(tokenizer, tasks[:3], None, None)
    for task, ex in zip(tasks, probe):
        full_tokens, full_mask = render_sft_example(tokenizer, calculator_demonstration(task, None))
        assert ex["tokens"] == full_tokens
        first = full_mask.index(1)
        assert ex["loss_mask"][first] == 0 and tokenizer.decode([full_tokens[first]]) == "<|call|>"
        assert ex["loss_mask"][first + 1:] == full_mask[first + 1:]
    with pytest.raises(ValueError, match="not '<answer>...</answer>'"):
        tokens = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], None, add_generation_prompt=True)
        extra = tokenizer.encode("no tags<|end|>")
        mask_answer_content(tokenizer, tokens + extra, [0] * len(tokens) + [1] * len(extra))


def test_teacher_forced_accuracy_counts_exact_rows_and_sft_stops_when_asked(tokenizer):
    cfg = S.ModelConfig.preset("tiny-moe", n_experts=4, max_seq_len=192)
    params = S.init_params(cfg, _one_device_mesh(), seed=0)
    examples = _examples(tokenizer, 8)
    acc = teacher_forced_accuracy(cfg, params, examples, batch_size=8)
    assert acc["sequence_accuracy"] == 0.0 and 0.0 <= acc["token_accuracy"] < 0.2  # untrained
    # a row whose loss tokens are all the model's own argmax counts as exact
    row = np.asarray(examples[0]["tokens"][:12], np.int32)
    for i in range(4, 12):  # greedy, one shape: causal logits at i - 1 do not see tokens >= i
        row[i] = int(np.argmax(np.asarray(S.forward(cfg, params, row[None, :]))[0, i - 1]))
    mask = [0] * 4 + [1] * 8
    mine = teacher_forced_accuracy(cfg, params, [{"tokens": row.tolist(), "loss_mask": mask}] + examples[:1],
                                   batch_size=8)
    assert mine["sequence_accuracy"] == 0.5
    calls = []
    opt = OptimizerConfig(learning_rate=1e-3, total_steps=20)
    _, _, hist = run_sft(cfg, params, opt, examples, steps=20, batch_size=8, stop_when=lambda n, p: calls.append(n) or n >= 6,
                         check_every=3)
    assert calls == [3, 6] and len(hist) == 6
    with pytest.raises(ValueError, match="stop_when needs check_every >= 1"):
        run_sft(cfg, params, opt, examples, steps=2, batch_size=8, stop_when=lambda n, p: True)
