"""The process that runs inside the sandbox: `python -I -S sandbox_launcher.py CONFIG_JSON < code`.

Standalone on purpose (stdlib only, no package imports) so the interpreter starts in ~10 ms.
It is started by `sandbox.PythonSandbox` as root (or as whoever the host is) and builds the jail:

  launcher (host pgid leader; enters new net + mount namespaces, asks for a new pid namespace)
    └─ init   (pid 1 of the new pid namespace; reaps, reports status, then exits)
         └─ user (rlimits, unprivileged per-call uid, cwd = private tmpfs /tmp; runs the code)

When `user` exits, `init` exits, and the kernel SIGKILLs every process left in the pid namespace:
nothing the code spawned (even after `setsid`) outlives the call. The host kills the launcher's
process group on its wall-clock timeout, which takes `init` and therefore the whole namespace down.

Config keys (JSON object in argv[1]); every isolation step is optional so the host can fall back
where the kernel or privileges do not allow it (the host probes first; see `sandbox.py`):
  uid, gid            run the code as this uid/gid (needs root); null keeps the current ids
  net_ns, mount_ns, pid_ns   booleans: which namespaces to create
  tmpfs_bytes         size of the private tmpfs mounted on /tmp (mount_ns only)
  workdir             host directory used as cwd when there is no mount namespace
  cpu_s, as_bytes, nproc, fsize_bytes, nofile   rlimits
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

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


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


def _make_filesystem_read_only(tmpfs_bytes, uid, gid):
    # Our copy of the mount table is private: changes below never reach the host.
    _check(_mount(None, "/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
    flag_of = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        mount_point = fields[4].replace("\\040", " ")
        keep = 0
        for option in fields[5].split(","):
            keep |= flag_of.get(option, 0)
        # Per-mount read-only remount; /proc and /sys pieces may refuse, and only root may
        # write there anyway, so a refusal is not fatal.
        _mount(None, mount_point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)
    options = "size=%d,mode=0700" % tmpfs_bytes
    if uid is not None:
        options += ",uid=%d,gid=%d" % (uid, gid)
    for target in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(target):
            _check(_mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, options), "tmpfs on " + target)
    _expose_stdlib()


def _expose_stdlib():
    """Make the interpreter's stdlib readable by the unprivileged uid.

    If the stdlib sits under a directory others cannot traverse (e.g. pyenv under /root, mode
    0700), cover that directory with a read-only tmpfs that holds only a read-only bind mount of
    the stdlib: the code can import `fractions` but still cannot see the rest of /root.
    """
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    blocked = None
    path = "/"
    for part in stdlib.strip("/").split("/"):
        path = os.path.join(path, part)
        if not os.stat(path).st_mode & 0o001:
            blocked = path
            break
    if blocked is None:
        return
    source = os.open(stdlib, os.O_PATH)
    _check(_mount("tmpfs", blocked, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755"), "tmpfs on " + blocked)
    os.makedirs(stdlib, exist_ok=True)
    _check(_mount("/proc/self/fd/%d" % source, stdlib, None, MS_BIND | MS_REC, None), "bind " + stdlib)
    _check(_mount(None, stdlib, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None), "ro " + stdlib)
    _check(_mount(None, blocked, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None), "ro " + blocked)
    os.close(source)


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
    sys.argv = ["<sandbox>"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<sandbox>", "exec"), namespace)
    except SystemExit as e:
        sys.stdout.flush()
        code_ = e.code
        os._exit(code_ if isinstance(code_, int) else (0 if code_ is None else 1))
    except BaseException as e:  # report like the interpreter would (minus our frame), then fail
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _status_of(wait_status):
    if os.WIFSIGNALED(wait_status):
        return None, os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status), None


def _run_init(cfg, code, status_fd):
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
    cfg = json.loads(sys.argv[1])
    code = sys.stdin.read()
    status_fd = cfg["status_fd"]
    flags = 0
    if cfg["net_ns"]:
        flags |= CLONE_NEWNET
    if cfg["mount_ns"]:
        flags |= CLONE_NEWNS
    if cfg["pid_ns"]:
        flags |= CLONE_NEWPID
    if flags:
        _check(_libc.unshare(flags), "unshare(0x%x)" % flags)
    if cfg["mount_ns"]:
        _make_filesystem_read_only(cfg["tmpfs_bytes"], cfg["uid"], cfg["gid"])
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
