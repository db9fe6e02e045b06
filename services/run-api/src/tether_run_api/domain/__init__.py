"""Pure decisions of the run-api: authentication rules, catalog validation, submit snapshots, streaming order."""
