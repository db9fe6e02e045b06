"""Scrubbing credentials out of text that is about to be logged or recorded (provider error messages)."""

from __future__ import annotations

import re
from collections.abc import Iterable

REDACTED = "[redacted]"

# Key-shaped strings: OpenAI/Anthropic style keys (also partially masked ones that providers
# echo in 401 messages), bearer tokens, and key=value pairs naming a secret.
_SECRET_SHAPES = re.compile(
    r"\bsk-[A-Za-z0-9_\-\*\.]{6,}"
    r"|\bBearer\s+[A-Za-z0-9_\-\.\*=]+"
    r"|\b(?:api[_-]?key|x-api-key|authorization|token|secret|password)\b\s*[:=]\s*\S+",
    re.IGNORECASE,
)


class Scrubber:
    """Replaces known secret values and secret-shaped strings with a marker."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        # Longest first, so a secret containing another is replaced whole.
        self._secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, REDACTED)
        return _SECRET_SHAPES.sub(REDACTED, text)


def cut_whole(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters for a message that is scrubbed later, without
    the word the cut fell in: a known secret cut in half would no longer match the scrubber."""
    if len(text) <= limit:
        return text
    kept = text[:limit]
    space = max(kept.rfind(" "), kept.rfind("\n"), kept.rfind("\t"))
    return (kept[:space] if space > 0 else "") + " …"
