"""Tasks, JSONL loading (errors name line and field), pure reward functions, demonstrations."""
import json

import pytest

from sfrrl_jax.agents.tasks.demos import calculator_demonstration
from sfrrl_jax.agents.protocols import Task
from sfrrl_jax.agents.tasks.verifiers import (arithmetic_reward, countdown_reward, exact_match_reward, extract_answer,
                                              numeric_match_reward, parse_number, task_reward)
from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task, generate_arithmetic_tasks, generate_countdown_tasks
from sfrrl_jax.agents.tasks.records import DatasetError, load_tasks_jsonl, save_tasks_jsonl
from sfrrl_jax.agents.tools import evaluate_arithmetic


def test_arithmetic_generator_is_seeded_multistep_and_big():
    a, b = generate_arithmetic_tasks(50, seed=5), generate_arithmetic_tasks(50, seed=5)
    assert a == b and a != generate_arithmetic_tasks(50, seed=6)
    for task in a:
        steps = task.metadata["steps"]
        assert 2 <= len(steps) <= 4
        assert int(task.answer) == evaluate_arithmetic(task.metadata["expression"])
        assert steps[-1][3] == task.answer
    assert max(len(t.answer.lstrip("-")) for t in a) >= 9  # beyond what a tiny model does in its head


def test_arithmetic_steps_exact():
    task = arithmetic_task("(12 * 34) - (5 + 6) * 7", "x")
    assert task.metadata["steps"] == [["12", "*", "34", "408"], ["5", "+", "6", "11"], ["11", "*", "7", "77"],
                                      ["408", "-", "77", "331"]]
    assert task.answer == "331"
    assert task.prompt == ("Compute (12 * 34) - (5 + 6) * 7 using the calculator tool. "
                           "Give the final answer as <answer>N</answer>.")


def test_countdown_generator_solutions_verify():
    tasks = generate_countdown_tasks(40, seed=1)
    assert tasks == generate_countdown_tasks(40, seed=1)
    for task in tasks:
        assert 1 <= task.metadata["target"] <= 1000
        assert task_reward(task, f"<answer>{task.answer}</answer>") == 1.0


def test_calculator_demonstrations_are_correct():
    for task in generate_arithmetic_tasks(20, seed=2):
        messages = calculator_demonstration(task)
        assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * len(
            task.metadata["steps"]) + ["assistant"]
        for call, result in zip(messages[2:-1:2], messages[3:-1:2]):
            expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
            assert result["content"] == str(evaluate_arithmetic(expression).numerator)
        assert task_reward(task, messages[-1]["content"]) == 1.0
    with pytest.raises(ValueError, match="need kind 'arithmetic'"):
        calculator_demonstration(generate_countdown_tasks(1)[0])


