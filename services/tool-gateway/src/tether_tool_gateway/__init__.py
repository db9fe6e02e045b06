"""Tool authorization and execution: policy, schema validation, idempotency ledger, sandbox, secrets."""
