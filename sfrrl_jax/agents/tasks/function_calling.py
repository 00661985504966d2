"""Function calling (BFCL style): tool schemas + expected calls, rewarded by an AST match.

Kind 'function_call' (registered on import). A record is BFCL's own item joined with its answer:
    {"id": str, "question": [[message, ...]] (BFCL: turns of messages; one turn here) or str,
     "function": [BFCL function doc, ...], "ground_truth": [{name: {param: [allowed values]}}, ...]}
`ground_truth: []` means no call is right (BFCL's irrelevance items). Task.metadata keeps
'messages' (the first turn's), 'functions' (BFCL's docs), 'tools' (them as OpenAI tool schemas:
BFCL's types 'dict', 'float', 'tuple', 'any' become 'object', 'number', 'array', untyped) and
'ground_truth'.

The match (`match_calls`) follows BFCL's AST checker (bfcl_eval/eval_checker/ast_eval) for Python:
the number of calls must equal the number expected; each expected call is matched to a distinct
actual call (in any order: BFCL's parallel categories) whose name equals it (or equals it with '.'
written '_', as APIs that forbid dots rename), that has every required parameter, no parameter
outside both the schema and the answer, and each value among the allowed ones: strings compared
case-insensitively without spaces and ',./-_*^' (BFCL's standardize_string), ints accepted for
floats, lists elementwise, dicts key by key; an expected parameter may be left out only where ""
is among its allowed values. Where BFCL assigns calls greedily we search all assignments, so we
accept the rare order BFCL's greedy pass misses. Java and JavaScript items are not loaded.

Why not BFCL's own checker: `bfcl_eval.eval_checker.ast_eval.ast_checker` imports the model
registry (`constants.model_config`), which imports every provider SDK (openai, anthropic, cohere,
mistralai, google-genai, ...), and the package pins numpy==1.26.4, which cannot install beside
jax (numpy>=2). So the data is read from the installed package (located, never imported;
install it with `pip install --no-deps bfcl-eval`) and the check is this module's ~100 lines.

Calls are read from the trajectory (`function_call_match`): the first assistant message with
`tool_calls` (the model's native tool-call format), else the final text in BFCL's prompting format
`[func(a=1, b='x'), other(c=[1, 2])]` (also inside a code fence or <answer>). The kind's verifier
(`answer_correct` sees only the final text) reads the latter.

`FunctionCallingEnvironment`: the agent loop asks an environment for its tools before it sees the
task, so the per-task tools are given in the system prompt (BFCL's prompting mode: the docs as
JSON), and `task_tool_schemas(task)` returns them for a loop or template that takes per-task
tools. Calls are graded, not run: `step` answers each with a note (use `AgentConfig(max_turns=1)`).
BFCL's multi-turn items (executable Python backends with state) are `bfcl_multi_turn.py`; the
memory and web-search agentic categories are left out.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Sequence

from sfrrl_jax.agents.protocols import Message, RewardFn, Task, ToolCall, ToolCallError, ToolResult
from sfrrl_jax.agents.tasks.environments import ToolEnvironment
from sfrrl_jax.agents.tasks.kinds import register_task_kind
from sfrrl_jax.agents.tasks.records import read_records, task_from_record
from sfrrl_jax.agents.tasks.verifiers import extract_answer
from sfrrl_jax.agents.trajectory import Trajectory

BFCL_HINT = ("pip install --no-deps 'bfcl-eval==2026.3.23' (--no-deps: only its data files are read, and its own "
             "requirements pin numpy==1.26.4, which conflicts with jax)")
BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
                   "live_parallel", "live_parallel_multiple", "irrelevance", "live_irrelevance")
FUNCTION_CALLING_SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. Based on "
    "the question, make one or more function calls to achieve the purpose. If none of the functions can be used, "
    "say so and call none. Call them with your tool-call format, or reply with only the calls in the format "
    "[func_name1(param1=value1, param2=value2), func_name2(param=value)].\n\n"
    "Here is a list of functions in JSON format that you can invoke.\n{functions}")
_TYPES = {"string": str, "integer": int, "float": float, "number": float, "boolean": bool, "array": list,
          "tuple": list, "dict": dict, "object": dict, "any": str}
_SCHEMA_TYPES = {"dict": "object", "float": "number", "tuple": "array"}
_STANDARDIZE = re.compile(r"[ ,./\-_*^]")
_FENCE = re.compile(r"```[a-zA-Z]*\n?(.*?)```", re.DOTALL)

Call = tuple[str, dict]


# ----------------------------------------------------------------------------- schemas

def json_schema(bfcl_schema: Any) -> Any:
    """BFCL's parameter schema as JSON schema: 'dict' -> 'object', 'float' -> 'number',
    'tuple' -> 'array', 'any' -> no type; recursively, other keys kept."""
    if isinstance(bfcl_schema, list):
        return [json_schema(s) for s in bfcl_schema]
    if not isinstance(bfcl_schema, dict):
        return bfcl_schema
    out = {}
    for key, value in bfcl_schema.items():
        if key == "type" and isinstance(value, str):
            if value != "any":
                out[key] = _SCHEMA_TYPES.get(value, value)
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key == "items":
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


def tool_schemas(functions: Sequence[dict]) -> list[dict]:
    """BFCL function docs as OpenAI tool schemas (what chat templates render)."""
    return [{"type": "function", "function": {"name": f["name"], "description": f.get("description", ""),
                                              "parameters": json_schema(f.get("parameters", {}))}}
            for f in functions]


# ----------------------------------------------------------------------------- the match

def _standardize(text: str) -> str:
    return _STANDARDIZE.sub("", text).lower().replace("'", '"')


def _std(value: Any) -> Any:
    return _standardize(value) if isinstance(value, str) else value


def _type_ok(value: Any, expected: type, allowed: list) -> bool:
    if type(value) is expected:
        return True
    # BFCL's "variable" case: the answer itself is of another type (a name given as a string)
    typed = [a for a in allowed if a != ""]
    return bool(typed) and type(value) is type(typed[0])


def _dict_ok(value: dict, allowed: list) -> bool:
    for option in allowed:
        if option == "" or not isinstance(option, dict):
            continue
        if all(k in option and _std(v) in [_std(a) for a in option[k]] for k, v in value.items()) and \
                all(k in value or "" in vals for k, vals in option.items()):
            return True
    return False


def _value_ok(value: Any, spec: dict, allowed: list) -> bool:
    kind = spec.get("type", "any")
    expected = _TYPES.get(kind, str)
    if isinstance(value, tuple):
        value = list(value)
    if expected is float and type(value) is int:  # Python accepts an int where a float is asked
        value = float(value)
    if not _type_ok(value, expected, allowed):
        return False
    if type(value) is not expected:  # a variable: compared as given
        return value in allowed
    items = spec.get("items")
    item_type = (_TYPES.get(items.get("type"), str) if expected is list and isinstance(items, dict)
                 and isinstance(items.get("type"), str) else None)
    if item_type is not None and not all(type(v) is item_type or (item_type is float and type(v) is int)
                                         for v in value):
        return False
    if expected is dict:
        return _dict_ok(value, allowed)
    if expected is list and item_type is dict:
        return any(isinstance(option, list) and len(option) == len(value)
                   and all(isinstance(v, dict) and _dict_ok(v, [o]) for v, o in zip(value, option))
                   for option in allowed)
    if expected is str:
        return _standardize(value) in [_standardize(a) for a in allowed if isinstance(a, str)]
    if expected is list:
        return [_std(v) for v in value] in [[_std(a) for a in option] for option in allowed if isinstance(option, list)]
    return value in allowed


def call_matches(call: Call, expected: dict, functions: Sequence[dict]) -> str | None:
    """None if `call` = (name, arguments) matches the expected `{name: {param: [allowed]}}`, else
    why not (one sentence)."""
    (want_name, answer), = expected.items()
    name, arguments = call
    if name not in (want_name, want_name.replace(".", "_")):
        return f"called {name!r}, expected {want_name!r}"
    doc = next((f for f in functions if f.get("name") == want_name), None)
    if doc is None:
        raise ValueError(f"ground truth calls {want_name!r}, which is not among the task's functions")
    params = doc.get("parameters", {})
    properties = params.get("properties", {})
    for param in params.get("required", []):
        if param not in arguments:
            return f"{want_name}: missing required parameter {param!r}"
    for param, value in arguments.items():
        if param not in properties or param not in answer:
            return f"{want_name}: unexpected parameter {param!r}"
        if not _value_ok(value, properties[param], answer[param]):
            return f"{want_name}: {param}={value!r} is not one of {answer[param]!r}"
    for param, allowed in answer.items():
        if param not in arguments and "" not in allowed:
            return f"{want_name}: parameter {param!r} left out (expected one of {allowed!r})"
    return None


def match_calls(calls: Sequence[Call], ground_truth: Sequence[dict], functions: Sequence[dict]) -> str | None:
    """None if the calls match the expected ones one to one in some order, else why not.

    Each expected call must match a distinct actual call (`call_matches`; the module docstring lists the
    rules); all assignments are searched.

    Args:
      calls: the actual calls, each `(name, arguments)`.
      ground_truth: the expected calls, each `{name: {param: [allowed values]}}`; [] means no call is right.
      functions: the task's BFCL function docs (their parameter schemas and required parameters).
    Returns:
      None on a match; else one sentence: the count mismatch, why the first expected call that no actual
      call matches fails against the first actual call, or that a match would need one call twice.
    Raises:
      ValueError: the ground truth calls a function that is not among `functions`.
    """
    if len(calls) != len(ground_truth):
        return f"{len(calls)} calls, expected {len(ground_truth)}"
    ok = [[call_matches(c, g, functions) is None for c in calls] for g in ground_truth]

    def assign(i: int, used: frozenset) -> bool:  # tiny bipartite search: a handful of calls per item
        return i == len(ground_truth) or any(ok[i][j] and j not in used and assign(i + 1, used | {j})
                                             for j in range(len(calls)))

    if assign(0, frozenset()):
        return None
    for g in ground_truth:  # name the first expected call nothing matches
        reasons = [call_matches(c, g, functions) for c in calls]
        if all(r is not None for r in reasons):
            return reasons[0]
    return "the calls match only in an assignment that reuses a call"


def _first(allowed: list) -> Any:
    return next(a for a in allowed if a != "")


def _first_allowed(allowed: list) -> Any:
    # A dict parameter's answer is {key: [allowed]} one level deep (BFCL's dict_checker), and so
    # is each dict of a list-of-dicts parameter; deeper values are compared whole.
    value = _first(allowed)
    if isinstance(value, dict):
        return {k: _first(v) for k, v in value.items() if any(a != "" for a in v)}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [{k: _first(vals) for k, vals in v.items() if any(a != "" for a in vals)} for v in value]
    return value


def ground_truth_calls(ground_truth: Sequence[dict], functions: Sequence[dict] = ()) -> list[Call]:
    """One reference answer: each expected call with the first allowed value of each parameter;
    one that may be left out ("" allowed) is left out unless `functions` marks it required."""
    required = {f.get("name"): set(f.get("parameters", {}).get("required", [])) for f in functions}
    calls = []
    for call in ground_truth:
        for name, params in call.items():
            need = required.get(name, set())
            calls.append((name, {p: _first_allowed(v) for p, v in params.items()
                                 if any(a != "" for a in v) and ("" not in v or p in need)}))
    return calls


# ----------------------------------------------------------------------------- reading calls

def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_call_name(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def parse_python_calls(text: str) -> list[Call] | None:
    """BFCL's prompting format `[f(a=1), g.h(b='x')]` (or one bare call) -> [(name, args)].

    The text read is the last code fence's content if there is one, then the last <answer> block in it if
    there is one. Argument values must be Python literals, given as keywords.

    Args:
      text: the model's text.
    Returns:
      The calls as `(dotted name, {keyword: value})`, in order; None if the text is not such a list (or a
      tuple, or one call), has a positional argument or a non-literal value, or is too deep or long to parse.
    """
    text = text.strip()
    fenced = _FENCE.findall(text)
    if fenced:
        text = fenced[-1].strip()
    answer = extract_answer(text)
    if answer is not None:
        text = answer
    # A model's text is hostile input: deep nesting is a MemoryError or RecursionError in the
    # parser, a long digit string a ValueError; each means "not a call list" (reward 0), not a
    # failed trajectory.
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls: list[Call] = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            return None
        try:
            calls.append((_call_name(node.func), {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords
                                                  if kw.arg is not None}))
        except (ValueError, TypeError, MemoryError, RecursionError):
            return None
    return calls


def message_tool_calls(message: Message) -> list[tuple[str, Call]]:
    """An assistant message's native tool calls as (call id, (name, arguments)); arguments given
    as a JSON string are decoded, and anything not an object becomes {}."""
    calls = []
    for entry in message.get("tool_calls") or []:
        function = entry.get("function", entry)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):   # JSONDecodeError, an over-long integer, deep nesting
                arguments = {}
        calls.append((entry.get("id"), (function.get("name", ""), arguments if isinstance(arguments, dict) else {})))
    return calls


def trajectory_calls(trajectory: Trajectory) -> list[Call]:
    """The first assistant turn's native tool calls, else the calls in the final text, else []."""
    for message in trajectory.messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            return [call for _, call in message_tool_calls(message)]
    return parse_python_calls(trajectory.final_text) or []


