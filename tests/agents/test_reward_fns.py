"""Reward functions as values and task kinds in a registry (issue #17 point 2): a new reward
function and a new task kind, each added in one place by the test, through `ToolEnvironment` and
`run_agent` with a scripted engine; weighted sums, recorded components, their means, the errors."""
import asyncio
import functools
import inspect
import json
import math
import threading
import time

import pytest

from sfrrl_jax.agents import (AgentConfig, CalculatorTool, Completion, DatasetError, RewardError, RewardFn, RewardSum,
                              Task, ToolEnvironment, Trajectory, UnknownTaskKindError, answer_correct, answer_format,
                              get_task_kind, in_thread, load_tasks_jsonl, named, register_task_kind, registered_task_kinds,
                              reward_component_means, run_agent, run_many, save_tasks_jsonl, task_reward,
                              tool_error_penalty, unregister_task_kind)
from sfrrl_jax.agents.tasks.verifiers import extract_answer
from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
from sfrrl_jax.tokenizer import load_tokenizer

CFG = AgentConfig(max_turns=3, max_new_tokens_per_turn=64, max_total_tokens=512, temperature=0.0)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


class _OneTurnEngine:
    """Every request gets the next scripted turn (text), whatever the slot."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.released = tok, list(turns), []

    async def complete(self, request):
        tokens = self.tok.encode(self.turns.pop(0))
        return Completion(tokens, [-0.1] * len(tokens), "stop", "slot")

    async def release(self, handle):
        self.released.append(handle)


class _PerTaskEngine:
    """A new slot's turns come from `script[task prompt]`; appends continue that slot."""

    def __init__(self, tok, script):
        self.tok, self.script, self.slots, self.released = tok, script, {}, []

    async def complete(self, request):
        if request.slot_handle is None:
            handle = len(self.slots)
            prompt = self.tok.decode(request.tokens)
            self.slots[handle] = list(next(turns for key, turns in self.script.items() if key in prompt))
        else:
            handle = request.slot_handle
        tokens = self.tok.encode(self.slots[handle].pop(0))
        return Completion(tokens, [-0.1] * len(tokens), "stop", handle)

    async def release(self, handle):
        self.released.append(handle)


def _run(tok, env, task, turns):
    try:
        return asyncio.run(run_agent(_OneTurnEngine(tok, turns), env, task, tok, CFG))
    finally:
        env.close()


# ----------------------------------------------------------------------------- a new reward function

def brevity(task, trajectory):  # the new reward function: defined here, no library edit
    return -len(trajectory.final_text) / 8


def test_a_new_reward_function_weighted_with_the_built_ins_through_the_loop(tok):
    env = ToolEnvironment([CalculatorTool()], None,
                          reward_fns=[answer_correct, answer_format, brevity, tool_error_penalty],
                          reward_weights=[1.0, 0.5, 2.0, 1.0])
    assert env.rewards.names == ("answer_correct", "answer_format", "brevity", "tool_error_penalty")
    turns = ['<|call|>calculator{"expression": "2 + 3"}<|/call|><|call|>abacus{"x": 1}<|/call|><|end|>',
             "<answer>5</answer><|end|>"]
    traj = _run(tok, env, arithmetic_task("2 + 3", "t0"), turns)
    assert traj.error is None and traj.final_text == "<answer>5</answer>"  # 18 characters
    assert (traj.num_tool_calls, traj.num_tool_errors) == (2, 1)
    assert traj.metadata["rewards"] == {"answer_correct": 1.0, "answer_format": 1.0, "brevity": -2.25,
                                        "tool_error_penalty": -0.5}   # unweighted
    assert traj.reward == 1.0 * 1.0 + 0.5 * 1.0 + 2.0 * -2.25 + 1.0 * -0.5 == -3.5
    assert reward_component_means([traj]) == {"reward/answer_correct": 1.0, "reward/answer_format": 1.0,
                                              "reward/brevity": -2.25, "reward/tool_error_penalty": -0.5}


def test_default_reward_is_the_kind_verifier_as_before(tok):
    wrong = _run(tok, ToolEnvironment([CalculatorTool()], None), arithmetic_task("2 + 3", "t0"),
                 ["<answer>6</answer><|end|>"])
    right = _run(tok, ToolEnvironment([CalculatorTool()], None), arithmetic_task("2 + 3", "t0"),
                 ["<answer>5</answer><|end|>"])
    assert (wrong.reward, wrong.metadata["rewards"]) == (0.0, {"answer_correct": 0.0})
    assert (right.reward, right.metadata["rewards"]) == (1.0, {"answer_correct": 1.0})
    assert right.metadata["rewards"]["answer_correct"] == task_reward(arithmetic_task("2 + 3", "t0"), right.final_text)
    # no <answer> block, no tool calls
    assert answer_format(None, Trajectory("t", "t", 0, 0, [], [], [], final_text="5")) == 0.0
    assert tool_error_penalty(None, Trajectory("t", "t", 0, 0, [], [], [])) == 0.0


