"""JSON Schema `format` checks for tool arguments: written here, stdlib only, so a verdict never depends on what is installed.

jsonschema only annotates `format` unless given a FormatChecker, and the checkers it ships depend on
optional packages (`uri` needs rfc3987 or rfc3986-validator, `date-time` rfc3339-validator, ...):
with one missing the format passes unchecked, and which one it uses changes with what else is
installed. A policy decision must re-derive identically on every host and after every upgrade, so
each format asserted here is checked by a function below, after the RFC the JSON Schema 2020-12
validation spec names for it (section 7.3), and nothing else.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

_A = re.ASCII

# -- email: RFC 5321 section 4.1.2 Mailbox (Local-part "@" (Domain / address-literal)) --------------
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_DOT_STRING = rf"{_ATEXT}+(?:\.{_ATEXT}+)*"
_QUOTED_STRING = r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\x20-\x7e])*"'
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DOMAIN = rf"{_LABEL}(?:\.{_LABEL})*"
_MAILBOX = re.compile(rf"(?P<local>{_DOT_STRING}|{_QUOTED_STRING})@(?:(?P<domain>{_DOMAIN})|\[(?P<literal>[^\[\]\\]+)\])",
                      _A)


def is_email(value: str) -> bool:
    m = _MAILBOX.fullmatch(value)
    if m is None or len(m["local"]) > 64:  # RFC 5321 4.5.3.1.1
        return False
    if m["domain"] is not None:
        return len(m["domain"]) <= 255  # 4.5.3.1.2
    literal = m["literal"]
    if literal[:5].lower() == "ipv6:":
        return is_ipv6(literal[5:])
    return is_ipv4(literal)  # a General-address-literal (tag:content) names no standard address: refused


# -- ipv4 (RFC 2673 section 3.2 dotted-quad) and ipv6 (RFC 4291 section 2.2) --------------------------
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DOTTED_QUAD = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}", _A)
_IPV6_TEXT = re.compile(r"[0-9A-Fa-f:.]+", _A)


def is_ipv4(value: str) -> bool:
    return _DOTTED_QUAD.fullmatch(value) is not None  # no leading zeros, ASCII digits only


def is_ipv6(value: str) -> bool:
    # Hex groups, "::" and a trailing dotted quad only: no zone id ("%eth0"), no spaces.
    if _IPV6_TEXT.fullmatch(value) is None:
        return False
    if "." in value and not is_ipv4(value.rsplit(":", 1)[-1]):
        return False
    try:
        ipaddress.IPv6Address(value)
    except ValueError:
        return False
    return True


# -- uri: RFC 3986 section 3 (an absolute URI with a scheme; a relative reference is not one) ----------
_UNRESERVED = r"A-Za-z0-9\-._~"
_SUB_DELIMS = r"!$&'()*+,;="
_PCT = r"%[0-9A-Fa-f]{2}"
_PCHAR = rf"(?:[{_UNRESERVED}{_SUB_DELIMS}:@]|{_PCT})"
_SEGMENT = rf"{_PCHAR}*"
_SEGMENT_NZ = rf"{_PCHAR}+"
_USERINFO = rf"(?:[{_UNRESERVED}{_SUB_DELIMS}:]|{_PCT})*"
_REG_NAME = rf"(?:[{_UNRESERVED}{_SUB_DELIMS}]|{_PCT})*"
_AUTHORITY = rf"(?:{_USERINFO}@)?(?:\[(?P<ip_literal>[^\[\]/?#@]*)\]|{_REG_NAME})(?::[0-9]*)?"
_HIER_PART = (rf"(?://{_AUTHORITY}(?:/{_SEGMENT})*"  # "//" authority path-abempty
              rf"|/(?:{_SEGMENT_NZ}(?:/{_SEGMENT})*)?"  # path-absolute
              rf"|{_SEGMENT_NZ}(?:/{_SEGMENT})*"  # path-rootless
              r"|)")  # path-empty
_QUERY_OR_FRAGMENT = rf"(?:{_PCHAR}|[/?])*"
_URI = re.compile(rf"[A-Za-z][A-Za-z0-9+\-.]*:{_HIER_PART}(?:\?{_QUERY_OR_FRAGMENT})?(?:#{_QUERY_OR_FRAGMENT})?", _A)
_IPV_FUTURE = re.compile(rf"[vV][0-9A-Fa-f]+\.[{_UNRESERVED}{_SUB_DELIMS}:]+", _A)


def is_uri(value: str) -> bool:
    m = _URI.fullmatch(value)
    if m is None:
        return False
    literal = m["ip_literal"]
    return literal is None or is_ipv6(literal) or _IPV_FUTURE.fullmatch(literal) is not None


# -- date, time, date-time: RFC 3339 section 5.6 ---------------------------------------------------
_FULL_DATE = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})", _A)
_FULL_TIME = re.compile(r"([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.[0-9]+)?(?:[Zz]|([+-])([0-9]{2}):([0-9]{2}))", _A)


def _days_in(year: int, month: int) -> int:
    if month == 2:
        return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def is_date(value: str) -> bool:
    m = _FULL_DATE.fullmatch(value)
    if m is None:
        return False
    year, month, day = (int(g) for g in m.groups())
    return 1 <= month <= 12 and 1 <= day <= _days_in(year, month)


def is_time(value: str) -> bool:
    m = _FULL_TIME.fullmatch(value)
    if m is None:
        return False
    hour, minute, second = int(m[1]), int(m[2]), int(m[3])
    offset_hours, offset_minutes = int(m[5] or 0), int(m[6] or 0)
    if hour > 23 or minute > 59 or second > 60 or offset_hours > 23 or offset_minutes > 59:
        return False
    if second == 60:  # a leap second is only ever inserted at 23:59:60 UTC
        utc = (hour * 60 + minute + (-1 if m[4] == "+" else 1) * (offset_hours * 60 + offset_minutes)) % (24 * 60)
        return utc == 23 * 60 + 59
    return True


def is_date_time(value: str) -> bool:
    date, sep, time = value[:10], value[10:11], value[11:]
    return sep in ("T", "t") and is_date(date) and is_time(time)


# -- uuid: RFC 4122 section 3 ----------------------------------------------------------------------
_UUID = re.compile(r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}", _A)


def is_uuid(value: str) -> bool:
    return _UUID.fullmatch(value) is not None


#: Every format the gateway can assert, by its JSON Schema name. A format not listed stays an
#: annotation. Adding one, or changing what one accepts, changes decisions: only with a new policy
#: version (a policy document lists the formats it asserts, docs/policy.md).
FORMAT_CHECKS: dict[str, Callable[[str], bool]] = {
    "date": is_date,
    "date-time": is_date_time,
    "email": is_email,
    "ipv4": is_ipv4,
    "ipv6": is_ipv6,
    "time": is_time,
    "uri": is_uri,
    "uuid": is_uuid,
}
