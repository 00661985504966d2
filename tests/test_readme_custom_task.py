"""The README's custom-task script is run exactly as printed there (issue #17: "the README shows a
complete custom-task RL loop, and that exact script is a test"): a new task kind, a new tool and a
reward function of its own, pipelined GRPO through the public `import sfrrl_jax as S` only."""
import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- readme-script: custom-task -->"


def readme_script() -> str:
    text = README.read_text()
    assert text.count(MARKER) == 1, f"README.md must hold the marker {MARKER!r} exactly once"
    match = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.S)
    assert match, f"README.md: a ```python block must follow {MARKER!r}"
    return match.group(1) + "\n"


def test_the_script_uses_only_the_flat_public_api():
    script = readme_script()
    imports = sorted(set(re.findall(r"^(?:import|from) (\S+)", script, re.M)))
    assert imports == ["jax", "sfrrl_jax", "tempfile"], imports
    assert "sfrrl_jax." not in script.replace("import sfrrl_jax as S", "")


def test_the_readme_custom_task_script_trains(tmp_path):
    path = tmp_path / "custom_task.py"
    path.write_text(readme_script())
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONHASHSEED": "0"}
    env.pop("XLA_FLAGS", None)  # as a user runs it: one CPU device
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"the README script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = re.findall(r"^step (\d+): reward (\S+)  answer_correct (\S+)  partial_credit (\S+)$", proc.stdout, re.M)
    assert [int(s) for s, *_ in lines] == [0, 1], proc.stdout
    partial = []
    for _, reward, correct, part in lines:
        reward, correct, part = float(reward), float(correct), float(part)
        assert 0.0 <= correct <= 1.0 and 0.0 <= part <= 1.0
        # the logged total is the weighted sum of the logged components (weights 1.0 and 0.5)
        assert abs(reward - (correct + 0.5 * part)) <= 2e-3, (reward, correct, part)
        partial.append(part)
    # sampled text holds some of the answer's letters: the component really reaches the metrics
    assert max(partial) > 0.0, proc.stdout
