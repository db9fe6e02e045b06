"""Observable side-effect sinks outside Tether: HTTP test service, SMTP sink, KV store, each recording to JSONL."""
