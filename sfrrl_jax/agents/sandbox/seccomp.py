"""The sandbox's seccomp filter: a classic-BPF program built here, installed by the launcher.
(Also `build_compute_filter`, stricter, for the reward scorers' forks: `tasks/rg_worker.py`.)

Hand-assembled rather than through libseccomp on purpose: the launcher must stay stdlib-only and
start in ~10 ms, and the filter is built once per sandbox in the host (`build_filter`), then handed
to the launcher as bytes (hex in its config) and installed with one prctl(PR_SET_SECCOMP) right
before the untrusted code runs (after prctl(PR_SET_NO_NEW_PRIVS), which also lets an unprivileged
process install it). The syscall numbers below were taken from libseccomp's tables and the test
suite checks them against libseccomp whenever it is installed.

What the filter does (x86_64 and aarch64; on any other architecture `build_filter` raises):
* a syscall of another ABI (i386 on x86_64, i.e. a foreign AUDIT_ARCH) kills the process, and
  x32 syscalls (nr >= 0x40000000) fail: a filter for one table must not be bypassed by another;
* EPERM for kernel-attack-surface and escape syscalls an unprivileged process could otherwise
  reach: ptrace and process_vm_*, new namespaces (unshare, setns, clone with CLONE_NEW* flags),
  the mount API, keyrings, bpf, perf_event_open, userfaultfd, io_uring, kcmp, pidfd_getfd,
  handle-based opens, fanotify, module/kexec/reboot/swap/clock/hostname calls;
* socket() only for AF_INET and AF_INET6 (so no AF_UNIX connection to a host daemon, no netlink,
  no packet sockets); socketpair() only for SOCK_STREAM / SOCK_SEQPACKET pairs, which cannot be
  pointed at another address (a SOCK_DGRAM pair could sendto() a host socket path);
* clone3 fails with ENOSYS (its flags sit in memory BPF cannot read), so libc falls back to
  clone(), whose flags are checked;
* SysV IPC (shm*, msg*, sem*) is denied when the call has no IPC namespace of its own (an
  unisolated run), because host IPC objects outlive the call;
* execve / execveat fail with EPERM unless `allow_exec` (`SandboxConfig.allow_exec`): the code
  starts no other program or interpreter. The launcher installs the filter in a fresh interpreter
  it has already exec'd (`launcher._RUNNER`), so the denial costs the code nothing else.
"""
from __future__ import annotations

import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

_COMMON = ("ptrace process_vm_readv process_vm_writev mount umount2 pivot_root chroot move_mount open_tree "
           "fsopen fsconfig fsmount fspick mount_setattr unshare setns keyctl add_key request_key bpf "
           "perf_event_open kexec_load kexec_file_load init_module finit_module delete_module reboot swapon "
           "swapoff userfaultfd kcmp pidfd_getfd name_to_handle_at open_by_handle_at fanotify_init "
           "io_uring_setup io_uring_enter io_uring_register acct quotactl lookup_dcookie vhangup syslog "
           "sethostname setdomainname settimeofday clock_settime nfsservctl").split()
_X86_ONLY = "iopl ioperm uselib _sysctl create_module get_kernel_syms query_module".split()
_SYSV_IPC = "shmget shmat shmdt shmctl msgget msgsnd msgrcv msgctl semget semop semtimedop semctl".split()

