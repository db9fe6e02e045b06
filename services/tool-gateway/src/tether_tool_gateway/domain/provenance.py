"""Where each argument of a call came from, derived by the gateway from the log alone.

Sources, in log order: the run's goal (RunAccepted.goal) and each earlier tool result
(ToolCallCompleted.result_json, its string values). For every string argument (a JSON
pointer): a value of at least MIN_EXACT_CHARS found whole in a source is an exact match; else
every WINDOW-character piece of it found in a source counts towards a partial match. The origin
is the goal if the whole value is in it, else the latest tool result holding the whole value,
else the source covering the most characters, else "model". `untrusted` is true when any
matching source is untrusted, so an approver sees data flowing from a fetched page even when
the goal also mentions it. Results stored out of band (claim checks) or cut to fit the state are
listed as `unsearched`/`truncated`: provenance is evidence for a human, never the boundary.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

#: Shorter values ("en", "10") occur everywhere by chance; they are not attributed.
MIN_EXACT_CHARS = 4
#: Pieces of a longer value are attributed in windows of this many characters.
WINDOW = 8
#: Kept per source and per run in the gateway's state (the changelog must stay small).
SOURCE_MAX_CHARS = 16 * 1024
RUN_SOURCES_MAX_CHARS = 128 * 1024


class Source(BaseModel):
    """Text an argument may have been copied from: the goal or one tool result. Frozen (a value):
    a working copy of the run state shares it with the committed one."""

    model_config = ConfigDict(frozen=True)

    origin: str  # "goal" or "tool:<call_id>"
    tool_name: str = ""
    untrusted: bool = False
    text: str | None = None  # None: not available to search (stored out of band)
    truncated: bool = False
    #: How many of the run's ToolCallRequested the log held when this source was recorded (its
    #: place among the requests); None in a state checkpointed before the field existed (unknown:
    #: `linked_args` does not search it).
    requests_before: int | None = None
    #: The text is a ToolCallFailed's detail (an error message, which may quote the arguments).
    failure: bool = False


def result_text(result_json: str) -> str:
    """The string values (and keys) of a JSON result, newline-separated: what a copy would come from."""
    try:
        value = json.loads(result_json)
    except json.JSONDecodeError:
        return result_json
    return "\n".join(_strings(value))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k in sorted(value):
            yield str(k)
            yield from _strings(value[k])
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif value is not None and not isinstance(value, bool):
        yield json.dumps(value)


def cap_source(source: Source, room: int) -> Source:
    """The source cut to SOURCE_MAX_CHARS and to the room left in the run's budget of text."""
    if source.text is None:
        return source
    limit = max(0, min(SOURCE_MAX_CHARS, room))
    if len(source.text) <= limit:
        return source
    return source.model_copy(update={"text": source.text[:limit], "truncated": True})


#: What separates the links (and other words) of a text: whitespace, quotes, brackets and the
#: characters HTML and Markdown put around a link (`href="…"`, `<…>`, `[…](…)`).
_TOKEN_SEPARATORS = re.compile(r"""[\s"'`<>()\[\]{}|^]+""")