def test_named_gives_a_partial_or_a_lambda_its_log_name(tok):
    def scaled(task, trajectory, by):
        return by * answer_correct(task, trajectory)

    double = named(functools.partial(scaled, by=2.0), "double_correct")
    half = named(lambda task, trajectory: 0.5, "half")
    assert isinstance(double, RewardFn) and double.__name__ == "double_correct"
    env = ToolEnvironment([], None, reward_fns=[double, half], reward_weights=[0.25, 3])
    traj = _run(tok, env, arithmetic_task("2 + 3", "t0"), ["<answer>5</answer><|end|>"])
    assert traj.metadata["rewards"] == {"double_correct": 2.0, "half": 0.5}
    assert traj.reward == 0.25 * 2.0 + 3 * 0.5 == 2.0


def test_reward_component_means_over_the_trajectories_that_have_each_component():
    def traj(rewards=None, error=None):
        t = Trajectory("t", "t", 0, 0, [], [], [], error=error)
        if rewards is not None:
            t.metadata["rewards"] = rewards
        return t

    trajs = [traj({"a": 1.0, "b": -0.5}), traj({"a": 0.0}), traj({"a": 0.5, "b": 0.25}), traj(),
             traj({"a": 100.0, "b": 100.0}, error="RewardError: x")]   # failed: left out
    assert reward_component_means(trajs) == {"reward/a": 0.5, "reward/b": -0.125}
    assert list(reward_component_means(trajs)) == ["reward/a", "reward/b"]
    assert reward_component_means([]) == {} and reward_component_means([traj()]) == {}


# ----------------------------------------------------------------------------- a new task kind

@pytest.fixture
def reverse_kind():
    def verify_reverse(task, final_text):  # the new kind: registered here, no library edit
        return float(extract_answer(final_text) == task.metadata["word"][::-1])

    kind = register_task_kind("reverse", verify_reverse)
    yield kind
    unregister_task_kind("reverse")


def test_a_new_task_kind_from_jsonl_through_the_default_reward(tok, tmp_path, reverse_kind):
    assert "reverse" in registered_task_kinds() and get_task_kind("reverse") is reverse_kind
    path = tmp_path / "rev.jsonl"
    path.write_text(json.dumps({"kind": "reverse", "prompt": "Reverse 'abc'.", "word": "abc"}) + "\n"
                    + json.dumps({"id": "r2", "kind": "reverse", "prompt": "Reverse 'xy'.", "answer": "yx",
                                  "word": "xy"}) + "\n")
    tasks = load_tasks_jsonl(path)
    assert tasks == [Task("rev-1", "reverse", "Reverse 'abc'.", None, {"word": "abc"}),
                     Task("r2", "reverse", "Reverse 'xy'.", "yx", {"word": "xy"})]
    assert load_tasks_jsonl(save_tasks_jsonl(tasks, tmp_path / "again.jsonl")) == tasks

    env = ToolEnvironment([], None)  # default reward_fns: the kind's verifier, looked up in the registry
    engine = _PerTaskEngine(tok, {"'abc'": ["<answer>cba</answer><|end|>"], "'xy'": ["<answer>xy</answer><|end|>"]})
    trajs = asyncio.run(run_many(engine, env, tasks, tok, CFG, samples_per_task=2))
    env.close()
    assert [(t.task_id, t.reward, t.error) for t in trajs] == [("rev-1", 1.0, None)] * 2 + [("r2", 0.0, None)] * 2
    assert [t.metadata["rewards"] for t in trajs] == [{"answer_correct": 1.0}] * 2 + [{"answer_correct": 0.0}] * 2
    assert reward_component_means(trajs) == {"reward/answer_correct": 0.5}


