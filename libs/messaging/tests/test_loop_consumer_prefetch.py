"""The loop's consumer fetches a bounded amount ahead (librdkafka's 64 MiB default is what a lagging consumer holds)."""

from __future__ import annotations

from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.topics import Topics


class Idle:
    """A processor that does nothing (only the loop's client configuration is looked at)."""

    name = "idle"
    inputs = ("p.in",)
    state_codec = None  # no state store: nothing to open or clean up

    def handle(self, msg, ctx) -> None: ...

    def on_work_done(self, done, ctx) -> None: ...

    def on_tick(self, ctx) -> None: ...


def _consumer_config(**config: object) -> dict:
    return ProcessorLoop(Idle(), LoopConfig(bootstrap="127.0.0.1:1", topics=Topics("p."), **config))._consumer_config()


def test_the_consumer_prefetches_a_few_batches_not_librdkafkas_64_mib() -> None:
    assert _consumer_config()["queued.max.messages.kbytes"] == 2048
    assert _consumer_config(consumer_prefetch_kib=512)["queued.max.messages.kbytes"] == 512
    # An explicit librdkafka override still has the last word.
    overridden = _consumer_config(consumer_overrides={"queued.max.messages.kbytes": 65536})
    assert overridden["queued.max.messages.kbytes"] == 65536
