"""The sandbox holds: each hostile program is contained, reported, and leaves nothing behind.

All programs run concurrently in one event loop (one ~2 s batch), next to a benign program whose
exact output proves the other calls were unaffected.
"""
import asyncio
import dataclasses
import os
import signal
import socket
import time
import uuid

import pytest

from sfrrl_jax.agents.protocols import ToolCall
from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox, SandboxConfig
from sfrrl_jax.agents.tools import PythonTool, ToolRunner, ToolRunnerConfig

CFG = SandboxConfig(wall_timeout_s=2.0, cpu_seconds=1, memory_bytes=256 * 2**20, max_processes=8,
                    max_file_bytes=2**20, tmpfs_bytes=8 * 2**20, output_limit_bytes=64 * 2**10, max_concurrency=16)


def _processes_owned_by(uids):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            except (OSError, StopIteration):
                continue
            if uid in uids:
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    host_dir = tmp_path_factory.mktemp("host_visible")
    os.chmod(host_dir, 0o777)  # world-writable: only the jail keeps the code out
    escape_name = f"sfrrl_escape_{uuid.uuid4().hex}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    programs = {
        "benign": "print(sum(range(10**6)))",
        "fork_bomb": "import os\nwhile True:\n    os.fork()",
        "fork_and_sleep": ("import os, time\nfor _ in range(100):\n    try:\n        os.fork()\n"
                           "    except OSError:\n        pass\ntime.sleep(60)"),
        # bytes(n) is calloc'd, so its pages stay untouched: RLIMIT_AS counts reserved address space,
        # and a bomb that zero-fills (bytearray) spends ~0.4 s of CPU in page faults here, which on a
        # loaded 2-core CI machine crossed the 1 s RLIMIT_CPU first (SIGXCPU, not MemoryError).
        "memory_bomb": "chunks = []\nwhile True:\n    chunks.append(bytes(64 * 2**20))",
        "infinite_loop": "while True:\n    pass",
        "sleep": "import time\ntime.sleep(30)",
        "write_outside": (f"import os\nfor p in [{str(host_dir / 'escaped.txt')!r}, '/etc/sfrrl_escape', "
                          "'/root/sfrrl_escape', '/var/sfrrl_escape']:\n"
                          "    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
                          "    except OSError as e:\n        print('refused', type(e).__name__)\n"
                          f"open('/tmp/{escape_name}', 'w').write('private')\n"
                          "open('local.txt', 'w').write('mine')\nprint(open('local.txt').read(), os.getcwd())"),
        "socket": (f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\n"
                   "print('CONNECTED')"),
        "socket_outside": "import socket\nsocket.create_connection(('8.8.8.8', 53), timeout=1)\nprint('CONNECTED')",
        "print_100mb": "import sys\nblock = 'x' * 2**20\nfor _ in range(100):\n    sys.stdout.write(block)",
        "big_file": "open('big.bin', 'wb').write(b'0' * 4 * 2**20)",
        "setsid_escape": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
                          "print('parent done')"),
    }
    timeouts = {"sleep": 1.0, "fork_and_sleep": 1.0, "infinite_loop": 10.0, "memory_bomb": 10.0}
    sandbox = PythonSandbox(CFG)

    async def main():
        start = time.perf_counter()
        results = await asyncio.gather(*(sandbox.run(code, timeouts.get(name)) for name, code in programs.items()))
        return dict(zip(programs, results)), time.perf_counter() - start

    results, elapsed = asyncio.run(main())
    try:
        connection = listener.accept()
    except BlockingIOError:
        connection = None
    listener.close()
    return {"results": results, "elapsed": elapsed, "sandbox": sandbox, "host_dir": host_dir,
            "escape_name": escape_name, "accepted": connection}


def test_capabilities_are_fully_enforced_on_this_machine(outcome):
    caps = outcome["sandbox"].capabilities
    assert caps.missing() == [] and not outcome["sandbox"].unisolated
    assert all(dataclasses.asdict(caps).values())


def test_benign_call_unaffected_by_hostile_neighbours(outcome):
    r = outcome["results"]["benign"]
    assert r.ok and r.stdout == "499999500000\n" and r.stderr == ""


def test_fork_bomb_contained_by_per_call_process_limit(outcome):
    r = outcome["results"]["fork_bomb"]
    assert not r.ok and not r.timed_out  # it died from its own failed forks, not from our timeout
    assert "BlockingIOError" in r.stderr
    assert r.wall_s < CFG.wall_timeout_s


def test_forked_sleepers_killed_at_timeout(outcome):
    r = outcome["results"]["fork_and_sleep"]
    assert r.timed_out and r.error_summary().startswith("timed out")
    assert r.wall_s < 2.5


def test_memory_bomb_hits_address_space_limit(outcome):
    r = outcome["results"]["memory_bomb"]
    assert not r.ok and r.exit_code == 1 and r.stderr.rstrip().endswith("MemoryError")


def test_infinite_loop_killed_by_cpu_limit(outcome):
    r = outcome["results"]["infinite_loop"]
    assert r.signal == signal.SIGXCPU and not r.timed_out
    assert "SIGXCPU" in r.error_summary()


def test_sleep_past_wall_timeout_is_killed(outcome):
    r = outcome["results"]["sleep"]
    assert r.timed_out and r.exit_code is None and r.wall_s < 2.0


