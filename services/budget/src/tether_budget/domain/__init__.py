"""The budget's pure decision code: run ledgers, caps, grants, loop detection, termination reports."""
