"""A model's answer is hostile input to the scorers that read it: math-verify runs in a child
process killed past its time (off the main thread math-verify has no timeout), and reasoning-gym's
scorers (countdown's evals the answer) in a fresh fork per answer that may only compute."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import sfrrl_jax as S
from sfrrl_jax.agents.tasks.isolated import KILL_MARGIN_S, MathVerifierProcess, ReasoningGymScorer



def test_a_runaway_answer_off_the_main_thread_scores_0_and_the_next_answer_is_scored():
    """2^{2^{2^{2^{20}}}} is an integer no memory holds: in a thread, before, it held the GIL and
    never returned (the whole process froze). Now it is not equal to the gold, within the limit."""
    verdicts = []

    def score():
        verdicts.append(S.math_equal("2^{2^{2^{2^{20}}}}", "2", boxed=True))
        verdicts.append(S.math_equal("\\frac{4}{2}", "2", boxed=True))

    worker = threading.Thread(target=score, daemon=True)
    t0 = time.monotonic()
    worker.start()
    worker.join(120)   # the child's start (sympy import) + its 5 s timeout, on a loaded 2-core machine
    assert not worker.is_alive(), "the verifier hung"
    assert verdicts == [False, True]
    print(f"runaway answer scored in {time.monotonic() - t0:.1f} s")


def test_a_child_that_stops_answering_is_killed_and_replaced():
    verifier = MathVerifierProcess(timeout_s=1)
    try:
        assert verifier.equal("0.5", "\\frac{1}{2}", False) is True
        os.kill(verifier._proc.pid, signal.SIGSTOP)   # stuck in C code, as a runaway sympy integer is
        t0 = time.monotonic()
        assert verifier.equal("0.5", "\\frac{1}{2}", False) is False
        waited = time.monotonic() - t0
        assert 1 + KILL_MARGIN_S - 0.5 <= waited < 60 and verifier.kills == 1
        assert verifier.equal("0.5", "\\frac{1}{2}", False) is True   # a fresh child
        assert verifier.equal("3", "4", False) is False and verifier.kills == 1
        assert verifier.equal("anything", "", False) is None   # the gold is not math: the caller compares text
    finally:
        verifier.close()
    assert verifier._proc is None


def test_threads_share_one_child_one_request_at_a_time():
    verifier = MathVerifierProcess()
    results = {}

    def score(i):
        results[i] = verifier.equal(f"{i} + 1", str(i + 1), True)

    try:
        threads = [threading.Thread(target=score, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == {i: True for i in range(8)} and verifier.kills == 0
    finally:
        verifier.close()


@pytest.mark.parametrize("text, expanded", [
    ("6.02e23", "602000000000000000000000"), ("1e-3", "0.001"), ("2.5E3", "2500"), ("3e+2", "300"),
    (".5e1", "5"), ("1.0e2", "100"), ("the answer is 1e20.", "the answer is 100000000000000000000."),
    ("1e999", "1 \\times 10^{999}"),
    # not numbers in E notation: inside a word, a hex literal, a longer number, no exponent digits
    ("x1e5", "x1e5"), ("0x1e5", "0x1e5"), ("1e20.5", "1e20.5"), ("12e", "12e"), ("e5", "e5"),
])
def test_e_notation_is_written_out(text, expanded):
    from sfrrl_jax.agents.tasks.math_worker import expand_e_notation
    assert expand_e_notation(text) == expanded


@pytest.mark.parametrize("prediction, answer, equal", [
    ("6.02e23", "6.02e23", True),                  # was False: the gold read as 6.02 * e * 23 (Euler's e)
    ("602000000000000000000000", "6.02e23", True),
    ("0.001", "1e-3", True), ("The mass is 1e-3 kg.", "0.001", True), ("2.5E3", "2500", True),
    ("1e20", "1", False),                          # was True: read as 1
    ("6.02e23", "6.02", False),                    # was True
    ("1", "1e-3", False),
])
def test_answers_in_e_notation_are_compared_as_numbers(prediction, answer, equal):
    assert S.math_equal(prediction, answer) is equal
    assert S.math_equal(prediction, answer, boxed=True) is equal


# ----------------------------------------------------------------------------- reasoning-gym


@pytest.fixture(scope="module")
def countdown():
    (task,) = S.reasoning_gym_tasks("countdown", 1, seed=0)
    entry = {"question": task.metadata["question"], "answer": task.answer, "metadata": task.metadata["entry_metadata"]}
    return task, entry


@pytest.fixture(scope="module")
def scorer():
    """The confined scorer itself, without `verify_reasoning_gym`'s answer screen in front of it."""
    scorer = ReasoningGymScorer()
    yield scorer
    scorer.close()


