"""Argument constraints a tool declares (ToolSpec.constraints_json), checked deterministically before a call runs.

Four kinds (docs/policy.md): `egress` (a URL argument's host must be allow-listed), `path_prefix`
(a path must stay under a prefix after normalisation), `max_amount` (a number, or a plain
decimal string, within a ceiling), `recipients` (every email address allow-listed by address
or domain). Each rule names its argument with a JSON pointer; `*` matches every element of an
array (or value of an object), and a rule on an array argument applies to every element. A
missing argument is left to the JSON Schema. Anything the checker cannot read with certainty
(an unparseable URL, an ambiguous recipient, an amount with a currency sign) is a violation.
"""

from __future__ import annotations

import ipaddress
import json
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

import idna
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

_ALLOWED_SCHEMES = ("http", "https")
_CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f-\x9f\u00a0\u1680\u2000-\u200f\u2028-\u202f\u205f\u2060\u3000\ufeff]")
_ASCII_HOST = re.compile(r"^[a-z0-9_-]+(\.[a-z0-9_-]+)*$")
_LOCAL_PART = re.compile(r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]+$")
_DECIMAL = re.compile(r"^-?[0-9]+(\.[0-9]+)?$")
_DISPLAY_ATOMS = re.compile(r"^[^<>@,;:\"()\[\]\\]*$")
_MAX_TEXT = 4096
_DECIMAL_DIGITS = re.compile(r"[0-9]+")
_OCTAL_DIGITS = re.compile(r"[0-7]+")
_HEX_NUMBER = re.compile(r"0[xX][0-9a-fA-F]*")


class ConstraintsInvalid(ValueError):
    """A tool's constraints_json does not follow docs/policy.md."""


@dataclass(frozen=True)
class Violation:
    """One argument breaking one rule; `detail` is what the model is told."""

    arg: str
    rule: str
    detail: str

    def describe(self) -> str:
        return f"argument {self.arg or '(root)'} breaks the {self.rule} rule: {self.detail}"


# -- the rules -----------------------------------------------------------------------------------
class _Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    arg: str = Field(description="JSON pointer to the argument; '*' matches every element.")

    @field_validator("arg")
    @classmethod
    def _pointer(cls, v: str) -> str:
        if v and not v.startswith("/"):
            raise ValueError("arg must be a JSON pointer ('' or starting with '/')")
        return v


class EgressRule(_Rule):
    kind: Literal["egress"]
    hosts: list[str] = Field(min_length=1, description="Host names, '*.domain' (subdomains), IPs or CIDRs, or '*'.")
    schemes: list[str] = Field(default_factory=lambda: list(_ALLOWED_SCHEMES))
    ports: list[int] | None = Field(None, description="Allowed ports (effective port); null = any.")

    @field_validator("schemes")
    @classmethod
    def _http_only(cls, v: list[str]) -> list[str]:
        bad = [s for s in v if s.lower() not in _ALLOWED_SCHEMES]
        if bad or not v:
            raise ValueError(f"schemes must be a non-empty subset of {list(_ALLOWED_SCHEMES)}, not {bad or v}")
        return [s.lower() for s in v]


class PathPrefixRule(_Rule):
    kind: Literal["path_prefix"]
    prefixes: list[str] = Field(min_length=1, description="Absolute directories the path must stay under.")
    base: str | None = Field(None, description="Directory relative paths are resolved against; null = absolute only.")

    @field_validator("prefixes")
    @classmethod
    def _absolute(cls, v: list[str]) -> list[str]:
        if any(not p.startswith("/") for p in v):
            raise ValueError("prefixes must be absolute paths")
        return v


class MaxAmountRule(_Rule):
    kind: Literal["max_amount"]
    max: Decimal
    min: Decimal = Decimal(0)


class RecipientsRule(_Rule):
    kind: Literal["recipients"]
    domains: list[str] = Field(default_factory=list, description="Allowed domains; '*.domain' for subdomains.")
    addresses: list[str] = Field(default_factory=list, description="Allowed single addresses.")


Rule = Annotated[EgressRule | PathPrefixRule | MaxAmountRule | RecipientsRule, Field(discriminator="kind")]


