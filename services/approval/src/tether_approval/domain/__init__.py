"""The approval service's pure decisions: pending approvals, who may decide them, expiry."""
