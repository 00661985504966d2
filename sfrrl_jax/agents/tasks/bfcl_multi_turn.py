"""BFCL multi-turn items: a user who speaks several times, tools that are real Python objects with state.

Kind 'bfcl_multi_turn' (registered on import). A record:
    {"id": str, "question": [[message, ...] per user turn] (a turn may be [] where functions are
     handed out, BFCL's miss_func), "initial_config": {class: scenario}, "involved_classes": [class],
     "ground_truth": [[call string, ...] per user turn], "function"?: [BFCL function doc],
     "excluded_function"?: [name], "missed_function"?: {turn: [name]}}
`function` defaults to the installed bfcl-eval's docs of the involved classes, less the excluded
functions. Task.metadata keeps these fields ('turns', 'functions', 'ground_truth', ...).

The tools are BFCL's own executable backends (`GorillaFileSystem`, `TwitterAPI`, `TravelAPI`,
...: in-memory Python classes in bfcl_eval/eval_checker/multi_turn_eval/func_source_code, whose
ids come from seeded generators, so a replay is deterministic). `BfclMultiTurnEnvironment` opens
one episode per trajectory (`protocols.Episode`): fresh instances loaded with the item's
scenario, every documented public method a tool bound to them (schema-checked, run in order:
calls mutate state), and the next user turn when the model answers without calls. A function
BFCL holds out until a later turn (miss_func) is left out of the rendered tools and handed out
in that turn's user message (the chat template rendered the tools once, at the top); as in
BFCL's own execution, calling it earlier is not refused (one ground truth does).

The reward (`multi_turn_match`) follows BFCL's multi-turn checker: it replays the trajectory's
calls, user turn by user turn, on fresh instances beside the ground truth's; after every turn
whose ground truth has calls, the model must have called something, every public attribute of
every instance must equal the ground truth's, and each result of the ground truth's calls must
be among the results of the model's calls so far (as a multiset). `multi_turn_progress` is the
share of user turns that pass in order, for partial credit. Calls are never `eval`ed (BFCL's
harness evals strings): the ground truth's are parsed as literal calls, the model's are the
parsed tool calls that ran (those with a result message).

Left out: the memory, web-search and 'composite' categories (they need embeddings or the net).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import json
from collections import Counter
from typing import Any, Sequence

from sfrrl_jax.agents.protocols import Message, RewardFn, Task, ToolCall, ToolCallError, ToolResult
from sfrrl_jax.agents.schema import validate
from sfrrl_jax.agents.tasks.environments import ToolEnvironment
from sfrrl_jax.agents.tasks.function_calling import (BFCL_HINT, bfcl_data_dir, bfcl_items_file, message_tool_calls,
                                                     tool_schemas)
from sfrrl_jax.agents.tasks.kinds import register_task_kind
from sfrrl_jax.agents.tasks.records import read_records, task_from_record
from sfrrl_jax.agents.tools import FunctionTool, ToolRunnerConfig
from sfrrl_jax.agents.trajectory import Trajectory

MULTI_TURN_CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param",
                         "multi_turn_long_context")
_BACKEND_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
# class -> (its module in _BACKEND_PACKAGE, its docs in data/multi_turn_func_doc)
BACKENDS = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
_STATELESS = ("MathAPI",)   # no scenario to load
MULTI_TURN_SYSTEM_PROMPT = (
    "You operate the user's tools by calling functions. In each of the user's requests, keep calling "
    "functions until the request is done, then reply without a call; the user may then ask more. If the "
    "functions cannot do what is asked, or a needed value is missing, say so instead of guessing.")
MORE_FUNCTIONS_MESSAGE = ("I have made more functions available to you:\n{functions}\n"
                          "Use them if they help with my earlier request.")

Call = tuple[str, dict]


# ----------------------------------------------------------------------------- backends

def backend_instances(task: Task) -> dict[str, Any]:
    """{class name: a fresh instance loaded with the task's scenario}."""
    meta = task.metadata
    out = {}
    for name in meta["involved_classes"]:
        module_name, _ = BACKENDS[name]
        try:
            module = importlib.import_module(f"{_BACKEND_PACKAGE}.{module_name}")
        except ImportError as e:
            raise ImportError(f"BFCL multi-turn tools need the bfcl-eval package ({e}): {BFCL_HINT}") from e
        instance = getattr(module, name)()
        if name not in _STATELESS:
            instance._load_scenario(copy.deepcopy(meta["initial_config"].get(name, {})),
                                    long_context=bool(meta.get("long_context")))
        out[name] = instance
    return out


def _method_owners(task: Task, instances: dict[str, Any]) -> dict[str, Any]:
    """{function name: the instance whose method it is}."""
    owners = {}
    for f in task.metadata["functions"]:
        owner = [inst for inst in instances.values() if callable(getattr(inst, f["name"], None))]
        if not owner:
            raise ValueError(f"task {task.task_id}: function {f['name']!r} is a method of none of "
                             f"{list(instances)}")
        owners[f["name"]] = owner[0]
    return owners


def _as_text(result: Any) -> str:
    """A method's return value as BFCL shows it: a str as is, a dict as JSON, else str()."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def shown_functions(task: Task, turn: int) -> set[str]:
    """The functions the model has been shown by user turn `turn` (held-out ones from their turn on)."""
    held = {name: int(t) for t, names in task.metadata.get("missed_function", {}).items() for name in names}
    return {f["name"] for f in task.metadata["functions"] if held.get(f["name"], 0) <= turn}


def _run(owners: dict[str, Any], schemas: dict[str, dict], name: str, arguments: dict) -> str:
    """One call of the model's, as the episode runs it and as the reward replays it."""
    if name not in owners:
        return f"Error during execution: unknown function {name!r}"
    problems = validate(arguments, schemas[name])
    if problems:
        return "Error during execution: invalid arguments: " + "; ".join(problems)
    try:
        return _as_text(getattr(owners[name], name)(**arguments))
    except Exception as e:  # the backends raise for bad states too: the model reads the error
        return f"Error during execution: {e}"


def parse_call(text: str) -> tuple[str, tuple, dict]:
    """A ground-truth call string `name(arg, key=value)` -> (name, args, kwargs); literals only."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("not a call of a plain name")
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"ground-truth call {text!r} is not a call with literal arguments ({e})") from None
    return node.func.id, args, kwargs


def _run_truth(owners: dict[str, Any], text: str) -> str:
    name, args, kwargs = parse_call(text)
    try:
        return _as_text(getattr(owners[name], name)(*args, **kwargs))
    except Exception as e:
        return f"Error during execution: {e}"


def _state(instance: Any) -> dict:
    return {k: v for k, v in vars(instance).items() if not k.startswith("_")}


# ----------------------------------------------------------------------------- the check

def turn_calls(trajectory: Trajectory) -> list[list[Call]]:
    """The calls that ran, per user turn: the trajectory's messages split at each user message
    (a run of them opens one turn); an assistant message's tool calls count where a tool result
    answers them (calls past the loop's per-turn cap never ran)."""
    turns: list[list[Call]] = []
    messages = trajectory.messages
    previous_role = None
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "user" and previous_role != "user":
            turns.append([])
        previous_role = role
        if role != "assistant" or not message.get("tool_calls") or not turns:
            continue
        answered = set()
        for later in messages[i + 1:]:
            if later.get("role") != "tool":
                break
            answered.add(later.get("tool_call_id"))
        turns[-1] += [call for call_id, call in message_tool_calls(message) if call_id in answered]
    return turns


@dataclasses.dataclass(frozen=True)
class MultiTurnVerdict:
    turns_passed: int       # user turns passed in order before the first failure (or all)
    turns: int              # user turns in the item
    why: str | None = None  # the first failure, one sentence; None: every turn passed


def check_multi_turn(task: Task, calls_per_turn: Sequence[Sequence[Call]]) -> MultiTurnVerdict:
    """BFCL's multi-turn check of the model's calls per user turn (see the module docstring)."""
    meta = task.metadata
    truth = meta["ground_truth"]
    model_instances, truth_instances = backend_instances(task), backend_instances(task)
    model_owners, truth_owners = _method_owners(task, model_instances), _method_owners(task, truth_instances)
    schemas = {f["name"]: json_schema_of(f) for f in meta["functions"]}
    model_results: list[str] = []
    for t, expected in enumerate(truth):
        calls = calls_per_turn[t] if t < len(calls_per_turn) else []
        model_results += [_run(model_owners, schemas, name, args) for name, args in calls]
        truth_results = [_run_truth(truth_owners, text) for text in expected]
        if not expected:
            continue
        if not calls:
            return MultiTurnVerdict(t, len(truth), f"turn {t}: no function calls, expected {len(expected)}")
        for cls, instance in truth_instances.items():
            want, got = _state(instance), _state(model_instances[cls])
            differ = sorted(k for k in want if got.get(k) != want[k])
            if differ:
                return MultiTurnVerdict(t, len(truth), f"turn {t}: {cls} state differs from the expected in "
                                                       f"{differ[:3]}")
        missing = Counter(truth_results) - Counter(model_results)
        if missing:
            first = next(iter(missing))
            return MultiTurnVerdict(t, len(truth), f"turn {t}: {sum(missing.values())} expected results are "
                                                   f"not among the calls' results, e.g. {first[:120]!r}")
    return MultiTurnVerdict(len(truth), len(truth))


def multi_turn_match(task: Task, trajectory: Trajectory) -> float:
    """Reward function: 1.0 if every user turn passes BFCL's multi-turn check, else 0.0; the
    reason for a 0 goes to `trajectory.metadata['call_mismatch']`.

    Args:
      task: a 'bfcl_multi_turn' task.
      trajectory: the finished trajectory; its calls that ran are replayed per user turn (`turn_calls`) on
        fresh backend instances beside the ground truth's (`check_multi_turn`). Written to on a failure.
    Returns:
      1.0 or 0.0.
    Raises:
      ImportError: bfcl-eval (whose backends run the calls) is not installed.
      ValueError: a ground-truth call is not a literal call, or a task function is no backend's method.
    """
    verdict = check_multi_turn(task, turn_calls(trajectory))
    if verdict.why is not None:
        trajectory.metadata["call_mismatch"] = verdict.why
    return float(verdict.why is None)


def multi_turn_progress(task: Task, trajectory: Trajectory) -> float:
    """Reward function: the share of user turns passed in order (partial credit).

    Args:
      task: a 'bfcl_multi_turn' task.
      trajectory: the finished trajectory, checked as by `multi_turn_match` (not written to).
    Returns:
      The user turns passed before the first failure, over the item's user turns: in [0, 1], 1.0 when
      `multi_turn_match` gives 1.0.
    Raises:
      ImportError: bfcl-eval is not installed.
      ValueError: a ground-truth call is not a literal call, or a task function is no backend's method.
    """
    verdict = check_multi_turn(task, turn_calls(trajectory))
    return verdict.turns_passed / max(verdict.turns, 1)


# ----------------------------------------------------------------------------- tasks

def json_schema_of(function: dict) -> dict:
    return tool_schemas([function])[0]["function"]["parameters"]


def _function_docs(classes: Sequence[str]) -> list[dict]:
    docs = []
    folder = bfcl_data_dir() / "multi_turn_func_doc"
    for name in classes:
        for _, record in read_records(folder / BACKENDS[name][1]):
            docs.append(record)
    return docs


def _check_record(record: dict) -> None:
    turns, truth = record["question"], record["ground_truth"]
    if not isinstance(turns, list) or not turns or not all(
            isinstance(turn, list) and all(isinstance(m, dict) and m.get("role") in ("user", "system")
                                           and isinstance(m.get("content"), str) for m in turn) for turn in turns):
        raise ValueError("field 'question' must be a list of user turns, each a list of {'role', 'content'} messages")
    if not turns[0]:
        raise ValueError("field 'question[0]' is empty: the first user turn must say something")
    if not isinstance(truth, list) or len(truth) != len(turns) or not all(
            isinstance(t, list) and all(isinstance(c, str) for c in t) for t in truth):
        raise ValueError(f"field 'ground_truth' must be a list of {len(turns)} lists of call strings "
                         "(one per user turn)")
    classes = record["involved_classes"]
    if not isinstance(classes, list) or not classes or not all(c in BACKENDS for c in classes):
        raise ValueError(f"field 'involved_classes' must list classes among {sorted(BACKENDS)}, got {classes!r}")
    if not isinstance(record["initial_config"], dict):
        raise ValueError("field 'initial_config' must map class names to their scenario")
    missed = record.get("missed_function", {})
    if not isinstance(missed, dict) or not all(str(k).isdigit() and 0 < int(k) < len(turns) and isinstance(v, list)
                                               for k, v in missed.items()):
        raise ValueError(f"field 'missed_function' must map turn indices in 1..{len(turns) - 1} to function names")
    for k in missed:
        if turns[int(k)]:
            raise ValueError(f"field 'question[{k}]' must be [] where 'missed_function' hands out functions")


def multi_turn_task(record: dict, task_id: str) -> Task:
    """A 'bfcl_multi_turn' task from a record (module docstring); errors name the field."""
    _check_record(record)
    functions = record.get("function")
    if functions is None:
        excluded = set(record.get("excluded_function", []))
        functions = [f for f in _function_docs(record["involved_classes"]) if f["name"] not in excluded]
    if not isinstance(functions, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                                  for f in functions):
        raise ValueError("field 'function' must be a list of function docs, each with a 'name'")
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError(f"field 'function' names a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    missed = {str(k): list(v) for k, v in record.get("missed_function", {}).items()}
    unknown = sorted({n for v in missed.values() for n in v} - set(names))
    if unknown:
        raise ValueError(f"field 'missed_function' names functions not among the item's functions: {unknown}")
    for t, calls in enumerate(record["ground_truth"]):
        for c, text in enumerate(calls):
            name = parse_call(text)[0]
            if name not in names:
                raise ValueError(f"field 'ground_truth[{t}][{c}]' calls {name!r}, not among the functions")
    extra = {k: v for k, v in record.items() if k not in ("id", "kind", "question", "function", "ground_truth",
                                                          "missed_function")}
    category = str(record.get("category", ""))
    metadata = {**extra, "turns": record["question"], "functions": functions, "ground_truth": record["ground_truth"],
                "missed_function": missed, "long_context": bool(record.get("long_context", "long_context" in category))}
    prompt = next(m["content"] for m in reversed(record["question"][0]) if m["role"] == "user")
    task = Task(task_id=task_id, kind="bfcl_multi_turn", prompt=prompt, metadata=metadata)
    backend_instances(task)   # the scenario loads (a bad initial_config fails here, naming the item)
    return task


def _to_record(task: Task) -> dict:
    meta = dict(task.metadata)
    return {"question": meta.pop("turns"), "function": meta.pop("functions"), **meta}


def _verify_final_text(task: Task, final_text: str) -> float:
    raise ValueError("a 'bfcl_multi_turn' task is judged on its whole trajectory, not its final text: reward it "
                     "with bfcl_multi_turn.multi_turn_match (BfclMultiTurnEnvironment's default)")


def bfcl_multi_turn_tasks(category: str = "multi_turn_base", limit: int | None = None) -> list[Task]:
    """BFCL v4 multi-turn items of `category` (one of `MULTI_TURN_CATEGORIES`) with their ground
    truth and function docs, from the installed bfcl-eval.

    Args:
      category: the BFCL category, one of `MULTI_TURN_CATEGORIES`.
      limit: keep the first `limit` items; None keeps all.
    Returns:
      'bfcl_multi_turn' tasks (`multi_turn_task`) with BFCL's item ids and metadata 'category', in file
      order; each item's scenario is loaded once to check it.
    Raises:
      ValueError: `category` is not in `MULTI_TURN_CATEGORIES`; an item has no ground truth in
        possible_answer/, or is malformed (`DatasetError`, naming the file, line and field).
      ImportError: bfcl-eval is not installed.
      FileNotFoundError: the installed bfcl-eval has no data file for `category`.
    """
    if category not in MULTI_TURN_CATEGORIES:
        raise ValueError(f"BFCL multi-turn category {category!r} is not supported; supported: "
                         f"{list(MULTI_TURN_CATEGORIES)}")
    items_path = bfcl_items_file(category)
    answers = {record.get("id"): record.get("ground_truth")
               for _, record in read_records(items_path.parent / "possible_answer" / items_path.name)}
    tasks = []
    for where, record in read_records(items_path):
        if limit is not None and len(tasks) >= limit:
            break
        truth = answers.get(record.get("id"))
        if truth is None:
            raise ValueError(f"{where}: item {record.get('id')!r} has no ground truth in possible_answer/")
        tasks.append(task_from_record({**record, "ground_truth": truth, "category": category}, where, "",
                                      "bfcl_multi_turn"))
    return tasks


# ----------------------------------------------------------------------------- environment

class BfclEpisode:
    """One trajectory of a multi-turn item: its own backend instances and user-turn counter."""

    def __init__(self, env: "BfclMultiTurnEnvironment", task: Task):
        self.env, self.task, self.turn = env, task, 0
        instances = backend_instances(task)
        owners = _method_owners(task, instances)
        schemas = {f["name"]: json_schema_of(f) for f in task.metadata["functions"]}

        def bind(name: str):
            # run as the reward replays it: same checks and result text
            return lambda **arguments: _run(owners, schemas, name, arguments)

        self.tools = {f["name"]: FunctionTool(f["name"], f.get("description", ""), schemas[f["name"]], bind(f["name"]))
                      for f in task.metadata["functions"]}

    def reset(self) -> list[Message]:
        return self.env.reset(self.task)

    async def step(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        # in call order, one at a time: the calls change the instances' state
        return [await self.env.runner.run_one(call, self.tools) for call in calls]

    def next_user_turn(self) -> list[Message] | None:
        turns = self.task.metadata["turns"]
        if self.turn + 1 >= len(turns):
            return None
        self.turn += 1
        handed = self.task.metadata["missed_function"].get(str(self.turn))
        if handed:
            docs = [f for f in self.task.metadata["functions"] if f["name"] in handed]
            return [{"role": "user", "content": MORE_FUNCTIONS_MESSAGE.format(functions=json.dumps(docs, indent=1))}]
        return [{"role": m["role"], "content": m["content"]} for m in turns[self.turn]]

    def close(self) -> None:
        self.tools = {}


class BfclMultiTurnEnvironment(ToolEnvironment):
    """BFCL multi-turn items with their executable backends (module docstring). One instance
    serves every trajectory; each gets its own `BfclEpisode`. Reward: `multi_turn_match` unless
    other reward functions are given. Give the agent room: `AgentConfig.max_turns` counts model
    turns over all user turns (BFCL allows up to 20 per user turn).

    `reset(task)` gives the system prompt (an item's own system message appended to it) and the first user
    turn; `task_tool_schemas(task)` the functions shown from the start (held-out ones are left out);
    `open_episode(task)` a `BfclEpisode`, which runs the calls and gives the next user turns. `step` on
    the environment itself raises RuntimeError: the state is per episode.

    Args:
      system_prompt: the system prompt, default `MULTI_TURN_SYSTEM_PROMPT`; None or '': none (an item's own
        system message then stays in the first user turn's messages).
      runner_cfg: how tool calls run (timeout, output cap, ...); backend 'ray' opens each episode on a Ray
        actor, which holds its backend instances (`agents.ray_tools`).
      reward_fns: the reward functions; None: `[multi_turn_match]` (`multi_turn_progress` gives partial
        credit).
      reward_weights: one weight per reward function; None: 1 each.
    """

    def __init__(self, system_prompt: str | None = MULTI_TURN_SYSTEM_PROMPT,
                 runner_cfg: ToolRunnerConfig = ToolRunnerConfig(), reward_fns: Sequence[RewardFn] | None = None,
                 reward_weights: Sequence[float] | None = None):
        super().__init__([], system_prompt, runner_cfg,
                         reward_fns=[multi_turn_match] if reward_fns is None else reward_fns,
                         reward_weights=reward_weights)

    def task_tool_schemas(self, task: Task) -> list[dict]:
        shown = shown_functions(task, 0)
        return tool_schemas([f for f in task.metadata["functions"] if f["name"] in shown])

    def reset(self, task: Task) -> list[Message]:
        messages: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        first = [{"role": m["role"], "content": m["content"]} for m in task.metadata["turns"][0]]
        if first and first[0]["role"] == "system" and messages:   # the item's own system text follows ours
            messages[0]["content"] += "\n\n" + first.pop(0)["content"]
        return messages + first

    def open_episode(self, task: Task) -> BfclEpisode:
        return BfclEpisode(self, task)

    async def step(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        raise RuntimeError("BfclMultiTurnEnvironment keeps state per trajectory: step an episode "
                           "(open_episode(task)), as the agent loop does")


# Registered last: the kind names its default environment, defined above.
register_task_kind("bfcl_multi_turn", _verify_final_text, from_record=multi_turn_task, to_record=_to_record,
                   fields=("question", "initial_config", "involved_classes", "ground_truth"),
                   environment=BfclMultiTurnEnvironment)
