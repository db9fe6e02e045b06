"""The run ledger and sequencer: caps, grants, loop detection, termination reports."""
