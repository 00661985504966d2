"""The agent loop against the scripted engine: exact tokens, masks, logprobs, slot protocol, limits."""
import asyncio
import random

import pytest

from sfrrl_jax.agents.tasks.demos import calculator_demonstration, render_sft_example
from sfrrl_jax.agents.tasks.environments import calculator_environment
from sfrrl_jax.agents.loop import AgentConfig, run_agent, run_many
from sfrrl_jax.agents.protocols import Completion, EngineError, EngineProtocol, GenerationRequest
from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task, generate_arithmetic_tasks
from sfrrl_jax.agents.tools import ToolRunnerConfig
from sfrrl_jax.testing import ScriptedEngine
from sfrrl_jax.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def _demo(tok, task, env):
    """(prompt, generated turns, sft tokens, sft mask) of the calculator demonstration of `task`."""
    tokens, mask = render_sft_example(tok, calculator_demonstration(task), env.tool_schemas())
    turns, current = [], []
    for t, m in zip(tokens, mask):
        if m:
            current.append(t)
        elif current:
            turns.append(current)
            current = []
    turns.append(current)
    return tokens[:mask.index(1)], turns, tokens, mask


TASK = arithmetic_task("1933 - (85407 - 98)", "t0")  # 2 calculator steps, then the answer: 3 turns


def test_engine_protocol_is_satisfied_by_the_scripted_engine():
    assert isinstance(ScriptedEngine({}), EngineProtocol)


def test_three_turn_trajectory_exact_tokens_masks_logprobs(tok):
    env = calculator_environment()
    prompt, turns, sft_tokens, sft_mask = _demo(tok, TASK, env)
    engine = ScriptedEngine({tuple(prompt): turns})
    traj = asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig(seed=7), sample_index=3, group_id="g"))

    obs1 = tok.encode("<|tool|>85309<|end|><|assistant|>")
    obs2 = tok.encode("<|tool|>-83376<|end|><|assistant|>")
    assert [tok.decode(t) for t in turns] == [
        '<|call|>calculator{"expression":"85407 - 98"}<|/call|><|end|>',  # spelt as in the prompt
        '<|call|>calculator{"expression":"1933 - 85309"}<|/call|><|end|>',
        "<answer>-83376</answer><|end|>"]
    expected = prompt + turns[0] + obs1 + turns[1] + obs2 + turns[2]
    assert traj.tokens == expected == sft_tokens  # engine output + rendered observations, token for token
    assert traj.loss_mask == ([0] * len(prompt) + [1] * len(turns[0]) + [0] * len(obs1) + [1] * len(turns[1])
                              + [0] * len(obs2) + [1] * len(turns[2])) == sft_mask
    generated_logprobs = [-1e-3 * i for i in range(1, sum(map(len, turns)) + 1)]
    assert [lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask) if m] == generated_logprobs
    assert all(lp == 0.0 for lp, m in zip(traj.rollout_logprobs, traj.loss_mask) if not m)
    traj.check()

    # Append-prefill: the prompt once, then only the deltas, on the same slot; released once.
    assert [r.tokens for r in engine.requests] == [prompt, obs1, obs2]
    assert [r.slot_handle for r in engine.requests] == [None, 0, 0]
    assert engine.released == [0] and engine.slots[0].tokens == traj.tokens
    assert all(r.stop_token_ids == tok.stop_token_ids for r in engine.requests)
    assert len({r.seed for r in engine.requests}) == 3

    p, g0, g1, g2 = len(prompt), len(turns[0]), len(turns[1]), len(turns[2])
    assert [(t.gen_start, t.gen_end, t.obs_end, t.num_tool_calls, t.num_tool_errors) for t in traj.turns] == [
        (p, p + g0, p + g0 + len(obs1), 1, 0),
        (p + g0 + len(obs1), p + g0 + len(obs1) + g1, p + g0 + len(obs1) + g1 + len(obs2), 1, 0),
        (len(expected) - g2, len(expected), len(expected), 0, 0)]
    assert (traj.finish_reason, traj.reward, traj.final_text) == ("answer", 1.0, "<answer>-83376</answer>")
    assert (traj.task_id, traj.group_id, traj.sample_index, traj.num_tool_calls) == ("t0", "g", 3, 2)
    assert traj.messages[-1] == {"role": "assistant", "content": "<answer>-83376</answer>"}