def test_an_answer_that_runs_code_in_the_countdown_scorer_changes_nothing_outside(countdown, scorer, tmp_path):
    """countdown's scorer is sympy.parse_expr(answer), which runs Python: before, this answer wrote
    the file (and os.system ran its command) in the trainer's process. Sent to the fork itself
    (past the answer screen, which scores such answers 0 unseen)."""
    task, entry = countdown
    written, touched = tmp_path / "written", tmp_path / "touched"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        for payload in (f"(lambda: open({str(written)!r}, 'w').write('x'))()",
                        f"__import__('os').system('touch {touched}')",
                        f"__import__('subprocess').run(['touch', {str(touched)!r}])",
                        "__import__('socket').create_connection(('127.0.0.1', 9))",
                        f"__import__('os').kill({bystander.pid}, 9)"):
            score = scorer.score("countdown", payload, entry)
            assert 0.0 <= score <= 0.05, payload   # reasoning-gym's own credit for a wrong answer, at most
            assert S.verify_reasoning_gym(task, f"<answer>{payload}</answer>") == 0.0, payload
        assert not written.exists() and not touched.exists() and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    assert S.verify_reasoning_gym(task, f"<answer>{task.answer}</answer>") == 1.0   # the scorer lives on


def test_an_answer_that_would_write_its_own_score_inside_the_scorer_scores_0(countdown, scorer):
    """The fork confines what code in an answer can reach, not what it computes inside the scorer:
    writing "1.0" to the result pipe and exiting forges a full score there. `verify_reasoning_gym`
    scores an answer to an evaluating scorer 0 when it holds code (`answer_screen`)."""
    task, entry = countdown
    forge = ('exec("import os\\nfor f in range(3, 64):\\n try: os.write(f, b\'1.0\')\\n except OSError: pass'
             '\\nos._exit(0)")')
    assert scorer.score("countdown", forge, entry) == 1.0          # what the fork alone lets through
    assert S.verify_reasoning_gym(task, f"<answer>{forge}</answer>") == 0.0
    assert S.verify_reasoning_gym(task, f"<answer>{task.answer}</answer>") == 1.0


def test_an_answer_cannot_rig_the_scorer_for_the_answers_after_it(countdown, scorer):
    """Each answer is scored in a fresh fork: a payload that makes numpy.isclose always true in its
    own process leaves the next wrong answer wrong (in the trainer's process, before, every later
    countdown answer that used the right numbers scored 1.0)."""
    task, entry = countdown
    always_true = "__import__('unittest.mock').mock.MagicMock(return_value=True)"
    rig = f"__import__('numpy').__setattr__('isclose', {always_true}) or 1"
    numbers = task.metadata["entry_metadata"]["numbers"]
    wrong = " + ".join(map(str, numbers))   # every number once, the target missed (checked below)
    assert sum(numbers) != task.metadata["entry_metadata"]["target"]
    before = scorer.score("countdown", wrong, entry)
    scorer.score("countdown", rig, entry)   # past the answer screen, to the fork itself
    assert scorer.score("countdown", wrong, entry) == before < 1.0


def test_a_runaway_countdown_answer_scores_0_within_its_limits(countdown):
    """9**9**9**9 in sympy: before, it froze the whole process (a C-level integer power holds the GIL)."""
    _, entry = countdown
    scorer = ReasoningGymScorer(timeout_s=2, cpu_seconds=2)
    try:
        result = []
        worker = threading.Thread(target=lambda: result.append(scorer.score("countdown", "9**9**9**9", entry)),
                                  daemon=True)
        t0 = time.monotonic()
        worker.start()
        worker.join(120)
        assert not worker.is_alive() and result == [0.0]
        assert time.monotonic() - t0 < 60 and scorer.kills == 0   # the fork was killed, not the worker
        assert scorer.score("countdown", entry["answer"], entry) == 1.0
    finally:
        scorer.close()
