"""API keys, principals and the roles a method needs; the tenant comes from the key, never the request."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from tether_run_api.domain.errors import MissingRole, Unauthenticated

ROLE_ADMIN = "admin"  # catalog writes (agents, tools)
ROLE_APPROVER = "approver"  # deciding approvals; never implied by admin (separation of duties)
ROLE_MEMBER = "member"  # submitting and reading runs
KNOWN_ROLES = frozenset({ROLE_ADMIN, ROLE_APPROVER, ROLE_MEMBER})

KEY_PREFIX = "tk_"
_KEY_SHAPE = re.compile(r"^tk_[A-Za-z0-9_-]{20,200}\Z")
#: Hex characters of a key's sha256 that name it (its key id): not a secret, and unique in practice.
KEY_ID_CHARS = 12
_BEARER = re.compile(r"^Bearer\s+(\S+)$", re.IGNORECASE)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant and principal an API key maps to, and the principal's roles."""

    tenant_id: str
    principal_id: str
    roles: frozenset[str]

    def has(self, role: str) -> bool:
        """True if the principal holds `role` (admin implies member, nothing implies approver)."""
        if role in self.roles:
            return True
        return role == ROLE_MEMBER and ROLE_ADMIN in self.roles

    def require(self, role: str) -> None:
        """Raise MissingRole unless the principal holds `role`."""
        if not self.has(role):
            raise MissingRole(role)

    def require_any(self, *roles: str) -> None:
        """Raise MissingRole (naming the first role, metadata any_of) unless the principal holds one of `roles`."""
        if not any(self.has(role) for role in roles):
            raise MissingRole(roles[0], any_of=roles)


def generate_api_key() -> str:
    """A new random API key (shown once; only its hash is stored)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """The stored form of a key: sha256 hex. Keys are random, so no salt or slow hash is needed."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key_hash: str) -> str:
    """The key id an operator sees (create-key, list-keys, revoke-key): the start of the key's hash."""
    return key_hash[:KEY_ID_CHARS]


def looks_like_api_key(text: str) -> bool:
    """True if `text` has the shape of an API key (anything else is refused before any lookup)."""
    return _KEY_SHAPE.match(text) is not None


@dataclass(frozen=True)
class ApiKeyRecord:
    """A stored API key as an operator may see it: its hash, never the key."""

    key_hash: str
    tenant_id: str
    principal_id: str
    roles: tuple[str, ...]
    label: str
    created_at: datetime
    revoked_at: datetime | None

    @property
    def key_id(self) -> str:
        return key_id(self.key_hash)


def api_key_from_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> str:
    """The key from `authorization: Bearer <key>` or `x-api-key: <key>`; raises Unauthenticated."""
    found: list[str] = []
    for name, value in metadata:
        if isinstance(value, bytes):
            continue
        lname = name.lower()
        if lname == "authorization":
            m = _BEARER.match(value.strip())
            if m is None:
                raise Unauthenticated("authorization metadata must be 'Bearer <api key>'")
            found.append(m.group(1))
        elif lname == "x-api-key":
            found.append(value.strip())
    if not found:
        raise Unauthenticated("missing API key: send 'authorization: Bearer <key>' or 'x-api-key: <key>'")
    if len(set(found)) > 1:
        raise Unauthenticated("conflicting API keys in metadata")
    key = found[0]
    if not looks_like_api_key(key):
        raise Unauthenticated("invalid API key")
    return key