def test_extract_answer_reads_blocks_as_the_non_greedy_regex_and_in_linear_time():
    """The blocks of `re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)`, the last one taken;
    exact on random texts of tag fragments. A text of 200,000 unclosed tags (the regex: minutes,
    quadratic) is None at once."""
    import random
    import re
    blocks = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    rng = random.Random(0)
    parts = ["<answer>", "</answer>", "a", " b ", "<ans", "answer>", "</answer", "\n", "<answer></answer>"]
    for _ in range(5000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
        found = blocks.findall(text)
        assert extract_answer(text) == (found[-1].strip() if found else None), text
    assert extract_answer("<answer>a<answer>b</answer>") == "a<answer>b"
    assert extract_answer("<answer>" * 200_000) is None
    assert extract_answer("<answer>" * 200_000 + "7</answer>") == "<answer>" * 199_999 + "7"


def test_reward_functions():
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert extract_answer("no tags") is None
    assert parse_number("1,234.5") == parse_number("2469/2") and parse_number("12abc") is None
    assert arithmetic_reward("<answer>-83,376</answer>", "-83376") == 1.0
    assert arithmetic_reward("<answer>-83377</answer>", "-83376") == 0.0
    assert arithmetic_reward("-83376", "-83376") == 0.0  # the answer must be tagged
    assert arithmetic_reward("<answer>123456789012345678901</answer>", "123456789012345678902") == 0.0
    assert exact_match_reward("<answer>  Paris. </answer>", "paris") == 1.0
    assert exact_match_reward("<answer>Lyon</answer>", "paris") == 0.0
    assert numeric_match_reward("<answer>3.1415927</answer>", "3.14159265") == 1.0
    assert numeric_match_reward("<answer>3.15</answer>", "3.14159265") == 0.0
    assert numeric_match_reward("<answer>3.15</answer>", "3.14159265", rel_tol=0.01) == 1.0
    numbers = [3, 7, 25, 50]
    assert countdown_reward("<answer>(50 - 25) * 7 - 3</answer>", numbers, 172) == 1.0
    assert countdown_reward("<answer>(50 - 25) * 7 - 3 = 172</answer>", numbers, 172) == 1.0
    assert countdown_reward("<answer>50 * 3 + 25 - 3</answer>", numbers, 172) == 0.0  # 3 used twice
    assert countdown_reward("<answer>50 * 4</answer>", numbers, 200) == 0.0  # 4 not given
    assert countdown_reward("<answer>__import__('os')</answer>", numbers, 1) == 0.0
    assert countdown_reward("<answer>7 / (25 - 25)</answer>", numbers, 1) == 0.0
    assert countdown_reward("<answer>(50 + 25) / 3 * 7</answer>", numbers, 175) == 1.0  # exact division
    with pytest.raises(ValueError, match="no verifier for kind 'poetry'"):
        task_reward(Task("p", "poetry", "write"), "x")


def _write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_round_trip_all_kinds(tmp_path):
    tasks = (generate_arithmetic_tasks(3, seed=1) + generate_countdown_tasks(3, seed=1)
             + load_tasks_jsonl(_write(tmp_path, [
                 '{"question": "Capital of France?", "answer": "Paris"}',
                 "",
                 '{"id": "pi", "question": "Pi?", "answer": 3.14159, "match": "numeric", "tolerance": 0.001}'])))
    assert [t.task_id for t in tasks[-2:]] == ["data-1", "pi"]
    assert tasks[-1].metadata == {"match": "numeric", "tolerance": 0.001} and tasks[-1].answer == "3.14159"
    path = save_tasks_jsonl(tasks, tmp_path / "all.jsonl")
    assert load_tasks_jsonl(path) == tasks
    # a '.gz' name is written compressed, as the reader reads it (it was plain text, unreadable back)
    gz = save_tasks_jsonl(tasks, tmp_path / "all.jsonl.gz")
    assert gz.read_bytes()[:2] == b"\x1f\x8b" and load_tasks_jsonl(gz) == tasks


@pytest.mark.parametrize("lines, message", [
    (['{"question": "q", "answer": "a"}', '{"question": "q2"}'],
     "data.jsonl:2: missing required field 'answer' (kind 'qa')"),
    (['{"question": "q", "answer": "a"}', "", '{"question": "q", "answer": "a",}'],
     "data.jsonl:3: invalid JSON: Expecting property name enclosed in double quotes at column 33"),
    (['["q", "a"]'], "data.jsonl:1: expected a JSON object, got list"),
    (['{"question": 5, "answer": "a"}'], "data.jsonl:1: field 'question' must be a string, got int"),
    (['{"question": "q", "answer": null}'], "data.jsonl:1: field 'answer' must be a string or number, got NoneType"),
    (['{"question": "q", "answer": "a", "match": "fuzzy"}'], "data.jsonl:1: field 'match' must be 'exact' or"),
    (['{"kind": "countdown", "numbers": [1, "2"], "target": 3}'],
     "data.jsonl:1: field 'numbers' must be a non-empty list of integers"),
    (['{"kind": "countdown", "numbers": [1, 2]}'], "data.jsonl:1: missing required field 'target' (kind 'countdown')"),
    (['{"kind": "arithmetic", "expression": "2 +"}'], "data.jsonl:1: field 'expression' is not a valid arithmetic"),
    (['{"kind": "arithmetic", "expression": "2 + 2", "answer": "5"}'], "data.jsonl:1: field 'answer' '5' disagrees"),
    (['{"kind": "essay", "question": "q"}'], "data.jsonl:1: field 'kind' must be one of"),
    (['{"id": "a", "question": "q", "answer": "1"}', '{"id": "a", "question": "q", "answer": "1"}'],
     "data.jsonl:2: duplicate id 'a' (first on line 1)"),
])
def test_jsonl_errors_name_line_and_field(tmp_path, lines, message):
    path = _write(tmp_path, lines)
    with pytest.raises(DatasetError) as info:
        load_tasks_jsonl(path)
    assert str(info.value).startswith(f"{tmp_path}/{message}"), str(info.value)


def test_jsonl_default_kind(tmp_path):
    path = _write(tmp_path, [json.dumps({"expression": "3 * (4 + 5)"})])
    (task,) = load_tasks_jsonl(path, default_kind="arithmetic")
    assert (task.kind, task.answer, task.task_id) == ("arithmetic", "27", "data-1")