def test_malformed_call_and_unknown_tool_become_observations(tok):
    env = calculator_environment()
    prompt = tok.apply_chat_template(env.reset(TASK), env.tool_schemas(), add_generation_prompt=True)
    bad = tok.encode('<|call|>calculator{"expression": 1933-}<|/call|><|call|>abacus{"x":1}<|/call|><|end|>')
    answer = tok.encode("<answer>7</answer><|end|>")
    engine = ScriptedEngine({tuple(prompt): [bad, answer]})
    traj = asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig()))
    assert tok.decode(engine.requests[1].tokens) == (
        "<|tool|>error: malformed tool call JSON in arguments of 'calculator': "
        "Expecting ',' delimiter at char 19<|end|>"
        "<|tool|>error: unknown tool 'abacus'; available tools: ['calculator']<|end|><|assistant|>")
    assert (traj.num_tool_calls, traj.num_tool_errors, traj.finish_reason, traj.reward) == (2, 2, "answer", 0.0)


def _looping_engine(tok, env, task, turns=20):
    prompt = tok.apply_chat_template(env.reset(task), env.tool_schemas(), add_generation_prompt=True)
    call = tok.encode('<|call|>calculator{"expression":"1+1"}<|/call|><|end|>')
    return ScriptedEngine({tuple(prompt): [call] * turns}), prompt, call


def test_max_turns(tok):
    env = calculator_environment()
    engine, prompt, call = _looping_engine(tok, env, TASK)
    traj = asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig(max_turns=2)))
    obs = tok.encode("<|tool|>2<|end|><|assistant|>")
    assert traj.tokens == prompt + call + obs + call
    assert traj.finish_reason == "max_turns" and traj.turns[-1].obs_end == traj.turns[-1].gen_end
    assert engine.released == [0]


def test_max_total_tokens_never_exceeded(tok):
    env = calculator_environment()
    engine, prompt, call = _looping_engine(tok, env, TASK)
    obs = tok.encode("<|tool|>2<|end|><|assistant|>")
    budget = len(prompt) + 2 * len(call) + len(obs) + 3  # the second observation does not fit
    traj = asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig(max_total_tokens=budget)))
    assert traj.tokens == prompt + call + obs + call
    assert traj.finish_reason == "max_tokens" and len(traj.tokens) <= budget
    # A per-turn cap below the call length truncates the turn: finish 'length'.
    engine, _, _ = _looping_engine(tok, env, TASK)
    traj = asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig(max_new_tokens_per_turn=5)))
    assert traj.tokens == prompt + call[:5] and traj.finish_reason == "length"
    assert engine.requests[0].max_new_tokens == 5


def test_wall_budget_while_generating_and_while_tools_hang(tok):
    env = calculator_environment()
    engine, prompt, call = _looping_engine(tok, env, TASK)
    engine.hang_on_turn = 1
    traj = asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig(wall_budget_s=0.3)))
    assert traj.finish_reason == "wall_budget" and engine.released == [0]
    assert traj.tokens == prompt + call + tok.encode("<|tool|>2<|end|><|assistant|>")

    class HangingEnv(type(env)):
        async def step(self, calls):
            await asyncio.sleep(3600)

    hanging = HangingEnv(env.runner.tools.values(), env.system_prompt)
    engine, prompt, call = _looping_engine(tok, hanging, TASK)
    traj = asyncio.run(run_agent(engine, hanging, TASK, tok, AgentConfig(wall_budget_s=0.3)))
    assert traj.finish_reason == "wall_budget" and traj.tokens == prompt + call and engine.released == [0]


