"""experiments/bench/real_model_step.py's pure parts, without the real model and without TRL:
the TRL reward adapter scores a completion as our agent loop does (same components, same weighted
sum), the settings become the gin bindings a user would write (trainer defaults left alone) and the
TRL config of the same group shape and objective, and the per-step summaries and ratios."""
import importlib.util
import pathlib

import pytest

from sfrrl_jax.agents.tasks.environments import qa_environment
from sfrrl_jax.agents.formats.registry import get_format
from sfrrl_jax.agents.loop import AgentConfig, run_agent
from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.tasks.reward_fns import answer_correct, answer_format
from sfrrl_jax.aio import run_sync
from sfrrl_jax.rl.config import AdvantageConfig, LossConfig
from sfrrl_jax.testing import ScriptedEngine
from sfrrl_jax.tokenizer import load_tokenizer

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench" / "real_model_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("real_model_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load()


def test_trl_reward_adapter_matches_our_agent_loop(bench, tok_dir):
    tok = load_tokenizer(tok_dir)
    env = qa_environment(reward_fns=[answer_correct, answer_format], reward_weights=[1.0, 0.2])
    tasks = [Task("q0", "qa", "Capital of France?", answer="Paris"), Task("q1", "qa", "2 + 2?", answer="4")]
    # right in tags, right without tags, wrong in tags, cut by the token limit (no stop token)
    answers = {0: ["<answer>Paris</answer><|end|>", "Paris<|end|>", "<answer>Rome</answer><|end|>",
                   "<answer>Paris</answer>" + " and so on" * 20],
               1: ["<answer>4</answer><|end|>", "<answer>5</answer><|end|>"]}
    agent = AgentConfig(max_turns=1, max_new_tokens_per_turn=24, max_total_tokens=256, tool_format="compact")
    messages = [env.reset(t) for t in tasks]
    prompt_ids = [tok.apply_chat_template(m, None, add_generation_prompt=True) for m in messages]
    funcs = bench.trl_reward_funcs(env.rewards.fns, env.rewards.names, tasks, prompt_ids, tok,
                                   get_format("compact"), messages)
    assert [f.__name__ for f in funcs] == ["answer_correct", "answer_format"]
    seen = set()
    for i, texts in answers.items():
        for text in texts:
            traj = run_sync(run_agent(ScriptedEngine([text], tokenizer=tok), env, tasks[i], tok, agent))
            assert traj.error is None
            completion = traj.tokens[traj.prompt_len:]
            got = [f(prompts=[messages[i]], completions=[[{"role": "assistant", "content": text}]],
                     completion_ids=[completion], task_index=[i], trainer_state=None)[0] for f in funcs]
            want = traj.metadata["rewards"]
            assert got == [want["answer_correct"], want["answer_format"]], text
            assert sum(w * g for w, g in zip(env.rewards.weights, got)) == pytest.approx(traj.reward)
            seen.add(tuple(got))
    assert seen == {(1.0, 1.0), (0.0, 0.0), (0.0, 1.0)}   # every case told apart
    env.close()


def test_settings_bind_only_what_they_fix(bench):
    from sfrrl_jax.launch import gin_bindings
    from sfrrl_jax.trainer import TrainerConfig

    defaults = TrainerConfig()
    for name, prompt_len, want_budget in (("small", 54, 256), ("realistic", 54, 384)):
        setting = bench.SETTINGS[name]
        budget = bench.token_budget(setting, prompt_len)
        assert budget == want_budget and budget >= prompt_len + setting["max_new_tokens"]
        bindings = bench.ours_bindings(setting, "/nonexistent/model", "/tmp/unused_run", 3, budget, devices=1)
        for knob in ("max_slots", "buckets", "decode_steps", "seq_bucket", "decode_buckets", "pack_rows"):
            assert not any(b.startswith(f"TrainerConfig.{knob} ") for b in bindings), knob
        cfg = gin_bindings.load_job([], bindings).experiment
        tc = cfg.trainer
        assert (tc.groups_per_step, tc.group_size) == (setting["groups_per_step"], setting["group_size"])
        assert tc.mode == "pipelined" and tc.max_len == max(defaults.max_len, budget)
        assert (tc.max_slots, tc.buckets, tc.decode_steps, tc.seq_bucket) == \
            (defaults.max_slots, defaults.buckets, defaults.decode_steps, defaults.seq_bucket)
        agent = cfg.rollout.agent
        assert (agent.max_new_tokens_per_turn, agent.max_total_tokens, agent.temperature, agent.max_turns) == \
            (setting["max_new_tokens"], budget, setting["temperature"], 1)
        assert cfg.optimizer.learning_rate == setting["learning_rate"]
        assert cfg.rollout.environment.rewards.names == bench.REWARD_FNS
        assert cfg.rollout.environment.rewards.weights == bench.REWARD_WEIGHTS
        cfg.rollout.environment.close()
    assert (bench.SETTINGS["small"]["groups_per_step"], bench.SETTINGS["small"]["group_size"]) == (2, 4)
    assert (bench.SETTINGS["realistic"]["groups_per_step"], bench.SETTINGS["realistic"]["group_size"]) == (8, 8)


def test_trl_loss_and_config_follow_ours(bench):
    from sfrrl_jax.learner.optimizer import OptimizerConfig

    loss = bench.trl_loss_kwargs(LossConfig(), AdvantageConfig())
    assert loss == {"beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2, "loss_type": "dapo", "scale_rewards": "group",
                    "importance_sampling_level": "token", "num_iterations": 1}
    assert bench.trl_loss_kwargs(LossConfig(policy_loss="gspo", clip_high=0.28), AdvantageConfig(
        estimator="dr_grpo"))["importance_sampling_level"] == "sequence"
    for bad in (LossConfig(dual_clip=3.0), LossConfig(objective="sft"), LossConfig(aggregation="seq_mean_token_sum"),
                LossConfig(behavior="rollout")):
        with pytest.raises(ValueError):
            bench.trl_loss_kwargs(bad, AdvantageConfig())
    kw = bench.trl_config_kwargs(bench.SETTINGS["realistic"], OptimizerConfig(learning_rate=2e-6), loss, 4, "/tmp/x")
    assert (kw["num_generations"], kw["per_device_train_batch_size"]) == (8, 8)
    assert kw["gradient_accumulation_steps"] == kw["steps_per_generation"] == 8
    assert (kw["max_completion_length"], kw["learning_rate"], kw["max_grad_norm"]) == (256, 2e-6, 1.0)
    assert not kw["bf16"] and not kw["gradient_checkpointing"] and kw["use_cpu"]
    trl = pytest.importorskip("trl")
    kw["reward_weights"] = [1.0, 0.2]
    args = trl.GRPOConfig(**kw)
    assert args.generation_batch_size == 64 and args.num_generations == 8 and args.beta == 0.0


def _row(step, wall, rollout, train, exposed, generated, compiles, seqs=8, padding=0.1):
    return {"step": step, "time/wall_s": wall, "time/rollout_s": rollout, "time/train_s": train,
            "time/train_exposed_s": exposed, "time/hidden_train_share": 1 - exposed / train,
            "rollout/generated_tokens": generated, "train/trained_tokens": generated, "train/num_seqs": seqs,
            "train/padding_share": padding, "perf/compile_count": compiles, "reward/mean": 0.5}


def test_summaries_and_ratios(bench):
    rows = [_row(0, 30.0, 20.0, 10.0, 10.0, 200, 7),            # the warm-up: dropped
            _row(1, 12.0, 6.0, 8.0, 6.0, 240, 9),               # compiled new shapes: left out
            _row(2, 10.0, 6.0, 5.0, 4.0, 200, 9), _row(3, 8.0, 5.0, 3.0, 3.0, 160, 9)]
    steps = bench.ours_steps(rows, warmup=1, prompt_len=50)
    assert [s["new_compiles"] for s in steps] == [2, 0, 0]
    assert steps[1]["host_s"] == pytest.approx(0.0) and steps[1]["trained_tokens"] == 8 * 50 + 200
    ours = bench.summarize(steps)
    assert ours["steps"] == 2 and ours["compiled_steps_left_out"] == 1
    assert ours["s_per_step"] == pytest.approx(9.0)
    assert ours["generated_tok_s"] == pytest.approx(360 / 18)
    assert ours["trained_tok_s"] == pytest.approx((600 + 560) / 8)
    assert bench.summarize(steps[:1])["compiled_steps_included"] == 1   # none warm: kept, and said
    trl = bench.summarize([{"step_s": 18.0, "rollout_s": 10.0, "train_s": 8.0, "generated_tokens": 180,
                            "trained_tokens": 580, "padding_share": 0.3, "reward": 0.2}])
    r = bench.ratios(ours, trl)
    assert r["per_step"] == pytest.approx(2.0) and r["per_generated_token"] == pytest.approx(20 / 10)
    assert bench.flop_share(ours, 100, 6.0 * 100 * ours["trained_tok_s"] * 2) == pytest.approx(0.5)
    table = bench.format_table({"small": {"ours": {"summary": ours, "train_flop_share": 0.5},
                                          "trl": {"summary": trl, "train_flop_share": None}, "ratios": r}})
    assert "2.00x per step" in table and len(table.splitlines()) == 4


def test_flop_share_counts_forward_only_tokens_at_a_third(bench):
    """Tokens of forward-only micro-steps (zero-advantage rows) cost 2 x params, not 6 x."""
    rows = [_row(0, 30.0, 20.0, 10.0, 10.0, 200, 9), _row(1, 10.0, 6.0, 4.0, 4.0, 200, 9)]
    rows[1]["train/forward_only_tokens"] = 300
    steps = bench.ours_steps(rows, warmup=1, prompt_len=50)
    assert steps[0]["trained_tokens"] == 600 and steps[0]["forward_only_tokens"] == 300
    ours = bench.summarize(steps)
    assert ours["forward_only_share"] == pytest.approx(0.5)
    # (6 x 300 + 2 x 300) x 100 params / 4 s = 60,000 FLOP/s
    assert bench.flop_share(ours, 100, 120_000.0) == pytest.approx(0.5)
