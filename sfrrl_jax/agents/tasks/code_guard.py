"""The guard a code reward's test program carries: the tests see what the solution computed, not
what it rigged.

A code reward runs the model's solution and the task's tests in one process (HumanEval's own
harness does the same), so the solution can reach whatever the tests use. Models trained on such
rewards find the cheap ways through, and this guard closes them:
- **Results that compare equal to anything.** A returned object whose class defines `__eq__`
  to return True passes every `assert candidate(x) == y`. Each value the entry point returns
  (containers and dict keys included, and the items of a returned iterator) must be of a class
  whose behaviour is not the solution's own. Classes written in C (int, str, list, numpy's) are
  trusted, as is `collections.Counter`. A class written in Python may not define dunder
  methods other than construction and `__repr__`, nor a method its C base has (a `lower` on a
  str subclass, which the test would call), nor may its instance set one. So a plain
  `class P(str): pass` or a namedtuple passes. Anything else raises TypeError in check(), and
  the program fails.
- **Patched builtins and modules.** `builtins.abs = lambda x: 0` turns `abs(got - want) < 1e-6`
  true, and `math.fabs`, `sys.modules['math']`, or a trace function that jumps over asserts
  can do the same. Before the tests run, and again after every call of the entry point, the
  namespaces of builtins and of the modules tests use are put back as they were before the
  solution ran. Those modules are math, cmath, random, copy, hashlib, re, string, itertools,
  functools, heapq, operator, collections and sys.modules (~30 us a call), and the trace and
  profile hooks are cleared too.
- **Names the tests look up.** The tests run in a namespace of their own: the program's names,
  less those that shadow a builtin (a global `abs = lambda x: 0`), and with the prompt's helpers
  as the prompt defines them. Otherwise a solution that redefines HumanEval/38's
  `encode_cyclic` as the identity would be checked against itself.

The guard's names are drawn per run, as the exit status is (`code_tasks.test_program`), so a
solution cannot name them to undo the guard. What stays open: code written to defeat this
harness in particular can still reach its objects. It can walk the interpreter's objects (`gc`,
frames, `ctypes`) or read the program's own text to learn the status. A per-process harness
closes what is cheap to find, not everything.
"""
from __future__ import annotations

import re

# Dunder names a Python-written class of a returned value may define: construction, pickling
# and repr, never comparison, hashing, arithmetic, truth, length, iteration or `__class__`.
_CONSTRUCTION_DUNDERS = ("__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__slots__",
                         "__annotations__", "__match_args__", "__init__", "__new__", "__getnewargs__", "__repr__",
                         "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__",
                         "__annotate__", "__type_params__", "__dataclass_fields__", "__dataclass_params__")

