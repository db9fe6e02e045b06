"""The bench's profile summaries: py-spy's collapsed stacks, and a real Flight Recording of the broker."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer

from tether_bench.profile import summarise, summarise_jfr


def test_py_spy_stacks_are_summarised_own_and_inclusive(tmp_path: Path) -> None:
    raw = tmp_path / "profile-budget.txt"
    raw.write_text("main (a.py:1);handle (b.py:2);encode (c.py:3) 30\nmain (a.py:1);handle (b.py:9) 10\n")
    summary = summarise(raw)
    assert "40 samples" in summary
    assert "own  75.0%  encode (c.py:3)" in summary
    assert "inc 100.0%  handle (b.py)" in summary  # line numbers folded: one function


def _listening_pid(port: int) -> int:
    """The broker's PID, by its port (deploy/local/stack.py's /proc lookup; the stack is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("local_stack", Path(__file__).parents[2] / "deploy/local/stack.py")
    assert spec is not None and spec.loader is not None
    stack = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(stack)
    pid = stack.listening_pid(port)
    assert pid is not None, f"no process of this host listens on port {port}"
    return pid


def test_a_broker_recording_is_summarised_by_thread_and_request(kafka_bootstrap, kafka_topics, tmp_path: Path) -> None:
    # What TETHER_BENCH_PROFILE=1 does to the broker: a JFR recording over a window of
    # transactional load, then the summary names the requests the handler threads served.
    jcmd = shutil.which("jcmd")
    assert jcmd is not None, "jcmd (part of the JDK) is not on PATH"
    broker = _listening_pid(int(kafka_bootstrap.rsplit(":", 1)[1]))
    recording = tmp_path / "broker.jfr"
    subprocess.run([jcmd, str(broker), "JFR.start", f"name=test-{uuid.uuid4().hex[:8]}", "duration=4s",
                    "settings=profile", f"filename={recording}"], check=True, capture_output=True, timeout=60)
    topic = kafka_topics.create("bench-jfr", partitions=2)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"jfr-{uuid.uuid4().hex}",
                         "linger.ms": 0})
    producer.init_transactions(30)
    end = time.monotonic() + 4.5
    while time.monotonic() < end:  # load for the whole recording: a transaction per record
        producer.begin_transaction()
        producer.produce(topic, b"x", partition=0)
        producer.commit_transaction(30)

    deadline = time.monotonic() + 60
    while not recording.exists() or recording.stat().st_size == 0:  # written when the recording ends
        assert time.monotonic() < deadline, "the recording was never written"
        time.sleep(0.2)
    time.sleep(1)
    summary = summarise_jfr(recording)
    assert "CPU samples" in summary
    assert "thread " in summary and "data-plane-kafka-request-handler-N" in summary
    assert "data-plane-kafka-request-handler-N: kafka.server.KafkaApis.handle" in summary