# Syscall numbers per architecture (from libseccomp; `tests/adversarial/test_sandbox_jail.py` checks them).
SYSCALLS = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165, "umount2": 166,
        "pivot_root": 155, "chroot": 161, "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "unshare": 272, "setns": 308, "keyctl": 250,
        "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "kexec_load": 246,
        "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176, "reboot": 169,
        "swapon": 167, "swapoff": 168, "userfaultfd": 323, "kcmp": 312, "pidfd_getfd": 438,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "fanotify_init": 300, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "acct": 163, "quotactl": 179, "lookup_dcookie": 212,
        "vhangup": 153, "syslog": 103, "sethostname": 170, "setdomainname": 171, "settimeofday": 164,
        "clock_settime": 227, "nfsservctl": 180, "iopl": 172, "ioperm": 173, "uselib": 134, "_sysctl": 156,
        "create_module": 174, "get_kernel_syms": 177, "query_module": 178,
        "shmget": 29, "shmat": 30, "shmdt": 67, "shmctl": 31, "msgget": 68, "msgsnd": 69, "msgrcv": 70,
        "msgctl": 71, "semget": 64, "semop": 65, "semtimedop": 220, "semctl": 66,
        "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435,
        # the compute-only filter's (`build_compute_filter`)
        "execve": 59, "execveat": 322, "fork": 57, "vfork": 58, "connect": 42, "bind": 49, "listen": 50,
        "accept": 43, "accept4": 288, "kill": 62, "tkill": 200, "tgkill": 234, "pidfd_open": 434,
        "pidfd_send_signal": 424, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "unlink": 87, "unlinkat": 263,
        "rename": 82, "renameat": 264, "renameat2": 316, "mkdir": 83, "mkdirat": 258, "rmdir": 84, "link": 86,
        "linkat": 265, "symlink": 88, "symlinkat": 266, "chmod": 90, "fchmod": 91, "fchmodat": 268, "chown": 92,
        "fchown": 93, "lchown": 94, "fchownat": 260, "truncate": 76, "ftruncate": 77, "mknod": 133,
        "mknodat": 259, "utime": 132, "utimes": 235, "utimensat": 280, "futimesat": 261, "setxattr": 188,
        "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199,
        "creat": 85, "memfd_create": 319, "process_madvise": 440, "open": 2, "openat": 257, "openat2": 437,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "mount": 40, "umount2": 39,
        "pivot_root": 41, "chroot": 51, "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "unshare": 97, "setns": 268, "keyctl": 219,
        "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241, "kexec_load": 104,
        "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106, "reboot": 142,
        "swapon": 224, "swapoff": 225, "userfaultfd": 282, "kcmp": 272, "pidfd_getfd": 438,
        "name_to_handle_at": 264, "open_by_handle_at": 265, "fanotify_init": 262, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "acct": 89, "quotactl": 60, "lookup_dcookie": 18,
        "vhangup": 58, "syslog": 116, "sethostname": 161, "setdomainname": 162, "settimeofday": 170,
        "clock_settime": 112, "nfsservctl": 42,
        "shmget": 194, "shmat": 196, "shmdt": 197, "shmctl": 195, "msgget": 186, "msgsnd": 189, "msgrcv": 188,
        "msgctl": 187, "semget": 190, "semop": 193, "semtimedop": 192, "semctl": 191,
        "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435,
        "execve": 221, "execveat": 281, "connect": 203, "bind": 200, "listen": 201, "accept": 202, "accept4": 242,
        "kill": 129, "tkill": 130, "tgkill": 131, "pidfd_open": 434, "pidfd_send_signal": 424,
        "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240, "unlinkat": 35, "renameat": 38, "renameat2": 276,
        "mkdirat": 34, "linkat": 37, "symlinkat": 36, "fchmod": 52, "fchmodat": 53, "fchown": 55, "fchownat": 54,
        "truncate": 45, "ftruncate": 46, "mknodat": 33, "utimensat": 88, "setxattr": 5, "lsetxattr": 6,
        "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16, "memfd_create": 279,
        "process_madvise": 440, "openat": 56, "openat2": 437,
    },
}

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_LD_ABS_W, _JEQ, _JGE, _JSET, _AND, _RET = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
EPERM, ENOSYS = 1, 38
# struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6]  (low word of an arg: little-endian)
_NR, _ARCH = 0, 4


def _arg(i: int) -> int:
    return 16 + 8 * i


AF_INET, AF_INET6 = 2, 10
SOCK_STREAM, SOCK_SEQPACKET = 1, 5
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000


def denied_syscalls(arch: str, sysv_ipc: bool) -> list[str]:
    names = _COMMON + (_X86_ONLY if arch == "x86_64" else [])
    return names + ([] if sysv_ipc else _SYSV_IPC)


# The compute-only filter's extra denials: no new program, process or thread, no network, no signal
# to another process, no change to any file (opens for writing are caught by their flags).
_COMPUTE_DENIED = ("execve execveat fork vfork clone socket socketpair connect bind listen accept accept4 kill "
                   "tkill tgkill pidfd_open pidfd_send_signal rt_sigqueueinfo rt_tgsigqueueinfo unlink unlinkat "
                   "rename renameat renameat2 mkdir mkdirat rmdir link linkat symlink symlinkat chmod fchmod "
                   "fchmodat chown fchown lchown fchownat truncate ftruncate mknod mknodat utime utimes utimensat "
                   "futimesat setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr creat "
                   "memfd_create process_madvise").split()
# open flags that write or create: O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND (same on both)
OPEN_WRITE_FLAGS = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000


def build_compute_filter(arch: str | None = None) -> bytes:
    """A filter for a process that only computes on what it already holds (a reward scorer fed a
    model's text, which some scorers eval): everything `build_filter` denies, SysV IPC, and every
    syscall in `_COMPUTE_DENIED` fail with EPERM; open/openat with any of `OPEN_WRITE_FLAGS` fail
    with EPERM (reading, e.g. a lazy import, still works); clone3 and openat2 (arguments in
    memory BPF cannot read) fail with ENOSYS. Packed as `build_filter`'s."""
    arch, nr, prog, ins = _start(arch)
    if arch == "x86_64":
        ins(_JEQ, nr["open"], "open", 0)
    ins(_JEQ, nr["openat"], "openat", 0)
    ins(_JEQ, nr["clone3"], "enosys", 0)
    ins(_JEQ, nr["openat2"], "enosys", 0)
    for name in denied_syscalls(arch, sysv_ipc=False) + [n for n in _COMPUTE_DENIED if n in nr]:
        ins(_JEQ, nr[name], "eperm", 0)
    ins(_RET, RET_ALLOW)
    if arch == "x86_64":
        prog.append(("label", "open"))
        ins(_LD_ABS_W, _arg(1))
        ins(_JSET, OPEN_WRITE_FLAGS, "eperm", "allow")
    prog.append(("label", "openat"))
    ins(_LD_ABS_W, _arg(2))
    ins(_JSET, OPEN_WRITE_FLAGS, "eperm", "allow")
    _shared_returns(ins, prog)
    return _assemble(prog)


