"""Producing commands to tether.commands.v1 with an idempotent producer, waiting for each acknowledgement."""

from __future__ import annotations

import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any

import structlog
from confluent_kafka import KafkaError, Message, Producer

from tether_contracts.records import Envelope
from tether_messaging.envelopes import headers_for
from tether_messaging.serde import EnvelopeCodec, SingleObjectCodec
from tether_run_api.domain.errors import CommandNotDelivered

log = structlog.get_logger("tether_run_api.kafka")


class KafkaCommandPublisher:
    """CommandPublisher: acks=all, enable.idempotence, key = run id, explicit partition.

    A background thread serves delivery callbacks; `publish` blocks the calling gRPC thread
    until its record is acknowledged, so a SubmitRun answers only once the command is durable.
    """

    def __init__(self, bootstrap: str, topic: str, *, delivery_timeout_ms: int = 10_000,
                 client_id: str = "tether-run-api", extra: dict[str, Any] | None = None,
                 codec: EnvelopeCodec | None = None) -> None:
        self.topic = topic
        self._codec = codec or SingleObjectCodec()
        self._timeout_s = delivery_timeout_ms / 1000.0
        self._producer = Producer({
            "bootstrap.servers": bootstrap,
            "client.id": client_id,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            "delivery.timeout.ms": delivery_timeout_ms,
            "request.timeout.ms": min(delivery_timeout_ms, 5_000),
            "error_cb": self._on_error,
            **(extra or {}),
        })
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="command-producer-poll", daemon=True)
        self._poller.start()

    def _on_error(self, err: KafkaError) -> None:
        log.warning("kafka_client_error", error=err.str(), fatal=err.fatal())

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.1)

    def publish(self, envelope: Envelope, partition: int) -> None:
        done: Future[None] = Future()

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is None:
                done.set_result(None)
            else:
                done.set_exception(CommandNotDelivered(err.str()))

        try:
            self._producer.produce(
                self.topic,
                value=self._codec.encode_value(envelope, self.topic),
                key=envelope.run_id.encode(),
                partition=partition,
                headers=headers_for(envelope),
                on_delivery=on_delivery,
            )
        except BufferError as exc:
            raise CommandNotDelivered("producer queue full") from exc
        except Exception as exc:  # KafkaException from produce(): e.g. unknown partition
            raise CommandNotDelivered(str(exc)) from exc
        try:
            # librdkafka reports every record by delivery.timeout.ms; the margin covers the poll cadence.
            done.result(timeout=self._timeout_s + 2.0)
        except FutureTimeout as exc:
            raise CommandNotDelivered(f"no acknowledgement within {self._timeout_s:g}s") from exc

    def ready(self) -> bool:
        """True while the poll thread runs."""
        return self._poller.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush outstanding records and stop the poll thread."""
        self._producer.flush(timeout_s)
        self._stop.set()
        self._poller.join(timeout=2.0)
