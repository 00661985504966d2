"""The process that builds the sandbox's jail: `python -I -S -c <this file>`, stdin = config + code.

Standalone on purpose (stdlib only, no package imports) so the interpreter starts in ~10 ms. The
host (`python_sandbox.PythonSandbox`) starts it as root, with the base interpreter's real path (never a
virtualenv's, which may live inside the project) and an environment of its own choosing (LANG
only), and it builds the jail:

  launcher (host pgid leader; enters new net, mount, IPC and UTS namespaces, asks for a new pid
  │         namespace, caps SysV IPC sizes, builds the read-only filesystem view)
  └─ init   (pid 1 of the new pid namespace; mounts a /proc of that namespace, reaps, reports)
       └─ user (rlimits, unprivileged per-call uid, no_new_privs; then execs the runner)
            = runner: a fresh `python -I -S -c _RUNNER` (same binary) that reads the seccomp
              program and the code from fd 3, installs the filter and runs the code

The exec is what keeps the launcher's state away from the code: after it, the process holds a
new interpreter's memory, its argv is the runner's source (no host path), its environment the
four variables set below, and fd 3 (a memfd, closed once read) was the only thing handed over.
So no frame, object, module or byte of the launcher (the config's host paths: `hide`, `expose`,
the workdir) exists in the code's process. The seccomp filter comes last, in the runner, so it
may deny execve (`SandboxConfig.allow_exec`).

When `user` exits, `init` exits, and the kernel SIGKILLs every process left in the pid namespace:
nothing the code spawned (even after `setsid`) outlives the call; the IPC namespace, and every
SysV segment, queue or semaphore in it, dies with it. The host kills the launcher's process group
on its wall-clock timeout, which takes `init` and therefore the whole namespace down. The host
also puts the launcher in the call's memory cgroup (`cgroup.py`) before it sends the
config, i.e. before anything forks, so every process of the call is charged to that cgroup.

Filesystem view (mount_ns): every mount is remounted read-only and nosuid; each `hide` directory is
covered by an empty read-only tmpfs, then each `expose` directory under it (the stdlib, allowed
paths) is bind-mounted back read-only at the same path, and so are the files this launcher has
mapped (the interpreter binary, libpython, loaded extension modules) where a cover hides them:
the runner is the same binary and needs them; /tmp (the cwd), /var/tmp and /dev/shm are
private, size-capped tmpfs mounts that vanish with the call; /proc is the new pid namespace's own.

Config keys (JSON object on the first line of stdin; the code, UTF-8, is the rest). Every isolation
step is optional so that the host can run unisolated where it was told to (it probes first and
refuses by default; see `python_sandbox.py`):
  uid, gid            run the code as this uid/gid (needs root); null keeps the current ids
  net_ns, mount_ns, pid_ns, ipc_ns, uts_ns   booleans: which namespaces to create
  hide, expose        lists of absolute directories (mount_ns only; see above)
  sys_path            directories appended to the code's sys.path (allowed site-packages)
  tmpfs_bytes         size of each private tmpfs, and of all SysV shared memory (ipc_ns)
  workdir             host directory used as cwd when there is no mount namespace
  cpu_s, as_bytes, nproc, fsize_bytes, nofile   rlimits
  seccomp             hex of a BPF program (`seccomp.build_filter`), or null
  status_fd           inherited pipe fd: init writes {"exit_code", "signal", "exec_s", "peak_rss_kb"}
Exit codes of the launcher: the code's exit code, 128+signal if it died from a signal, and
SETUP_FAILED (121) with a message on stderr if the jail could not be built.
"""
import ctypes
import json
import marshal
import os
import resource
import stat
import sys
import time

SETUP_FAILED = 121
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm")
PAYLOAD_FD = 3

# The program of the fresh interpreter the code runs in (see the module docstring): it reads
# marshal((seccomp program, extra sys.path, code)) from fd 3, then behaves like `python -c code`:
# prints an uncaught exception (minus its own frame), honours sys.exit's argument, then joins
# non-daemon threads and runs atexit handlers. Its source is its argv: it names no host path.
_RUNNER = r"""
import os, sys


def _exit_status(code):
    # what the interpreter makes of SystemExit(code): None -> 0, an int -> itself, else print it -> 1
    if code is None:
        return 0
    if isinstance(code, int):
        return code if -2**31 <= code < 2**31 else -1
    try:
        sys.stderr.write("%s\n" % (code,))
    except Exception:
        pass
    return 1


def _run():
    import ctypes, marshal, types
    chunks = []
    while True:
        chunk = os.read(3, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(3)
    program, extra_path, code = marshal.loads(b"".join(chunks))
    del chunks
    sys.argv[:] = ["<sandbox>"]
    sys.path.extend(extra_path)
    # a real __main__ module (as `python -c` has), so pickling functions defined by the code works
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    if program:
        class Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        buffer = ctypes.create_string_buffer(program, len(program))
        fprog = Fprog(len(program) // 8, ctypes.addressof(buffer))
        if libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
            sys.stderr.write("sandbox setup failed: prctl(PR_SET_SECCOMP): %s\n" % os.strerror(ctypes.get_errno()))
            sys.stderr.flush()
            os._exit(121)
    status = 0
    try:
        exec(compile(code, "<sandbox>", "exec"), main_module.__dict__)
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException as e:
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        status = 1
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException as e:  # e.g. KeyboardInterrupt while joining: report, keep exiting
            sys.stderr.write("Exception while joining threads: %r\n" % (e,))
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status & 0xFF)


_run()
"""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _fail(message):
    sys.stderr.write("sandbox setup failed: %s\n" % message)
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        _fail("%s: %s" % (what, os.strerror(errno)))