def test_a_new_kind_with_its_own_record_format(tmp_path):
    def from_record(record, task_id):
        if type(record["n"]) is not int:
            raise ValueError(f"field 'n' must be an integer, got {record['n']!r}")
        return Task(task_id, "square", f"Square {record['n']}.", str(record["n"] ** 2))

    register_task_kind("square", lambda task, text: float(extract_answer(text) == task.answer),
                       from_record=from_record, to_record=lambda task: {"n": int(task.prompt[7:-1])}, fields=("n",))
    try:
        path = tmp_path / "sq.jsonl"
        path.write_text('{"kind": "square", "n": 12}\n')
        (task,) = load_tasks_jsonl(path)
        assert task == Task("sq-1", "square", "Square 12.", "144")
        assert task_reward(task, "<answer>144</answer>") == 1.0 and task_reward(task, "<answer>12</answer>") == 0.0
        assert load_tasks_jsonl(save_tasks_jsonl([task], tmp_path / "out.jsonl")) == [task]
        path.write_text('{"kind": "square", "n": 1}\n{"kind": "square", "n": "7"}\n')
        with pytest.raises(DatasetError, match=r"sq.jsonl:2: field 'n' must be an integer, got '7'$"):
            load_tasks_jsonl(path)
        path.write_text('{"kind": "square", "m": 1}\n')
        with pytest.raises(DatasetError, match=r"sq.jsonl:1: missing required field 'n' \(kind 'square'\)$"):
            load_tasks_jsonl(path)
    finally:
        unregister_task_kind("square")
    assert "square" not in registered_task_kinds()


def test_registering_an_existing_kind_needs_override(reverse_kind):
    with pytest.raises(ValueError, match="task kind 'reverse' is already registered; pass override=True"):
        register_task_kind("reverse", lambda task, text: 0.0)
    with pytest.raises(ValueError, match="task kind 'qa' is already registered"):
        register_task_kind("qa", lambda task, text: 0.0)
    replaced = register_task_kind("reverse", lambda task, text: 0.75, override=True)
    assert get_task_kind("reverse") is replaced
    assert task_reward(Task("r", "reverse", "p", metadata={"word": "ab"}), "<answer>ba</answer>") == 0.75
    with pytest.raises(TypeError, match="verify must be callable"):
        register_task_kind("broken", "not a function")
    with pytest.raises(TypeError, match="fields must be a tuple of field names, got 'ab'"):
        register_task_kind("broken", lambda task, text: 0.0, fields="ab")
    assert "broken" not in registered_task_kinds()


def test_unknown_kind_lists_the_registered_kinds_and_how_to_register(tok, tmp_path):
    kinds = registered_task_kinds()
    assert {"arithmetic", "countdown", "qa"} <= set(kinds)
    with pytest.raises(UnknownTaskKindError) as info:
        task_reward(Task("p", "poetry", "write"), "x")
    assert str(info.value) == (f"task p: no verifier for kind 'poetry': the registered task kinds are {kinds}; add "
                               "one with sfrrl_jax.agents.register_task_kind('poetry', verify), "
                               "verify(task, final_text) -> float")
    path = tmp_path / "d.jsonl"
    path.write_text('{"kind": "poetry", "prompt": "write"}\n')
    with pytest.raises(DatasetError) as info:
        load_tasks_jsonl(path)
    assert str(info.value) == (f"{path}:1: field 'kind' must be one of {kinds}, got 'poetry' (add a kind with "
                               "sfrrl_jax.agents.register_task_kind(name, verify))")
    # through the loop: that sample's error, naming the reward function and the kind
    traj = _run(tok, ToolEnvironment([], None), Task("p", "poetry", "write"), ["<answer>x</answer><|end|>"])
    assert traj.finish_reason == "error" and traj.reward == 0.0 and "rewards" not in traj.metadata
    assert traj.error.startswith("RewardError: reward function 'answer_correct' raised UnknownTaskKindError: "
                                 "task p: no verifier for kind 'poetry'")


# ----------------------------------------------------------------------------- errors

