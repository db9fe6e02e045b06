"""LoopGuard: tells an unproductive loop from hard work using per-step signatures (safety notes §C4).

A step's signature is computed by the budget service from the log, never by the model:
for each tool call `a` = tool name + canonical JSON arguments (never normalised: a new page
number or quantity is a new call), `o` = hash of the normalised result (timestamps, uuids, ids,
measured durations, epochs named as times replaced: docs/loop-detection.md), `e` = error class
(a denial is `denied:<reason>`); for a text-only turn `m` = hash of the assistant text. The rules
run after every step; the first detection yields a one-time warning, any later detection terminates.

What counts as volatile is versioned (`LOOP_RULES`): a run is judged from start to end by the rules
it was accepted under (`LoopGuardState.rules`, named on its RunAccepted), so an upgrade does not
change a running run's verdicts and an auditor replays each run by the rules it names.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

EXCERPT_CHARS = 200

# A number shaped like a Unix time from 2001 to 2033 (seconds, milli-, micro- or nanoseconds).
_EPOCH = re.compile(r"\b(1\d{9}(?:\d{3}|\d{6}|\d{9})?)(\.\d+)?\b")
_DURATION = re.compile(r"\b\d+(\.\d+)?\s?(ns|us|µs|ms|s|sec|secs|second|seconds|min|mins|minute|minutes)\b", re.I)
# The word (and the one before it) just before a number, and how it is attached: `key=`, `"key":`,
# `key: ` or a space. Searched in a bounded window, so a long token costs no backtracking.
_CONTEXT_CHARS = 48
_CONTEXT = re.compile(r"(?:([A-Za-z][\w.-]*)\s+)?([A-Za-z][\w.-]*)(\"?\s*[=:]\s*\"?|\s+)$")
# Names (or a name's last snake_case part: created_at, lastModified) that say a point in time.
_TIME_NAMES = frozenset(
    {
        "time", "timestamp", "ts", "t", "date", "datetime", "epoch", "unix", "now", "at",
        "since", "until", "expires", "expiry", "exp", "iat", "nbf", "deadline",
        "created", "updated", "modified", "started", "finished", "completed", "issued", "seen",
    }
)  # fmt: skip
# Words after which a duration is a measurement, not an instruction: `took 3 s`, `uptime 5 min`;
# and verbs that make `in`/`after` a measurement: `finished in 41 s` (but `retry in 5 min`).
_MEASURED = frozenset({"uptime", "spent", "waited"})
_DONE = frozenset(
    {"finished", "completed", "done", "ran", "executed", "returned", "responded", "succeeded", "passed", "failed"}
)
_SUBSECOND_UNITS = frozenset({"ns", "us", "µs", "ms"})
_SECOND_UNITS = frozenset({"s", "sec", "secs", "second", "seconds"})


def _context(m: re.Match[str]) -> tuple[str | None, str | None, bool]:
    """The word before the matched number, the word before that, and whether it is a key (`=`/`:`)."""
    window = m.string[max(0, m.start() - _CONTEXT_CHARS) : m.start()]
    found = _CONTEXT.search(window)
    if found is None:
        return None, None, False
    before, word, sep = found.groups()
    return word, before, any(c in sep for c in "=:")


def _time_name(word: str) -> bool:
    name = _UNIT_SUFFIX.sub("", _key_name(word).strip("_"))
    return name.rsplit("_", 1)[-1] in _TIME_NAMES


def _epoch(m: re.Match[str]) -> str:
    """A Unix time is volatile when it looks like a clock reading, not merely like ten digits: a
    fraction (1717171717.25), or a name saying time before it (`"expires_at": 1717171717`,
    `since 1717171717`). After `at` (`call us at 1234567890`) only the milli/micro/nanosecond
    widths count: a phone number never has 13, 16 or 19 digits starting with 1."""
    digits, fraction = m.groups()
    if fraction:
        return "<epoch>"
    word, _, keyed = _context(m)
    if word is None or not _time_name(word):
        return m.group()
    if not keyed and word.lower() == "at" and len(digits) == 10:
        return m.group()
    return "<epoch>"


def _duration(m: re.Match[str]) -> str:
    """A duration is volatile when it was measured: a sub-second unit (`35ms`), seconds with a
    fraction (`3.2s`), or after a word saying it was measured (`took 3 s`, `elapsed: 2 min`,
    `finished in 41 s`). A whole number of seconds or minutes otherwise is a value the call means
    (`retry in 5 min`, `cached for 30 s`) and stays."""
    fraction, unit = m.groups()
    unit = unit.lower()
    if unit in _SUBSECOND_UNITS or (fraction and unit in _SECOND_UNITS):
        return "<duration>"
    word, before, _ = _context(m)
    if word is None:
        return m.group()
    if _volatile_key(word) or _key_name(word) in _MEASURED:
        return "<duration>"
    if word.lower() in ("in", "after") and before is not None and before.lower() in _DONE:
        return "<duration>"
    return m.group()


Replacement = tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]


def _volatile_patterns(epoch: Replacement, duration: Replacement, named_ids: bool) -> tuple[Replacement, ...]:
    """Volatile substrings that change between otherwise identical observations, applied in order:
    whole date-times first, so their digits are never read as bare numbers. Only the pieces the
    rules versions disagree on are parameters."""
    return (
        (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I), "<uuid>"),
        (
            re.compile(
                r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?\b", re.I
            ),
            "<time>",
        ),
        (re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b"), "<time>"),
        epoch,
        duration,
        # A process id is a number ("Process started" / "Process exited" are states, not ids).
        (re.compile(r"\b(?:pid|process)[=: ]+\d+\b", re.I), "<id>"),
        (re.compile(r"\b(?:request[_ -]?id|trace[_ -]?id)[=: ]+\w+", re.I), "<id>"),
        # A value named for being new on every call (as the keys below): a retry with a fresh nonce is a repeat.
        *([(re.compile(r"\b(?:nonce|etag|span[_ -]?id)\s*[=:]\s*[\"']?[\w-]+", re.I), "<id>")] if named_ids else []),
        (re.compile(r"\b0x[0-9a-f]{6,}\b", re.I), "<addr>"),
    )


# The loop guard's rules versions: what each replaces in an observation's text. A version, once
# released, never changes (runs recorded under it are judged and audited by it); a change of
# normalisation is a new version, and `CURRENT_RULES` the one new runs get (docs/loop-detection.md).
LOOP_RULES: dict[int, tuple[Replacement, ...]] = {
    # Until bd39882: every number with a time unit was a duration and every 10/13/16/19-digit
    # number starting with 1 an epoch ("retry in 5 min" = "retry in 30 min"); text nonces were kept.
    1: _volatile_patterns((_EPOCH, "<epoch>"), (_DURATION, "<duration>"), named_ids=False),
    # Since bd39882: only measured durations and epochs named as times; `nonce=`/`ETag:`/`span-id:` are ids.
    2: _volatile_patterns((_EPOCH, _epoch), (_DURATION, _duration), named_ids=True),
}
CURRENT_RULES = 2


class UnknownLoopRules(ValueError):
    """A rules version this code does not have (a run recorded by a newer budget)."""

    def __init__(self, rules: int) -> None:
        super().__init__(f"loop guard rules version {rules} is unknown (known: {sorted(LOOP_RULES)})")
        self.rules = rules

# JSON object keys whose values are volatile by name.
_VOLATILE_KEYS = frozenset(
    {
        "timestamp", "ts", "time", "date", "datetime", "now",
        "created_at", "updated_at", "started_at", "finished_at", "completed_at",
        "duration", "duration_ms", "elapsed", "elapsed_ms", "latency", "latency_ms", "took", "took_ms",
        "pid", "request_id", "requestid", "trace_id", "traceid", "span_id", "etag", "nonce",
    }
)  # fmt: skip

# A unit at the end of a key names the same volatile value: duration_ms, elapsedSeconds, ts_ns.
_UNIT_SUFFIX = re.compile(r"_(?:ns|us|µs|ms|s|sec|secs|seconds|millis|micros|nanos|msec|usec|nsec)$")
_CAMEL_HUMP = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def _key_name(key: str) -> str:
    """A JSON key in one spelling: camelCase, kebab-case and dotted keys as snake_case, lower case."""
    return re.sub(r"[-.\s]+", "_", _CAMEL_HUMP.sub("_", key)).lower()


def _volatile_key(key: str) -> bool:
    name = _key_name(key)
    return name in _VOLATILE_KEYS or _UNIT_SUFFIX.sub("", name) in _VOLATILE_KEYS


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _excerpt(text: str) -> str:
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 1] + "…"


def canonical_action(tool_name: str, args_json: str) -> str:
    """`a`: the tool name with canonical JSON arguments (key order and whitespace do not matter).
    No value is normalised: arguments are the model's choice, so `{"page": 3}` after `{"page": 2}`
    or `{"wait": "30 min"}` after `"5 min"` is another call (docs/loop-detection.md)."""
    try:
        args = json.dumps(json.loads(args_json), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        args = " ".join(args_json.split())
    return f"{tool_name}({args})"


def _drop_volatile_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_volatile_keys(v) for k, v in value.items() if not _volatile_key(k)}
    if isinstance(value, list):
        return [_drop_volatile_keys(v) for v in value]
    return value


def normalise_observation(text: str, rules: int = CURRENT_RULES) -> str:
    """The observation with volatile keys and substrings removed (as rules version `rules` says), so
    reruns compare equal."""
    patterns = LOOP_RULES.get(rules)
    if patterns is None:
        raise UnknownLoopRules(rules)
    try:
        parsed = json.loads(text)
    except ValueError:
        normalised = text
    else:
        normalised = json.dumps(_drop_volatile_keys(parsed), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for pattern, replacement in patterns:
        normalised = pattern.sub(replacement, normalised)
    return " ".join(normalised.split())


class CallSignature(BaseModel):
    """The signature of one tool call with its outcome."""

    model_config = ConfigDict(frozen=True)

    action: str = Field(description="Hash of the canonical action a.")
    label: str = Field(description="The canonical action, shortened, for warnings and reports.")
    observation: str = Field(description="Hash of the normalised observation o (result or error).")
    error: str | None = Field(None, description="Error class e, or None when the call succeeded.")
    excerpt: str = Field("", description="Start of the observation, for warnings and reports.")
    pollable: bool = False

    @property
    def denied(self) -> bool:
        return self.error is not None and self.error.startswith("denied:")


def call_signature(
    tool_name: str,
    args_json: str,
    *,
    observation: str,
    error: str | None = None,
    pollable: bool = False,
    rules: int = CURRENT_RULES,
) -> CallSignature:
    """Sign a finished tool call: `observation` is the result JSON, or the error text for failures;
    `rules` is the run's loop guard rules version."""
    action = canonical_action(tool_name, args_json)
    normalised = normalise_observation(observation, rules)
    return CallSignature(
        action=_hash(action),
        label=_excerpt(action),
        observation=_hash(f"{error or ''}\x1f{normalised}"),
        error=error,
        excerpt=_excerpt(observation),
        pollable=pollable,
    )


