"""Named refusals of an approver's decision: each carries a stable reason code and the facts."""

from __future__ import annotations


class DecisionRefused(Exception):
    """A DecideApproval that must not take effect. `reason` is machine-readable, `detail` for humans."""

    reason = "DECISION_REFUSED"

    def __init__(self, detail: str, **facts: object) -> None:
        super().__init__(f"{self.reason}: {detail}")
        self.detail = detail
        self.facts = facts


class ApprovalNotFound(DecisionRefused):
    """No approval with that id is known for the run."""

    reason = "APPROVAL_NOT_FOUND"


class EarlyDecisionExists(DecisionRefused):
    """A decision for this approval already waits for its request (read first, so it wins)."""

    reason = "EARLY_DECISION_EXISTS"


class TooManyEarlyDecisions(DecisionRefused):
    """The run already keeps as many decisions waiting for their requests as the policy allows."""

    reason = "TOO_MANY_EARLY_DECISIONS"


class WrongTenant(DecisionRefused):
    """The command's (authenticated) tenant is not the run's tenant."""

    reason = "WRONG_TENANT"


class ApprovalNotPending(DecisionRefused):
    """The approval was already decided (approved, rejected or expired): a duplicate or late decision."""

    reason = "APPROVAL_NOT_PENDING"


class DecisionAfterExpiry(DecisionRefused):
    """A decision recorded in time (by `expires_at_ms`; run-api accepted it) but read here only after
    the approval had expired: its record reached the commands topic later than the grace allows
    (run-api's produce took longer, or the two hosts' clocks differ by more). EXPIRED is already the
    approval's decision on the log, so this one is refused, not lost: it has its own reason and is
    counted, and an operator should look (a lost approval is a call that did not run)."""

    reason = "DECISION_AFTER_EXPIRY"


class CallMismatch(DecisionRefused):
    """The decision names another tool call than the one the approval is for."""

    reason = "CALL_MISMATCH"


class NotAnApprover(DecisionRefused):
    """The decider lacks the approver role in the tenant."""

    reason = "NOT_AN_APPROVER"


class SelfApproval(DecisionRefused):
    """The run's submitter tried to approve a call of their own run (forbidden by policy)."""

    reason = "SELF_APPROVAL"


class SubmitterUnknown(DecisionRefused):
    """Self-approval is forbidden but the run's submitter is unknown here, so it cannot be ruled out."""

    reason = "SUBMITTER_UNKNOWN"


class StaleArgsHash(DecisionRefused):
    """The approver saw other arguments than the ones awaiting approval."""

    reason = "STALE_ARGS_HASH"


class ApprovalExpired(DecisionRefused):
    """The decision was made after the approval's expiry."""

    reason = "APPROVAL_EXPIRED"