def _all_leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a JSON value with its JSON pointer, strings or not."""
    if isinstance(value, dict):
        for k in sorted(value):
            yield from _all_leaves(value[k], f"{path}/{str(k).replace('~', '~0').replace('/', '~1')}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _all_leaves(v, f"{path}/{i}")
    else:
        yield path, value


def _leaves(value: Any) -> Iterator[tuple[str, str]]:
    """The string leaves: what provenance attributes."""
    return ((path, v) for path, v in _all_leaves(value) if isinstance(v, str))


def request_text(args_json: str) -> str:
    """What a ToolCallRequested's arguments hold, as `linked_args` searches it: the raw JSON text
    and every key and string value decoded (so an escaped spelling is found too)."""
    try:
        decoded = json.loads(args_json)
    except json.JSONDecodeError:
        return args_json
    return "\x00".join([args_json, *_strings(decoded)])


def copied_args(args: Any, sources: Sequence[Source]) -> dict[str, str | None]:
    """For each leaf of the arguments (JSON pointer): the source that holds it as a whole token,
    or None. Only the goal and untrusted results count; deterministic (an input of the decision).

    This is what lets a read-only egress tool follow a link on a tainted run (docs/policy.md,
    "Following links"): a URL the principal gave or a fetched page holds, repeated exactly, carries
    nothing the model composed, so it cannot carry data out. The value must be a whole token of
    the source (`_TOKEN_SEPARATORS`), not just a substring, so the model cannot spell data by
    choosing where to cut a longer URL. Results of trusted tools do not count: the model writes
    what some of them return (a key-value store), so a URL read back from one may carry data.
    Non-string leaves (numbers, booleans, null) and texts that are not searchable (claim checks)
    or were cut to fit the state are not found: the rule fails closed.
    """
    eligible = [s for s in sources if s.text and (s.origin == "goal" or s.untrusted)]
    return _whole_tokens(args, eligible, lambda value, source: True)


def linked_args(args: Any, sources: Sequence[Source], requests: Sequence[str]) -> dict[str, str | None]:
    """`copied_args` as a policy with `taint.strict_link_sources` reads it (docs/policy.md,
    "Following links"): a result counts for a value only if it is an untrusted **completed**
    result, kept whole in the state, and recorded before the first of the run's requests whose
    arguments hold the value (`requests`: each ToolCallRequested's `request_text`, in log order,
    up to the call decided). The goal counts as before.

    Why: a tool that echoes its arguments (a not-found error quoting the id, a search repeating the
    query) hands the model back whatever it composed, so a URL carrying data, sent first to a tool
    without egress, would otherwise come back as a "link the run was given". A result recorded
    before the model first wrote the value cannot be an echo of it. Failure details are error
    messages (they quote arguments, and no page links from one); a result cut to fit the state
    ends where the sizes of earlier results put the cut, which the model can choose, so its last
    token may be a prefix the model picked.
    """
    eligible = [s for s in sources if s.text and (
        s.origin == "goal"
        or (s.untrusted and not s.failure and not s.truncated and s.requests_before is not None))]

    def first_request(value: str) -> int:
        return next((n for n, text in enumerate(requests) if value in text), len(requests))

    return _whole_tokens(args, eligible, lambda value, source: source.origin == "goal" or (
        source.requests_before is not None and source.requests_before <= first_request(value)))


def _whole_tokens(args: Any, eligible: Sequence[Source], counts: Any) -> dict[str, str | None]:
    """For each leaf: the eligible source holding it as a whole token and for which
    `counts(value, source)` holds — the goal first, else the latest — or None."""
    tokens: dict[int, frozenset[str]] = {}

    def tokens_of(i: int) -> frozenset[str]:
        if i not in tokens:
            tokens[i] = frozenset(t for t in _TOKEN_SEPARATORS.split(eligible[i].text or "") if t)
        return tokens[i]

    out: dict[str, str | None] = {}
    for path, value in _all_leaves(args):
        found = None
        if isinstance(value, str) and value:
            holders = [src.origin for i, src in enumerate(eligible) if value in tokens_of(i) and counts(value, src)]
            if holders:
                # The goal first (the principal's own words), else the latest result holding it.
                found = "goal" if "goal" in holders else holders[-1]
        out[path] = found
    return out


def _covered(value: str, grams: set[str]) -> int:
    hit = bytearray(len(value))
    for i in range(len(value) - WINDOW + 1):
        if value[i: i + WINDOW] in grams:
            hit[i: i + WINDOW] = b"\x01" * WINDOW
    return sum(hit)


def provenance(args: Any, sources: Sequence[Source]) -> dict[str, Any]:
    """The provenance map shown to an approver (see the module docstring); deterministic."""
    searchable = [s for s in sources if s.text]
    grams_cache: dict[int, set[str]] = {}

    def grams(i: int) -> set[str]:
        if i not in grams_cache:
            text = searchable[i].text or ""
            grams_cache[i] = {text[k: k + WINDOW] for k in range(len(text) - WINDOW + 1)}
        return grams_cache[i]

    out: dict[str, Any] = {}
    for path, value in _leaves(args):
        if len(value) < MIN_EXACT_CHARS:
            continue
        matches: list[tuple[Source, str, int]] = []
        for i, src in enumerate(searchable):
            if value in (src.text or ""):
                matches.append((src, "exact", len(value)))
            elif len(value) >= WINDOW:
                covered = _covered(value, grams(i))
                if covered:
                    matches.append((src, "partial", covered))
        out[path] = _entry(value, matches)
    unsearched = [s.origin for s in sources if s.text is None]
    truncated = [s.origin for s in sources if s.truncated]
    result: dict[str, Any] = {"args": out}
    if unsearched:
        result["unsearched"] = unsearched
    if truncated:
        result["truncated"] = truncated
    return result


def _entry(value: str, matches: list[tuple[Source, str, int]]) -> dict[str, Any]:
    if not matches:
        return {"origin": "model"}
    exact = [m for m in matches if m[1] == "exact"]
    goal = [m for m in exact if m[0].origin == "goal"]
    if goal:
        primary = goal[0]
    elif exact:
        primary = exact[-1]  # the latest result holding the whole value
    else:
        best = max(m[2] for m in matches)
        primary = [m for m in matches if m[2] == best][-1]
    entry: dict[str, Any] = {
        "origin": primary[0].origin,
        "match": primary[1],
        "untrusted": any(m[0].untrusted for m in matches),
    }
    if primary[1] == "partial":
        entry["covered_chars"] = primary[2]
        entry["chars"] = len(value)
    others = [m[0].origin for m in matches if m is not primary]
    if others:
        entry["also"] = others
    return entry
