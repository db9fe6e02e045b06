"""Secrets by name: the provider port, environment/file/static providers, and the registry that feeds the redactor."""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from tether_security.redaction import Redactor

HANDLE_PREFIX = "secret://"
# Names look like paths of plain segments: "stripe/test", "github/deploy-bot", "OPENAI_API_KEY".
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(?:/[A-Za-z0-9][A-Za-z0-9_.-]*)*$")


class SecretNotFound(LookupError):
    """No secret of that name exists in the provider. Carries the name, never a value."""

    code = "SECRET_NOT_FOUND"

    def __init__(self, name: str, where: str = "") -> None:
        super().__init__(f"secret {name!r} not found" + (f" in {where}" if where else ""))
        self.name = name


class SecretTooShort(SecretNotFound):
    """The secret exists but its value is too short for the redactor, so it is not handed out.

    A value the redactor cannot scrub would reach events and logs if a tool echoed it. A
    SecretNotFound, so whoever refuses a call for a missing secret refuses it for this one too.
    Carries the name and the minimum length, never the value (nor its length).
    """

    code = "SECRET_TOO_SHORT"

    def __init__(self, name: str, min_length: int) -> None:
        LookupError.__init__(self, f"secret {name!r} is refused: a value shorter than {min_length} characters "
                                   "cannot be redacted")
        self.name = name
        self.min_length = min_length


class InvalidSecretName(ValueError):
    """A secret name or handle is malformed (e.g. contains '..' or starts with '/')."""


class InsecureSecretStore(PermissionError):
    """A secret file or directory is readable or writable by others than its owner, or owned by someone else."""


def secret_name(name_or_handle: str) -> str:
    """The secret name in `stripe/test` or `secret://stripe/test`; raises InvalidSecretName if malformed."""
    name = name_or_handle[len(HANDLE_PREFIX):] if name_or_handle.startswith(HANDLE_PREFIX) else name_or_handle
    if not _NAME.match(name) or ".." in name.split("/"):
        raise InvalidSecretName(f"malformed secret name {name_or_handle!r}")
    return name


def handle(name: str) -> str:
    """The opaque handle the model and tool arguments use instead of the value: `secret://<name>`."""
    return HANDLE_PREFIX + secret_name(name)


class SecretProvider(Protocol):
    """Port: resolves a secret name to its value, at execution time. Never logs or caches values itself."""

    def resolve(self, name: str) -> str:
        """The value of secret `name`; raises SecretNotFound."""
        ...


class StaticSecretProvider:
    """Secrets from an in-memory mapping: the fake for tests and local demos."""

    def __init__(self, secrets: Mapping[str, str]) -> None:
        self._secrets = dict(secrets)

    def resolve(self, name: str) -> str:
        """The mapped value; raises SecretNotFound."""
        try:
            return self._secrets[secret_name(name)]
        except KeyError:
            raise SecretNotFound(name, "static provider") from None


class EnvSecretProvider:
    """Secrets from environment variables: `stripe/test` → `<prefix>STRIPE_TEST` (non-alphanumerics become `_`).

    The composition root passes the environment mapping in (os.environ); nothing here reads it
    at import time.
    """

    def __init__(self, environ: Mapping[str, str], *, prefix: str = "TETHER_SECRET_") -> None:
        self._environ = environ
        self._prefix = prefix

    def variable(self, name: str) -> str:
        """The environment variable that holds secret `name`."""
        return self._prefix + re.sub(r"[^A-Za-z0-9]", "_", secret_name(name)).upper()

    def resolve(self, name: str) -> str:
        """The variable's value; an unset or empty variable raises SecretNotFound."""
        var = self.variable(name)
        value = self._environ.get(var)
        if not value:
            raise SecretNotFound(name, f"environment variable {var}")
        return value


def _check_private(path: Path, *, is_dir: bool) -> None:
    """Owner-only permissions, owned by this process's user (or root): anything else may have leaked."""
    st = path.stat()
    if is_dir != stat.S_ISDIR(st.st_mode):
        raise InsecureSecretStore(f"{path} is not a {'directory' if is_dir else 'regular file'}")
    if st.st_mode & 0o077:
        raise InsecureSecretStore(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}; secrets must be private to their owner "
            f"(chmod {'700' if is_dir else '600'} {path})"
        )
    if st.st_uid not in (os.geteuid(), 0):
        raise InsecureSecretStore(f"{path} is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})")


