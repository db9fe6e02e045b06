"""A processing loop run on a thread, for tests against the real broker."""

from __future__ import annotations

import threading
from typing import Any


class LoopThread:
    """`loop.run(stop_event)` on a thread. What the loop raises lands in `errors`, for the test to
    check (an exception in a thread is otherwise only printed); `stop()` asks it to end and waits,
    bounded. `loop` is anything with `run(stop: threading.Event)` (a ProcessorLoop)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="processor-loop", daemon=True)

    def _run(self) -> None:
        try:
            self.loop.run(self.stop_event)
        except BaseException as exc:  # surfaced through `errors`
            self.errors.append(exc)

    def start(self) -> LoopThread:
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.stop_event.set()
        self.thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self.thread.is_alive()
