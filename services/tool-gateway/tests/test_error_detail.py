"""A ToolError's text reaches the ledger redacted whole, then shortened: a secret cut in two would match no rule."""

from __future__ import annotations

from tether_security import Redactor
from tether_tool_gateway.domain.errors import DETAIL_INPUT_MAX, ToolError, head_of, tail_of
from tether_tool_gateway.execution import _DETAIL_MAX, error_detail

SECRET = "tok-5d1e9a7c3b2f48e6a0c4d8b2f6e1a9c7"


def _redactor() -> Redactor:
    redactor = Redactor()
    redactor.add_secret(SECRET)
    return redactor


def shows_a_piece(text: str) -> bool:
    return any(SECRET[i:i + 8] in text for i in range(len(SECRET) - 7))


def test_a_detail_is_redacted_before_it_is_shortened():
    # The secret straddles where the detail is cut.
    detail = "e" * (_DETAIL_MAX - 21) + " " + SECRET + " and more"
    shown = error_detail(_redactor(), ToolError("TOOL_ERROR", detail))
    assert len(shown) <= _DETAIL_MAX and not shows_a_piece(shown)


def test_a_tail_keeps_its_end_and_is_redacted_before_it_is_cut():
    # The secret straddles where the tail is cut (its start goes, its end stays).
    tail = "first line\n" + "a " * 400 + SECRET + " " + "z" * (_DETAIL_MAX - 100) + "\nthe last line"
    shown = error_detail(_redactor(), ToolError("TOOL_ERROR", "the server exited; stderr: ", tail=tail))
    assert shown.startswith("the server exited; stderr: …") and shown.endswith("the last line")
    assert len(shown) <= _DETAIL_MAX and not shows_a_piece(shown)


def test_a_captured_tail_cut_at_its_start_loses_its_first_line():
    # Whoever captured it kept the last bytes only: the first line may start inside a secret.
    captured = SECRET[16:].encode() + b" leaked?\nthe error\n"
    assert tail_of(captured, cut=True) == "the error"
    assert tail_of(captured, cut=False) == captured.decode().strip()
    assert tail_of(b"x" * 10 + b"\n" + b"y" * DETAIL_INPUT_MAX, cut=False) == ""  # cut here: no whole line left


def test_a_head_cut_at_the_bound_loses_its_last_token():
    data = b"e " * ((DETAIL_INPUT_MAX - 20) // 2) + SECRET.encode() + b" more"
    head = head_of(data)
    assert head.endswith("e …") and not shows_a_piece(head)
    assert head_of(b"short body") == "short body"
