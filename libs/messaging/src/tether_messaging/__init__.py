"""Kafka plumbing written once: serde, partitioner, topics, hash chain, the exactly-once loop, dead letters."""