def verify_function_call(task: Task, final_text: str) -> float:
    """The kind's verifier: the calls written in the final text (BFCL prompting format) match."""
    calls = parse_python_calls(final_text) or []
    return float(match_calls(calls, task.metadata["ground_truth"], task.metadata["functions"]) is None)


def function_call_match(task: Task, trajectory: Trajectory) -> float:
    """Reward function: 1.0 if the trajectory's calls (`trajectory_calls`) match the task's
    expected calls, else 0.0; the reason for a 0 goes to `trajectory.metadata['call_mismatch']`.

    Args:
      task: a 'function_call' task (`metadata` holds 'ground_truth' and 'functions').
      trajectory: the finished trajectory: the first assistant message's native tool calls are read, else
        the calls in its final text (`parse_python_calls`). Written to on a mismatch.
    Returns:
      1.0 or 0.0 (`match_calls`).
    Raises:
      ValueError: the task's ground truth calls a function not among its functions.
    """
    why = match_calls(trajectory_calls(trajectory), task.metadata["ground_truth"], task.metadata["functions"])
    if why is not None:
        trajectory.metadata["call_mismatch"] = why
    return float(why is None)


# ----------------------------------------------------------------------------- tasks

def _messages(question: Any) -> list[Message]:
    if isinstance(question, str):
        return [{"role": "user", "content": question}]
    turns = question
    if isinstance(turns, list) and turns and isinstance(turns[0], list):
        if len(turns) != 1:
            raise ValueError(f"field 'question' has {len(turns)} turns; multi-turn items are not supported")
        turns = turns[0]
    if not isinstance(turns, list) or not turns or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user", "assistant")
            for m in turns):
        raise ValueError("field 'question' must be a string or a list of {'role', 'content'} messages")
    return [{"role": m["role"], "content": m["content"]} for m in turns]