class StepSignature(BaseModel):
    """The signature of one step: its tool calls in call order, or the text of a text-only turn.
    Frozen (a value): the guard's history shares it between a ledger and its working copy."""

    model_config = ConfigDict(frozen=True)

    step: int
    calls: tuple[CallSignature, ...] = ()
    text: str | None = Field(None, description="m: hash of the assistant text, for a text-only turn.")
    novel: bool = Field(False, description="Set by the guard: some (a, o) pair of the step was new to the run.")

    @property
    def text_only(self) -> bool:
        return not self.calls

    @property
    def action(self) -> str:
        return _hash("\n".join(c.action for c in self.calls))

    @property
    def outcome(self) -> str:
        """The step's (a, o) identity."""
        return _hash("\n".join(f"{c.action}:{c.observation}" for c in self.calls))

    @property
    def error(self) -> str | None:
        if all(c.error is None for c in self.calls):
            return None
        return ";".join(c.error or "-" for c in self.calls)

    @property
    def pollable(self) -> bool:
        return any(c.pollable for c in self.calls)

    @property
    def label(self) -> str:
        return _excerpt(", ".join(c.label for c in self.calls)) if self.calls else "(text-only turn)"

    @property
    def excerpt(self) -> str:
        return self.calls[0].excerpt if self.calls else ""