def test_a_failing_request_is_that_samples_error_and_its_slot_is_released(tok):
    env = calculator_environment()
    engine, prompt, call = _looping_engine(tok, env, TASK, turns=1)  # no script for turn 2 -> IndexError
    traj = asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig()))
    assert engine.released == [0]
    assert traj.finish_reason == "error" and traj.error.startswith("IndexError")
    assert traj.reward == 0.0 and traj.num_generated == 0 and traj.tokens[:len(prompt) + len(call)] == prompt + call
    traj.check()


def test_an_engine_error_propagates_and_the_slot_is_released(tok):
    env = calculator_environment()
    engine, _, _ = _looping_engine(tok, env, TASK, turns=3)
    complete = engine.complete

    async def dying(request):
        if request.slot_handle is not None:
            raise EngineError("the device is gone")
        return await complete(request)
    engine.complete = dying
    with pytest.raises(EngineError, match="device is gone"):
        asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig()))
    assert engine.released == [0]


def test_run_many_thousand_concurrent_nothing_lost_or_duplicated(tok):
    env = calculator_environment(ToolRunnerConfig(max_concurrency=64))
    tasks = generate_arithmetic_tasks(250, seed=3, min_ops=1, max_ops=3)
    scripts, expected = {}, {}
    for task in tasks:
        prompt, turns, sft_tokens, _ = _demo(tok, task, env)
        scripts[tuple(prompt)] = turns
        expected[task.task_id] = sft_tokens
    rng = random.Random(0)
    engine = ScriptedEngine(scripts, delay=lambda: rng.random() * 0.01)
    groups = {}

    def on_group_done(group_id, trajs):
        assert group_id not in groups and all(t is not None and t.reward is not None for t in trajs)
        groups[group_id] = [t.sample_index for t in trajs]

    G = 4
    trajs = asyncio.run(run_many(engine, env, tasks, tok, AgentConfig(), samples_per_task=G,
                                 on_group_done=on_group_done))
    assert len(trajs) == len(tasks) * G == len(engine.released) == len(set(engine.released))
    assert [(t.task_id, t.sample_index) for t in trajs] == [(task.task_id, s) for task in tasks for s in range(G)]
    assert groups == {task.task_id: list(range(G)) for task in tasks}
    assert all(t.tokens == expected[t.task_id] and t.reward == 1.0 and t.finish_reason == "answer" for t in trajs)
    assert all(engine.slots[h].tokens for h in engine.released)
    # A long-running, fully concurrent batch: far more trajectories in flight than tools allowed at once.
    assert len({r.seed for r in engine.requests}) == len(engine.requests)


def test_run_many_rejects_duplicate_task_ids(tok):
    env = calculator_environment()
    with pytest.raises(ValueError, match="task ids must be unique"):
        asyncio.run(run_many(ScriptedEngine({}), env, [TASK, TASK], tok, AgentConfig()))


def test_agent_config_validation():
    with pytest.raises(ValueError, match="AgentConfig.max_turns must be >= 1, got 0"):
        AgentConfig(max_turns=0)
    # Checked once here: a bad sampling setting would otherwise fail every sample one by one.
    with pytest.raises(ValueError, match="AgentConfig.temperature must be >= 0 and finite, got nan"):
        AgentConfig(temperature=float("nan"))
    with pytest.raises(ValueError, match=r"AgentConfig.top_p must be in \(0, 1\]"):
        AgentConfig(top_p=0.0)
    with pytest.raises(ValueError, match="unknown tool-call format"):
        AgentConfig(tool_format="xml")
    with pytest.raises(ValueError, match="tokens is empty"):
        GenerationRequest(tokens=[], max_new_tokens=1)
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        Completion([1, 2], [0.0], "stop")


