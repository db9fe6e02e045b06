"""Tenant partitioning agrees byte for byte with Java's murmur2, librdkafka and aiokafka."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from aiokafka.partitioner import DefaultPartitioner
from confluent_kafka import Producer

from tether_messaging.admin import declare_specs
from tether_messaging.partitioner import (
    InvalidSpread,
    home_partition,
    key_partition,
    murmur2,
    partition_for,
)
from tether_messaging.topics import TopicSpec

REPO = Path(__file__).resolve().parents[3]

# org.apache.kafka.common.utils.UtilsTest#testMurmur2
JAVA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def _keys(n: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    keys = [b"", b"a", b"ab", b"abc", "tenant-é".encode()]
    keys += [rng.randbytes(rng.randrange(0, 40)) for _ in range(n)]
    keys += [f"run-{uuid.UUID(int=rng.getrandbits(128))}".encode() for _ in range(n)]
    return keys


def test_murmur2_matches_kafkas_own_test_vectors() -> None:
    assert {k: murmur2(k) for k in JAVA_VECTORS} == JAVA_VECTORS


def test_key_partition_matches_aiokafka_default_partitioner() -> None:
    partitioner = DefaultPartitioner()
    for partitions in (1, 6, 7, 32):
        all_parts = list(range(partitions))
        for key in _keys(300):
            assert key_partition(key, partitions) == partitioner(key, all_parts, all_parts), key


def test_every_run_of_a_tenant_lands_on_its_home_partition_with_spread_one() -> None:
    for t in range(40):
        tenant = f"tenant-{t}"
        home = home_partition(tenant, 6)
        assert {partition_for(tenant, f"run-{r}", 6) for r in range(200)} == {home}


def test_runs_of_a_spread_tenant_stay_within_its_spread_and_use_all_of_it() -> None:
    for t in range(40):
        tenant = f"tenant-{t}"
        home = home_partition(tenant, 6)
        lane = {(home + i) % 6 for i in range(3)}
        used = {partition_for(tenant, f"run-{r}", 6, spread=3) for r in range(300)}
        assert used == lane


def test_spread_outside_the_partition_count_is_refused() -> None:
    with pytest.raises(InvalidSpread):
        partition_for("t", "r", 6, spread=0)
    with pytest.raises(InvalidSpread):
        partition_for("t", "r", 6, spread=7)


def _kafka_clients_jar() -> Path | None:
    candidates = []
    if os.environ.get("TETHER_KAFKA_LIBS"):
        candidates.append(Path(os.environ["TETHER_KAFKA_LIBS"]))
    state = Path(os.environ.get("TETHER_STATE_DIR") or REPO / ".state")
    candidates += [state / "kafka" / "libs", Path("/tmp/kafka-libs")]
    for directory in candidates:
        jars = sorted(directory.glob("kafka-clients-*.jar")) if directory.is_dir() else []
        if jars:
            return jars[-1]
    return None


JAVA_MURMUR = """
import org.apache.kafka.common.utils.Utils;
import java.io.*;
import java.util.HexFormat;
public class Murmur {
    public static void main(String[] args) throws IOException {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        String line;
        while ((line = in.readLine()) != null) {
            byte[] key = HexFormat.of().parseHex(line.trim());
            System.out.println(Utils.murmur2(key) + " " + Utils.toPositive(Utils.murmur2(key)) % 6);
        }
    }
}
"""


def test_murmur2_matches_java_kafka_clients(tmp_path: Path) -> None:
    jar = _kafka_clients_jar()
    java = shutil.which("java")
    if jar is None or java is None:
        pytest.skip(
            "Java comparison needs `java` and kafka-clients-*.jar in $TETHER_KAFKA_LIBS, "
            "$TETHER_STATE_DIR/kafka/libs or .state/kafka/libs (run `make setup`)"
        )
    source = tmp_path / "Murmur.java"
    source.write_text(JAVA_MURMUR)
    keys = _keys(200)
    result = subprocess.run(
        # The jar's directory as classpath: Utils needs slf4j beside kafka-clients.
        [java, "-cp", f"{jar.parent}/*", str(source)],
        input="\n".join(k.hex() for k in keys) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout.split("\n")
    java_results = [tuple(int(x) for x in line.split()) for line in out if line.strip()]
    assert java_results == [(murmur2(k), key_partition(k, 6)) for k in keys]


@pytest.mark.integration
@pytest.mark.parametrize("partitions", [6, 7])
def test_librdkafka_murmur2_random_puts_keys_where_we_compute(kafka_bootstrap: str, partitions: int) -> None:
    topic = f"test-partitioner-{uuid.uuid4().hex[:12]}"
    declare_specs(kafka_bootstrap, partitions, [TopicSpec(topic)])
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": "murmur2_random"})
    landed: dict[bytes, int] = {}

    def on_delivery(err, msg) -> None:
        assert err is None, err
        landed[msg.key()] = msg.partition()

    keys = [k for k in _keys(150) if k]  # an empty key is "no key" to librdkafka: random partition
    tenants = [f"tenant-{i}".encode() for i in range(50)]
    for key in keys + tenants:
        producer.produce(topic, b"x", key, on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert landed == {k: key_partition(k, partitions) for k in keys + tenants}
    assert all(landed[t] == home_partition(t.decode(), partitions) for t in tenants)
