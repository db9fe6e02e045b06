"""Named errors of the messaging layer."""

from __future__ import annotations


class Unprocessable(Exception):
    """A record that can never be handled; the loop sends it to the dead-letter topic.

    `reason` is a stable machine-readable code, `detail` a human explanation.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