def text_step(step: int, assistant_text: str) -> StepSignature:
    """The signature of a text-only turn."""
    return StepSignature(step=step, text=_hash(" ".join(assistant_text.split())))


class LoopRule(StrEnum):
    """The detection rules; values are stable, machine-readable names used in reports and metrics."""

    REPEAT = "R1_REPEAT"
    REPEAT_ERROR = "R2_REPEAT_ERROR"
    REPEATED_DENIAL = "R2B_REPEATED_DENIAL"
    MONOLOGUE = "R3_MONOLOGUE"
    CYCLE = "R4_CYCLE"
    NO_PROGRESS = "R5_NO_PROGRESS"


class Detection(BaseModel):
    """One firing of a rule, with what a human (or the model) needs to understand it."""

    model_config = ConfigDict(frozen=True)

    rule: LoopRule
    step: int
    count: int = Field(description="Repetitions (or window length) that made the rule fire.")
    period: int | None = None
    action: str = Field(description="The repeated action(s), shortened.")
    excerpt: str = ""
    error: str | None = None

    def warning(self) -> str:
        """The deterministic one-time note given to the model with the next grant."""
        act = self.action
        match self.rule:
            case LoopRule.REPEAT:
                what = f"you have called {act} {self.count} times in a row with the identical result \"{self.excerpt}\""
            case LoopRule.REPEAT_ERROR:
                what = f"{act} failed {self.count} times in a row with the same error ({self.error})"
            case LoopRule.REPEATED_DENIAL:
                return (
                    f"Loop warning ({self.rule}): {act} has been denied {self.count} times in this run "
                    f"({self.error}). It will not be allowed; do not propose it again. Change approach or finish."
                )
            case LoopRule.MONOLOGUE:
                return (
                    f"Loop warning ({self.rule}): your last {self.count} turns were text without a tool call. "
                    "Call a tool, or give your final answer."
                )
            case LoopRule.CYCLE:
                what = (
                    f"your last {self.count} steps repeat the same {self.period}-step cycle ({act}) "
                    "with identical results"
                )
            case LoopRule.NO_PROGRESS:
                what = f"your last {self.count} tool steps produced no new information (latest: {act})"
        return f"Loop warning ({self.rule}): {what}. Change approach, ask the user, or finish."

    def summary(self) -> str:
        """One line for a termination report: the rule and the repeated action."""
        period = f", period {self.period}" if self.period else ""
        error = f", error {self.error}" if self.error else ""
        return f"{self.rule} at step {self.step} ({self.count} repetitions{period}{error}): {self.action}"


