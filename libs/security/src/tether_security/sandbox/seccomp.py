"""A classic-BPF seccomp filter, built in pure Python, that denies kernel-escalation syscalls inside the sandbox."""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: nr (u32) at 0, arch (u32) at 4, instruction pointer at 8, args (u64 each) from 16.
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG0_LO = 16
_OFF_ARG1_LO = 24

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K

_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000

# x86_64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl). Denied with EPERM: tracing other
# processes, mounting, new namespaces, kernel keyrings, BPF, perf, module and kexec loading, and the
# other host-administration calls a tool never needs.
DENIED_SYSCALLS_X86_64: dict[str, int] = {
    "ptrace": 101,
    "syslog": 103,
    "pivot_root": 155,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}
# Memory that no per-process limit counts: a memfd's or a SysV segment's pages belong to no
# address space once unmapped (RLIMIT_AS sees none of it, RSS neither), so one process could hold
# any amount of host memory under a small memory_bytes. ENOSYS, as a kernel without them would
# answer, so a program falls back (to a file in the size-capped /tmp or /dev/shm) rather than die.
UNSUPPORTED_SYSCALLS_X86_64: dict[str, int] = {
    "shmget": 29,
    "memfd_create": 319,
    "memfd_secret": 447,
}
_CLONE = 56
_CLONE3 = 435
_IOCTL = 16
_TIOCSTI = 0x5412
# CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
_CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000


class SeccompUnsupported(RuntimeError):
    """No seccomp filter is defined for this machine's architecture."""


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def _deny_if_equal(value: int, ret: int) -> list[bytes]:
    # Compare-and-return pairs keep every jump offset at 0/1, so no label arithmetic is needed.
    return [_insn(_JEQ_K, 0, 1, value), _insn(_RET_K, 0, 0, ret)]


def build_filter(machine: str | None = None) -> bytes:
    """The BPF program (an array of struct sock_filter) that bubblewrap loads with --seccomp FD."""
    machine = machine or platform.machine()
    if machine != "x86_64":
        raise SeccompUnsupported(f"no seccomp filter is defined for architecture {machine!r}")
    eperm = _RET_ERRNO | errno.EPERM
    prog: list[bytes] = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        # A foreign ABI (e.g. int 0x80 i386 calls) would bypass the number table below: kill it.
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
        # x32 syscalls reuse the numbers with a high bit set; deny them wholesale.
        _insn(_JGE_K, 0, 1, _X32_SYSCALL_BIT),
        _insn(_RET_K, 0, 0, eperm),
    ]
    for nr in DENIED_SYSCALLS_X86_64.values():
        prog += _deny_if_equal(nr, eperm)
    for nr in UNSUPPORTED_SYSCALLS_X86_64.values():
        prog += _deny_if_equal(nr, _RET_ERRNO | errno.ENOSYS)
    # clone3 passes its flags in memory the filter cannot read: ENOSYS makes libc fall back to clone.
    prog += _deny_if_equal(_CLONE3, _RET_ERRNO | errno.ENOSYS)
    prog += [
        # clone with any namespace flag → EPERM; plain fork/thread creation passes.
        _insn(_JEQ_K, 0, 4, _CLONE),
        _insn(_LD_W_ABS, 0, 0, _OFF_ARG0_LO),
        _insn(_JSET_K, 0, 1, _CLONE_NAMESPACE_FLAGS),
        _insn(_RET_K, 0, 0, eperm),
        _insn(_RET_K, 0, 0, _RET_ALLOW),
        # ioctl(TIOCSTI) would push keystrokes into a shared terminal (CVE-2017-5226); --new-session
        # already prevents it, this is the second lock.
        _insn(_JEQ_K, 0, 4, _IOCTL),
        _insn(_LD_W_ABS, 0, 0, _OFF_ARG1_LO),
        _insn(_JEQ_K, 0, 1, _TIOCSTI),
        _insn(_RET_K, 0, 0, eperm),
        _insn(_RET_K, 0, 0, _RET_ALLOW),
        _insn(_RET_K, 0, 0, _RET_ALLOW),
    ]
    return b"".join(prog)
