"""An SMTP sink: accepts every message and records from/to/subject/body; delivers nothing.

With `delay_ms`, a message is recorded at once but its "250 OK" comes only after the delay
(a client can die after the mail was taken and before it heard so).
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import threading
from email.message import EmailMessage
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from tether_devservices.recorder import EffectRecorder
from tether_devservices.server import RunningService


def _text_body(msg: EmailMessage) -> str:
    part = msg.get_body(preferencelist=("plain", "html"))
    if part is None:
        return ""
    content = part.get_content()
    return content if isinstance(content, str) else content.decode("utf-8", errors="replace")


def _header(msg: EmailMessage, name: str) -> str:
    # Folded long values come back with the fold's whitespace; the value itself has none at its ends.
    return str(msg.get(name, "")).strip()


class _RecordingHandler:
    def __init__(self, recorder: EffectRecorder, delay_ms: int = 0) -> None:
        self.recorder = recorder
        self.delay_ms = delay_ms

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        raw = envelope.original_content or envelope.content or b""
        if isinstance(raw, str):
            raw = raw.encode("utf-8")
        msg: Any = email.message_from_bytes(raw, policy=email.policy.default)
        self.recorder.record(
            mail_from=envelope.mail_from,
            rcpt_tos=list(envelope.rcpt_tos),
            to=_header(msg, "To"),
            subject=_header(msg, "Subject"),
            body=_text_body(msg),
            message_id=_header(msg, "Message-ID"),
            idempotency_key=_header(msg, "X-Idempotency-Key") or None,
        )
        if self.delay_ms:
            await asyncio.sleep(self.delay_ms / 1000)
        return "250 OK: recorded"


def start_smtp_sink(record: str, host: str = "127.0.0.1", port: int = 0, delay_ms: int = 0) -> RunningService:
    """Start the SMTP sink on a background thread with its own event loop."""
    recorder = EffectRecorder(record, "smtp")
    handler = _RecordingHandler(recorder, delay_ms)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="devservice-smtp", daemon=True)
    thread.start()

    async def _start() -> asyncio.base_events.Server:
        return await loop.create_server(lambda: SMTP(handler, hostname="tether-smtp-sink"), host, port)

    server = asyncio.run_coroutine_threadsafe(_start(), loop).result(timeout=10)
    bound_port = server.sockets[0].getsockname()[1]

    def stop() -> None:
        async def _close() -> None:
            server.close()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(_close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()
        recorder.close()

    return RunningService("smtp", host, bound_port, stop)
