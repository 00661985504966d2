"""Which answers could run code in a scorer that evaluates them.

Some reasoning-gym scorers evaluate the model's answer as Python: countdown and puzzle24 through
`sympy.parse_expr`, the integration and polynomial tasks too, the matrix and board tasks through
`eval` (`EVALUATED_DATASETS`). They run in a confined fork (`rg_worker.py`), so such code can
only compute, but it computes inside the scorer: it can write the scorer's result itself, and a
policy that finds that out learns to forge its reward instead of solving the task. So before an
answer of those datasets reaches its scorer, `code_in_answer` reads its Python tokens and names
what a math expression or a literal never needs:
  - attribute access (any '.' operator: numbers keep their point inside the number token);
  - a name with '__', or the keywords lambda, import, def, class, global, yield, await;
  - a call of anything but a math function (`MATH_CALLS`: sin, exp, sqrt, ...), or of the
    result of an expression (`[f][0](...)`);
  - an f-string, or any string when the answer also calls something (sympy's functions read a
    string argument as an expression to evaluate);
  - assignment, `:=`, ';' and '@'.
Text that Python cannot tokenize cannot be evaluated either, so it passes (the scorer rejects it).
The answer is scored 0.0 instead: a correct answer is an expression or a literal and passes.
"""
from __future__ import annotations

import io
import keyword
import tokenize

#: reasoning-gym datasets whose `score_answer` evaluates the answer (reasoning-gym 0.1.x).
EVALUATED_DATASETS = frozenset({
    "countdown", "puzzle24", "polynomial_multiplication", "simple_integration", "intermediate_integration",
    "binary_matrix", "spiral_matrix", "string_insertion", "n_queens"})

#: Functions a math answer may call (sympy's names, as its printer writes them, and Python's
#: abs): intermediate_integration's own answers hold unevaluated `Integral(...)`.
MATH_CALLS = frozenset(
    "sin cos tan cot sec csc asin acos atan acot asec acsc atan2 sinh cosh tanh coth sech csch asinh acosh "
    "atanh acoth exp log ln sqrt cbrt root Abs abs sign floor ceiling factorial binomial gamma erf erfi Si Ci "
    "Ei li Rational Integral Derivative Sum Product Max Min Mod Piecewise".split())

_KEYWORDS = frozenset({"lambda", "import", "from", "def", "class", "global", "nonlocal", "yield", "await",
                       "async", "del", "with", "raise", "try", "assert", "return"})
_FORBIDDEN_OPS = frozenset({"=", ":=", ";", "@", "@=", "+=", "-=", "*=", "/=", "//=", "%=", "**=", ">>=", "<<=",
                            "&=", "|=", "^=", "->"})
_SKIP = frozenset({tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT,
                   tokenize.ENDMARKER})


def code_in_answer(answer: str) -> str | None:
    """What in `answer` could run code if a scorer evaluated it (module doc), or None."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(answer).readline) if t.type not in _SKIP]
    except (tokenize.TokenError, SyntaxError, ValueError):   # not Python: no evaluation runs it
        return None
    calls, strings = False, False
    previous = None
    for token in tokens:
        kind, text = token.type, token.string
        if kind == tokenize.NAME and ("__" in text or text in _KEYWORDS):
            return f"the name {text!r}"
        if kind == tokenize.STRING:
            prefix = text[:len(text) - len(text.lstrip("rRbBuUfF"))]
            if "f" in prefix.lower():
                return "an f-string"
            strings = True
        if kind == tokenize.OP:
            if "." in text:
                return "attribute access ('.')"
            if text in _FORBIDDEN_OPS:
                return f"the operator {text!r}"
            if text == "(" and previous is not None:
                if previous.type == tokenize.NAME and not keyword.iskeyword(previous.string):
                    if previous.string not in MATH_CALLS:
                        return f"a call of {previous.string!r}"
                    calls = True
                elif previous.type == tokenize.STRING or previous.string in (")", "]", "}"):
                    return "a call of an expression's result"
        previous = token
    if calls and strings:
        return "a string given to a function (sympy evaluates it)"
    return None
