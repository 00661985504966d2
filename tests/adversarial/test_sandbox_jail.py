"""Issue #24 part C: each attack that escaped the sandbox, tried again the same way (hostile code
run through `PythonSandbox.run`), now contained. The hostile programs of one batch run concurrently;
the IPC "later call" runs in a second batch. Host state the attacks aim at (a secret env variable,
listening Unix sockets, a setuid-root binary) is set up by the fixture.
"""
import asyncio
import ctypes
import ctypes.util
import json
import os
import platform
import shutil
import socket
import struct
import subprocess
import textwrap
import uuid
import warnings

import pytest

from sfrrl_jax.agents.sandbox import python_sandbox as sandbox_module
from sfrrl_jax.agents.sandbox import seccomp as sandbox_seccomp
from sfrrl_jax.agents.sandbox.python_sandbox import PythonSandbox, SandboxCapabilities, SandboxConfig

PROJECT = sandbox_module._PROJECT_ROOT
ARCH = platform.machine()
IPC_KEY = 0x5F00_0000 + (os.getpid() & 0xFFFF)

_MEMORY_SCAN = """
import ctypes, json, os
needle_a, needle_b = {a!r}, {b!r}  # the secret, in two pieces: it never exists whole in here
found, stack_has_env, scanned = False, False, 0
for line in open('/proc/self/maps').read().splitlines():
    fields = line.split()
    name = fields[5] if len(fields) > 5 else ''
    lo, hi = (int(x, 16) for x in fields[0].split('-'))
    # Anonymous memory only (stack, heap, arenas): file mappings past EOF would SIGBUS.
    if 'r' not in fields[1] or name not in ('', '[stack]', '[heap]') or hi - lo > 256 * 2**20:
        continue
    data = ctypes.string_at(lo, hi - lo)  # read our own memory directly, as the attacker did
    scanned += len(data)
    i = data.find(needle_a)
    while i >= 0:
        found |= data[i + len(needle_a):i + len(needle_a) + len(needle_b)] == needle_b
        i = data.find(needle_a, i + 1)
    if name == '[stack]':
        stack_has_env = b'LANG=C.UTF-8' in data  # the launcher's environment block is on this stack
try:
    environ = open('/proc/self/environ', 'rb').read().decode()
except OSError as e:
    environ = type(e).__name__
print(json.dumps({{"found": found, "stack_scanned": stack_has_env, "scanned_mb": scanned / 2**20,
                  "environ": environ, "os_environ": sorted(os.environ)}}))
"""

_IPC_CREATE = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.restype = ctypes.c_void_p
out = {{}}
shmid = libc.shmget({key}, 2**20, 0o1000 | 0o666)
out["shm"] = shmid >= 0
addr = libc.shmat(shmid, None, 0)
ctypes.memmove(addr, b"carried over", 12)
libc.shmdt(ctypes.c_void_p(addr))
out["big_shm"] = libc.shmget({key} + 1, 960 * 2**20, 0o1000 | 0o666)
out["big_shm_errno"] = ctypes.get_errno()
qid = libc.msgget({key}, 0o1000 | 0o666)
class Msg(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 16)]
out["msg"] = qid >= 0 and libc.msgsnd(qid, ctypes.byref(Msg(1, b"carried over")), 16, 0) == 0
print(json.dumps(out))
"""

_IPC_LATER = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
shm = libc.shmget({key}, 0, 0); shm_errno = ctypes.get_errno()
msg = libc.msgget({key}, 0); msg_errno = ctypes.get_errno()
print(json.dumps({{"shm": shm, "shm_errno": shm_errno, "msg": msg, "msg_errno": msg_errno}}))
"""

_PROC = """
import json, os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
try:
    open('/proc/{host_pid}/cmdline', 'rb').read()
    host_cmdline = 'READ'
except OSError as e:
    host_cmdline = type(e).__name__
try:
    os.kill({host_pid}, 0)
    signal_host = 'SENT'
except OSError as e:
    signal_host = type(e).__name__
print(json.dumps({{"pids": pids, "me": os.getpid(), "host_cmdline": host_cmdline, "signal_host": signal_host,
                  "own_cmdline": open('/proc/self/cmdline', 'rb').read().decode()}}))
"""