def test_countdown_with_the_real_sandboxed_python_tool(tok):
    from sfrrl_jax.agents.tasks.environments import countdown_environment
    from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox, SandboxConfig
    from sfrrl_jax.agents.tasks.builtin_kinds import countdown_task

    env = countdown_environment(PythonSandbox(SandboxConfig(wall_timeout_s=2.0, max_concurrency=2)))
    task = countdown_task([3, 7, 25, 50], 172, "cd")
    prompt = tok.apply_chat_template(env.reset(task), env.tool_schemas(), add_generation_prompt=True)
    code = "print((50 - 25) * 7 - 3)"
    call = tok.encode('<|call|>python{"code":"' + code + '"}<|/call|><|call|>python{"code":"1/0"}<|/call|><|end|>')
    answer = tok.encode("<answer>(50 - 25) * 7 - 3</answer><|end|>")
    engine = ScriptedEngine({tuple(prompt): [call, answer]})
    traj = asyncio.run(run_agent(engine, env, task, tok, AgentConfig()))
    assert tok.decode(engine.requests[1].tokens) == (
        '<|tool|>172\n<|end|><|tool|>error: exit code 1\nTraceback (most recent call last):\n  File "<sandbox>", '
        'line 1, in <module>\nZeroDivisionError: division by zero<|end|><|assistant|>')
    assert traj.tokens == prompt + call + engine.requests[1].tokens + answer
    assert (traj.reward, traj.num_tool_calls, traj.num_tool_errors) == (1.0, 2, 1)


def test_an_environments_per_task_tools_reach_the_chat_template(tok):
    """`task_tool_schemas(task)` (BFCL items carry their own functions) is what the template renders,
    for the prompt and for every observation appended after it."""
    from sfrrl_jax.agents.tasks.function_calling import FunctionCallingEnvironment, bfcl_tasks
    task = bfcl_tasks("simple_python", limit=1)[0]
    env = FunctionCallingEnvironment()
    seen = []

    class Recording:
        def __getattr__(self, name):
            return getattr(tok, name)

        def apply_chat_template(self, messages, tools=None, **kw):
            seen.append(tools)
            return tok.apply_chat_template(messages, tools, **kw)

    expected = env.task_tool_schemas(task)
    assert expected and env.tool_schemas() == []
    prompt = tok.apply_chat_template(env.reset(task), expected, add_generation_prompt=True)
    answer = tok.encode("<answer>done</answer><|end|>")
    traj = asyncio.run(run_agent(ScriptedEngine({tuple(prompt): [answer]}), env, task, Recording(), AgentConfig()))
    assert seen == [expected] and traj.error is None and traj.tokens[:len(prompt)] == prompt


def test_the_trajectory_keeps_the_routes_of_every_token_fed_across_turns(tok):
    """Routing replay: the routes of each call (prompt / observation delta, then the generated
    tokens but the last) concatenate to the routes of the trajectory's tokens but its last."""
    from sfrrl_jax.testing.scripted_engine import scripted_routes
    env = calculator_environment()
    prompt, turns, _, _ = _demo(tok, TASK, env)
    engine = ScriptedEngine({tuple(prompt): turns}, route_dims=(3, 2))
    traj = asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig()))
    assert traj.error is None and len(traj.turns) == 3
    traj.check()
    assert traj.routes.shape == (len(traj.tokens) - 1, 3, 2) and traj.routes.dtype.name == "int16"
    assert (traj.routes == scripted_routes(traj.tokens, 3, 2)[:-1]).all()


def test_routes_that_do_not_cover_the_fed_tokens_fail_that_sample_only(tok):
    class DropsARoute(ScriptedEngine):
        async def complete(self, request):
            c = await super().complete(request)
            if request.slot_handle is not None:  # a continued call loses one token's routes
                c = Completion(c.tokens, c.logprobs, c.finish_reason, c.slot_handle, routes=c.routes[1:])
            return c

    env = calculator_environment()
    prompt, turns, _, _ = _demo(tok, TASK, env)
    engine = DropsARoute({tuple(prompt): turns}, route_dims=(3, 2))
    traj = asyncio.run(run_agent(engine, env, TASK, tok, AgentConfig()))
    assert traj.finish_reason == "error" and "routes cover" in traj.error and sum(traj.loss_mask) == 0
    assert engine.released == [0]