def _mount(source, target, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    return _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data))


def _limit_ipc(tmpfs_bytes):
    """Cap the new IPC namespace: SysV shared memory is not charged to RLIMIT_AS once detached."""
    page = os.sysconf("SC_PAGE_SIZE")
    limits = (("kernel/shmmax", tmpfs_bytes), ("kernel/shmall", max(tmpfs_bytes // page, 1)),
              ("kernel/shmmni", 64), ("kernel/msgmni", 16), ("kernel/sem", "32 1024 32 16"),
              ("fs/mqueue/queues_max", 16))
    for name, value in limits:
        try:
            with open("/proc/sys/" + name, "w") as f:
                f.write(str(value))
        except OSError as e:
            _fail("limit IPC namespace (%s): %s" % (name, e))


def _under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


def _mapped_files():
    """The regular files this process has mapped: the interpreter, libpython, the extension
    modules it loaded and their libraries. The runner is the same binary and needs them."""
    files = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.rstrip("\n").split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/") and os.path.isfile(fields[5]):
                files.add(fields[5])  # a "(deleted)" name is no file: skipped
    return files


def _build_view(cfg):
    # Our copy of the mount table is private: changes below never reach the host.
    _check(_mount(None, "/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
    flag_of = {"nodev": MS_NODEV, "noexec": MS_NOEXEC}
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        mount_point = fields[4].replace("\\040", " ")
        keep = 0
        for option in fields[5].split(","):
            keep |= flag_of.get(option, 0)
        # Per-mount read-only, nosuid remount; /proc and /sys pieces may refuse, and only root may
        # write there anyway, so a refusal is not fatal.
        _mount(None, mount_point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | keep, None)

    def depth_of_deepest(path, roots):
        return max([root.count("/") for root in roots if _under(path, root)] or [-1])

    # A mapped file needs its own bind only where a cover hides it and no exposed directory
    # brings it back (libpython next to a hidden site-packages, the binary in a hidden bin/).
    files = [path for path in _mapped_files()
             if depth_of_deepest(path, cfg["hide"] + list(PRIVATE_TMPFS)) > depth_of_deepest(path, cfg["expose"])]
    # Handles on what must stay visible, taken before anything covers them.
    exposed = []
    for path in sorted(set(cfg["expose"]) | set(files), key=lambda p: p.count("/")):
        try:
            fd = os.open(path, os.O_PATH)
            exposed.append((path, fd, stat.S_ISDIR(os.fstat(fd).st_mode)))
        except OSError:
            continue
    covers = [(path, False) for path in cfg["hide"]] + [(path, True) for path in PRIVATE_TMPFS]
    covers.sort(key=lambda c: c[0].count("/"))  # shallow first: a deeper cover lands on top
    for path, private in covers:
        if os.path.islink(path) or not os.path.isdir(path):
            continue  # absent here, or already hidden by a shallower cover
        if private:
            options = "size=%d,mode=0700" % cfg["tmpfs_bytes"]
            if cfg["uid"] is not None:
                options += ",uid=%d,gid=%d" % (cfg["uid"], cfg["gid"])
        else:
            options = "size=1m,mode=0755"
        _check(_mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options), "tmpfs on " + path)
        for target, fd, is_dir in exposed:
            if target.startswith(path.rstrip("/") + "/"):
                try:
                    os.makedirs(target if is_dir else os.path.dirname(target), mode=0o755, exist_ok=True)
                    if not is_dir:
                        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
                except OSError as e:
                    _fail("mount point for %s: %s" % (target, e))
                _check(_mount("/proc/self/fd/%d" % fd, target, None, MS_BIND | MS_REC, None), "bind " + target)
                _check(_mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None),
                       "read-only " + target)
        if not private:
            _check(_mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None),
                   "read-only " + path)
    for _, fd, _ in exposed:
        os.close(fd)


def _mount_own_proc():
    # In init (pid 1 of the new namespace): this proc lists only the jail's processes, and
    # hidepid=2 hides even init (root) from the code.
    _check(_mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2"), "mount /proc")


def _apply_limits(cfg):
    # CPU: SIGXCPU at the soft limit (reported as such), SIGKILL one second later if ignored.
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    limits = [
        (resource.RLIMIT_AS, cfg["as_bytes"]),
        (resource.RLIMIT_FSIZE, cfg["fsize_bytes"]),
        (resource.RLIMIT_NPROC, cfg["nproc"]),
        (resource.RLIMIT_NOFILE, cfg["nofile"]),
        (resource.RLIMIT_CORE, 0),
    ]
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def _no_new_privs():
    # setuid/setcap binaries no longer raise privileges on exec (and an unprivileged process may
    # then install a seccomp filter); kept across exec, so the runner has it too.
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _lock_down(seccomp_hex):
    """no_new_privs, then the seccomp filter (hex). The runner installs the code's filter itself;
    this is for `tasks/rg_worker.py`, which loads this file for it."""
    _no_new_privs()
    if seccomp_hex:
        program = ctypes.create_string_buffer(bytes.fromhex(seccomp_hex))
        fprog = _SockFprog(len(program.raw) // 8, ctypes.addressof(program))
        _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
               "prctl(PR_SET_SECCOMP)")


def _payload(cfg, code):
    """A memfd holding what the runner needs: the seccomp program, extra sys.path, the code."""
    program = bytes.fromhex(cfg["seccomp"]) if cfg["seccomp"] else b""
    data = memoryview(marshal.dumps((program, cfg["sys_path"], code)))
    fd = os.memfd_create("sandbox-payload", 0)
    while data:
        data = data[os.write(fd, data):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_user(cfg, code, status_fd):
    os.close(status_fd)  # the code must not be able to forge the status report
    try:
        payload = _payload(cfg, code)  # before RLIMIT_FSIZE, which the code may be larger than
        _apply_limits(cfg)
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        os.chdir("/tmp" if cfg["mount_ns"] else cfg["workdir"])
        home = os.getcwd()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if payload != PAYLOAD_FD:
            os.dup2(payload, PAYLOAD_FD)
            os.close(payload)
        os.set_inheritable(PAYLOAD_FD, True)
    except OSError as e:
        _fail("dropping privileges / limits: %s" % e)
    _no_new_privs()
    env = {"HOME": home, "TMPDIR": home, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    try:
        # Every other descriptor is close-on-exec (PEP 446): 0-2 and the payload are all it gets.
        os.execve(_PYTHON, [_PYTHON, "-I", "-S", "-c", _RUNNER], env)
    except OSError as e:
        _fail("exec %s: %s" % (_PYTHON, e))


def _status_of(wait_status):
    if os.WIFSIGNALED(wait_status):
        return None, os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status), None


def _run_init(cfg, code, status_fd):
    if cfg["pid_ns"] and cfg["mount_ns"]:
        _mount_own_proc()
    start = time.perf_counter()
    try:
        user = os.fork()
    except OSError as e:
        _fail("fork user process: %s" % e)
    if user == 0:
        _run_user(cfg, code, status_fd)
    # Reap everything (we are the namespace's reaper) until the user process itself is gone.
    while True:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            _fail("lost the user process")
        if pid == user:
            break
    exec_s = time.perf_counter() - start
    exit_code, signal_number = _status_of(wait_status)
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    report = {"exit_code": exit_code, "signal": signal_number, "exec_s": exec_s, "peak_rss_kb": peak_kb}
    os.write(status_fd, json.dumps(report).encode())
    os.close(status_fd)
    os._exit(exit_code if exit_code is not None else 128 + signal_number)


_PYTHON = None  # this interpreter's binary, set by main(): the runner is the same one


def main():
    global _PYTHON
    _PYTHON = os.readlink("/proc/self/exe")
    header, _, code = sys.stdin.buffer.read().partition(b"\n")
    cfg = json.loads(header)
    code = code.decode("utf-8", "surrogatepass")
    status_fd = cfg["status_fd"]
    os.umask(0o022)
    flags = 0
    for key, flag in (("net_ns", CLONE_NEWNET), ("mount_ns", CLONE_NEWNS), ("pid_ns", CLONE_NEWPID),
                      ("ipc_ns", CLONE_NEWIPC), ("uts_ns", CLONE_NEWUTS)):
        if cfg[key]:
            flags |= flag
    if flags:
        _check(_libc.unshare(flags), "unshare(0x%x)" % flags)
    if cfg["uts_ns"]:
        _check(_libc.sethostname(b"sandbox", 7), "sethostname")
    if cfg["ipc_ns"]:
        _limit_ipc(cfg["tmpfs_bytes"])
    if cfg["mount_ns"]:
        _build_view(cfg)
    try:
        init = os.fork()
    except OSError as e:
        _fail("fork init: %s" % e)
    if init == 0:
        _run_init(cfg, code, status_fd)
    os.close(status_fd)
    _, wait_status = os.waitpid(init, 0)
    exit_code, signal_number = _status_of(wait_status)
    os._exit(exit_code if exit_code is not None else 128 + signal_number)


if __name__ == "__main__":
    main()