def _start(arch: str | None):
    """(arch, its syscall numbers, the program so far, ins(code, k, jt=0, jf=0) appending to it):
    a program that kills a syscall of a foreign ABI, fails an x32 one, and holds the syscall
    number in the accumulator. Instructions are (code, jt, jf, k), jt/jf label names or 0."""
    arch = arch or platform.machine()
    if arch not in SYSCALLS:
        raise RuntimeError(f"sandbox seccomp filter: unsupported architecture {arch!r} (x86_64 and aarch64 only)")
    prog: list[tuple] = []

    def ins(code, k, jt=0, jf=0):
        prog.append((code, jt, jf, k))

    ins(_LD_ABS_W, _ARCH)
    ins(_JEQ, AUDIT_ARCH[arch], 0, "kill")
    ins(_LD_ABS_W, _NR)
    if arch == "x86_64":
        ins(_JGE, X32_SYSCALL_BIT, "eperm", 0)
    return arch, SYSCALLS[arch], prog, ins


def _shared_returns(ins, prog) -> None:
    # classic BPF only jumps forward: the shared returns come last
    prog.append(("label", "enosys"))
    ins(_RET, RET_ERRNO | ENOSYS)
    prog.append(("label", "eperm"))
    ins(_RET, RET_ERRNO | EPERM)
    prog.append(("label", "kill"))
    ins(_RET, RET_KILL_PROCESS)
    prog.append(("label", "allow"))
    ins(_RET, RET_ALLOW)


def _assemble(prog: list[tuple]) -> bytes:
    """(code, jt, jf, k) instructions with jt/jf label names (or 0) and ('label', name) markers ->
    packed `struct sock_filter`s with relative jump offsets (counted from the next instruction)."""
    where, index = {}, 0
    for item in prog:
        if item[0] == "label":
            where[item[1]] = index
        else:
            index += 1
    out, index = [], 0
    for item in prog:
        if item[0] == "label":
            continue
        code, jt, jf, k = item
        offsets = []
        for target in (jt, jf):
            off = 0 if target == 0 else where[target] - index - 1
            if not 0 <= off <= 255:
                raise AssertionError(f"BPF jump out of range: {off}")
            offsets.append(off)
        out.append(struct.pack("=HBBI", code, offsets[0], offsets[1], k))
        index += 1
    return b"".join(out)


def build_filter(sysv_ipc: bool, arch: str | None = None, allow_exec: bool = False) -> bytes:
    """The filter as packed `struct sock_filter` instructions (8 bytes each, native order).

    `sysv_ipc`: allow SysV IPC (only when the call has its own IPC namespace). `allow_exec`:
    allow execve / execveat (denied with EPERM otherwise).
    """
    arch, nr, prog, ins = _start(arch)

    def label(name):
        prog.append(("label", name))

    ins(_JEQ, nr["socket"], "socket", 0)
    ins(_JEQ, nr["socketpair"], "socketpair", 0)
    ins(_JEQ, nr["clone"], "clone", 0)
    ins(_JEQ, nr["clone3"], "enosys", 0)
    for name in denied_syscalls(arch, sysv_ipc) + ([] if allow_exec else ["execve", "execveat"]):
        ins(_JEQ, nr[name], "eperm", 0)
    ins(_RET, RET_ALLOW)
    # Sections below are entered by jumps; classic BPF only jumps forward, so the shared returns
    # come last.
    label("socket")
    ins(_LD_ABS_W, _arg(0))
    ins(_JEQ, AF_INET, "allow", 0)
    ins(_JEQ, AF_INET6, "allow", "eperm")
    label("socketpair")
    ins(_LD_ABS_W, _arg(1))
    ins(_AND, 0xF)  # strip SOCK_NONBLOCK / SOCK_CLOEXEC
    ins(_JEQ, SOCK_STREAM, "allow", 0)
    ins(_JEQ, SOCK_SEQPACKET, "allow", "eperm")
    label("clone")
    ins(_LD_ABS_W, _arg(0))
    ins(_JSET, CLONE_NEW_ANY, "eperm", "allow")
    _shared_returns(ins, prog)
    return _assemble(prog)