class Verdict(StrEnum):
    CONTINUE = "CONTINUE"
    WARN = "WARN"
    TERMINATE = "TERMINATE"


class LoopGuardState(BaseModel):
    """What the guard remembers about a run; part of the run's ledger checkpoint, bounded in size."""

    history: list[StepSignature] = Field(default_factory=list, description="Recent counted steps, oldest first.")
    seen_pairs: dict[str, int] = Field(
        default_factory=dict,
        description="(a, o) pairs seen in the run with the step last seen, least recent first (at most "
        "`LoopGuardConfig.pair_memory`).",
    )
    denials: dict[str, int] = Field(
        default_factory=dict, description="Denials per action hash in the run, least recently denied first."
    )
    polls: dict[str, int] = Field(
        default_factory=dict, description="Uncounted poll repeats per step identity, least recently polled first."
    )
    warned: Detection | None = None
    fired: Detection | None = None
    rules: int = Field(
        CURRENT_RULES,
        description="The rules version (`LOOP_RULES`) the run is judged by, fixed when it is accepted: the "
        "signatures in this memory were made by it. A checkpoint written before versions existed is v1 "
        "(`Ledger`).",
    )

    @field_validator("seen_pairs", mode="before")
    @classmethod
    def _pairs_without_steps(cls, value: Any) -> Any:
        # Written before the memory was bounded: a set of every pair (step unknown, order arbitrary).
        return dict.fromkeys(value, 0) if isinstance(value, list | set | frozenset) else value

    def clone(self) -> LoopGuardState:
        """A working copy: the containers copied, their frozen signatures shared (see `Ledger.clone`)."""
        return self.model_copy(
            update={
                "history": list(self.history),
                "seen_pairs": dict(self.seen_pairs),
                "denials": dict(self.denials),
                "polls": dict(self.polls),
            }
        )


