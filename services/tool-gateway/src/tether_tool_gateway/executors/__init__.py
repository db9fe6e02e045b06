"""Executors, one per executor_kind."""
