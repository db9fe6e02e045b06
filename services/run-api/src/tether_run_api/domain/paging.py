"""Page sizes and opaque page tokens (AIP-158): keyset pagination keyed by the last item returned."""

from __future__ import annotations

import base64
import json

from tether_run_api.domain.errors import FieldViolation, InvalidArgument, InvalidPageToken

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
#: Longer than any token this server issues (the longest, an approvals listing's with a 128-character
#: approval id of astral-plane characters escaped by json.dumps, is about 2,200), so a longer one
#: is refused before it is decoded at all.
MAX_TOKEN_CHARS = 4096


def page_size(requested: int, path: str = "page_size") -> int:
    """0 means the default; above the maximum is coerced down (AIP-158); negative is invalid."""
    if requested < 0:
        raise InvalidArgument(FieldViolation(path, "must not be negative"))
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)


def encode_token(listing: str, key: object) -> str:
    """An opaque token resuming `listing` after `key`. The tenant is not in it: it comes from the caller."""
    raw = json.dumps({"l": listing, "k": key}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(token: str, listing: str) -> object | None:
    """The key a token resumes after, None for the first page; InvalidPageToken if it is not ours."""
    if not token:
        return None
    if len(token) > MAX_TOKEN_CHARS:
        raise InvalidPageToken()
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        body = json.loads(raw)
    except (ValueError, RecursionError):
        # ValueError covers bad base64, bad UTF-8 and bad JSON; RecursionError a token nesting
        # arrays or objects deeper than the parser recurses ("[[[[..." fits well under the cap).
        raise InvalidPageToken() from None
    if not isinstance(body, dict) or body.get("l") != listing or "k" not in body:
        raise InvalidPageToken()
    return body["k"]
