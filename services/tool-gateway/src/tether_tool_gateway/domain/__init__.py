"""The gateway's pure decision code: no Kafka, PostgreSQL, HTTP or clock; only recorded inputs."""
