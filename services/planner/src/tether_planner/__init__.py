"""Model calls: provider adapters, working context, compaction. Never executes tools."""