class Constraints(BaseModel):
    """A tool's parsed constraints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: list[Rule] = Field(default_factory=list)


_CONSTRAINTS = TypeAdapter(Constraints)


def parse_constraints(text: str) -> Constraints:
    """Parse ToolSpec.constraints_json; raises ConstraintsInvalid (run-api can call this at registration)."""
    try:
        raw = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise ConstraintsInvalid(f"constraints_json is not JSON: {exc.msg}") from exc
    try:
        return _CONSTRAINTS.validate_python(raw)
    except ValidationError as exc:
        errors = "; ".join(f"{'/'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors())
        raise ConstraintsInvalid(f"constraints_json is invalid: {errors}") from exc


def check_constraints(constraints: Constraints, args: Any) -> list[Violation]:
    """Every violation of every rule, in rule order (empty when the arguments comply)."""
    found: list[Violation] = []
    for rule in constraints.rules:
        for path, value in _select(args, rule.arg):
            problem = _CHECKS[type(rule)](rule, value)
            if problem is not None:
                found.append(Violation(path, rule.kind, problem))
    return found


# -- JSON pointers -----------------------------------------------------------------------------
def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _select(doc: Any, pointer: str) -> Iterator[tuple[str, Any]]:
    """(concrete path, value) for every value the pointer selects; arrays at the end are expanded."""
    tokens = [_unescape(t) for t in pointer.split("/")[1:]] if pointer else []

    def walk(node: Any, i: int, path: str) -> Iterator[tuple[str, Any]]:
        if i == len(tokens):
            if isinstance(node, list):
                for k, item in enumerate(node):
                    yield f"{path}/{k}", item
            else:
                yield path, node
            return
        token = tokens[i]
        if token == "*":
            if isinstance(node, list):
                for k, item in enumerate(node):
                    yield from walk(item, i + 1, f"{path}/{k}")
            elif isinstance(node, dict):
                for key in sorted(node):
                    yield from walk(node[key], i + 1, f"{path}/{_escape(key)}")
        elif isinstance(node, dict) and token in node:
            yield from walk(node[token], i + 1, f"{path}/{_escape(token)}")
        elif isinstance(node, list) and _DECIMAL_DIGITS.fullmatch(token) and int(token) < len(node):
            yield from walk(node[int(token)], i + 1, f"{path}/{token}")

    yield from walk(doc, 0, "")


# -- hosts -----------------------------------------------------------------------------------------
class HostInvalid(ValueError):
    """A host name that cannot be normalised with certainty."""


def _ipv4_number(part: str) -> int:
    # WHATWG URL host parsing: 0x.. is hex, a leading 0 is octal, else decimal. ASCII digits only:
    # int() alone would also take a sign, '_', spaces and non-ASCII digits.
    if _HEX_NUMBER.fullmatch(part):
        return int(part[2:] or "0", 16)
    if len(part) > 1 and part.startswith("0"):
        if not _OCTAL_DIGITS.fullmatch(part[1:]):
            raise ValueError(f"{part!r} is not an octal number")
        return int(part[1:], 8)
    if not _DECIMAL_DIGITS.fullmatch(part):
        raise ValueError(f"{part!r} is not a number")
    return int(part)


def _whatwg_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address a browser-style URL parser reads `host` as (127.1, 0x7f.0.0.1, 2130706433), or None."""
    parts = host.split(".")
    if parts[-1] == "" and len(parts) > 1:
        parts = parts[:-1]
    last = parts[-1]
    if not (_DECIMAL_DIGITS.fullmatch(last) or _HEX_NUMBER.fullmatch(last)):
        return None  # a name, not a number
    if len(parts) > 4:
        raise HostInvalid(f"{host!r} looks like an IPv4 address but has more than four parts")
    try:
        numbers = [_ipv4_number(p) for p in parts]
    except ValueError:
        raise HostInvalid(f"{host!r} looks like an IPv4 address but is not a valid one") from None
    if any(n > 255 for n in numbers[:-1]) or numbers[-1] >= 256 ** (5 - len(numbers)):
        raise HostInvalid(f"{host!r} is out of range for an IPv4 address")
    value = numbers[-1]
    for k, n in enumerate(numbers[:-1]):
        value += n * 256 ** (3 - k)
    return ipaddress.IPv4Address(value)


Host = str | ipaddress.IPv4Address | ipaddress.IPv6Address


