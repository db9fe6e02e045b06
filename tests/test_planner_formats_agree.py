"""The planner's pre-check of a call's arguments asserts the formats the gateway's default policy asserts.

The gateway is the authority (its policy document's arguments.assert_formats); the planner checks
the same formats before it proposes a call, so a malformed value goes back to the model at once.
Were the defaults to differ, the planner would either refuse calls the gateway allows (more formats)
or let through calls the gateway then denies a step later (fewer).
"""

from __future__ import annotations

from tether_planner.settings import PlannerSettings
from tether_tool_gateway.domain.policy_document import default_policy


def test_the_planners_default_formats_are_the_default_policys() -> None:
    assert PlannerSettings().assert_formats == sorted(default_policy().document.arguments.assert_formats)
