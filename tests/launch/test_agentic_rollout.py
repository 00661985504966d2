"""The real experiment path in gin (issue #22 point 3): `ExperimentConfig.rollout = @AgenticRollout()`
trains agentic RL from an HF directory (weights, tokenizer and its own tool-calling chat template)
on a task file, and refuses mismatched parts by name before anything compiles."""
import inspect
import json
import shutil
import sys
from pathlib import Path

import pytest
import transformers

from sfrrl_jax.agents.tasks.builtin_kinds import generate_arithmetic_tasks
from sfrrl_jax.agents.tasks.records import save_tasks_jsonl
from sfrrl_jax.launch import gin_bindings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))
from hf_tokenizer_fixtures import CORPUS, build_qwen3_style_tokenizer  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from family_tokenizer_fixtures import build_llama3_style_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny dense Qwen3 in HF format with a Qwen3-style tokenizer and chat template beside it."""
    directory = tmp_path_factory.mktemp("qwen3_tiny")
    corpus = CORPUS + ["calculator: 3 + 4 * 2 = 11. Answer: 11", "Compute 12 - 5 + 7. Use the calculator tool."] * 20
    build_qwen3_style_tokenizer(directory, corpus=corpus)
    config = transformers.Qwen3Config(vocab_size=448, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def _bindings(model_dir, tasks_file, run_dir, **extra):
    b = {"Job.kind": "'rl'", "Job.experiment": "@ExperimentConfig()",
         "ExperimentConfig.run_dir": repr(str(run_dir)), "ExperimentConfig.model": "None",
         "ExperimentConfig.hf_path": repr(str(model_dir)), "ExperimentConfig.hf_dtype": "'float32'",
         "ExperimentConfig.mesh_data": "8", "ExperimentConfig.num_steps": "1", "ExperimentConfig.progress_bar": "False",
         "ExperimentConfig.rollout": "@AgenticRollout()", "ExperimentConfig.trainer": "@TrainerConfig()",
         "AgenticRollout.tasks": repr(str(tasks_file)), "AgenticRollout.agent": "@AgentConfig()",
         "AgentConfig.max_turns": "2", "AgentConfig.max_new_tokens_per_turn": "12",
         "AgentConfig.max_total_tokens": "1024",
         "TrainerConfig.groups_per_step": "2", "TrainerConfig.group_size": "4", "TrainerConfig.max_slots": "8",
         "TrainerConfig.max_len": "1024", "TrainerConfig.seq_bucket": "256", "TrainerConfig.buckets": "(512, 1024)",
         "TrainerConfig.dynamic_sampling": "False"}
    b.update(extra)
    return [f"{k} = {v}" for k, v in b.items()]


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory):
    return save_tasks_jsonl(generate_arithmetic_tasks(4, seed=0), tmp_path_factory.mktemp("tasks") / "arith.jsonl")


def test_sfrrl_train_runs_agentic_rl_from_an_hf_directory_on_a_task_file(model_dir, tasks_file, tmp_path):
    job = gin_bindings.load_job([], _bindings(model_dir, tasks_file, tmp_path / "run"))
    model_cfg = gin_bindings.validate_job(job)
    assert model_cfg.vocab_size == 448 and not model_cfg.is_moe
    summary = gin_bindings.run_job(job, gin_bindings.operative_config(), log=lambda line: None)
    assert summary["steps_done"] == 1
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # real trajectories of the real template: prompts of several hundred tokens (system + tools block)
    assert row["rollout/generated_tokens"] > 0 and row["train/trained_tokens"] == row["rollout/generated_tokens"]
    assert "reward/answer_correct" in row and 0.0 <= row["reward/mean"] <= 1.0
    assert (tmp_path / "run" / "checkpoints").is_dir()
    operative = (tmp_path / "run" / "operative_config.gin").read_text()
    assert "AgenticRollout.tasks" in operative


def _refusal(model_dir, tasks_file, tmp_path, **extra):
    job = gin_bindings.load_job([], _bindings(model_dir, tasks_file, tmp_path / "run", **extra))
    with pytest.raises(ValueError) as info:
        gin_bindings.validate_job(job)
    return str(info.value)


def test_mismatched_parts_are_refused_by_name_before_anything_compiles(model_dir, tasks_file, tmp_path):
    # a tokenizer of another model: more ids than the embedding has rows
    small = tmp_path / "small_vocab"
    shutil.copytree(model_dir, small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    msg = _refusal(small, tasks_file, tmp_path, **{"ExperimentConfig.hf_path": repr(str(small))})
    assert "ModelConfig.vocab_size=300" in msg and "tokenizer" in msg
    # a chat template that ignores `tools` (the calculator would never be shown)
    plain = tmp_path / "plain_template"
    plain.mkdir()
    build_qwen3_style_tokenizer(plain, template="{% for m in messages %}{{ m.content }}{% endfor %}")
    msg = _refusal(model_dir, tasks_file, tmp_path, **{"AgenticRollout.tokenizer_path": repr(str(plain))})
    assert "ignores `tools`" in msg
    none = tmp_path / "no_template"
    none.mkdir()
    build_qwen3_style_tokenizer(none, template=None)
    assert "no chat template" in _refusal(model_dir, tasks_file, tmp_path,
                                          **{"AgenticRollout.tokenizer_path": repr(str(none))})
    # a template whose tool markup this library does not read, of a family without a default
    # format, must be told one (Llama checkpoints differ: SmolLM2's template writes no calls)
    llama = tmp_path / "llama_like"
    shutil.copytree(model_dir, llama)
    (llama / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    build_qwen3_style_tokenizer(llama, template="{% for m in messages %}{{ m.content }}{% endfor %}"
                                                "{% if tools %}Tools: {{ tools | tojson }}{% endif %}")
    msg = _refusal(llama, tasks_file, tmp_path, **{"ExperimentConfig.hf_path": repr(str(llama))})
    assert "AgenticRollout.tool_format" in msg and "'llama'" in msg and "writes no tool-call markup" in msg
    # the agent's budget must fit the train rows
    msg = _refusal(model_dir, tasks_file, tmp_path, **{"AgentConfig.max_total_tokens": "4096"})
    assert "AgentConfig.max_total_tokens=4096" in msg and "TrainerConfig.max_len=1024" in msg
    assert "AgenticRollout.tasks" in _refusal(model_dir, "", tmp_path)


def test_a_package_task_set_gets_its_kinds_environment(model_dir, tmp_path):
    """BFCL items (the installed bfcl-eval): per-task tool schemas, rendered by the model's template."""
    job = gin_bindings.load_job([], _bindings(model_dir, "bfcl:simple_python", tmp_path / "run",
                                              **{"AgenticRollout.task_limit": "3"}))
    gin_bindings.validate_job(job)
    source = job.experiment.rollout(job.experiment, gin_bindings.validate_job(job))
    assert len(source.tasks) == 3 and {t.kind for t in source.tasks} == {"function_call"}
    assert type(source.rollout_fn.env).__name__ == "FunctionCallingEnvironment"
    assert source.rollout_fn.agent_cfg.tool_format == "qwen3"   # from config.json's model_type