def normalise_host(host: str) -> Host:
    """A DNS name as lowercase ASCII (IDNA, UTS #46) without a trailing dot, or an IP address."""
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise HostInvalid(f"{host!r} is not a valid IPv6 literal") from None
    if "%" in host:
        raise HostInvalid(f"{host!r} contains percent-encoding")
    if host.endswith("."):
        host = host[:-1]
    if not host:
        raise HostInvalid("the host is empty")
    if host.isascii():
        name = host.lower()
    else:
        # Mapped to ASCII before the IPv4 test, as a URL parser does: '１２７.０.０.１' is 127.0.0.1.
        try:
            name = idna.encode(host, uts46=True).decode("ascii")
        except idna.IDNAError as exc:
            raise HostInvalid(f"{host!r} is not a valid internationalised domain name ({exc})") from None
    ip = _whatwg_ipv4(name)
    if ip is not None:
        return ip
    if not _ASCII_HOST.match(name) or any(len(label) > 63 for label in name.split(".")):
        raise HostInvalid(f"{host!r} is not a valid host name")
    return name


def _is_local_name(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost") or "." not in name


def host_allowed(host: Host, patterns: list[str]) -> bool:
    """Whether a normalised host matches an allowlist: exact names, '*.domain', IPs, CIDRs, or '*'.

    IP literals match only listed IPs or networks; '*' matches DNS names but not IP literals,
    localhost or single-label (intranet) names — those must be listed by name.
    """
    for pattern in patterns:
        p = pattern.strip()
        if isinstance(host, str):
            if p == "*":
                if not _is_local_name(host):
                    return True
            elif p.startswith("*."):
                try:
                    domain = normalise_host(p[2:])
                except HostInvalid:
                    continue
                if isinstance(domain, str) and host.endswith("." + domain):
                    return True
            else:
                try:
                    if normalise_host(p) == host:
                        return True
                except HostInvalid:
                    continue
        else:
            try:
                if "/" in p and host in ipaddress.ip_network(p, strict=False):
                    return True
                if "/" not in p and ipaddress.ip_address(p.strip("[]")) == host:
                    return True
            except ValueError:
                continue
    return False


# -- the checks ----------------------------------------------------------------------------------
def _split_authority(authority: str) -> tuple[str, str | None]:
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise HostInvalid("unterminated IPv6 literal")
        host, rest = authority[: end + 1], authority[end + 1:]
        if rest and not rest.startswith(":"):
            raise HostInvalid("junk after the IPv6 literal")
        return host, rest[1:] if rest else None
    host, sep, port = authority.rpartition(":")
    return (host, port) if sep else (authority, None)


def check_url(rule: EgressRule, value: Any) -> str | None:
    if not isinstance(value, str):
        return "the value is not a URL string"
    if len(value) > _MAX_TEXT:
        return "the URL is too long"
    if _CONTROL_OR_SPACE.search(value) or "\\" in value:
        return "the URL contains whitespace, control characters or backslashes"
    scheme, sep, rest = value.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return "the value is not an absolute URL (scheme://host/...)"
    scheme = scheme.lower()
    if scheme not in rule.schemes:
        return f"scheme {scheme!r} is not allowed (allowed: {', '.join(rule.schemes)})"
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        return "URLs with user information (user@host) are not allowed"
    try:
        raw_host, port_text = _split_authority(authority)
        host = normalise_host(raw_host)
    except HostInvalid as exc:
        return str(exc)
    if port_text is not None and port_text != "":
        if not _DECIMAL_DIGITS.fullmatch(port_text) or not 0 < int(port_text) < 65536:
            return f"port {port_text!r} is not a valid port"
        port = int(port_text)
    else:
        port = 443 if scheme == "https" else 80
    if not host_allowed(host, rule.hosts):
        return f"host {str(host)!r} is not on the egress allowlist ({', '.join(rule.hosts)})"
    if rule.ports is not None and port not in rule.ports:
        return f"port {port} is not allowed (allowed: {', '.join(map(str, rule.ports))})"
    return None


def _norm_path(path: str) -> str:
    norm = posixpath.normpath(path)
    return "/" + norm.lstrip("/") if norm.startswith("//") else norm


def check_path(rule: PathPrefixRule, value: Any) -> str | None:
    if not isinstance(value, str):
        return "the value is not a path string"
    if "\x00" in value or "\\" in value:
        return "the path contains a NUL byte or a backslash"
    if not value:
        return "the path is empty"
    if not value.startswith("/"):
        if rule.base is None:
            return "the path must be absolute"
        value = posixpath.join(rule.base, value)
    norm = _norm_path(value)
    for prefix in rule.prefixes:
        p = _norm_path(prefix)
        if p == "/" or norm == p or norm.startswith(p + "/"):
            return None
    return f"path {norm!r} (normalised) is not under {', '.join(rule.prefixes)}"


def _amount(value: Any) -> Decimal | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        amount = Decimal(repr(value))
        return amount if amount.is_finite() else None
    if isinstance(value, str) and len(value) <= 64 and _DECIMAL.match(value):
        try:
            return Decimal(value)
        except InvalidOperation:
            return None
    return None


def check_amount(rule: MaxAmountRule, value: Any) -> str | None:
    amount = _amount(value)
    if amount is None:
        return f"{value!r} is not a plain number (digits, an optional '-' and decimal point)"
    if amount > rule.max:
        return f"amount {amount} exceeds the ceiling {rule.max}"
    if amount < rule.min:
        return f"amount {amount} is below the minimum {rule.min}"
    return None


def _split_recipients(value: str) -> list[str] | str:
    """Top-level ',' / ';' separated parts, or why the value cannot be read with certainty."""
    parts: list[str] = []
    current: list[str] = []
    quoted = angle = False
    for ch in value:
        if ch == '"' and not angle:
            quoted = not quoted
        elif ch == "<" and not quoted:
            if angle:
                return "nested '<'"
            angle = True
        elif ch == ">" and not quoted:
            if not angle:
                return "unbalanced '>'"
            angle = False
        elif ch in "()" and not quoted:
            return "comments in parentheses are not allowed"
        if ch in ",;" and not quoted and not angle:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if quoted or angle:
        return "an unterminated quote or '<'"
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _address_of(part: str) -> tuple[str, str] | str:
    """(local, domain) of one recipient: 'a@b' or 'Display Name <a@b>' or '"Display" <a@b>'."""
    m = re.fullmatch(r'(?P<display>.*?)\s*<(?P<addr>[^<>]*)>', part, flags=re.S)
    if m:
        display = m.group("display").strip()
        if display.startswith('"') and display.endswith('"') and len(display) >= 2:
            display = display[1:-1]
            if '"' in display or "\\" in display:
                return "escapes in a quoted display name are not allowed"
        elif not _DISPLAY_ATOMS.match(display):
            return f"display name {display!r} has special characters; quote it"
        if "@" in display:
            return f"display name {display!r} looks like an address (ambiguous)"
        addr = m.group("addr").strip()
    else:
        addr = part
    local, sep, domain = addr.rpartition("@")
    if not sep or not local or not domain or "@" in local or not _LOCAL_PART.match(local) or "[" in domain:
        return f"{addr!r} is not a plain address (local@domain; no quoted parts or domain literals)"
    return local, domain


def check_recipients(rule: RecipientsRule, value: Any) -> str | None:
    if not isinstance(value, str):
        return "the value is not an address string"
    if len(value) > _MAX_TEXT or re.search(r"[\x00-\x1f\x7f]", value):
        return "the value is too long or contains control characters"
    parts = _split_recipients(value)
    if isinstance(parts, str):
        return f"recipients cannot be read with certainty: {parts}"
    if not parts:
        return "no recipient address"
    allowed_addresses = set()
    for a in rule.addresses:
        parsed = _address_of(a)
        if isinstance(parsed, tuple):
            try:
                allowed_addresses.add(f"{parsed[0].lower()}@{normalise_host(parsed[1])}")
            except HostInvalid:
                continue
    for part in parts:
        parsed = _address_of(part)
        if isinstance(parsed, str):
            return parsed
        local, domain = parsed
        try:
            host = normalise_host(domain)
        except HostInvalid as exc:
            return f"recipient domain: {exc}"
        if not isinstance(host, str):
            return f"recipient {part!r} uses an IP address, not a domain"
        address = f"{local.lower()}@{host}"
        if address in allowed_addresses:
            continue
        if _is_local_name(host) or not host_allowed(host, [d for d in rule.domains if d.strip() != "*"]):
            return f"recipient {address!r} is not on the allowlist"
    return None


_CHECKS: dict[type, Any] = {
    EgressRule: check_url,
    PathPrefixRule: check_path,
    MaxAmountRule: check_amount,
    RecipientsRule: check_recipients,
}