# The guard's source; NAME is replaced by a per-run identifier. It runs before the solution, so
# everything it keeps (the builtins, the modules' namespaces, the trusted classes) is the
# interpreter's own. It binds one global, a tuple (run_tests(prompt, test, entry_name), exit(status)).
_GUARD_SOURCE = '''
def NAME():
    import builtins, sys, os, types, collections, collections.abc
    import math, cmath, random, copy, hashlib, re, string, itertools, functools, heapq, operator
    kept = [(m.__dict__, dict(m.__dict__)) for m in (builtins, math, cmath, random, copy, hashlib, re, string,
                                                     itertools, functools, heapq, operator, collections)]
    kept_modules = dict(sys.modules)
    main = globals()   # the program's namespace: the prompt's, the solution's, and this guard's
    builtin_names = frozenset(n for n in builtins.__dict__ if not (n.startswith("__") and n.endswith("__")))
    _exec, _compile = exec, compile
    modules, settrace, setprofile, exit_now = sys.modules, sys.settrace, sys.setprofile, os._exit
    # the builtins this guard calls, bound now: the solution may shadow them in __main__'s globals
    _type, _list, _id, _issubclass, _isinstance, _set, _sorted = type, list, id, issubclass, isinstance, set, sorted
    _len = len
    _TypeError, _AttributeError, _Exception = TypeError, AttributeError, Exception
    _getattribute, _getset = object.__getattribute__, types.GetSetDescriptorType
    _keys, _values = dict.keys, dict.values
    heap_type = 1 << 9   # Py_TPFLAGS_HEAPTYPE: a class written in Python, not in C
    allowed = frozenset(ALLOWED)
    trusted = (collections.Counter,)
    collections_ = (dict, list, tuple, set, frozenset, collections.deque)
    iterator = collections.abc.Iterator

    def restore():
        # dict.update runs in C (~20 us for all of them); names added since are rare, so their
        # removal is a Python loop only when a namespace has grown
        settrace(None)
        setprofile(None)
        for live, saved in kept:
            live.update(saved)
            if _len(live) != _len(saved):
                for name in _list(live):
                    if name not in saved:
                        del live[name]
        modules.update(kept_modules)

    def own_behaviour(value, cls):
        # None when nothing of `value`'s behaviour is the solution's code, else why it is
        if _type(cls).__flags__ & heap_type:   # a metaclass in Python (the solution's, an Enum's) decides == of classes
            return "its class has the metaclass " + _type(cls).__qualname__
        if not cls.__flags__ & heap_type:
            return None   # a class written in C: all of it is the interpreter's or a library's
        mro = cls.__mro__
        builtin_names = _set()
        for k in mro:
            if not k.__flags__ & heap_type:
                builtin_names.update(k.__dict__)
        for k in mro:
            if k in trusted:
                break
            if not k.__flags__ & heap_type:
                continue
            for name, attr in k.__dict__.items():
                dunder = name.startswith("__") and name.endswith("__")
                if name in ("__dict__", "__weakref__") and _type(attr) is not _getset:
                    return k.__qualname__ + " defines " + name
                if (dunder and name not in allowed) or (not dunder and name in builtin_names):
                    return k.__qualname__ + " defines " + name
        if cls.__flags__ & heap_type:   # an instance's own attributes shadow its class's methods
            try:
                own = _getattribute(value, "__dict__")
            except _AttributeError:
                own = ()
            except _Exception:
                return "its __dict__ cannot be read"
            shadowing = builtin_names.intersection(own)
            if shadowing:
                return "the instance sets " + ", ".join(_sorted(shadowing))
        return None

    def plain(value):
        stack, seen = [value], _set()
        while stack:
            v = stack.pop()
            t = _type(v)
            why = own_behaviour(v, t)
            if why is not None:
                raise _TypeError("the entry point returned a " + t.__qualname__ + " (" + why + "): a value "
                                 "whose comparison is the solution's own is not a result")
            if _issubclass(t, collections_):
                if _id(v) in seen:
                    continue
                seen.add(_id(v))
                if _issubclass(t, dict):
                    stack.extend(_keys(v))
                    stack.extend(_values(v))
                else:
                    stack.extend(_list(v))
            elif (not t.__flags__ & heap_type and t.__module__ == "numpy" and t.__name__ == "ndarray"
                  and v.dtype.hasobject):
                stack.extend(v.flat)
        return value

    def checked_items(items):
        for item in items:
            yield plain(item)

    def wrap(function):
        def candidate(*args, **kwargs):
            try:
                result = function(*args, **kwargs)
            finally:
                restore()
            t = _type(result)
            if not t.__flags__ & heap_type and not _issubclass(t, collections_) and _isinstance(result, iterator):
                return checked_items(result)   # a generator, map, zip...: its items are the results
            return plain(result)
        return candidate

    def run_tests(prompt_source, test_source, entry_name):
        # The tests run in a namespace of their own: the program's names less those that shadow a
        # builtin (a solution's global `abs` would be the tests' abs), the prompt's helpers as the
        # prompt defines them (a solution that redefines encode_cyclic would check itself), and
        # the builtins as they were.
        restore()
        helpers = {"__builtins__": builtins, "__name__": "__prompt__"}
        try:
            _exec(_compile(prompt_source, "<prompt>", "exec"), helpers)
        except _Exception:   # a stub without a body does not compile: no helpers to take
            helpers = {}
        restore()
        namespace = {name: value for name, value in main.items() if name not in builtin_names}
        for name, value in helpers.items():
            if name != entry_name and not (name.startswith("__") and name.endswith("__")):
                namespace[name] = value
        namespace["__builtins__"] = builtins
        _exec(_compile(test_source, "<test>", "exec"), namespace)
        namespace["check"](wrap(main.get(entry_name)))

    return run_tests, exit_now
NAME = NAME()
'''

# a module-level future import, its names in parentheses over several lines too
_FUTURE = re.compile(r"^from[ \t]+__future__[ \t]+import[ \t]*(?:\([^)]*\)[^\n]*|[^\n]*)\n?", re.MULTILINE)


def guard_source(name: str) -> str:
    """The guard's source, binding the global `name` to (run_tests, exit): `name[0](prompt,
    test, entry_name)` runs the tests' source and `check(entry)` as described above;
    `name[1](status)` is `os._exit`."""
    if not name.isidentifier():
        raise ValueError(f"the guard's name must be an identifier, got {name!r}")
    return _GUARD_SOURCE.replace("ALLOWED", repr(_CONSTRUCTION_DUNDERS)).replace("NAME", name)


def hoist_future_imports(source: str) -> tuple[str, str]:
    """(the module-level `from __future__ import ...` lines, `source` without them). They must
    open the program, so they go before the guard (a solution that starts with one is common)."""
    futures = "".join(line if line.endswith("\n") else line + "\n" for line in _FUTURE.findall(source))
    return futures, _FUTURE.sub("", source)
