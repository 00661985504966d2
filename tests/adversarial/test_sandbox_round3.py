"""Issue #48 point 3: the sandbox's rows of a hostile round, each tried the way an attacker would
(hostile code through `PythonSandbox.run`), now contained:

1. memory: six processes of 400 MiB touched memory under a 512 MiB cap (one call's total);
2. the launcher's state (host paths) reached through frames, `gc` or `sys.modules`;
3. another program (an interpreter) started with `subprocess` / `os.execv`;
4. a virtualenv inside (or beside) the checkout: the host interpreter's path in the code's argv.
"""
import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from sfrrl_jax.agents.sandbox import python_sandbox as sandbox_module
from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox, SandboxConfig

PROJECT = sandbox_module._PROJECT_ROOT
MiB = 2**20


def _run(sandbox, code, timeout=None):
    return asyncio.run(sandbox.run(code, timeout))


# ----------------------------------------------------------------------------- 1. memory, whole call

# Each child writes every page of 400 MiB, says so (its index on a pipe) and holds it until the
# parent has seen all of them ready or dead; `max_holding` is how many held theirs at once.
_SIX_CHILDREN = """
import json, os, select, time
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
pids, fork_errors = {}, []
for i in range(6):
    try:
        pid = os.fork()
    except OSError as e:
        fork_errors.append(type(e).__name__)
        continue
    if pid == 0:
        try:
            block = bytearray(b"\\x01") * (400 * 2**20)
        except MemoryError:
            os._exit(3)
        os.write(ready_w, bytes([i]))
        os.read(go_r, 1)
        os._exit(0)
    pids[pid] = i
holding, max_holding, outcome = set(), 0, {}
deadline = time.monotonic() + 8
while len(outcome) + len(holding) < len(pids) and time.monotonic() < deadline:
    if select.select([ready_r], [], [], 0.02)[0]:
        holding.update(os.read(ready_r, 16))
        max_holding = max(max_holding, len(holding))
    for pid, i in pids.items():
        if i in outcome:
            continue
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            holding.discard(i)
            outcome[i] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
os.write(go_w, b"x" * len(pids))
for pid, i in pids.items():
    if i not in outcome:
        _, status = os.waitpid(pid, 0)
        outcome[i] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
print(json.dumps({"max_holding": max_holding, "outcome": sorted(outcome.values()), "fork_errors": fork_errors}))
"""

_ONE_100MB = "block = bytearray(b'\\x01') * (100 * 2**20)\nprint(len(block) // 2**20)"


def _refused(r):
    assert r.stdout, (r.stderr, r.error_summary())
    out = json.loads(r.stdout)
    assert out["max_holding"] <= 1, out  # 2 x 400 MiB never held at once under 512 MiB
    refused = [o for o in out["outcome"] if o in (-signal.SIGKILL, 3)] + out["fork_errors"]
    assert refused, out  # OOM-killed, MemoryError, or never forked
    return out


def test_memory_cap_holds_for_the_whole_call():
    sandbox = PythonSandbox(SandboxConfig(memory_bytes=512 * MiB, wall_timeout_s=15.0, max_concurrency=1))
    r = _run(sandbox, _SIX_CHILDREN)
    _refused(r)
    if sandbox.capabilities.memory_cap.startswith("cgroup"):
        assert r.memory_limit_hit and not r.ok
        assert "memory limit" in r.error_summary()
        assert r.peak_memory_bytes is not None and r.peak_memory_bytes <= 512 * MiB
    ok = _run(sandbox, _ONE_100MB)
    assert ok.ok and ok.stdout == "100\n" and not ok.memory_limit_hit, (ok.stderr, ok.error_summary())


def test_oom_kill_of_the_main_process_is_reported_as_memory_limit():
    sandbox = PythonSandbox(SandboxConfig(memory_bytes=512 * MiB, max_concurrency=1))
    if not sandbox.capabilities.memory_cap.startswith("cgroup"):
        pytest.skip("no memory cgroup here: the rlimit split answers with MemoryError instead")
    # Under RLIMIT_AS (512 MiB each) but not under the call's cap: a forked child holds 200 MiB,
    # then the main process writes 400 MiB, and is the largest when the cap is hit.
    code = ("import os, time\nif os.fork() == 0:\n    b = bytearray(b'1') * (200 * 2**20)\n    time.sleep(30)\n"
            "time.sleep(0.5)\nb = bytearray(b'1') * (400 * 2**20)\nprint('survived')")
    r = _run(sandbox, code, 10.0)
    assert r.memory_limit_hit and not r.ok and r.stdout == "" and r.signal == signal.SIGKILL, r
    assert r.error_summary().startswith("killed by the memory limit")


