"""The working context as sent to a provider: every tool call answered, no orphan tool results."""

from __future__ import annotations

from collections.abc import Sequence

from tether_planner.domain.messages import ChatMessage
from tether_planner.domain.tool_results import wrap_tool_result

NO_RESULT = {"detail": "no result has been recorded for this call"}


def for_request(messages: Sequence[ChatMessage], *, max_chars: int = 2000) -> list[ChatMessage]:
    """Providers refuse a tool call without a result (and a result without its call): add a
    'no result' placeholder after each turn's results for unanswered calls, and drop orphans."""
    out: list[ChatMessage] = []
    open_calls: dict[str, ChatMessage] = {}
    open_turn: ChatMessage | None = None

    def close_turn() -> None:
        nonlocal open_turn
        if open_turn is None:
            return
        for ref in open_turn.tool_calls:
            if ref.id in open_calls:
                out.append(
                    ChatMessage(
                        role="tool",
                        content=wrap_tool_result(
                            tool_name=ref.name,
                            call_id=ref.call_id or ref.id,
                            status="pending",
                            content=NO_RESULT,
                            untrusted=False,
                            max_chars=max_chars,
                        ),
                        tool_call_id=ref.id,
                        tool_name=ref.name,
                        call_id=ref.call_id,
                        step=open_turn.step,
                    )
                )
        open_calls.clear()
        open_turn = None

    for m in messages:
        if m.role == "tool":
            if m.tool_call_id in open_calls:
                del open_calls[m.tool_call_id]
                out.append(m)
            continue
        if m.role == "assistant" or open_turn is not None:
            # A tool result can only follow its own turn's results; anything else closes the turn.
            close_turn()
        out.append(m)
        if m.role == "assistant" and m.tool_calls:
            open_turn = m
            open_calls = {c.id: m for c in m.tool_calls}
    close_turn()
    return out