_IMPORTS = """
import json, os, sys
sys.path[:0] = {dirs!r}
out = {{}}
for name in ("numpy", "jax", "sfrrl_jax", "pytest"):
    try:
        __import__(name)
        out[name] = "IMPORTED"
    except ImportError as e:
        out[name] = type(e).__name__
for d in {listed!r}:
    out[d] = os.listdir(d) if os.path.isdir(d) else "absent"
import fractions, json, ctypes  # the stdlib still works
print(json.dumps(out))
"""

_UNIX_SOCKETS = """
import json, os, socket
out = {{}}
for name, address in (("run", {run!r}), ("visible", {visible!r}), ("abstract", "\\0" + {abstract!r})):
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1)
        s.connect(address)
        out[name] = "CONNECTED"
    except OSError as e:
        out[name] = "%s %s" % (type(e).__name__, e.errno)
out["run_exists"], out["visible_exists"] = os.path.exists({run!r}), os.path.exists({visible!r})
try:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.sendto(b"x", {visible!r})
    out["dgram_pair"] = "SENT"
except OSError as e:
    out["dgram_pair"] = "%s %s" % (type(e).__name__, e.errno)
a, b = socket.socketpair()  # what multiprocessing and asyncio use: still fine
a.sendall(b"ok")
out["stream_pair"] = b.recv(2).decode()
print(json.dumps(out))
"""

_SETUID = """
import json, os, subprocess
try:
    r = subprocess.run([{binary!r}, "-u"], capture_output=True, text=True)
    id_u, stderr = r.stdout.strip(), r.stderr
except OSError as e:  # exec denied (SandboxConfig.allow_exec=False)
    id_u, stderr = "%s %s" % (type(e).__name__, e.errno), ""
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(json.dumps({{"id_u": id_u, "stderr": stderr, "me": os.geteuid(),
                  "no_new_privs": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip()}}))
"""

