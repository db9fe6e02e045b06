"""Safety building blocks: secrets, redaction, untrusted-content envelopes, and the tool sandbox."""

from tether_security.logs import RedactingFilter, RedactingProcessor
from tether_security.redaction import Finding, Redactor
from tether_security.sandbox import (
    InvalidSandboxRequest,
    SandboxErrorCode,
    SandboxLimits,
    SandboxResult,
    SandboxRunner,
    SandboxSetupError,
    SandboxUnavailable,
)
from tether_security.secrets import (
    EnvSecretProvider,
    FileSecretProvider,
    InsecureSecretStore,
    InvalidSecretName,
    SecretNotFound,
    SecretProvider,
    SecretRegistry,
    StaticSecretProvider,
    handle,
    secret_name,
)
from tether_security.untrusted import (
    DataEnvelope,
    HeuristicInjectionDetector,
    InjectionDetector,
    InjectionFlag,
    InjectionReport,
    InvalidEnvelopeRequest,
    sanitize,
    wrap_untrusted,
)

__all__ = [
    "DataEnvelope",
    "EnvSecretProvider",
    "FileSecretProvider",
    "Finding",
    "HeuristicInjectionDetector",
    "InjectionDetector",
    "InjectionFlag",
    "InjectionReport",
    "InsecureSecretStore",
    "InvalidEnvelopeRequest",
    "InvalidSandboxRequest",
    "InvalidSecretName",
    "RedactingFilter",
    "RedactingProcessor",
    "Redactor",
    "SandboxErrorCode",
    "SandboxLimits",
    "SandboxResult",
    "SandboxRunner",
    "SandboxSetupError",
    "SandboxUnavailable",
    "SecretNotFound",
    "SecretProvider",
    "SecretRegistry",
    "StaticSecretProvider",
    "handle",
    "sanitize",
    "secret_name",
    "wrap_untrusted",
]