def test_cannot_write_outside_private_dir(outcome):
    r = outcome["results"]["write_outside"]
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:4] == ["refused FileNotFoundError", "refused OSError", "refused OSError", "refused OSError"]
    assert lines[4] == "mine /tmp"
    assert not (outcome["host_dir"] / "escaped.txt").exists()
    assert not os.path.exists(f"/tmp/{outcome['escape_name']}")  # its /tmp was private


def test_no_network(outcome):
    for name in ("socket", "socket_outside"):
        r = outcome["results"][name]
        assert not r.ok and "CONNECTED" not in r.stdout
        assert "Network is unreachable" in r.stderr, r.stderr
    assert outcome["accepted"] is None  # the host listener never saw a connection


def test_output_is_capped(outcome):
    r = outcome["results"]["print_100mb"]
    assert r.output_truncated and len(r.stdout) == CFG.output_limit_bytes
    assert r.wall_s < CFG.wall_timeout_s


def test_file_size_limit(outcome):
    r = outcome["results"]["big_file"]
    assert not r.ok and "File too large" in r.stderr


def test_setsid_escapee_dies_with_the_call(outcome):
    r = outcome["results"]["setsid_escape"]
    assert r.ok and r.stdout == "parent done\n"


def test_nothing_left_running_and_batch_was_fast(outcome):
    assert _processes_owned_by(set(outcome["sandbox"]._uids)) == []
    assert outcome["elapsed"] < 8.0


def test_python_tool_reports_errors_as_observations():
    sandbox = PythonSandbox(SandboxConfig(wall_timeout_s=1.0, max_concurrency=2))
    runner = ToolRunner([PythonTool(sandbox)], ToolRunnerConfig(timeout_s=5.0))

    async def main():
        return await runner.run([
            ToolCall("python", {"code": "print(6 * 7)"}, "call_0"),
            ToolCall("python", {"code": "1 / 0"}, "call_1"),
            ToolCall("python", {"code": "import time\ntime.sleep(10)"}, "call_2"),
            ToolCall("python", {"code": "x = 1"}, "call_3"),
        ])

    ok, crash, hang, silent = asyncio.run(main())
    runner.close()
    assert (ok.content, ok.is_error) == ("42\n", False)
    assert crash.is_error and crash.content.startswith("error: exit code 1") and "ZeroDivisionError" in crash.content
    assert hang.is_error and hang.content.startswith("error: timed out")
    assert (silent.content, silent.is_error) == ("(no output)", False)


def test_queueing_for_a_slot_does_not_count_against_the_timeout():
    sandbox = PythonSandbox(SandboxConfig(wall_timeout_s=1.5, max_concurrency=2))

    started = []

    async def main():
        return await asyncio.gather(*(sandbox.run("import time\ntime.sleep(0.5)", on_slot=lambda: started.append(1))
                                      for _ in range(8)))

    results = asyncio.run(main())
    assert [r.timed_out for r in results] == [False] * 8 and all(r.ok for r in results)
    assert max(r.queued_s for r in results) > 1.0  # the last pair waited ~1.5 s for its slots
    assert len(started) == 8  # on_slot: when a caller's own deadline may start


def test_exit_behaves_like_the_interpreter():
    """sys.exit("msg"), atexit handlers and non-daemon threads keep their output, as with `python -c`."""
    sandbox = PythonSandbox(SandboxConfig(wall_timeout_s=5.0, max_concurrency=8))
    programs = {
        "exit_message": "import sys\nprint('before')\nsys.exit('goodbye: bad input')",
        "exit_int": "import sys\nsys.exit(3)",
        "exit_none": "raise SystemExit",
        "atexit": "import atexit\natexit.register(lambda: print('cleanup ran'))\nprint('main')",
        "atexit_after_crash": "import atexit\natexit.register(print, 'cleanup ran')\n1 / 0",
        "thread": ("import threading, time\n"
                   "def late():\n    time.sleep(0.3)\n    print('thread done', flush=False)\n"
                   "threading.Thread(target=late).start()\nprint('main done')"),
        "thread_then_exit": ("import sys, threading, time\n"
                             "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
                             "sys.exit('main failed')"),
        "main_module": ("import __main__, pickle\ndef f(): pass\n"
                        "print(__main__.f is f, pickle.loads(pickle.dumps(f)) is f)"),
        "lone_surrogate": "print('a')  # \udcff",  # model output can hold one: an error result, no raise
    }

    async def main():
        return dict(zip(programs, await asyncio.gather(*(sandbox.run(code) for code in programs.values()))))

    r = asyncio.run(main())
    assert (r["exit_message"].exit_code, r["exit_message"].stdout, r["exit_message"].stderr) == (
        1, "before\n", "goodbye: bad input\n")
    assert r["exit_int"].exit_code == 3 and r["exit_none"].ok
    assert r["atexit"].ok and r["atexit"].stdout == "main\ncleanup ran\n"
    crash = r["atexit_after_crash"]
    assert crash.exit_code == 1 and crash.stdout == "cleanup ran\n" and "ZeroDivisionError" in crash.stderr
    assert r["thread"].ok and r["thread"].stdout == "main done\nthread done\n"
    assert (r["thread_then_exit"].exit_code, r["thread_then_exit"].stdout, r["thread_then_exit"].stderr) == (
        1, "thread done\n", "main failed\n")
    assert r["main_module"].stdout == "True True\n"
    assert r["lone_surrogate"].exit_code == 1 and "surrogates not allowed" in r["lone_surrogate"].stderr
