"""The tool sandbox: bubblewrap with namespaces, rlimits, seccomp and a parent-enforced wall clock."""

from tether_security.sandbox.process import SandboxedProcess, SandboxExit
from tether_security.sandbox.runner import (
    InvalidSandboxRequest,
    SandboxErrorCode,
    SandboxLimits,
    SandboxResult,
    SandboxRunner,
    SandboxSetupError,
    SandboxUnavailable,
)

__all__ = [
    "InvalidSandboxRequest",
    "SandboxErrorCode",
    "SandboxExit",
    "SandboxLimits",
    "SandboxResult",
    "SandboxRunner",
    "SandboxSetupError",
    "SandboxedProcess",
    "SandboxUnavailable",
]