def _check_ground_truth(ground_truth: Any, functions: list[dict]) -> None:
    names = {f["name"] for f in functions}
    if not isinstance(ground_truth, list):
        raise ValueError(f"field 'ground_truth' must be a list of {{name: {{param: [allowed]}}}}, got "
                         f"{type(ground_truth).__name__}")
    for i, call in enumerate(ground_truth):
        if not isinstance(call, dict) or len(call) != 1:
            raise ValueError(f"field 'ground_truth[{i}]' must be one {{name: {{param: [allowed values]}}}}")
        (name, params), = call.items()
        if name not in names:
            raise ValueError(f"field 'ground_truth[{i}]' calls {name!r}, not among the functions {sorted(names)}")
        if not isinstance(params, dict) or not all(isinstance(v, list) for v in params.values()):
            raise ValueError(f"field 'ground_truth[{i}].{name}' must map each parameter to a list of allowed values")


def function_call_task(question: Any, functions: list[dict], ground_truth: list[dict], task_id: str,
                       **metadata: Any) -> Task:
    """A 'function_call' task (see the module docstring for the fields).

    Args:
      question: the user's text (a str), a list of {'role', 'content'} messages (roles 'system', 'user',
        'assistant'), or BFCL's list of turns holding one such list.
      functions: BFCL function docs, each a dict with a 'name' (and 'description', 'parameters').
      ground_truth: the expected calls, each `{name: {param: [allowed values]}}` naming one of `functions`;
        [] means no call is right.
      task_id: the task's id.
      **metadata: more `Task.metadata` entries (e.g. 'category').
    Returns:
      The Task, kind 'function_call', no answer: its prompt is the last user message's content (else the
      last message's); metadata 'messages', 'functions', 'tools' (OpenAI tool schemas) and 'ground_truth'.
    Raises:
      ValueError: a malformed `question` (or one of more than one turn), `functions` or `ground_truth`;
        the message names the field.
    """
    messages = _messages(question)
    if not isinstance(functions, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                                  for f in functions):
        raise ValueError("field 'function' must be a list of function docs, each with a 'name'")
    _check_ground_truth(ground_truth, functions)
    prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    return Task(task_id=task_id, kind="function_call", prompt=prompt, answer=None,
                metadata={"messages": messages, "functions": functions, "tools": tool_schemas(functions),
                          "ground_truth": ground_truth, **metadata})


