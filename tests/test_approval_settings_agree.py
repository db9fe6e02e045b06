"""run-api and the approval service apply the same approval rules: one self-approval variable, one approver role.

run-api checks a decision before it sends DecideApproval; the approval service makes the binding
decision. Were they to disagree, run-api would answer APPROVED for a decision the approval service
then refuses (logged only), and the tool call would wait until its approval expired.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tether_approval.settings import ApprovalSettings
from tether_run_api.domain.auth import KNOWN_ROLES, ROLE_APPROVER
from tether_run_api.settings import RunApiSettings

OLD_NAMES = ("TETHER_APPROVAL_FORBID_SELF_APPROVAL", "TETHER_RUN_API_FORBID_SELF_APPROVAL")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TETHER_FORBID_SELF_APPROVAL", "TETHER_APPROVAL_APPROVER_ROLE", *OLD_NAMES):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value,forbid", [("false", False), ("true", True)])
def test_one_variable_sets_self_approval_for_both(monkeypatch: pytest.MonkeyPatch, value: str, forbid: bool) -> None:
    monkeypatch.setenv("TETHER_FORBID_SELF_APPROVAL", value)
    assert RunApiSettings().forbid_self_approval is forbid
    assert ApprovalSettings().forbid_self_approval is forbid


def test_both_forbid_self_approval_by_default() -> None:
    assert RunApiSettings().forbid_self_approval is True
    assert ApprovalSettings().forbid_self_approval is True


@pytest.mark.parametrize("old", OLD_NAMES)
def test_the_shared_variable_wins_over_a_services_old_name(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    monkeypatch.setenv(old, "false")
    monkeypatch.setenv("TETHER_FORBID_SELF_APPROVAL", "true")
    assert RunApiSettings().forbid_self_approval is True
    assert ApprovalSettings().forbid_self_approval is True


def test_the_approval_only_name_is_still_read_and_the_shared_one_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    # Alone it can only make the approval service more lenient than run-api's door, which then
    # refuses the self-approval itself: never a decision accepted by one and refused by the other.
    monkeypatch.setenv("TETHER_APPROVAL_FORBID_SELF_APPROVAL", "false")
    assert ApprovalSettings().forbid_self_approval is False
    monkeypatch.setenv("TETHER_FORBID_SELF_APPROVAL", "true")
    assert ApprovalSettings().forbid_self_approval is True


def test_the_approval_service_requires_the_role_run_api_requires() -> None:
    assert ApprovalSettings().approver_role == ROLE_APPROVER


def test_another_approver_role_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # run-api requires ROLE_APPROVER and issues keys with KNOWN_ROLES only: a release-manager could
    # not decide there, and an approver's decisions would all be refused NOT_AN_APPROVER here.
    assert "release-manager" not in KNOWN_ROLES
    monkeypatch.setenv("TETHER_APPROVAL_APPROVER_ROLE", "release-manager")
    with pytest.raises(ValidationError):
        ApprovalSettings()
    monkeypatch.setenv("TETHER_APPROVAL_APPROVER_ROLE", ROLE_APPROVER)
    assert ApprovalSettings().approver_role == ROLE_APPROVER


def test_run_api_s_old_name_alone_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # Alone it made run-api accept a self-approval the approval service (which does not read it)
    # then refused: the call waited until its approval expired.
    monkeypatch.setenv("TETHER_RUN_API_FORBID_SELF_APPROVAL", "false")
    with pytest.raises(ValidationError, match="TETHER_FORBID_SELF_APPROVAL"):
        RunApiSettings()
    assert ApprovalSettings().forbid_self_approval is True

