"""StreamRunEvents of a finished run whose last seq is an event the read model holds under another tenant
(the projector's TENANT_MISMATCH rows): the stream ends with STREAM_HOLE, never polls for ever."""

from __future__ import annotations

import pytest

from tether_run_api import handlers
from tether_run_api.domain.auth import ROLE_MEMBER, Principal
from tether_run_api.domain.errors import StreamHole
from tether_run_api.domain.views import EventView, RunStatus, RunView
from tether_run_api.testing import FakeLedger, FakeLiveEvents, FakeReadModel

TENANT, OTHER = "tenant-a", "tenant-b"
RUN = "01JABCDEFGHJKMNPQRSTVWXYZ0"
ALICE = Principal(TENANT, "alice", frozenset({ROLE_MEMBER}))
TYPES = {1: "RunAccepted", 2: "StepGranted", 3: "RunTerminated", 4: "ToolCallCompleted"}


def a_finished_run_ending_in_another_tenants_event() -> FakeReadModel:
    """Seqs 1-4 the run's tenant's (RunTerminated at 3, a late fact at 4), seq 5 stored under tenant-b,
    last_seq 5: what the projector makes of another tenant's event on the run since 1281524."""
    rm = FakeReadModel()
    rm.add_events(TENANT, [EventView(RUN, seq, f"e{seq}", f"tether.v1.{t}", 1000 + seq) for seq, t in TYPES.items()])
    rm.add_events(OTHER, [EventView(RUN, 5, "e5", "tether.v1.ApprovalRequested", 1005)])
    rm.runs[(TENANT, RUN)] = RunView(RUN, RunStatus.TERMINATED, last_seq=5)
    return rm


def stream(rm: FakeReadModel, from_seq: int, live: FakeLiveEvents, *, max_reads: int = 50) -> list[int]:
    """The seqs sent; the stream is given up after max_reads reads of the feed (a client hanging up)."""
    return [e.seq for e in handlers.stream_run_events(
        RUN, from_seq, principal=ALICE, read_model=rm, ledger=FakeLedger(), live=live,
        policy=handlers.StreamPolicy(page=2, block_ms=1, gap_wait_s=0.05, gap_poll_s=0.0),
        is_active=lambda: live.reads < max_reads, sleep=lambda s: None,
    )]


@pytest.mark.parametrize(("from_seq", "sent_before"), [(1, [1, 2, 3, 4]), (4, [4]), (5, [])])
def test_a_finished_runs_last_seq_held_by_another_tenant_ends_the_stream_with_a_hole(
    from_seq: int, sent_before: list[int]
) -> None:
    # Resuming past the caller's last visible event (`tether watch --from-seq 5`, a reconnect after seq 4)
    # polled the read model every block_ms until the client left: last_seq 5 was never below the seq owed.
    # Now it ends at once, from the catch-up, with the hole and where the log goes on (past last_seq); the
    # stream through the terminal event says the same at the same seq.
    rm, live = a_finished_run_ending_in_another_tenants_event(), FakeLiveEvents()
    seen: list[int] = []
    with pytest.raises(StreamHole) as err:
        for seq in stream(rm, from_seq, live):
            seen.append(seq)
    assert err.value.metadata == {"run_id": RUN, "next_seq": "5", "next_stored_seq": "6"}
    # Nothing is stored at 6 (the run's log ends at 5): the message said "the next stored event is seq 6".
    assert err.value.message == (
        f"the read model of run {RUN!r} is missing seq 5 and nothing will fill it; resume at seq 6: the next "
        "stored event, or the end of the run's log if its last seq is 5")
    assert err.value.retry_after_s is None
    assert live.reads == 0  # not after polling
    # The client goes on from next_stored_seq, as for any hole: the stream ends there, nothing sent.
    assert stream(rm, 6, live) == [] and live.reads == 0


def test_a_run_that_finishes_during_the_stream_with_another_tenants_last_event_ends_it_with_a_hole() -> None:
    # The stream opened while the run was live and the caller had seen seq 4; the run then ended with
    # another tenant's event at 5, which gets no live entry. A quiet feed's re-check finds the run
    # finished with last_seq 5 and nothing stored for this tenant at 5: a hole, not more waiting.
    rm, live = a_finished_run_ending_in_another_tenants_event(), FakeLiveEvents()
    rm.runs[(TENANT, RUN)] = RunView(RUN, RunStatus.RUNNING, last_seq=4)
    live.script[RUN] = [[], [], []]
    original = live.read

    def read_then_finish(run_id: str, cursor: str, block_ms: int):
        out = original(run_id, cursor, block_ms)
        if live.reads == 2:
            rm.runs[(TENANT, RUN)] = RunView(RUN, RunStatus.TERMINATED, last_seq=5)
        return out

    live.read = read_then_finish  # type: ignore[method-assign]
    with pytest.raises(StreamHole) as err:
        stream(rm, 5, live, max_reads=200)
    assert err.value.metadata == {"run_id": RUN, "next_seq": "5", "next_stored_seq": "6"}
    assert live.reads == 2  # the first quiet read after the run finished


class StoresALateFactOnGetRun(FakeReadModel):
    """The projector commits the run's own late fact at 5 between the stream's catch-up and its get_run."""

    def get_run(self, tenant_id: str, run_id: str) -> RunView | None:
        if self.runs[(TENANT, RUN)].status is RunStatus.RUNNING and self.event_queries >= 2:
            self.add_events(TENANT, [EventView(RUN, 5, "e5", "tether.v1.ToolCallCompleted", 1005)])
            self.runs[(TENANT, RUN)] = RunView(RUN, RunStatus.TERMINATED, last_seq=5)
        return super().get_run(tenant_id, run_id)


def test_an_event_committed_between_the_catch_up_and_the_run_check_is_sent_not_taken_for_a_hole() -> None:
    rm, live = StoresALateFactOnGetRun(), FakeLiveEvents()
    rm.add_events(TENANT, [EventView(RUN, seq, f"e{seq}", f"tether.v1.{t}", 1000 + seq) for seq, t in TYPES.items()])
    rm.runs[(TENANT, RUN)] = RunView(RUN, RunStatus.RUNNING, last_seq=4)
    assert stream(rm, 5, live) == [5]
