"""The multi-turn agent loop: generate -> parse -> run tools -> append the delta -> continue.

Everything goes through `EngineProtocol`: the first request prefills the prompt, every later one
appends only the observation delta to the trajectory's parked slot, and the slot is released once
when the trajectory ends (also on errors and cancellation). Thousands of `run_agent` coroutines
share one asyncio loop; tools run through the environment's bounded runner.

An environment with `open_episode(task)` (protocols.Episode) gets one episode per trajectory: its
tools keep state there, and when the model answers without tool calls the episode may give the
next user turn, which is appended like an observation (the trajectory goes on).

Finish reasons: 'answer' (a turn without tool calls and no further user turn), 'max_turns', 'max_tokens' (the total budget
`max_total_tokens` would be exceeded: the trajectory never grows past it), 'length' (a turn hit
`max_new_tokens_per_turn`), 'wall_budget' (the wall-clock budget ran out while generating or
waiting for tools), 'error' (something in this sample raised: the environment, a tokenizer step,
the reward; the trajectory keeps its tokens and the error, has reward 0 and trains nothing; it is
logged, and the other samples go on). An `EngineError` (the engine itself is gone) propagates.

User code is contained (see `sfrrl_jax.aio`): whatever the environment's episode (step,
next_user_turn, close) or the reward raises, SystemExit, KeyboardInterrupt and GeneratorExit
included, is that sample's error (`Trajectory.error` names its type), never the batch's; only a
cancellation of the trajectory itself propagates. What raises before the trajectory has a prompt
(opening or resetting the episode) leaves `run_agent` as an Exception (a `UserCodeExit` for those
three), and `run_many` turns it into a failed, empty trajectory. The environment's step runs as a
task of its own: at the wall budget it is cancelled and, if it ignores that, abandoned (the trajectory
ends 'wall_budget' on time). Calls and steps abandoned while still running are counted in
`metadata["orphaned_tool_calls"]` (absent when none).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import logging
import math
import os
import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

from sfrrl_jax.agents.formats.call_text import TOOL_NAME
from sfrrl_jax.agents.formats.registry import get_format, renders_tool_calls, trajectory_format, turn_stop_ids
from sfrrl_jax.agents.protocols import (EngineError, EngineProtocol, Environment, Episode, GenerationRequest,
                                       Message, Task, ToolCall, ToolCallError, ToolResult)
from sfrrl_jax.agents.trajectory import Trajectory, TrajectoryBuilder, Turn
from sfrrl_jax.aio import (ABANDON_GRACE_S, Raised, UserCodeExit, count_orphans, describe, own_cancellation,
                           settled, stop_counting_orphans, user_task, wait_or_abandon)
from sfrrl_jax.checks import check_int, check_int_fields, check_number, check_seed
from sfrrl_jax.tokenizer.protocol import TokenizerProtocol

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """How `run_agent` rolls out a trajectory: turn and token budgets, sampling, tool-call parsing.

    Every field is checked when the config is built (a bad value would otherwise fail every
    sample one by one).

    Attributes:
      max_turns: most assistant turns (generations) per trajectory, >= 1; reaching it ends the
        trajectory 'max_turns' (the calls of the last turn are not run: nobody would read them).
      max_new_tokens_per_turn: most tokens one turn generates, >= 1; a turn that hits it ends the
        trajectory 'length'.
      max_total_tokens: most tokens of the whole trajectory (prompt, turns, observations), >= 1;
        the trajectory never grows past it and ends 'max_tokens' where it would.
      wall_budget_s: wall-clock budget of the trajectory in seconds (> 0), generation and tool
        time together; running out ends it 'wall_budget'.
      temperature: sampling temperature, >= 0 (0: greedy).
      top_k: keep the `top_k` most likely tokens when sampling (>= 0); None (or 0): no top-k filter.
      top_p: nucleus sampling mass, in (0, 1]; None: no top-p filter.
      seed: base sampling seed, in [0, 2**32); each turn's seed is `turn_seed(seed, task_id,
        sample_index, turn)`.
      tool_format: the tool-call format turns are parsed with: None, the format the tokenizer's
        chat template writes (`formats.registry.format_for`); a built-in's name (`formats.registry.FORMATS`: 'qwen3',
        'harmony', 'llama3_json', 'mistral', 'pythonic', ...) or a format value
        (`formats.ToolCallFormat`: `parse(text) -> ParsedTurn`). An unknown name fails here.
      max_tool_calls_per_turn: most calls of one turn that are run, >= 1; calls past it are not
        run: one error observation says so (`capped_calls`).
      stop_token_ids: the ids that end a turn; None: the tokenizer's stops as the tool format
        refines them (`formats.registry.turn_stop_ids`).
      chat_template_kwargs: variables for the chat template in every render of the trajectory
        (Qwen3's `{'enable_thinking': False}`, gpt-oss's `{'reasoning_effort': 'high'}`): a mapping or
        (name, value) pairs, kept as sorted (key, value) pairs. Needs a tokenizer with
        `with_template_kwargs`.

    Raises:
      ValueError: (when built) a field out of its range or of the wrong type, an unknown
        `tool_format` name, or `chat_template_kwargs` whose keys are not identifiers.
      TypeError: `tool_format` is neither a string nor a value with `parse`.
    """

    max_turns: int = 8
    max_new_tokens_per_turn: int = 512
    max_total_tokens: int = 4096
    wall_budget_s: float = 600.0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    # None: the format the tokenizer's chat template writes (formats.format_for); a built-in's name
    # (formats.FORMATS: 'qwen3', 'harmony', 'llama3_json', 'mistral', 'pythonic', ...) or a format
    # value (formats.ToolCallFormat: parse(text) -> ParsedTurn)
    tool_format: Any = None
    max_tool_calls_per_turn: int = 32  # calls past it are not run: one error observation says so
    # None: the tokenizer's stops as the tool format refines them (formats.turn_stop_ids)
    stop_token_ids: tuple[int, ...] | None = None
    # variables for the chat template in every render of the trajectory (Qwen3's
    # {'enable_thinking': False}, gpt-oss's {'reasoning_effort': 'high'}); a dict is kept as
    # sorted (key, value) pairs. Needs a tokenizer with `with_template_kwargs`
    chat_template_kwargs: Any = ()

    def __post_init__(self):
        # Checked here, not per request: a bad value would otherwise fail every sample one by one.
        check_int_fields(self, ("max_turns", "max_new_tokens_per_turn", "max_total_tokens",
                                "max_tool_calls_per_turn"), 1)
        check_number("AgentConfig.wall_budget_s", self.wall_budget_s, 0, lo_open=True)
        check_number("AgentConfig.temperature", self.temperature, 0)
        check_int("AgentConfig.top_k", self.top_k, 0, optional=True)
        check_number("AgentConfig.top_p", self.top_p, 0, 1, lo_open=True, optional=True)
        check_seed("AgentConfig.seed", self.seed)
        if self.tool_format is not None:
            get_format(self.tool_format)  # fail early on an unknown format name
        kwargs = self.chat_template_kwargs
        items = kwargs.items() if isinstance(kwargs, Mapping) else kwargs
        try:
            items = tuple(sorted((k, v) for k, v in items))
        except (TypeError, ValueError):
            items = None
        if items is None or not all(isinstance(k, str) and k.isidentifier() for k, _ in items):
            raise ValueError(f"AgentConfig.chat_template_kwargs={kwargs!r} must map variable names to values "
                             "(e.g. {'enable_thinking': False})")
        object.__setattr__(self, "chat_template_kwargs", items)


def turn_seed(seed: int, task_id: str, sample_index: int, turn: int) -> int:
    """Deterministic per-(task, sample, turn) sampling seed in [0, 2**31)."""
    digest = hashlib.blake2b(f"{seed}/{task_id}/{sample_index}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def capped_calls(calls: Sequence[ToolCall | ToolCallError], cap: int) -> tuple[ToolCall | ToolCallError, ...]:
    """The first `cap` calls, then (if any were cut) one `ToolCallError` naming how many were not
    run: a turn of thousands of calls costs the tools and the context nothing past the cap. The
    error carries the first cut call's id, which its format made (Mistral's template refuses a
    result whose id is not one of its 9-character ones)."""
    if len(calls) <= cap:
        return tuple(calls)
    return tuple(calls[:cap]) + (ToolCallError(
        f"{len(calls) - cap} more tool calls in this turn were not run: at most {cap} per turn",
        call_id=calls[cap].call_id),)


class _SharedEpisode:
    """A plain (stateless) environment seen as an episode: its reset and step, one user turn."""

    def __init__(self, env: Environment, task: Task):
        self.env, self.task = env, task

    def reset(self) -> list[Message]:
        return self.env.reset(self.task)

    async def step(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        return await self.env.step(calls)

    def next_user_turn(self) -> list[Message] | None:
        return None

    def close(self) -> None:
        pass


def open_episode(env: Environment, task: Task) -> Episode:
    """`env.open_episode(task)` where the environment keeps per-trajectory state, else the
    environment itself behind the `Episode` interface."""
    opener = getattr(env, "open_episode", None)
    if opener is None:
        return _SharedEpisode(env, task)
    # tools on a Ray cluster (`ray_tools.RayToolRunner`): the episode's state lives on an actor
    remote = getattr(getattr(env, "runner", None), "open_remote_episode", None)
    return remote(task) if remote is not None else opener(task)



def _without_reasoning(messages: Sequence[Message]) -> list[Message]:
    # For a new user turn's delta only: templates that keep reasoning only after the last user
    # message (Qwen3) drop it from earlier turns once a user speaks again, so the full render
    # would not be append-only. The trajectory keeps the generated tokens as they were (token in,
    # token out); the delta is what the template renders for the new messages.
    return [{k: v for k, v in m.items() if k != "reasoning_content"} if m.get("role") == "assistant" else m
            for m in messages]


def _observation(tokenizer: TokenizerProtocol, messages: list[Message], calls: Sequence[ToolCall | ToolCallError],
                 results: Sequence[ToolResult], tools, stop_text: str
                 ) -> tuple[list[Message], list[int], Message | None]:
    """(the messages of a turn's results, the delta that appends them, the assistant message the
    template is to render from now on in place of `messages[-1]`, or None: the same).

    Results are tool messages. A call that did not parse is not in the assistant message, and
    some templates refuse a tool message for a call they never saw: gpt-oss's raises on it at
    once; Mistral's and Gemma's count roles without tool messages, so the next assistant turn
    would break their user / assistant alternation (checked here by rendering one). For those,
    in this order, the first that renders:
      - the unparsed calls' errors go as one user message after the other results (untrusted
        contents, like tool output: no control tokens);
      - the template renders the assistant message with a stand-in call for each unparsed one
        (its id, the name it gave or 'invalid_tool_call', no arguments), which Mistral's needs:
        its tools block moves to the last user message. The stand-ins are for the template
        only: the trajectory's messages keep the calls the model made (`tool_calls` holds the
        parsed ones), and its tokens the ones it generated.
    """
    tool_messages = [r.as_message() for r in results]
    unparsed = [i for i, c in enumerate(calls) if isinstance(c, ToolCallError)]
    first: tuple | None = None
    first_error: Exception | None = None
    try:
        delta = tokenizer.render_delta(messages, tool_messages, tools, stop_text=stop_text)
        first = (tool_messages, delta, None)
        if not unparsed or _takes_an_assistant_turn_after(tokenizer, messages + tool_messages, tools):
            return first
    except Exception as e:
        if not unparsed:
            raise
        first_error = e
    kept = [m for i, m in enumerate(tool_messages) if i not in unparsed]
    errors = {"role": "user", "content": "\n".join(results[i].content for i in unparsed)}
    stand_ins = dict(messages[-1], tool_calls=[_stand_in(c, i) for i, c in enumerate(calls)])
    candidates = ((messages, kept + [errors], ("tool", "user"), None),
                  (messages[:-1] + [stand_ins], tool_messages, ("tool",), stand_ins))
    # first one that leaves the history before the turn as it was rendered (Mistral's moves its
    # tools block to a new user message), then any
    for strict in (True, False):
        for history, new, untrusted, shown in candidates:
            try:
                if (_takes_an_assistant_turn_after(tokenizer, history + new, tools)
                        and (not strict or _keeps_the_history(tokenizer, history, new, tools))):
                    return new, tokenizer.render_delta(history, new, tools, stop_text=stop_text,
                                                       untrusted_roles=untrusted), shown
            except Exception:
                continue
    if first is not None:   # nothing renders better: the tool messages as they were
        return first
    raise first_error


def _keeps_the_history(tokenizer: TokenizerProtocol, history: list[Message], new: list[Message], tools) -> bool:
    """Whether the template renders the messages before the last turn as it did (as far as it
    renders them alike with and without that turn) once `new` follows."""
    stable = os.path.commonprefix([tokenizer.render(history[:-1], tools, add_generation_prompt=False),
                                   tokenizer.render(history, tools, add_generation_prompt=False)])
    return tokenizer.render(history + new, tools, add_generation_prompt=True).startswith(stable)


def _stand_in(call: ToolCall | ToolCallError, index: int) -> dict:
    """A `tool_calls` entry for the template: the call itself, or for one that did not parse a
    call of its name (or 'invalid_tool_call') without arguments, under its id."""
    if isinstance(call, ToolCall):
        return call.as_message_entry()
    name = call.name if call.name and TOOL_NAME.match(call.name) else "invalid_tool_call"
    return {"id": call.call_id or f"call_{index}", "type": "function", "function": {"name": name, "arguments": {}}}


def _takes_an_assistant_turn_after(tokenizer: TokenizerProtocol, messages: list[Message], tools) -> bool:
    """Whether the chat template renders `messages` followed by an assistant answer."""
    try:
        tokenizer.render(messages + [{"role": "assistant", "content": "ok"}], tools, add_generation_prompt=False)
    except Exception:
        return False
    return True


async def run_agent(engine: EngineProtocol, env: Environment, task: Task, tokenizer: TokenizerProtocol, cfg: AgentConfig,
                    sample_index: int = 0, group_id: str | None = None) -> Trajectory:
    """Roll out one trajectory of `task`; the reward is set from `env.reward` at the end (which may
    record its components in `traj.metadata["rewards"]`, see `reward_fns.py`).

    Generates turns on `engine`, parses their tool calls with the config's format, runs them
    through the environment (its episode, where it opens one per trajectory) and appends the
    observations, until a finish reason (module doc). The engine slot is released at the end,
    also on errors and cancellation.

    Args:
      engine: the generation engine (`EngineProtocol`).
      env: the environment: prompt, tools, tool execution and reward.
      task: the task to roll out.
      tokenizer: the tokenizer with the policy's chat template.
      cfg: budgets, sampling and tool-call format (`AgentConfig`).
      sample_index: which of the task's samples this is (feeds the per-turn sampling seed).
      group_id: the trajectory's group id (for group advantages); None: `task.task_id`.
    Returns:
      The `Trajectory`: tokens, loss mask, turns, messages, `finish_reason`, and its reward; a
      sample whose environment, tokenizer step or reward raised after the prompt was built is
      returned failed (`error` set, reward 0) instead of raising.
    Raises:
      EngineError: the engine itself failed.
      Exception: what the setup raised before the trajectory had a prompt (tool schemas, format,
        opening or resetting the episode, the prompt's render), e.g. a TypeError for
        `chat_template_kwargs` with a tokenizer lacking `with_template_kwargs`; a SystemExit,
        KeyboardInterrupt or GeneratorExit there comes as a `UserCodeExit`.
      asyncio.CancelledError: the trajectory itself was cancelled.
    """
    start = time.perf_counter()
    deadline = asyncio.get_running_loop().time() + cfg.wall_budget_s
    try:
        # an environment whose tools differ per task (BFCL items) says so with `task_tool_schemas`
        per_task = getattr(env, "task_tool_schemas", None)
        tools = (per_task(task) if per_task is not None else env.tool_schemas()) or None
        if cfg.chat_template_kwargs:
            bind_kwargs = getattr(tokenizer, "with_template_kwargs", None)
            if bind_kwargs is None:
                raise TypeError(f"AgentConfig.chat_template_kwargs={dict(cfg.chat_template_kwargs)} needs a "
                                f"tokenizer with with_template_kwargs(**kwargs); {type(tokenizer).__name__} has none")
            tokenizer = bind_kwargs(**dict(cfg.chat_template_kwargs))
        fmt = trajectory_format(cfg.tool_format, tokenizer, tools)
        stops = cfg.stop_token_ids if cfg.stop_token_ids is not None else turn_stop_ids(fmt, tokenizer)
        episode = open_episode(env, task)
        try:
            messages = await settled(episode.reset())
            prompt = tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True)
        except BaseException:
            _close_episode(episode, task, sample_index)
            raise
    except Exception:
        raise
    except BaseException as e:  # synchronous user code: never a cancellation (see the module doc)
        raise UserCodeExit(e) from e
    builder = TrajectoryBuilder(task.task_id, group_id or task.task_id, sample_index, prompt)
    traj = builder.trajectory
    # what the template renders: `messages`, but with stand-in calls where a template needs them
    # for calls that did not parse (`_observation`); the trajectory keeps `messages`
    shown = list(messages)
    traj.finish_reason = "max_turns"
    handle: Any = None
    pending = prompt
    failure: BaseException | None = None
    orphans, counting = count_orphans()  # the steps' tasks see it (they copy this context)
    try:
        try:
            for turn_index in range(cfg.max_turns):
                room = cfg.max_total_tokens - len(builder)
                if room <= 0:
                    traj.finish_reason = "max_tokens"
                    break
                max_new = min(cfg.max_new_tokens_per_turn, room)
                request = GenerationRequest(
                    tokens=pending, max_new_tokens=max_new, temperature=cfg.temperature, top_k=cfg.top_k,
                    top_p=cfg.top_p, seed=turn_seed(cfg.seed, task.task_id, sample_index, turn_index),
                    stop_token_ids=tuple(stops), slot_handle=handle)
                gen_start = time.perf_counter()
                try:
                    async with asyncio.timeout_at(deadline):
                        completion = await engine.complete(request)
                except TimeoutError:
                    traj.finish_reason = "wall_budget"
                    break
                handle = completion.slot_handle
                generate_s = time.perf_counter() - gen_start
                gen_lo, gen_hi = builder.append_completion(completion)  # (and its routes, if recorded)
                parsed = fmt.parse(tokenizer.decode(completion.tokens))
                assistant: dict = {"role": "assistant", "content": parsed.content}
                if parsed.reasoning:
                    # HF's key for it: templates that keep reasoning (Qwen3 within a tool loop)
                    # render it from here; the trajectory's tokens are the generated ones anyway.
                    assistant["reasoning_content"] = parsed.reasoning
                if parsed.tool_calls:
                    assistant["tool_calls"] = [c.as_message_entry() for c in parsed.tool_calls]
                if (parsed.calls or parsed.reasoning) and not renders_tool_calls(tokenizer):
                    # a template that shows only an assistant message's content (SmolLM3's) would
                    # render this turn without its calls or reasoning: the content is the turn as
                    # generated
                    kept = completion.tokens[:-1] if completion.finish_reason == "stop" else completion.tokens
                    assistant["content"] = tokenizer.decode(kept)
                messages.append(assistant)
                shown.append(assistant)
                traj.final_text = parsed.content

                def record(obs_end: int, tools_s: float = 0.0, errors: int = 0, calls: int = 0) -> None:
                    traj.turns.append(Turn(turn_index, gen_lo, gen_hi, obs_end, completion.finish_reason, generate_s,
                                           tools_s, calls, errors))

                if completion.finish_reason == "length" or not completion.tokens:
                    record(gen_hi)
                    traj.finish_reason = "max_tokens" if max_new < cfg.max_new_tokens_per_turn else "length"
                    break
                if not parsed.calls:
                    user_turn = await settled(episode.next_user_turn())
                    if not user_turn or turn_index == cfg.max_turns - 1:
                        record(gen_hi)
                        traj.finish_reason = "answer" if not user_turn else "max_turns"
                        break
                    delta = tokenizer.render_delta(_without_reasoning(shown), user_turn, tools,
                                                   stop_text=tokenizer.decode([completion.tokens[-1]]))
                    messages.extend(user_turn)
                    shown.extend(user_turn)
                    if len(builder) + len(delta) >= cfg.max_total_tokens:
                        record(gen_hi)
                        traj.finish_reason = "max_tokens"
                        break
                    record(builder.append_observation(delta))
                    pending = delta
                    continue
                if turn_index == cfg.max_turns - 1:  # nobody would read the results
                    record(gen_hi, calls=len(parsed.calls))
                    traj.finish_reason = "max_turns"
                    break
                calls = capped_calls(parsed.calls, cfg.max_tool_calls_per_turn)
                tools_start = time.perf_counter()
                # A task of its own, abandoned at the wall budget if it ignores cancellation. Twice
                # the grace: a ToolRunner in the step abandons its own calls within one.
                step = user_task(episode.step, calls)
                if not await wait_or_abandon(step, deadline, grace=2 * ABANDON_GRACE_S):
                    record(gen_hi, time.perf_counter() - tools_start, calls=len(calls))
                    traj.finish_reason = "wall_budget"
                    break
                results = step.result()
                if isinstance(results, Raised):
                    failure = results.error
                    break
                tools_s = time.perf_counter() - tools_start
                if len(results) != len(calls):
                    raise RuntimeError(f"environment returned {len(results)} results for {len(calls)} calls")
                tool_messages, delta, stand_in = _observation(tokenizer, shown, calls, results, tools,
                                                              tokenizer.decode([completion.tokens[-1]]))
                if stand_in is not None:
                    shown[-1] = stand_in
                messages.extend(tool_messages)
                shown.extend(tool_messages)
                errors = sum(r.is_error for r in results)
                queued = [r.queue_s for r in results if getattr(r, "queue_s", 0.0) > 0.0]
                if queued:  # waits for a free remote worker (Ray backend): load, reported per step
                    traj.metadata.setdefault("tool_queue_s", []).extend(queued)
                if len(builder) + len(delta) >= cfg.max_total_tokens:  # no room to append and still generate
                    record(gen_hi, tools_s, errors, len(calls))
                    traj.finish_reason = "max_tokens"
                    break
                record(builder.append_observation(delta), tools_s, errors, len(calls))
                pending = delta
        except EngineError:
            raise  # the engine is gone, not this sample: the batch cannot go on
        except asyncio.CancelledError as e:
            if own_cancellation():
                raise  # this trajectory is being stopped
            failure = e  # raised by something in this sample, nobody cancelled it
        except BaseException as e:  # this sample's failure only (SystemExit & co.: see the module doc)
            failure = e
    finally:
        stop_counting_orphans(counting)
        _close_episode(episode, task, sample_index)
        if handle is not None:
            await engine.release(handle)
    traj.messages = messages
    traj.wall_s = time.perf_counter() - start
    if orphans[0]:
        traj.metadata["orphaned_tool_calls"] = orphans[0]
    if failure is None:
        try:
            reward = env.reward(task, traj)
            if inspect.isawaitable(reward):  # an async reward: the loop serves the others meanwhile
                reward = await reward
            reward = float(reward)
            if not math.isfinite(reward):  # one NaN would poison its whole group's advantages
                raise ValueError(f"the environment's reward is {reward}, not a finite number")
            traj.reward = reward
        except asyncio.CancelledError as e:
            if own_cancellation():
                raise
            failure = e
        except BaseException as e:  # a reward's sys.exit() fails its sample only
            failure = e
    if failure is not None:
        traj.mark_failed(describe(failure))
        _log.warning("trajectory %s/%d failed (reward 0, trains nothing): %s", task.task_id, sample_index,
                     traj.error, exc_info=failure)
    return traj


def _close_episode(episode: Episode, task: Task, sample_index: int) -> None:
    try:
        episode.close()
    except BaseException:  # synchronous user code; its state is being dropped anyway: the trajectory stands
        _log.warning("closing the episode of %s/%d failed", task.task_id, sample_index, exc_info=True)


def failed_trajectory(task: Task, sample_index: int, error: BaseException | str) -> Trajectory:
    """An empty failed trajectory of (task, sample_index) for a sample that never had one (its
    environment's setup raised); `error` (or its `aio.describe`) is its `error`."""
    traj = Trajectory(task.task_id, task.task_id, sample_index, 0, [], [], [])
    traj.mark_failed(error if isinstance(error, str) else describe(error))
    _log.warning("trajectory %s/%d failed before it began: %s", task.task_id, sample_index, traj.error,
                 exc_info=error if isinstance(error, BaseException) else None)
    return traj


GroupCallback = Callable[[str, list[Trajectory]], Any | Awaitable[Any]]


async def run_many(engine: EngineProtocol, env: Environment, tasks: Sequence[Task], tokenizer: TokenizerProtocol, cfg: AgentConfig,
                   samples_per_task: int = 1, max_concurrency: int | None = None,
                   on_group_done: GroupCallback | None = None) -> list[Trajectory]:
    """Roll out `samples_per_task` (G) trajectories per task, all on this event loop.

    Returns exactly len(tasks) * G trajectories, ordered task-major: result[i * G + s] is sample
    `s` of `tasks[i]`, whose group id is the task id. Trajectories start in task order (so a
    caller can put the longest-expected groups first); at most `max_concurrency` are in flight.
    `on_group_done(group_id, trajectories)` (sync or async) fires as soon as a group's G samples
    are all finished and rewarded, which is when its advantages can be computed. A sample that
    fails is returned as a failed trajectory (`Trajectory.error`), also one whose environment
    raised before it began (`failed_trajectory`); no slot is ever None. An `EngineError`, or an
    error in `on_group_done`, cancels the rest and propagates.

    Args:
      engine: the generation engine (`EngineProtocol`), shared by all trajectories.
      env: the environment, shared by all trajectories.
      tasks: the tasks; their `task_id`s must be unique (they are the group ids).
      tokenizer: the tokenizer with the policy's chat template.
      cfg: budgets, sampling and tool-call format (`AgentConfig`).
      samples_per_task: G, trajectories per task, > 0.
      max_concurrency: most trajectories in flight at once; None (or 0): no limit.
      on_group_done: `on_group_done(group_id, trajectories)`, sync or async, called once per task
        with its G finished and rewarded trajectories (in sample order).
    Returns:
      `len(tasks) * samples_per_task` trajectories, task-major: `result[i * G + s]` is sample `s`
      of `tasks[i]`.
    Raises:
      ValueError: `samples_per_task` <= 0 or duplicate task ids.
      ExceptionGroup: holding the `EngineError` (the engine itself failed) or the error of
        `on_group_done` that cancelled the rest (the samples run in an `asyncio.TaskGroup`).
    """
    if samples_per_task <= 0:
        raise ValueError(f"samples_per_task must be > 0, got {samples_per_task}")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError("run_many: task ids must be unique (they are the group ids)")
    results: list[Trajectory | None] = [None] * (len(tasks) * samples_per_task)
    remaining = {t.task_id: samples_per_task for t in tasks}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int, task: Task, s: int) -> None:
        try:
            if limit is None:
                traj = await run_agent(engine, env, task, tokenizer, cfg, sample_index=s, group_id=task.task_id)
            else:
                async with limit:
                    traj = await run_agent(engine, env, task, tokenizer, cfg, sample_index=s,
                                           group_id=task.task_id)
        except EngineError:
            raise
        except asyncio.CancelledError as e:
            if own_cancellation():
                raise
            traj = failed_trajectory(task, s, e)  # a stray cancellation, not ours: this sample's error
        except Exception as e:  # raised before the trajectory began (the environment's setup)
            traj = failed_trajectory(task, s, e)
        results[i * samples_per_task + s] = traj
        remaining[task.task_id] -= 1
        if remaining[task.task_id] == 0 and on_group_done is not None:
            group = results[i * samples_per_task:(i + 1) * samples_per_task]
            outcome = on_group_done(task.task_id, group)
            if inspect.isawaitable(outcome):
                await outcome

    async with asyncio.TaskGroup() as group:
        for i, task in enumerate(tasks):
            for s in range(samples_per_task):
                group.create_task(one(i, task, s))
    for k, traj in enumerate(results):  # a sample task cancelled from outside this function
        if traj is None:
            results[k] = failed_trajectory(tasks[k // samples_per_task], k % samples_per_task,
                                           "cancelled before it finished")
    return results  # type: ignore[return-value]