def test_without_a_cgroup_the_rlimit_split_holds(monkeypatch):
    sandbox_module.probe_capabilities()  # cached as it is: the patch below is for this sandbox only
    monkeypatch.setattr(sandbox_module, "_memory_cgroups", lambda refresh=False: None)
    sandbox = PythonSandbox(SandboxConfig(memory_bytes=512 * MiB, max_processes=16, wall_timeout_s=15.0,
                                          max_concurrency=1))
    assert sandbox.memory_cap == "rlimit-split: 4 processes x 128 MiB"
    out = _refused(_run(sandbox, _SIX_CHILDREN))
    assert out["max_holding"] == 0  # no single process gets 400 MiB of address space
    ok = _run(sandbox, "block = bytearray(b'\\x01') * (64 * 2**20)\nprint(len(block) // 2**20)")
    assert ok.ok and ok.stdout == "64\n", ok.stderr


# ----------------------------------------------------------------------------- 2. launcher state

# Host paths, each given in two pieces so the source never holds one whole; found only if some
# object (reached through frames, gc or sys.modules) or the process's anonymous memory holds it.
_REACH = """
import ctypes, gc, json, sys
pieces = {pieces!r}

def scan():
    needles = [a + b for a, b in pieces]
    blobs = [n.encode() for n in needles]
    mine = set(map(id, needles + blobs))
    hits = set()

    def check(obj, where):
        if id(obj) in mine:
            return
        if isinstance(obj, str):
            for i, n in enumerate(needles):
                if n in obj:
                    hits.add((i, where))
        elif isinstance(obj, (bytes, bytearray)):
            for i, n in enumerate(blobs):
                if n in obj:
                    hits.add((i, where))

    def walk(obj, where, depth=0):
        check(obj, where)
        if depth < 3 and isinstance(obj, (list, tuple, set, frozenset)):
            for item in list(obj):
                walk(item, where, depth + 1)
        elif depth < 3 and isinstance(obj, dict):
            for k, v in list(obj.items()):
                walk(k, where, depth + 1)
                walk(v, where, depth + 1)

    frame = sys._getframe()
    while frame is not None:
        walk(frame.f_globals, "frame globals")
        walk(frame.f_locals, "frame locals")
        walk(frame.f_code.co_consts, "frame code")
        walk(frame.f_code.co_filename, "frame code")
        frame = frame.f_back
    for name, module in list(sys.modules.items()):
        walk(name, "sys.modules")
        walk(getattr(module, "__dict__", {{}}), "sys.modules")
    walk([sys.executable, sys.prefix, sys.exec_prefix, sys.path, sys.argv, sys.orig_argv], "sys")
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            walk(obj, "gc")
        elif isinstance(obj, (list, tuple, set, frozenset)):
            walk(obj, "gc")
        elif hasattr(obj, "__code__"):
            walk(obj.__code__.co_consts, "gc")
    return hits

def raw_memory():
    hits = set()
    for line in open('/proc/self/maps').read().splitlines():
        fields = line.split()
        name = fields[5] if len(fields) > 5 else ''
        lo, hi = (int(x, 16) for x in fields[0].split('-'))
        if 'r' not in fields[1] or name not in ('', '[stack]', '[heap]') or hi - lo > 256 * 2**20:
            continue
        data = ctypes.string_at(lo, hi - lo)
        for i, (a, b) in enumerate(pieces):
            a, b = a.encode(), b.encode()
            j = data.find(a)
            while j >= 0:
                if data[j + len(a):j + len(a) + len(b)] == b:
                    hits.add((i, name or 'anonymous'))
                j = data.find(a, j + 1)
    return hits

memory = sorted(raw_memory())  # first: scan() builds the needles, and freed memory keeps bytes
print(json.dumps({{"objects": sorted(scan()), "memory": memory}}))
"""


