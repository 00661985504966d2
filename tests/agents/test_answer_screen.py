"""The answer screen in front of reasoning-gym's evaluating scorers: every answer the generators
themselves give passes; code that could run inside the scorer (and write its own score there)
is named."""
import pytest
import reasoning_gym   # a test dependency (pyproject's test extra)

from sfrrl_jax.agents.tasks.answer_screen import EVALUATED_DATASETS, code_in_answer


@pytest.mark.parametrize("dataset", sorted(EVALUATED_DATASETS))
def test_the_generators_own_answers_pass(dataset):
    answers = [str(e["answer"]) for seed in (0, 1) for e in reasoning_gym.create_dataset(dataset, size=50, seed=seed)]
    assert [a for a in answers if code_in_answer(a) is not None] == []


@pytest.mark.parametrize("answer", [
    "3 + 4*(2 - 1)", "-x**2/2 + C", "Integral(x**2*cos(x), x) + C", "sin(x)**2 + cos(x)", "exp(log(2))",
    "2(x+1)", "not (1)", "1 if x else 2", "[[1, 2], [3, 4]]", "['A', 'B']", "1 0 1\n0 1 0", "_ Q _\n_ _ Q",
    "x^2 + 3!", "unbalanced (", "EACADDDDB"])
def test_math_and_literals_pass(answer):
    assert code_in_answer(answer) is None


@pytest.mark.parametrize("answer, why", [
    ("__import__('os').write(9, b'1.0')", "the name '__import__'"),
    ("(lambda: 1)()", "the name 'lambda'"),
    ("exec('import os')", "a call of 'exec'"),
    ("getattr(x, '_' '_class_' '_')", "a call of 'getattr'"),
    ("x.subs(x, 1)", "attribute access"),
    ("().__class__.__base__", "attribute access"),
    ("__builtins__", "the name '__builtins__'"),
    ("1..real", "attribute access"),
    ("f'{1}'", "an f-string"),
    ("sqrt('1 + 1')", "a string given to a function"),
    ("[eval][0]('1')", "a call of an expression's result"),
    ("sympify('1')", "a call of 'sympify'"),
    ("[x for x in range(9)]", "a call of 'range'"),
    ("x := 1", "the operator ':='"),
    ("1; 2", "the operator ';'"),
])
def test_code_is_named(answer, why):
    assert why in (code_in_answer(answer) or "")