_SYSCALLS = """
import ctypes, json, os, socket, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nr = {numbers!r}
def errno_of(result):
    return 0 if result >= 0 else ctypes.get_errno()
out = {{
    "ptrace_traceme": errno_of(libc.ptrace(0, 0, None, None)),
    "ptrace_attach_init": errno_of(libc.ptrace(16, 1, None, None)),
    "unshare_user": errno_of(libc.unshare(0x10000000)),
    "unshare_net": errno_of(libc.unshare(0x40000000)),
    "mount": errno_of(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
}}
for name in ("keyctl", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "kcmp"):
    out[name] = errno_of(libc.syscall(nr[name], 0, 0, 0, 0, 0))
if out["unshare_user"]:  # only if the unshare was refused, so a leaked child cannot run on
    out["clone_newuser"] = errno_of(libc.syscall(nr["clone"], 0x10000000 | 17, 0, 0, 0, 0))
pid = os.fork()  # plain fork and threads still work
if pid == 0:
    os._exit(7)
out["fork"] = os.WEXITSTATUS(os.waitpid(pid, 0)[1])
box = []
t = threading.Thread(target=box.append, args=(1,))
t.start(); t.join()
out["thread"] = box
socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    shared = tmp_path_factory.mktemp("jail_shared")
    os.chmod(shared, 0o755)
    tag = uuid.uuid4().hex[:12]
    # A setuid-root copy of `id`: prints the effective uid it ends up with.
    setuid_id = shared / "id_setuid"
    shutil.copy("/usr/bin/id", setuid_id)
    os.chown(setuid_id, 0, 0)
    os.chmod(setuid_id, 0o4755)
    # Listening Unix sockets: under /run (hidden), in a directory the code can see, and abstract.
    listeners, paths = [], {"run": f"/run/sfrrl_jail_{tag}.sock", "visible": str(shared / "host.sock")}
    for address in (paths["run"], paths["visible"], "\0sfrrl_jail_" + tag):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        if not address.startswith("\0"):
            os.chmod(address, 0o777)
        s.listen(4)
        s.setblocking(False)
        listeners.append(s)
    secret = uuid.uuid4().hex + uuid.uuid4().hex
    os.environ["SFRRL_TEST_SECRET"] = secret
    sandbox = PythonSandbox(SandboxConfig(wall_timeout_s=10.0, cpu_seconds=5, max_concurrency=8,
                                          visible_paths=(str(shared),)))
    # Only where exec is allowed can the setuid binary run at all: no_new_privs must defuse it.
    exec_sandbox = PythonSandbox(SandboxConfig(wall_timeout_s=10.0, max_concurrency=1, allow_exec=True,
                                               visible_paths=(str(shared),)))
    site_dirs = sandbox_module._site_dirs()
    numbers = sandbox_seccomp.SYSCALLS[ARCH]
    first = {
        "memory_scan": _MEMORY_SCAN.format(a=secret[:32].encode(), b=secret[32:].encode()),
        "ipc_create": _IPC_CREATE.format(key=IPC_KEY),
        "proc": _PROC.format(host_pid=os.getpid()),
        "imports": _IMPORTS.format(dirs=[PROJECT] + site_dirs, listed=[PROJECT] + site_dirs + ["/root", "/run"]),
        "unix_sockets": _UNIX_SOCKETS.format(run=paths["run"], visible=paths["visible"], abstract="sfrrl_jail_" + tag),
        "setuid_no_exec": _SETUID.format(binary=str(setuid_id)),
        "setuid": (exec_sandbox, _SETUID.format(binary=str(setuid_id))),
        "syscalls": _SYSCALLS.format(numbers=numbers),
    }
    later = {"ipc_later": _IPC_LATER.format(key=IPC_KEY)}

    async def batch(programs):
        runs = [box.run(code) for box, code in (p if isinstance(p, tuple) else (sandbox, p) for p in programs.values())]
        return dict(zip(programs, await asyncio.gather(*runs)))

    try:
        results = asyncio.run(batch(first))
        results.update(asyncio.run(batch(later)))
        accepted = []
        for s in listeners:
            try:
                accepted.append(s.accept())
            except BlockingIOError:
                pass
    finally:
        del os.environ["SFRRL_TEST_SECRET"]
        for s in listeners:
            s.close()
        os.unlink(paths["run"])
    host_ipc = {kind: open(f"/proc/sysvipc/{kind}").read() for kind in ("shm", "msg")}
    return {"results": results, "accepted": accepted, "host_ipc": host_ipc, "sandbox": sandbox}


def _json(attacks, name):
    r = attacks["results"][name]
    assert r.ok, (name, r.stdout, r.stderr, r.setup_error)
    return json.loads(r.stdout)


def test_environment_secret_not_in_the_codes_memory(attacks):
    out = _json(attacks, "memory_scan")
    assert out["stack_scanned"] and out["scanned_mb"] > 1  # the scan did reach the process stack
    assert not out["found"]
    assert "SFRRL_TEST_SECRET" not in out["environ"]
    assert out["os_environ"] == ["HOME", "LANG", "PATH", "TMPDIR"]


def test_sysv_ipc_dies_with_the_call_and_is_capped(attacks):
    created = _json(attacks, "ipc_create")
    assert created["shm"] and created["msg"]  # SysV IPC works inside the call's own namespace
    assert created["big_shm"] == -1 and created["big_shm_errno"] == 22  # EINVAL: over the shm cap
    later = _json(attacks, "ipc_later")
    assert (later["shm"], later["shm_errno"], later["msg"], later["msg_errno"]) == (-1, 2, -1, 2)  # ENOENT
    for kind, table in attacks["host_ipc"].items():
        keys = [int(line.split()[0]) for line in table.splitlines()[1:]]
        assert IPC_KEY not in keys and IPC_KEY + 1 not in keys, kind


def test_host_processes_invisible_and_unsignallable(attacks):
    out = _json(attacks, "proc")
    assert out["pids"] == [out["me"]]  # its own pid namespace and /proc; init hidden by hidepid
    assert out["host_cmdline"] == "FileNotFoundError" and out["signal_host"] == "ProcessLookupError"
    # Its argv (on its stack, in its cmdline) names no host path: the config came on stdin.
    assert PROJECT not in out["own_cmdline"] and '"hide":' not in out["own_cmdline"]


def test_project_and_site_packages_hidden(attacks):
    out = _json(attacks, "imports")
    assert {name: out[name] for name in ("numpy", "jax", "sfrrl_jax", "pytest")} == dict.fromkeys(
        ("numpy", "jax", "sfrrl_jax", "pytest"), "ModuleNotFoundError")
    # A project under /tmp (a CI clone) is not even there: the jail's /tmp is its own tmpfs.
    assert out[PROJECT] in ([], "absent") and out["/run"] == []
    for d in sandbox_module._site_dirs():
        assert out[d] in ([], "absent"), d
    # /root holds nothing but the mount points leading to the stdlib (pyenv lives there).
    stdlib = sandbox_module._stdlib_dirs()
    assert all(any(p.startswith(f"/root/{entry}/") for p in stdlib) for entry in out["/root"]), out["/root"]


def test_no_unix_socket_to_host(attacks):
    out = _json(attacks, "unix_sockets")
    assert out["visible_exists"] and not out["run_exists"]
    assert out["run"] == out["visible"] == out["abstract"] == "PermissionError 1"  # seccomp: socket(AF_UNIX)
    assert out["dgram_pair"] == "PermissionError 1" and out["stream_pair"] == "ok"
    assert attacks["accepted"] == []


def test_setuid_binary_gains_nothing(attacks):
    out = _json(attacks, "setuid")  # exec allowed: it runs, with no more than the code's uid
    assert out["id_u"] == str(out["me"]) and out["me"] != 0, out
    assert out["no_new_privs"] == "1" and out["seccomp"] == "2"
    denied = _json(attacks, "setuid_no_exec")  # the default: it does not even start
    assert denied["id_u"] == "PermissionError 1" and denied["no_new_privs"] == "1" and denied["seccomp"] == "2"


def test_dangerous_syscalls_denied(attacks):
    out = _json(attacks, "syscalls")
    denied = {k: v for k, v in out.items() if k not in ("fork", "thread")}
    assert denied == dict.fromkeys(denied, 1), out  # EPERM each
    assert "clone_newuser" in denied
    assert out["fork"] == 7 and out["thread"] == [1]


# ----------------------------------------------------------------------------- the filter itself

def _run_bpf(program: bytes, arch: int, nr: int, args=(0,) * 6) -> int:
    """A classic-BPF interpreter for the opcodes build_filter uses; returns the seccomp action."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    insns = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x54:
            acc &= k
        elif code in (0x15, 0x35, 0x45):
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unknown opcode {code:#x}")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_seccomp_filter_decisions(arch):
    allow, eperm, enosys, kill = 0x7FFF0000, 0x50001, 0x50026, 0x80000000
    audit, nr = sandbox_seccomp.AUDIT_ARCH[arch], sandbox_seccomp.SYSCALLS[arch]
    for sysv in (True, False):
        prog = sandbox_seccomp.build_filter(sysv_ipc=sysv, arch=arch)
        assert _run_bpf(prog, 0x40000003, nr["ptrace"]) == kill  # i386 ABI: another syscall table
        assert _run_bpf(prog, audit, 0) == allow
        assert _run_bpf(prog, audit, nr["ptrace"]) == eperm
        assert _run_bpf(prog, audit, nr["unshare"]) == eperm
        assert _run_bpf(prog, audit, nr["socket"], (1, 1, 0, 0, 0, 0)) == eperm  # AF_UNIX
        assert _run_bpf(prog, audit, nr["socket"], (16, 3, 0, 0, 0, 0)) == eperm  # AF_NETLINK
        assert _run_bpf(prog, audit, nr["socket"], (2, 1, 0, 0, 0, 0)) == allow
        assert _run_bpf(prog, audit, nr["socket"], (10, 2, 0, 0, 0, 0)) == allow
        assert _run_bpf(prog, audit, nr["socketpair"], (1, 1 | 0x80000, 0, 0, 0, 0)) == allow
        assert _run_bpf(prog, audit, nr["socketpair"], (1, 2, 0, 0, 0, 0)) == eperm
        assert _run_bpf(prog, audit, nr["clone"], (0x01200011, 0, 0, 0, 0, 0)) == allow  # glibc fork
        assert _run_bpf(prog, audit, nr["clone"], (0x10000011, 0, 0, 0, 0, 0)) == eperm
        assert _run_bpf(prog, audit, nr["clone3"]) == enosys
        assert _run_bpf(prog, audit, nr["shmget"]) == (allow if sysv else eperm)
        assert _run_bpf(prog, audit, nr["execve"]) == _run_bpf(prog, audit, nr["execveat"]) == eperm
        with_exec = sandbox_seccomp.build_filter(sysv_ipc=sysv, arch=arch, allow_exec=True)
        assert _run_bpf(with_exec, audit, nr["execve"]) == _run_bpf(with_exec, audit, nr["execveat"]) == allow
        assert _run_bpf(with_exec, audit, nr["ptrace"]) == eperm
        if arch == "x86_64":
            assert _run_bpf(prog, audit, 0x40000000 + 101) == eperm  # x32 ABI
            assert _run_bpf(prog, audit, 1) == allow  # write
    with pytest.raises(RuntimeError, match="unsupported architecture"):
        sandbox_seccomp.build_filter(sysv_ipc=True, arch="riscv64")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_compute_only_filter_decisions(arch):
    """The reward scorers' filter (`build_compute_filter`): reads and computes, never writes a
    file, starts a program, a process or a thread, opens a socket or signals a process."""
    allow, eperm, enosys, kill = 0x7FFF0000, 0x50001, 0x50026, 0x80000000
    audit, nr = sandbox_seccomp.AUDIT_ARCH[arch], sandbox_seccomp.SYSCALLS[arch]
    prog = sandbox_seccomp.build_compute_filter(arch=arch)
    assert _run_bpf(prog, 0x40000003, nr["ptrace"]) == kill
    o_rdonly, o_cloexec, o_directory = 0, 0o2000000, 0o200000
    assert _run_bpf(prog, audit, nr["openat"], (0xFFFFFF9C, 0, o_rdonly | o_cloexec, 0, 0, 0)) == allow
    assert _run_bpf(prog, audit, nr["openat"], (0xFFFFFF9C, 0, o_directory | o_cloexec, 0, 0, 0)) == allow
    for flags in (0o1, 0o2, 0o100 | 0o1, 0o1000, 0o2000 | 0o1, 0o20200000 | 0o2):   # ..., O_TMPFILE
        assert _run_bpf(prog, audit, nr["openat"], (0xFFFFFF9C, 0, flags, 0, 0, 0)) == eperm, oct(flags)
    for name in ("execve", "execveat", "clone", "socket", "socketpair", "connect", "kill", "tgkill", "unlinkat",
                 "renameat2", "mkdirat", "fchmodat", "ftruncate", "memfd_create", "ptrace", "unshare", "shmget"):
        assert _run_bpf(prog, audit, nr[name]) == eperm, name
    assert _run_bpf(prog, audit, nr["clone"], (0x01200011, 0, 0, 0, 0, 0)) == eperm   # glibc's fork too
    assert _run_bpf(prog, audit, nr["clone3"]) == enosys and _run_bpf(prog, audit, nr["openat2"]) == enosys
    if arch == "x86_64":
        for name in ("fork", "vfork", "unlink", "rename", "mkdir", "creat"):
            assert _run_bpf(prog, audit, nr[name]) == eperm, name
        assert _run_bpf(prog, audit, nr["open"], (0, 0, 0, 0, 0, 0)) == allow
        assert _run_bpf(prog, audit, nr["open"], (0, 0o101, 0, 0, 0, 0)) == eperm
        for allowed in (0, 1, 3, 9, 11, 202, 231):   # read write close mmap munmap futex exit_group
            assert _run_bpf(prog, audit, allowed) == allow, allowed
    else:
        for allowed in (63, 64, 57, 222, 215, 98, 94):   # read write close mmap munmap futex exit_group
            assert _run_bpf(prog, audit, allowed) == allow, allowed


def test_seccomp_syscall_numbers_match_libseccomp():
    path = ctypes.util.find_library("seccomp")
    if path is None:
        pytest.skip("libseccomp not installed")
    lib = ctypes.CDLL(path)
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    for arch, table in sandbox_seccomp.SYSCALLS.items():
        for name, number in table.items():
            resolved = lib.seccomp_syscall_resolve_name_arch(sandbox_seccomp.AUDIT_ARCH[arch], name.encode())
            assert resolved == number, (arch, name, resolved, number)


# ----------------------------------------------------------------------------- refusal without the jail

_NON_ROOT_SCRIPT = textwrap.dedent("""
    import asyncio, sys, types, warnings
    root = sys.argv[1]
    for name, path in (("sfrrl_jax", root + "/sfrrl_jax"), ("sfrrl_jax.agents", root + "/sfrrl_jax/agents")):
        module = types.ModuleType(name)  # skip the package __init__s (they import jax)
        module.__path__ = [path]
        sys.modules[name] = module
    import sfrrl_jax.agents.sandbox.python_sandbox as S
    try:
        S.PythonSandbox(S.SandboxConfig())
        print("NOT REFUSED")
    except RuntimeError as e:
        print("REFUSED:", e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sandbox = S.PythonSandbox(S.SandboxConfig(allow_unisolated=True, max_concurrency=1))
    print("WARNED:", [str(w.message) for w in caught])
    code = ("import os, socket\\nprint(os.getuid())\\ntry:\\n    socket.socket(socket.AF_UNIX)\\n"
            "except PermissionError:\\n    print('unix denied')")
    r = asyncio.run(sandbox.run(code))
    print("RAN:", repr(r.stdout), r.exit_code)
""")


def test_non_root_is_refused_unless_opted_in():
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.access(python, os.X_OK):
        pytest.skip("needs root (to drop to uid 65534) and a system python3 that uid can run")
    as_nobody = {"user": 65534, "group": 65534, "extra_groups": [], "cwd": "/", "env": {"PATH": "/usr/bin:/bin"},
                 "capture_output": True, "text": True, "timeout": 60}
    readable = ("import os, sys; "
                "sys.exit(not os.access(sys.argv[1] + '/sfrrl_jax/agents/sandbox/python_sandbox.py', os.R_OK))")
    if subprocess.run([python, "-I", "-c", readable, PROJECT], **as_nobody).returncode != 0:
        pytest.skip("the project is not readable by uid 65534")
    proc = subprocess.run([python, "-I", "-c", _NON_ROOT_SCRIPT, PROJECT], **as_nobody)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 3, (proc.stdout, proc.stderr)
    assert lines[0].startswith("REFUSED:") and "not running as root" in lines[0]
    assert "allow_unisolated=True" in lines[0] and "separate_uid" in lines[0] and "pid namespace" in lines[0]
    assert lines[1].startswith("WARNED:") and "UNISOLATED SANDBOX" in lines[1]
    assert lines[2:] == ["RAN: '65534\\nunix denied\\n' 0"]  # seccomp still holds without root


def test_missing_namespace_refused_then_warned(monkeypatch, caplog):
    full = sandbox_module.probe_capabilities()
    partial = SandboxCapabilities(**{**full.__dict__, "ipc_namespace": False})
    monkeypatch.setattr(sandbox_module, "probe_capabilities", lambda refresh=False: partial)
    with pytest.raises(RuntimeError, match=r"missing IPC namespace .*allow_unisolated=True"):
        PythonSandbox(SandboxConfig())
    with pytest.warns(RuntimeWarning, match="UNISOLATED SANDBOX"):
        sandbox = PythonSandbox(SandboxConfig(allow_unisolated=True, max_concurrency=1))
    assert sandbox.unisolated and "UNISOLATED SANDBOX" in caplog.text
    # Without its own IPC namespace, SysV IPC would reach the host's: seccomp denies it instead.
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.shmget({IPC_KEY + 2}, 4096, 0o1000 | 0o600), ctypes.get_errno())")
    r = asyncio.run(sandbox.run(code))
    assert r.ok and r.stdout == "-1 1\n", (r.stdout, r.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fully capable machine does not warn
        monkeypatch.setattr(sandbox_module, "probe_capabilities", lambda refresh=False: full)
        assert not PythonSandbox(SandboxConfig()).unisolated


def test_visible_paths_and_site_packages_opt_in():
    sandbox = PythonSandbox(SandboxConfig(visible_paths=(PROJECT,), allow_site_packages=True, max_concurrency=1))
    code = (f"import os, json, jinja2\nprint(json.dumps([sorted(os.listdir({PROJECT!r}))[:50], "
            "jinja2.__name__]))")
    r = asyncio.run(sandbox.run(code))
    assert r.ok, r.stderr
    listed, name = json.loads(r.stdout)
    assert "sfrrl_jax" in listed and name == "jinja2"
    r = asyncio.run(sandbox.run(f"open({PROJECT + '/sfrrl_escape'!r}, 'w')"))
    assert not r.ok and "Read-only file system" in r.stderr  # visible, never writable
