"""The agentic SmolLM2 recipe's parts (experiments/recipes/smollm2_tool_rl.py), without the weights: its
chat template renders SmolLM2's own text when no tool is given, puts the tool schemas in the system
message, and writes calls the 'qwen3' format reads back; the demonstrations call the calculator with
the task's expression and answer with its value (or answer at once, digits out of the loss)."""
import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "checkpoints"))

from hf_tokenizer_fixtures import build_qwen3_style_tokenizer  # noqa: E402

from experiments.recipes.smollm2_tool_rl import (TEMPLATE, SmolLM2ToolRL, calculator_call_demonstration,  # noqa: E402
                                                 make_warm_start_dir, task_expression, warm_start_examples)
from sfrrl_jax.agents.tasks.environments import CALCULATOR_SYSTEM_PROMPT  # noqa: E402
from sfrrl_jax.agents.formats.registry import get_format  # noqa: E402
from sfrrl_jax.agents.protocols import Task  # noqa: E402
from sfrrl_jax.agents.tools import CalculatorTool, tool_schema  # noqa: E402
from sfrrl_jax.launch.runner import ExperimentConfig  # noqa: E402
from sfrrl_jax.tokenizer import load_tokenizer  # noqa: E402

# SmolLM2-135M-Instruct's template as its GGUF / tokenizer_config ship it (the reference the tool
# template must equal when no tool is given)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _task(problem: str, answer: str) -> Task:
    return Task(task_id="t", prompt=problem + "\n\nGive the final answer as <answer>...</answer>.", answer=answer,
                kind="math", metadata={"problem": problem})


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    base = build_qwen3_style_tokenizer(tmp_path_factory.mktemp("base"), template=SMOLLM2_TEMPLATE)
    warm = make_warm_start_dir(base, tmp_path_factory.mktemp("warm") / "warm_start", TEMPLATE)
    return load_tokenizer(base), load_tokenizer(warm), warm


def test_without_tools_the_template_renders_smollm2s_text(tokenizers):
    smollm2, ours, warm = tokenizers
    assert "chat_template" not in json.loads((warm / "tokenizer_config.json").read_text())
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2 + 2?"}]):
        for gen in (True, False):
            assert ours.render(messages, None, add_generation_prompt=gen) == \
                smollm2.render(messages, None, add_generation_prompt=gen)


def test_tools_go_in_the_system_message_and_calls_read_back_with_qwen3(tokenizers):
    _, ours, _ = tokenizers
    schema = tool_schema(CalculatorTool())
    demo = calculator_call_demonstration(_task("Calculate -701 * 202.", "-141602"), CALCULATOR_SYSTEM_PROMPT)
    text = ours.render(demo, [schema], add_generation_prompt=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n" + CALCULATOR_SYSTEM_PROMPT)
    assert json.dumps(schema["function"] if "function" in schema else schema) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "-701 * 202"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n-141602\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n<answer>-141602</answer><|im_end|>') in text
    turn = get_format("qwen3").parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n'
                                     '</tool_call><|im_end|>')
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "3 * 4"})]


def test_demonstrations_call_with_the_expression_or_answer_at_once(tokenizers):
    _, ours, _ = tokenizers
    assert task_expression(_task("Calculate ( 56 + -33 ).", "23")) == "( 56 + -33 )"
    assert calculator_call_demonstration(_task("Calculate 3 * 4.", "13"), None) is None   # a wrong gold is not taught
    with pytest.raises(ValueError, match="Calculate"):
        task_expression(_task("What is 3 * 4?", "12"))
    tasks = [_task(f"Calculate {a} * {a + 1}.", str(a * (a + 1))) for a in range(10, 30)]
    rows, counts = warm_start_examples(ours, tasks, [tool_schema(CalculatorTool())], CALCULATOR_SYSTEM_PROMPT,
                                       direct_fraction=0.5, seed=0, tool_format="qwen3")
    assert counts["direct"] + counts["tool"] == len(rows) == 20 and counts["direct"] > 0 and counts["tool"] > 0
    for row in rows:
        learned = ours.decode([t for t, m in zip(row["tokens"], row["loss_mask"]) if m])
        if "<tool_call>" in learned:   # the call and the answer copied from the tool's result
            assert learned.count("<|im_end|>") == 2 and "</answer>" in learned
            value = learned.split("<answer>")[1].split("</answer>")[0]
            assert value.lstrip("-").isdigit()
        else:                          # the route and the tags, not the digits
            assert learned == "<answer></answer><|im_end|>"


def test_the_recipe_names_bad_settings():
    exp = ExperimentConfig(run_dir="/tmp/unused", model=None, hf_path="/nowhere")
    with pytest.raises(ValueError, match="sft_direct_answer_fraction"):
        SmolLM2ToolRL(experiment=exp, sft_direct_answer_fraction=1.0)
    with pytest.raises(ValueError, match="sft_batch_size"):
        SmolLM2ToolRL(experiment=exp, sft_batch_size=0)
    with pytest.raises(TypeError, match="ExperimentConfig"):
        SmolLM2ToolRL(experiment=None)