def test_bad_reward_configurations_are_refused_at_construction():
    def a(task, trajectory):
        return 0.0

    other_a = named(lambda task, trajectory: 1.0, "a")
    cases = [
        (dict(reward_fns=[a, answer_correct], reward_weights=[1.0]), ValueError,
         r"reward_weights has 1 entries for 2 reward_fns \['a', 'answer_correct'\]"),
        (dict(reward_fns=[a], reward_weights=[1.0, 2.0]), ValueError, r"reward_weights has 2 entries for 1"),
        (dict(reward_fns=[a, brevity], reward_weights=[1.0, float("nan")]), ValueError,
         r"reward_weights\[1\] must be a finite number, got nan"),
        (dict(reward_fns=[a], reward_weights=[math.inf]), ValueError, r"reward_weights\[0\] must be a finite number"),
        (dict(reward_fns=[a], reward_weights=["1"]), ValueError, r"reward_weights\[0\] must be a finite number"),
        (dict(reward_fns=[a], reward_weights=[True]), ValueError, r"reward_weights\[0\] must be a finite number"),
        (dict(reward_fns=[a, brevity, other_a, answer_format, answer_format]), ValueError,
         r"duplicate reward function names \['a', 'answer_format'\]: .*named\(fn, name\)"),
        (dict(reward_fns=[lambda task, trajectory: 1.0]), ValueError, r"a lambda has no usable name.*named\(fn,"),
        (dict(reward_fns=[functools.partial(brevity)]), ValueError, r"has no usable name \(None"),
        (dict(reward_fns=[]), ValueError, "reward_fns is empty"),
        (dict(reward_fns=a), TypeError, r"reward_fns must be a list of reward functions.*wrap one in \[...\]"),
        (dict(reward_fns=[a, 3]), TypeError, r"reward_fns\[1\] must be callable"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            ToolEnvironment([CalculatorTool()], None, **kwargs)
    with pytest.raises(ValueError, match="no usable name"):
        named(a, "reward/a")


def test_a_raising_or_non_finite_reward_is_that_samples_error(tok):
    def bonus(task, trajectory):
        if task.task_id == "raises":
            raise KeyError("bonus table")
        return {"nan": math.nan, "inf": -math.inf, "none": None, "text": "1.0"}.get(task.task_id, 0.5)

    tasks = [arithmetic_task("2 + 3", name) for name in ("ok", "raises", "nan", "inf", "none", "text")]
    env = ToolEnvironment([], None, reward_fns=[answer_correct, bonus], reward_weights=[1.0, 2.0])
    engine = _PerTaskEngine(tok, {"2 + 3": ["<answer>5</answer><|end|>"]})
    trajs = {t.task_id: t for t in asyncio.run(run_many(engine, env, tasks, tok, CFG))}
    env.close()
    assert (trajs["ok"].reward, trajs["ok"].error, trajs["ok"].metadata["rewards"]) == (
        2.0, None, {"answer_correct": 1.0, "bonus": 0.5})
    assert trajs["raises"].error == "RewardError: reward function 'bonus' raised KeyError: 'bonus table'"
    assert trajs["nan"].error == ("RewardError: reward function 'bonus' returned nan for task nan: "
                                  "rewards must be finite")
    assert trajs["inf"].error == ("RewardError: reward function 'bonus' returned -inf for task inf: "
                                  "rewards must be finite")
    assert trajs["none"].error == "RewardError: reward function 'bonus' returned None, not a number"
    assert trajs["text"].error == "RewardError: reward function 'bonus' returned '1.0', not a number"
    for name in ("raises", "nan", "inf", "none", "text"):
        failed = trajs[name]
        assert (failed.finish_reason, failed.reward, failed.num_generated) == ("error", 0.0, 0)
        assert "rewards" not in failed.metadata
        failed.check()
    assert reward_component_means(trajs.values()) == {"reward/answer_correct": 1.0, "reward/bonus": 0.5}
    assert sorted(engine.released) == list(range(6))


def test_a_finite_components_overflowing_sum_and_a_custom_environments_nan_are_errors(tok):
    huge = named(lambda task, trajectory: 1e308, "huge")
    with pytest.raises(RewardError, match="the weighted sum of the rewards .* is inf"):
        RewardSum([huge], [10.0])(arithmetic_task("2 + 3", "t"), Trajectory("t", "t", 0, 0, [], [], []))

    class NanEnvironment(ToolEnvironment):  # an Environment of one's own, not summing reward functions
        def reward(self, task, trajectory):
            return math.nan

    traj = _run(tok, NanEnvironment([], None), arithmetic_task("2 + 3", "t"), ["<answer>5</answer><|end|>"])
    assert traj.error == "ValueError: the environment's reward is nan, not a finite number"
    assert (traj.finish_reason, traj.reward) == ("error", 0.0)


# ----------------------------------------------------------------------------- async and threaded rewards

def test_async_reward_functions_are_awaited_with_the_sync_ones(tok):
    async def judged(task, trajectory):  # e.g. a reward model served elsewhere
        await asyncio.sleep(0)
        return 0.25 if task.task_id == "t0" else 0.0

    env = ToolEnvironment([], None, reward_fns=[answer_correct, judged], reward_weights=[1.0, 4.0])
    traj = _run(tok, env, arithmetic_task("2 + 3", "t0"), ["<answer>5</answer><|end|>"])
    assert (traj.error, traj.reward, traj.metadata["rewards"]) == (None, 2.0, {"answer_correct": 1.0, "judged": 0.25})
    # called outside a loop, a sum with an async function is awaitable; one without stays a float
    outside = Trajectory("t", "t", 0, 0, [], [], [], final_text="<answer>5</answer>")
    pending = env.rewards(arithmetic_task("2 + 3", "t0"), outside)
    assert asyncio.run(pending) == 2.0
    assert RewardSum([answer_correct])(arithmetic_task("2 + 3", "t0"), outside) == 1.0


def test_an_async_reward_that_raises_or_returns_nan_is_that_samples_error(tok):
    async def flaky(task, trajectory):
        if task.task_id == "raises":
            raise ConnectionError("judge unreachable")
        return math.nan

    def strict(task, trajectory):  # a sync fn that raises after the async one was called
        if task.task_id == "both":
            raise KeyError("strict")
        return 1.0

    tasks = [arithmetic_task("2 + 3", name) for name in ("raises", "nan", "both")]
    env = ToolEnvironment([], None, reward_fns=[flaky, strict])
    engine = _PerTaskEngine(tok, {"2 + 3": ["<answer>5</answer><|end|>"]})
    trajs = {t.task_id: t for t in asyncio.run(run_many(engine, env, tasks, tok, CFG))}
    env.close()
    assert trajs["raises"].error == ("RewardError: reward function 'flaky' raised ConnectionError: "
                                     "judge unreachable")
    assert trajs["nan"].error == "RewardError: reward function 'flaky' returned nan for task nan: rewards must be finite"
    assert trajs["both"].error == "RewardError: reward function 'strict' raised KeyError: 'strict'"
    assert all(t.reward == 0.0 and t.finish_reason == "error" for t in trajs.values())
    # the coroutine of an async function called before a sync one raised is closed, not dropped
    # unawaited (which warns "never awaited" whenever it is collected)
    made = []

    def recording(task, trajectory):
        made.append(flaky(task, trajectory))
        return made[-1]
    with pytest.raises(RewardError, match="'strict' raised KeyError"):
        RewardSum([named(recording, "flaky"), strict])(arithmetic_task("2 + 3", "both"), trajs["both"])
    assert inspect.getcoroutinestate(made[0]) == inspect.CORO_CLOSED


def _waits_for_the_other(other_done: threading.Event, wait_s: float):
    """A blocking reward: 'slow' holds its thread until 'fast' has been rewarded (1.0), or gives
    up after wait_s (0.0). 'fast' is rewarded by setting the event."""
    def reward(task, trajectory):
        if task.task_id == "fast":
            other_done.set()
            return 1.0
        return float(other_done.wait(wait_s))
    return reward


def test_in_thread_keeps_the_loop_serving_other_trajectories_while_a_reward_blocks(tok):
    tasks = [arithmetic_task("2 + 3", "slow"), arithmetic_task("2 + 3", "fast")]
    script = {"2 + 3": ["<answer>5</answer><|end|>"]}
    # in a thread: 'slow' (started first) waits while the loop finishes and rewards 'fast'
    done = threading.Event()
    env = ToolEnvironment([], None, reward_fns=[in_thread(named(_waits_for_the_other(done, 60.0), "waits"))])
    start = time.perf_counter()
    trajs = {t.task_id: t for t in asyncio.run(run_many(_PerTaskEngine(tok, script), env, tasks, tok, CFG))}
    assert time.perf_counter() - start < 30  # measured: milliseconds
    assert {k: (t.error, t.reward) for k, t in trajs.items()} == {"slow": (None, 1.0), "fast": (None, 1.0)}
    assert trajs["slow"].metadata["rewards"] == {"waits": 1.0}
    # the control: the same function on the loop holds it, so 'fast' cannot run until it gives up
    done = threading.Event()
    env = ToolEnvironment([], None, reward_fns=[named(_waits_for_the_other(done, 0.5), "waits")])
    trajs = {t.task_id: t for t in asyncio.run(run_many(_PerTaskEngine(tok, script), env, tasks, tok, CFG))}
    assert {k: t.reward for k, t in trajs.items()} == {"slow": 0.0, "fast": 1.0}


def test_in_thread_checks_what_it_wraps():
    assert in_thread(answer_correct).__name__ == "answer_correct"
    assert in_thread(answer_correct, "correct").__name__ == "correct"
    with pytest.raises(ValueError, match="has no usable name"):
        in_thread(lambda task, trajectory: 1.0)
    with pytest.raises(ValueError, match="reward/mean"):
        in_thread(answer_correct, "mean")

    async def already(task, trajectory):
        return 1.0
    with pytest.raises(TypeError, match="already async"):
        in_thread(already)
    with pytest.raises(TypeError, match="must be callable"):
        in_thread(3.0)