def _host_paths(sandbox):
    paths = {PROJECT, os.getcwd()}
    if sys.prefix != sys.base_prefix:
        paths.add(sys.prefix)  # a venv's own prefix (the base prefix holds the stdlib, visible anyway)
    exposed = sandbox._plan["expose"]
    for path in sandbox._plan["hide"]:
        if path not in sandbox_module._ALWAYS_HIDDEN and not any(e.startswith(path + "/") for e in exposed):
            paths.add(path)
    # A path under another is found with it (and its first half would hold the other whole).
    return sorted(p for p in paths if not any(p.startswith(q + "/") for q in paths))


def test_launcher_state_unreachable_from_the_code():
    sandbox = PythonSandbox(SandboxConfig(max_concurrency=1))
    paths = _host_paths(sandbox)
    assert PROJECT in paths and len(paths) >= 2
    pieces = [(p[:len(p) // 2], p[len(p) // 2:]) for p in paths]
    r = _run(sandbox, _REACH.format(pieces=pieces), 10.0)
    assert r.ok, (r.stderr, r.error_summary())
    out = json.loads(r.stdout)
    assert out == {"objects": [], "memory": []}, [(paths[i], where) for i, where in out["objects"] + out["memory"]]


def test_code_frames_start_at_the_code():
    """The code's caller is the small runner, holding nothing of the launcher's."""
    r = _run(PythonSandbox(SandboxConfig(max_concurrency=1)), textwrap.dedent("""
        import json, sys
        frames, f = [], sys._getframe()
        while f is not None:
            frames.append((f.f_code.co_name, sorted(k for k in f.f_locals if not k.startswith('__'))))
            f = f.f_back
        print(json.dumps(frames[1:]))
    """))
    assert r.ok, r.stderr
    names = [name for name, _ in json.loads(r.stdout)]
    assert not {"_run_user", "_run_init", "main"} & set(names), names


# ----------------------------------------------------------------------------- 3. other programs

_EXEC = """
import json, multiprocessing, os, subprocess, sys, threading
out = {}
programs = {"own_python": [sys.executable, "-I", "-c", "print(2)"], "true": ["/bin/true"]}
if os.path.exists("/usr/bin/python3"):
    programs["system_python"] = ["/usr/bin/python3", "-c", "print(1)"]
for name, argv in programs.items():
    try:
        out[name] = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except OSError as e:
        out[name] = "%s %s" % (type(e).__name__, e.errno)
pid = os.fork()
if pid == 0:
    try:
        os.execv("/bin/true", ["true"])
    except OSError as e:
        os._exit(e.errno)
out["execv"] = os.WEXITSTATUS(os.waitpid(pid, 0)[1])
box = []
t = threading.Thread(target=box.append, args=(1,))
t.start(); t.join()
out["thread"] = box
with multiprocessing.get_context("fork").Pool(2) as pool:
    out["pool"] = pool.map(abs, [-1, -2, -3])
print(json.dumps(out))
"""


def test_exec_denied_by_default_fork_and_threads_work():
    r = _run(PythonSandbox(SandboxConfig(max_concurrency=1)), _EXEC, 15.0)
    assert r.ok, (r.stderr, r.error_summary())
    out = json.loads(r.stdout)
    assert out.pop("system_python", "PermissionError 1") == "PermissionError 1"
    assert out == {"own_python": "PermissionError 1", "true": "PermissionError 1", "execv": 1, "thread": [1],
                   "pool": [1, 2, 3]}, out


def test_exec_allowed_when_asked():
    r = _run(PythonSandbox(SandboxConfig(max_concurrency=1, allow_exec=True)), _EXEC, 15.0)
    assert r.ok, (r.stderr, r.error_summary())
    out = json.loads(r.stdout)
    assert out.pop("system_python", "1\n") == "1\n"
    assert out == {"own_python": "2\n", "true": "", "execv": 0, "thread": [1], "pool": [1, 2, 3]}, out


# ----------------------------------------------------------------------------- 4. venv in the checkout

_FROM_VENV = textwrap.dedent("""
    import asyncio, json, os, sys, types
    checkout, project = sys.argv[1], sys.argv[2]
    for name, path in (("sfrrl_jax", checkout + "/sfrrl_jax"), ("sfrrl_jax.agents", checkout + "/sfrrl_jax/agents")):
        module = types.ModuleType(name)  # skip the package __init__s (they import jax)
        module.__path__ = [path]
        sys.modules[name] = module
    import sfrrl_jax.agents.sandbox.paths as P
    import sfrrl_jax.agents.sandbox.python_sandbox as S
    P._PROJECT_ROOT = project   # the checkout the jail plan hides (paths reads it)
    assert sys.prefix.startswith(project) or sys.executable.startswith(project), (sys.prefix, sys.executable)
    code = ("import json, os, sys\\ntry:\\n    environ = open('/proc/self/environ').read()\\n"
            "except OSError as e:\\n    environ = type(e).__name__\\n"
            "print(json.dumps({'cmdline': open('/proc/self/cmdline').read(), 'exe': os.readlink('/proc/self/exe'), "
            "'executable': sys.executable, 'prefix': sys.prefix, 'path': sys.path, 'environ': environ}))\\n"
            f"print(os.path.exists({project!r}))")  # the venv's lib/ once came along with the stdlib
    r = asyncio.run(S.PythonSandbox(S.SandboxConfig(max_concurrency=1)).run(code))
    print(json.dumps({"ok": r.ok, "stdout": r.stdout, "stderr": r.stderr}))
""")


@pytest.mark.parametrize("layout", ["inside", "beside"])
def test_venv_path_in_or_beside_the_checkout_is_not_shown(tmp_path, layout):
    project = tmp_path / "proj"
    project.mkdir()
    venv = project / ".venv" if layout == "inside" else tmp_path / "proj-venv"
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    subprocess.run([base, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=60)
    proc = subprocess.run([str(venv / "bin" / "python3"), "-c", _FROM_VENV, PROJECT, str(project)], cwd=project,
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["ok"], result["stderr"]
    shown, project_there = result["stdout"].splitlines()
    seen = json.loads(shown)
    assert str(project) not in json.dumps(seen) and project_there == "False", (seen, project_there)
    assert seen["exe"] == seen["executable"] and os.path.isabs(seen["exe"]), seen


# ----------------------------------------------------------------------------- cgroup discovery

_MOUNTS = {
    "hybrid": ("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
               "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
               "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"),
    # a container's cgroup namespace: the mount's root is our own cgroup
    "namespaced_v2": "50 40 0:30 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
    "escaped": "35 31 0:32 / /sys/fs/cgroup/my\\040memory rw - cgroup cgroup rw,memory\n",
}


@pytest.mark.parametrize("layout, cgroup_file, expected", [
    ("hybrid", "4:memory:/process_api/ab12\n0::/\n",
     [(2, "/sys/fs/cgroup/unified"), (1, "/sys/fs/cgroup/memory/process_api/ab12")]),
    ("namespaced_v2", "0::/kubepods/pod1/app\n", [(2, "/sys/fs/cgroup/app")]),
    ("escaped", "7:cpu,memory:/a\n", [(1, "/sys/fs/cgroup/my memory/a")]),
])
def test_own_cgroup_found_in_each_layout(monkeypatch, layout, cgroup_file, expected):
    from sfrrl_jax.agents.sandbox import cgroup as sandbox_cgroup

    files = {"/proc/self/cgroup": cgroup_file, "/proc/self/mountinfo": _MOUNTS[layout]}
    monkeypatch.setattr(sandbox_cgroup, "_read", files.get)
    assert sandbox_cgroup._own_cgroup_dirs() == expected


def test_cgroup_counters_read_for_both_versions(tmp_path):
    from sfrrl_jax.agents.sandbox.cgroup import CallCgroup

    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 1\n")
    (tmp_path / "memory.peak").write_text("536870912\n")
    v2 = CallCgroup(str(tmp_path), 2)
    assert (v2.oom_kills(), v2.peak_bytes()) == (2, 512 * MiB)
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    assert (CallCgroup(str(tmp_path), 1).oom_kills(), CallCgroup(str(tmp_path), 1).peak_bytes()) == (0, None)
