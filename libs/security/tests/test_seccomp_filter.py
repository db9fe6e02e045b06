"""The seccomp program's structure (its effect is tested in the containment tests against real bwrap)."""

from __future__ import annotations

import struct

import pytest

from tether_security.sandbox.seccomp import (
    DENIED_SYSCALLS_X86_64,
    UNSUPPORTED_SYSCALLS_X86_64,
    SeccompUnsupported,
    build_filter,
)


def _decode(prog: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack("<HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]


def test_program_checks_the_architecture_first_and_ends_in_allow() -> None:
    insns = _decode(build_filter("x86_64"))
    assert insns[0] == (0x20, 0, 0, 4)  # load seccomp_data.arch
    assert insns[1][3] == 0xC000003E  # AUDIT_ARCH_X86_64
    assert insns[2] == (0x06, 0, 0, 0x80000000)  # otherwise kill the process
    assert insns[-1] == (0x06, 0, 0, 0x7FFF0000)  # default: allow
    assert len(insns) <= 4096  # BPF_MAXINSNS


def test_every_denied_syscall_returns_eperm() -> None:
    insns = _decode(build_filter("x86_64"))
    for name, nr in DENIED_SYSCALLS_X86_64.items():
        i = next(i for i, (code, jt, jf, k) in enumerate(insns) if code == 0x15 and k == nr and (jt, jf) == (0, 1))
        assert insns[i + 1] == (0x06, 0, 0, 0x00050000 | 1), name


def test_memory_no_address_space_counts_is_unsupported() -> None:
    insns = _decode(build_filter("x86_64"))
    assert set(UNSUPPORTED_SYSCALLS_X86_64) == {"memfd_create", "memfd_secret", "shmget"}
    for name, nr in UNSUPPORTED_SYSCALLS_X86_64.items():
        i = next(i for i, (code, jt, jf, k) in enumerate(insns) if code == 0x15 and k == nr and (jt, jf) == (0, 1))
        assert insns[i + 1] == (0x06, 0, 0, 0x00050000 | 38), name  # ENOSYS


def test_jumps_stay_inside_the_program() -> None:
    insns = _decode(build_filter("x86_64"))
    for i, (code, jt, jf, _) in enumerate(insns):
        if code & 0x07 == 0x05:  # BPF_JMP
            assert i + 1 + max(jt, jf) < len(insns)


def test_other_architectures_are_refused() -> None:
    with pytest.raises(SeccompUnsupported):
        build_filter("aarch64")
