"""The process that runs inside the sandbox: `python -I -S -c <this file>`, stdin = config + code.

Standalone on purpose (stdlib only, no package imports) so the interpreter starts in ~10 ms. The
host (`sandbox.PythonSandbox`) starts it as root with an environment of its own choosing (LANG
only: the process's initial stack, which every forked child inherits, never holds the trainer's
variables) and no host path in its argv, and it builds the jail:

  launcher (host pgid leader; enters new net, mount, IPC and UTS namespaces, asks for a new pid
  │         namespace, caps SysV IPC sizes, builds the read-only filesystem view)
  └─ init   (pid 1 of the new pid namespace; mounts a /proc of that namespace, reaps, reports)
       └─ user (rlimits, unprivileged per-call uid, no_new_privs, seccomp; runs the code)

When `user` exits, `init` exits, and the kernel SIGKILLs every process left in the pid namespace:
nothing the code spawned (even after `setsid`) outlives the call; the IPC namespace, and every
SysV segment, queue or semaphore in it, dies with it. The host kills the launcher's process group
on its wall-clock timeout, which takes `init` and therefore the whole namespace down.

Filesystem view (mount_ns): every mount is remounted read-only and nosuid; each `hide` directory is
covered by an empty read-only tmpfs, then each `expose` directory under it (the stdlib, allowed
paths) is bind-mounted back read-only at the same path; /tmp (the cwd), /var/tmp and /dev/shm are
private, size-capped tmpfs mounts that vanish with the call; /proc is the new pid namespace's own.

Config keys (JSON object on the first line of stdin; the code, UTF-8, is the rest). Every isolation
step is optional so that the host can run unisolated where it was told to (it probes first and
refuses by default; see `sandbox.py`):
  uid, gid            run the code as this uid/gid (needs root); null keeps the current ids
  net_ns, mount_ns, pid_ns, ipc_ns, uts_ns   booleans: which namespaces to create
  hide, expose        lists of absolute directories (mount_ns only; see above)
  sys_path            directories appended to the code's sys.path (allowed site-packages)
  tmpfs_bytes         size of each private tmpfs, and of all SysV shared memory (ipc_ns)
  workdir             host directory used as cwd when there is no mount namespace
  cpu_s, as_bytes, nproc, fsize_bytes, nofile   rlimits
  seccomp             hex of a BPF program (`sandbox_seccomp.build_filter`), or null
  status_fd           inherited pipe fd: init writes {"exit_code", "signal", "exec_s", "peak_rss_kb"}
Exit codes of the launcher: the code's exit code, 128+signal if it died from a signal, and
SETUP_FAILED (121) with a message on stderr if the jail could not be built.
"""
import ctypes
import json
import os
import resource
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
    # Handles on what must stay visible, taken before anything covers them.
    exposed = []
    for path in sorted(set(cfg["expose"]), key=lambda p: p.count("/")):
        try:
            exposed.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
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
        for target, fd in exposed:
            if target.startswith(path.rstrip("/") + "/"):
                try:
                    os.makedirs(target, mode=0o755, exist_ok=True)
                except OSError as e:
                    _fail("mount point for %s: %s" % (target, e))
                _check(_mount("/proc/self/fd/%d" % fd, target, None, MS_BIND | MS_REC, None), "bind " + target)
                _check(_mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None),
                       "read-only " + target)
        if not private:
            _check(_mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None),
                   "read-only " + path)
    for _, fd in exposed:
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


def _lock_down(seccomp_hex):
    # no_new_privs: setuid/setcap binaries no longer raise privileges on exec (and an
    # unprivileged process may then install a seccomp filter).
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    if seccomp_hex:
        program = ctypes.create_string_buffer(bytes.fromhex(seccomp_hex))
        fprog = _SockFprog(len(program.raw) // 8, ctypes.addressof(program))
        _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
               "prctl(PR_SET_SECCOMP)")


def _exit_status(code):
    """What the interpreter makes of SystemExit(code): None -> 0, an int -> itself, else print it -> 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code if -2**31 <= code < 2**31 else -1
    try:
        sys.stderr.write("%s\n" % (code,))
    except Exception:  # a broken __str__ or stderr: the status is what matters
        pass
    return 1


def _run_user(cfg, code, status_fd):
    os.close(status_fd)  # the code must not be able to forge the status report
    try:
        _apply_limits(cfg)
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        os.chdir("/tmp" if cfg["mount_ns"] else cfg["workdir"])
    except OSError as e:
        _fail("dropping privileges / limits: %s" % e)
    home = os.getcwd()
    os.environ.clear()
    os.environ.update({"HOME": home, "TMPDIR": home, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = ["<sandbox>"]
    sys.path.extend(cfg["sys_path"])
    import atexit
    import types

    # A real __main__ module (as `python -c` has), so pickling functions defined by the code works.
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    _lock_down(cfg["seccomp"])
    # From here on, behave like `python -c code`: print an uncaught exception (minus our frame),
    # honour sys.exit's argument, then join non-daemon threads and run atexit handlers.
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
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status & 0xFF)


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


def main():
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
