"""The planner's pure decision code: working context, validation of model output, compaction. No I/O."""