def _fc_from_record(record: dict, task_id: str) -> Task:
    extra = {k: v for k, v in record.items() if k not in ("id", "kind", "question", "function", "ground_truth")}
    return function_call_task(record["question"], record["function"], record["ground_truth"], task_id, **extra)


def _fc_to_record(task: Task) -> dict:
    meta = task.metadata
    extra = {k: v for k, v in meta.items() if k not in ("messages", "functions", "tools", "ground_truth")}
    return {"question": [meta["messages"]], "function": meta["functions"], "ground_truth": meta["ground_truth"],
            **extra}


def bfcl_data_dir() -> Path:
    """The `data` folder of the installed bfcl-eval package (located, not imported)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"BFCL items need the bfcl-eval package: {BFCL_HINT}")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def bfcl_items_file(category: str) -> Path:
    """The installed bfcl-eval's item file of `category` (its ground truth: `possible_answer/`, same name).
    Raises FileNotFoundError naming the file when this bfcl-eval has none (ImportError: not installed)."""
    path = bfcl_data_dir() / f"BFCL_v4_{category}.json"
    if not path.is_file():
        raise FileNotFoundError(f"the installed bfcl-eval has no {path} (its version: see {BFCL_HINT})")
    return path


def bfcl_tasks(category: str = "simple_python", limit: int | None = None) -> list[Task]:
    """BFCL v4 items of `category` (one of `BFCL_CATEGORIES`) with their ground truth, from the
    installed bfcl-eval; irrelevance categories get `ground_truth: []` (no call is right).

    Args:
      category: the BFCL category, one of `BFCL_CATEGORIES`.
      limit: keep the first `limit` items; None keeps all.
    Returns:
      'function_call' tasks with BFCL's item ids and metadata 'category', in file order.
    Raises:
      ValueError: `category` is not in `BFCL_CATEGORIES`; an item has no ground truth in possible_answer/,
        or is malformed (`DatasetError`, naming the file and line).
      ImportError: bfcl-eval is not installed.
      FileNotFoundError: the installed bfcl-eval has no data file for `category`.
    """
    if category not in BFCL_CATEGORIES:
        raise ValueError(f"BFCL category {category!r} is not supported; supported: {list(BFCL_CATEGORIES)} "
                         f"(multi-turn: bfcl_multi_turn.MULTI_TURN_CATEGORIES; Java, JavaScript and agentic ones are not)")
    items_path = bfcl_items_file(category)
    answers: dict[str, list] = {}
    if "irrelevance" not in category:
        for where, record in read_records(items_path.parent / "possible_answer" / items_path.name):
            answers[record.get("id")] = record.get("ground_truth")
    tasks = []
    for where, record in read_records(items_path):
        if limit is not None and len(tasks) >= limit:
            break
        truth = [] if "irrelevance" in category else answers.get(record.get("id"))
        if truth is None:
            raise ValueError(f"{where}: item {record.get('id')!r} has no ground truth in possible_answer/")
        tasks.append(task_from_record({**record, "ground_truth": truth, "category": category}, where, "",
                                      "function_call"))
    return tasks


# ----------------------------------------------------------------------------- environment

class FunctionCallingEnvironment(ToolEnvironment):
    """Per-task tools in the system prompt, calls graded and not run (see the module docstring).
    Reward: `function_call_match` unless other reward functions are given.

    `reset(task)` gives the system prompt with '{functions}' replaced by the task's BFCL docs as JSON (an
    item's own system message appended to it), then the item's messages; `task_tool_schemas(task)` gives
    the task's tools as OpenAI schemas; `step` answers each call with a note that it was recorded (an
    unparseable one with its error).

    Args:
      system_prompt: the system prompt; '{functions}' in it is replaced per task. Default
        `FUNCTION_CALLING_SYSTEM_PROMPT` (BFCL's prompting-mode prompt).
      reward_fns: the reward functions; None: `[function_call_match]`.
      reward_weights: one weight per reward function; None: 1 each.
    """

    def __init__(self, system_prompt: str = FUNCTION_CALLING_SYSTEM_PROMPT,
                 reward_fns: Sequence[RewardFn] | None = None, reward_weights: Sequence[float] | None = None):
        super().__init__([], system_prompt, reward_fns=[function_call_match] if reward_fns is None else reward_fns,
                         reward_weights=reward_weights)

    def task_tool_schemas(self, task: Task) -> list[dict]:
        return list(task.metadata["tools"])

    def reset(self, task: Task) -> list[Message]:
        functions = json.dumps(task.metadata["functions"], indent=1)
        system = self.system_prompt.replace("{functions}", functions)
        messages = [dict(m) for m in task.metadata["messages"]]
        if messages and messages[0]["role"] == "system":  # the item's own system text follows ours
            system = f"{system}\n\n{messages.pop(0)['content']}"
        return [{"role": "system", "content": system}, *messages]

    async def step(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        return [ToolResult(name=c.name or "invalid", content=f"error: {c.message}", is_error=True)
                if isinstance(c, ToolCallError) else
                ToolResult(name=c.name, content="(recorded: this item grades the calls and does not run them)",
                           call_id=c.call_id)
                for c in calls]


# Registered last: the kind names its default environment, defined above.
register_task_kind("function_call", verify_function_call, from_record=_fc_from_record, to_record=_fc_to_record,
                   fields=("question", "function", "ground_truth"), environment=FunctionCallingEnvironment)