def test_the_tool_format_is_the_one_the_chat_template_writes(model_dir, tasks_file, tmp_path):
    """A Llama-family directory whose template writes Llama 3 JSON calls gets 'llama3_json'; the
    Qwen3 one's <tool_call> template 'qwen3'; a bound AgenticRollout.tool_format wins."""
    cfg = json.loads((model_dir / "config.json").read_text())
    llama = tmp_path / "llama3_like"
    shutil.copytree(model_dir, llama)
    (llama / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    build_llama3_style_tokenizer(llama)
    for directory, extra, want in ((llama, {}, "llama3_json"), (model_dir, {}, "qwen3"),
                                   (model_dir, {"AgenticRollout.tool_format": "'mistral'"}, "mistral"),
                                   (model_dir, {"AgentConfig.tool_format": "'qwen3_xml'"}, "qwen3_xml")):
        job = gin_bindings.load_job([], _bindings(directory, tasks_file, tmp_path / "run", **extra))
        source = job.experiment.rollout(job.experiment, gin_bindings.validate_job(job))
        assert source.rollout_fn.agent_cfg.tool_format == want, directory
    both = {"AgenticRollout.tool_format": "'mistral'", "AgentConfig.tool_format": "'qwen3_xml'"}
    job = gin_bindings.load_job([], _bindings(model_dir, tasks_file, tmp_path / "run", **both))
    with pytest.raises(ValueError, match="AgenticRollout.tool_format='mistral' and AgentConfig.tool_format='qwen3_xml' "
                                         "disagree"):
        job.experiment.rollout(job.experiment, gin_bindings.validate_job(job))


def test_the_environment_is_a_gin_value_and_the_run_fingerprint_is_stable(model_dir, tasks_file, tmp_path):
    """`@qa_environment()` with its own reward bindings (one run off the agent loop, `in_thread`);
    the rollout's repr (part of the resume fingerprint) names functions, never addresses, so a
    resumed run in a new process matches."""
    extra = {"AgenticRollout.environment": "@qa_environment()",
             "qa_environment.reward_fns": "[@correct/in_thread(), @answer_format]",
             "correct/in_thread.fn": "@answer_correct",
             "qa_environment.reward_weights": "[1.0, 0.2]"}
    reprs = []
    for _ in range(2):
        job = gin_bindings.load_job([], _bindings(model_dir, tasks_file, tmp_path / "run", **extra))
        model_cfg = gin_bindings.validate_job(job)
        reprs.append(repr(job.experiment.rollout))
    assert reprs[0] == reprs[1] and "0x" not in reprs[0] and "ToolEnvironment" in reprs[0]
    source = job.experiment.rollout(job.experiment, model_cfg)
    env = source.rollout_fn.env
    assert env.tool_schemas() == [] and list(env.rewards.weights) == [1.0, 0.2]
    assert list(env.rewards.names) == ["answer_correct", "answer_format"]
    assert [inspect.iscoroutinefunction(fn) for fn in env.rewards.fns] == [True, False]


def test_the_code_environment_runs_its_tests_off_the_agent_loop():
    """code_environment's reward (the task's tests in the sandbox) is awaited in a worker thread."""
    import asyncio

    from sfrrl_jax.agents import Trajectory
    from sfrrl_jax.agents.tasks.code_tasks import code_environment, code_task
    env = code_environment()
    try:
        assert [inspect.iscoroutinefunction(fn) for fn in env.rewards.fns] == [True]
        assert env.rewards.names == ("tests_passed",)
        task = code_task("def add(a, b):\n", "add", "def check(candidate):\n    assert candidate(2, 3) == 5\n", "t")
        answer = "```python\ndef add(a, b):\n    return a {} b\n```"
        for text, want in ((answer.format("+"), 1.0), (answer.format("-"), 0.0)):
            traj = Trajectory("t", "t", 0, 0, [], [], [], final_text=text)
            assert asyncio.run(env.reward(task, traj)) == want and traj.metadata["rewards"] == {"tests_passed": want}
    finally:
        env.close()