@dataclass(frozen=True)
class LoopGuardConfig:
    """Thresholds (the OpenHands defaults, per §C4)."""

    repeat_n: int = 4
    error_n: int = 3
    denial_n: int = 3
    monologue_n: int = 3
    cycle_periods: tuple[int, ...] = (2, 3, 4)
    cycle_repeats: int = 3
    novelty_window: int = 12
    poll_budget: int = 20
    # Run-wide memories, bounded because the state is checkpointed after every record: the
    # least recently seen entries are forgotten first. Exact for runs with fewer distinct
    # (a, o) pairs, denied actions, polled step identities.
    pair_memory: int = 512
    action_memory: int = 128

    @property
    def history_len(self) -> int:
        return max(
            self.repeat_n,
            self.error_n,
            self.monologue_n,
            max(self.cycle_periods, default=0) * self.cycle_repeats,
            self.novelty_window,
        )


class LoopGuard:
    """Evaluates the rules after each step. Pure: all memory is in the `LoopGuardState` passed in."""

    def __init__(self, config: LoopGuardConfig | None = None) -> None:
        self.config = config or LoopGuardConfig()

    def observe(self, state: LoopGuardState, step: StepSignature) -> tuple[Verdict, Detection | None]:
        """Fold one finished step into `state`; the first detection warns, a later one terminates."""
        detection = self._fold(state, step)
        if detection is None:
            return Verdict.CONTINUE, None
        if state.warned is None:
            state.warned = detection
            return Verdict.WARN, detection
        state.fired = detection
        return Verdict.TERMINATE, detection

    # -- folding ------------------------------------------------------------------------------
    def _fold(self, state: LoopGuardState, step: StepSignature) -> Detection | None:
        cfg = self.config
        denial = self._count_denials(state, step)
        if not step.text_only and step.pollable:
            # A poll that repeats a poll seen before counts once per distinct result, within the
            # budget. Only the pollable calls are exempt: the rest of the step still counts (a
            # pollable job_status next to the same fetch every step exempted the fetch too, and
            # the loop ran 25 steps instead of 5).
            polled = tuple(c for c in step.calls if c.pollable)
            key = _hash("\n".join(f"{c.action}:{c.observation}" for c in polled))  # = outcome of a pure poll
            if key in state.polls and state.polls[key] < cfg.poll_budget:
                _touch(state.polls, key, state.polls[key] + 1, cfg.action_memory)
                rest = tuple(c for c in step.calls if not c.pollable)
                if not rest:
                    return denial
                step = step.model_copy(update={"calls": rest})
            else:
                _touch(state.polls, key, state.polls.get(key, 0), cfg.action_memory)
        pairs = sorted({f"{c.action}:{c.observation}" for c in step.calls})
        step = step.model_copy(update={"novel": any(p not in state.seen_pairs for p in pairs)})
        for pair in pairs:
            _touch(state.seen_pairs, pair, step.step, cfg.pair_memory)
        state.history.append(step)
        del state.history[: -cfg.history_len]
        return denial or self._detect(state.history)

    def _count_denials(self, state: LoopGuardState, step: StepSignature) -> Detection | None:
        worst: Detection | None = None
        for call in step.calls:
            if not call.denied:
                continue
            count = state.denials.get(call.action, 0) + 1
            _touch(state.denials, call.action, count, self.config.action_memory)
            if count >= self.config.denial_n and (worst is None or count > worst.count):
                worst = Detection(
                    rule=LoopRule.REPEATED_DENIAL, step=step.step, count=count,
                    action=call.label, excerpt=call.excerpt, error=call.error,
                )  # fmt: skip
        return worst

    # -- rules over the recent history --------------------------------------------------------
    def _detect(self, history: list[StepSignature]) -> Detection | None:
        cfg = self.config
        last = history[-1]
        if last.text_only:
            run = _tail(history, cfg.monologue_n)
            if run and all(s.text_only for s in run):
                return Detection(rule=LoopRule.MONOLOGUE, step=last.step, count=len(run), action=last.label)
            return None

        run = _tail(history, cfg.error_n)
        if run and _tool_steps(run) and last.error is not None and all(
            s.action == last.action and s.error == last.error for s in run
        ):
            return Detection(
                rule=LoopRule.REPEAT_ERROR, step=last.step, count=len(run),
                action=last.label, excerpt=last.excerpt, error=last.error,
            )  # fmt: skip

        run = _tail(history, cfg.repeat_n)
        if run and _tool_steps(run) and all(s.outcome == last.outcome for s in run):
            return Detection(
                rule=LoopRule.REPEAT, step=last.step, count=len(run), action=last.label, excerpt=last.excerpt
            )

        for p in cfg.cycle_periods:
            run = _tail(history, p * cfg.cycle_repeats)
            if not run or not _tool_steps(run):
                continue
            keys = [s.outcome for s in run]
            block = keys[:p]
            if all(keys[i] == block[i % p] for i in range(len(keys))) and _minimal_period(block) == p:
                return Detection(
                    rule=LoopRule.CYCLE, step=last.step, count=len(run), period=p,
                    action=" → ".join(s.label for s in run[:p]), excerpt=last.excerpt,
                )  # fmt: skip

        tool_steps = [s for s in history if not s.text_only][-cfg.novelty_window :]
        if len(tool_steps) == cfg.novelty_window and not any(s.novel for s in tool_steps):
            return Detection(
                rule=LoopRule.NO_PROGRESS, step=last.step, count=cfg.novelty_window,
                action=last.label, excerpt=last.excerpt,
            )  # fmt: skip
        return None


def _touch(memory: dict[str, int], key: str, value: int, limit: int) -> None:
    """Set `key` as the most recent entry of a bounded memory, forgetting the least recent ones."""
    memory.pop(key, None)
    memory[key] = value
    while len(memory) > limit:
        del memory[next(iter(memory))]


def _tail(history: list[StepSignature], n: int) -> list[StepSignature]:
    return history[-n:] if n > 0 and len(history) >= n else []


def _tool_steps(steps: list[StepSignature]) -> bool:
    return all(not s.text_only for s in steps)


def _minimal_period(block: list[str]) -> int:
    n = len(block)
    for d in range(1, n):
        if n % d == 0 and all(block[i] == block[i % d] for i in range(n)):
            return d
    return n
