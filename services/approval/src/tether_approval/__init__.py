"""Pending approvals, approver authorization, expiry."""