class FileSecretProvider:
    """Secrets from the file system, with permissions checked on every read.

    Either a directory where secret `stripe/test` is the file `<dir>/stripe/test` (one trailing
    newline stripped; sub-directories allowed, symlinks out of the directory refused), or one
    `.json`/`.toml` file whose table holds `stripe/test` as a key or as nested tables
    (`[stripe] test = "..."`). Files must be mode 0600-ish and directories 0700-ish.
    """

    def __init__(self, path: Path | str, *, require_private: bool = True) -> None:
        self._path = Path(path)
        self._require_private = require_private
        if not self._path.exists():
            raise SecretNotFound("*", f"missing secret store {self._path}")
        self._is_dir = self._path.is_dir()
        if not self._is_dir and self._path.suffix not in (".json", ".toml"):
            raise InvalidSecretName(f"secret file {self._path} must be a directory, a .json or a .toml file")
        if require_private:
            _check_private(self._path, is_dir=self._is_dir)

    def resolve(self, name: str) -> str:
        """The secret's value; raises SecretNotFound, InsecureSecretStore or InvalidSecretName."""
        name = secret_name(name)
        if self._is_dir:
            return self._from_directory(name)
        return self._from_document(name)

    def _from_directory(self, name: str) -> str:
        root = self._path.resolve()
        path = (root / name).resolve()
        if root not in path.parents:
            raise InvalidSecretName(f"secret {name!r} resolves outside {root}")
        if not path.is_file():
            raise SecretNotFound(name, str(root))
        if self._require_private:
            for parent in path.parents:
                if parent == root:
                    break
                _check_private(parent, is_dir=True)
            _check_private(path, is_dir=False)
        value = path.read_text(encoding="utf-8")
        return value[:-1] if value.endswith("\n") else value

    def _from_document(self, name: str) -> str:
        if self._require_private:
            _check_private(self._path, is_dir=False)
        raw = self._path.read_bytes()
        data: Any = tomllib.loads(raw.decode()) if self._path.suffix == ".toml" else json.loads(raw)
        if isinstance(data, Mapping) and isinstance(data.get(name), str):
            return data[name]
        node: Any = data
        for part in name.split("/"):
            if not isinstance(node, Mapping) or part not in node:
                raise SecretNotFound(name, str(self._path))
            node = node[part]
        if not isinstance(node, str):
            raise SecretNotFound(name, f"{self._path} (the entry is not a string)")
        return node


class SecretRegistry:
    """Resolves secrets at execution time and registers every resolved value with the redactor first.

    The only path from a secret name to a value: anything the value is later written into (tool
    output, errors, logs) is then scrubbed by the same redactor. Values are not cached here; the
    provider is asked on each use, so rotation takes effect on the next call.
    """

    def __init__(self, provider: SecretProvider, redactor: Redactor) -> None:
        self._provider = provider
        self._redactor = redactor
        self._resolved: set[str] = set()
        self._lock = threading.Lock()

    @property
    def redactor(self) -> Redactor:
        """The redactor that knows every value resolved so far."""
        return self._redactor

    def resolve(self, name_or_handle: str) -> str:
        """The value of a secret name or `secret://` handle, registered for redaction before it is returned.

        Raises SecretNotFound, or SecretTooShort for a value the redactor refuses (shorter than
        its `min_secret_length`): a secret that cannot be redacted is never handed out."""
        name = secret_name(name_or_handle)
        value = self._provider.resolve(name)
        if not self._redactor.add_secret(value):
            raise SecretTooShort(name, self._redactor.min_secret_length)
        with self._lock:
            self._resolved.add(name)
        return value

    def preload(self, names: Iterable[str]) -> None:
        """Resolve and register secrets up front (e.g. every secret a run's tools may use), so redaction
        covers them even in output produced before their first explicit use.

        The values the redactor accepts are registered; then SecretTooShort names the first it refused."""
        resolved = {secret_name(n): self._provider.resolve(secret_name(n)) for n in names}
        accepted = {name: value for name, value in resolved.items() if self._redactor.accepts(value)}
        self._redactor.add_secrets(accepted.values())
        with self._lock:
            self._resolved |= set(accepted)
        refused = [name for name in resolved if name not in accepted]
        if refused:
            raise SecretTooShort(refused[0], self._redactor.min_secret_length)

    def resolved_names(self) -> frozenset[str]:
        """Names resolved so far (never values): for audit records."""
        with self._lock:
            return frozenset(self._resolved)
