"""BFCL multi-turn items (issue #22 point 2): real items from the installed bfcl-eval, their tools
the package's own executable Python backends with state, a user who speaks again after each
answer, and BFCL's state + response check as the reward."""
import asyncio
import inspect
import json
import sys
from pathlib import Path

import pytest

from sfrrl_jax.agents import AgentConfig, run_agent
from sfrrl_jax.agents.protocols import Completion
from sfrrl_jax.agents.tasks import load_tasks
from sfrrl_jax.agents.tasks.bfcl_multi_turn import (MULTI_TURN_CATEGORIES, BfclMultiTurnEnvironment, backend_instances,
                                                    check_multi_turn, multi_turn_match, multi_turn_progress,
                                                    multi_turn_task, parse_call, turn_calls)
from sfrrl_jax.agents.tasks.records import save_tasks_jsonl
from sfrrl_jax.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))
from hf_tokenizer_fixtures import CORPUS, QWEN3_STYLE_TEMPLATE, build_qwen3_style_tokenizer  # noqa: E402

pytest.importorskip("bfcl_eval", reason="pip install --no-deps 'bfcl-eval==2026.3.23' (README: Tests)")

# Qwen3's habit: reasoning is rendered only for assistant turns after the last user message, so
# earlier turns re-render without it once the user speaks again.
THINKING_TEMPLATE = QWEN3_STYLE_TEMPLATE.replace(
    "{% for m in messages %}",
    "{%- set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}", 1).replace(
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n",
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{% if m.reasoning_content and loop.index0 > ns.last %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}", 1)


def keyword_calls(task, texts):
    """Ground-truth call strings as (name, keyword arguments), positional ones bound by signature."""
    owners = {}
    for instance in backend_instances(task).values():
        owners.update({n: instance for n, _ in inspect.getmembers(instance, inspect.ismethod)})
    calls = []
    for text in texts:
        name, args, kwargs = parse_call(text)
        calls.append((name, dict(inspect.signature(getattr(owners[name], name)).bind(*args, **kwargs).arguments)))
    return calls


def truth_per_turn(task):
    return [keyword_calls(task, turn) for turn in task.metadata["ground_truth"]]


@pytest.fixture(scope="module")
def base_tasks():
    return load_tasks("bfcl:multi_turn_base", limit=12)


@pytest.mark.parametrize("category", MULTI_TURN_CATEGORIES)
def test_real_items_load_and_their_ground_truth_passes_the_check(category):
    tasks = load_tasks(f"bfcl:{category}", limit=8)
    assert len(tasks) == 8 and all(t.kind == "bfcl_multi_turn" for t in tasks)
    for task in tasks:
        meta = task.metadata
        assert len(meta["turns"]) == len(meta["ground_truth"]) >= 2 and meta["functions"]
        assert meta["long_context"] == (category == "multi_turn_long_context")
        verdict = check_multi_turn(task, truth_per_turn(task))
        assert verdict.why is None and verdict.turns_passed == verdict.turns, (task.task_id, verdict)
    if category == "multi_turn_miss_func":
        held = {n for t in tasks for names in t.metadata["missed_function"].values() for n in names}
        assert held


def test_wrong_or_missing_calls_fail_naming_the_turn(base_tasks):
    task = base_tasks[0]
    truth = truth_per_turn(task)
    # nothing done in the second turn
    verdict = check_multi_turn(task, [truth[0], []] + truth[2:])
    assert verdict.turns_passed == 1 and verdict.why.startswith("turn 1: no function calls")
    # the right names with a wrong value: the file system's state differs
    name, args = truth[0][-1]
    wrong = truth[0][:-1] + [(name, {**args, "destination": "elsewhere"})]
    verdict = check_multi_turn(task, [wrong] + truth[1:])
    assert verdict.turns_passed == 0 and "GorillaFileSystem state differs" in verdict.why
    # calls that change nothing but miss an expected result (grep's output)
    no_grep = [c for c in truth[1] if c[0] != "grep"]
    assert len(no_grep) < len(truth[1])
    verdict = check_multi_turn(task, [truth[0], no_grep] + truth[2:])
    assert verdict.turns_passed == 1 and "expected results are not among" in verdict.why
    # calls past the last turn are ignored; an item's turns all pass: progress 1
    assert check_multi_turn(task, truth + [[("ls", {})]]).why is None


def test_records_round_trip_and_bad_records_name_the_field(base_tasks, tmp_path):
    path = tmp_path / "items.jsonl"
    save_tasks_jsonl(base_tasks[:3], path)
    again = load_tasks(path)
    assert [t.metadata for t in again] == [t.metadata for t in base_tasks[:3]]
    record = json.loads(path.read_text().splitlines()[0])
    for field, value, message in [
            ("ground_truth", record["ground_truth"][:-1], "field 'ground_truth' must be a list of"),
            ("involved_classes", ["NoSuchAPI"], "field 'involved_classes'"),
            ("question", [[]], "field 'question\\[0\\]' is empty"),
            ("missed_function", {"0": ["ls"]}, "field 'missed_function'")]:
        with pytest.raises(ValueError, match=message):
            multi_turn_task({**record, field: value}, "bad")
    bad_truth = [list(t) for t in record["ground_truth"]]
    bad_truth[0] = ["rm_rf(path='/')"]
    with pytest.raises(ValueError, match=r"ground_truth\[0\]\[0\]' calls 'rm_rf'"):
        multi_turn_task({**record, "ground_truth": bad_truth}, "bad")
    with pytest.raises(ValueError, match="literal arguments"):
        multi_turn_task({**record, "ground_truth": [["__import__('os').system('x')"]] + bad_truth[1:]}, "bad")


class ScriptedModel:
    """An engine that answers each request with the next scripted turn (text -> tokens)."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.requests, self.released = tok, list(turns), [], []

    async def complete(self, request):
        self.requests.append(list(request.tokens))
        tokens = self.tok.encode(self.turns.pop(0))
        return Completion(tokens, [-0.1] * len(tokens), "stop", "slot")

    async def release(self, handle):
        self.released.append(handle)


def qwen3_turn(calls, think=None):
    body = "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    return (f"<think>\n{think}\n</think>\n\n" if think else "") + body + "<|im_end|>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_thinking_tok")
    build_qwen3_style_tokenizer(directory, THINKING_TEMPLATE, corpus=CORPUS + ["cd mkdir mv grep sort diff"] * 10)
    return load_tokenizer(directory)


def script_for(task, think=False):
    """The ground truth's calls of each user turn in one assistant message, then a plain answer."""
    turns = []
    for i, calls in enumerate(truth_per_turn(task)):
        if calls:
            turns.append(qwen3_turn(calls, think=f"plan {i}" if think else None))
        turns.append(f"Done with request {i}.<|im_end|>")
    return turns


def test_the_agent_loop_plays_every_user_turn_on_per_trajectory_state(base_tasks, tok):
    """Two trajectories of one item at once on one environment: one follows the ground truth
    (thinking, which the template drops from earlier turns once the user speaks again), the other
    stops after its first turn's calls and answers wrongly in the second. Each sees its own file
    system; the first gets reward 1, the second 0 with the failing turn named."""
    task = base_tasks[0]
    env = BfclMultiTurnEnvironment(reward_fns=[multi_turn_match, multi_turn_progress], reward_weights=[1.0, 0.0])
    cfg = AgentConfig(max_turns=20, max_new_tokens_per_turn=512, max_total_tokens=16384, temperature=0.0,
                      tool_format="qwen3")
    good = ScriptedModel(tok, script_for(task, think=True))
    truth = truth_per_turn(task)
    bad = ScriptedModel(tok, [qwen3_turn(truth[0]), "ok<|im_end|>", "I cannot.<|im_end|>"] +
                        ["no<|im_end|>"] * (len(truth) - 2))

    async def both():
        return await asyncio.gather(run_agent(good, env, task, tok, cfg, sample_index=0),
                                    run_agent(bad, env, task, tok, cfg, sample_index=1))

    traj, other = asyncio.run(both())
    env.close()
    assert traj.error is None and traj.finish_reason == "answer", traj.error
    assert traj.reward == 1.0 and traj.metadata["rewards"]["multi_turn_progress"] == 1.0
    assert turn_calls(traj) == truth
    user_turns = [m["content"] for m in traj.messages if m["role"] == "user"]
    assert user_turns == [t[0]["content"] for t in task.metadata["turns"]]
    # the tools ran on the item's real backend: grep found the line in the moved file
    tool_texts = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert any("budget analysis" in t for t in tool_texts)
    # token in, token out: every request after the first is exactly the delta the trajectory holds
    for turn, request in zip(traj.turns[:-1], good.requests[1:]):
        assert traj.tokens[turn.gen_end:turn.obs_end] == request
    assert "<think>\nplan 0\n</think>" in tok.decode(traj.tokens)   # kept although the template drops it
    assert other.reward == 0.0 and other.metadata["rewards"]["multi_turn_progress"] == 0.25
    assert other.metadata["call_mismatch"].startswith("turn 1")
    assert good.released == ["slot"] and bad.released == ["slot"]


def test_held_out_functions_are_handed_out_at_their_turn(tok):
    task = next(t for t in load_tasks("bfcl:multi_turn_miss_func", limit=5) if t.metadata["missed_function"])
    (turn, names), = task.metadata["missed_function"].items()
    env = BfclMultiTurnEnvironment()
    shown = {s["function"]["name"] for s in env.task_tool_schemas(task)}
    assert not shown & set(names) and shown
    episode = env.open_episode(task)
    for _ in range(int(turn)):
        messages = episode.next_user_turn()
    assert all(f'"name": "{n}"' in messages[0]["content"] for n in names)
    while episode.next_user_turn() is not None:
        pass
    episode.close()
    env.close()


def test_a_tool_call_with_bad_arguments_is_that_calls_error(base_tasks):
    """Schema-checked before it reaches the backend; a backend that raises is an observation."""
    task = base_tasks[0]
    env = BfclMultiTurnEnvironment()
    episode = env.open_episode(task)
    from sfrrl_jax.agents.protocols import ToolCall
    results = asyncio.run(episode.step([ToolCall("cd", {"folder": 3}, "call_0"), ToolCall("nope", {}, "call_1"),
                                        ToolCall("cd", {"folder": "document"}, "call_2")]))
    assert results[0].is_error and "expected string" in results[0].content
    assert results[1].is_error and "unknown tool 'nope'" in results[1].content
    assert not results[2].is_error and "document" in results[2].content
    episode.close()
    env.close()


def test_the_gin_rollout_picks_the_multi_turn_environment_for_these_tasks():
    from sfrrl_jax.launch.agentic import AgenticRollout
    rollout = AgenticRollout(tasks="bfcl:multi_turn_long_context", task_limit=2)
    tasks = load_tasks(rollout.tasks, limit=2)
    env = rollout._environment(tasks)
    assert isinstance(env, BfclMultiTurnEnvironment)
    env.close()
