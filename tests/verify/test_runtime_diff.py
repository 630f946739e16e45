"""The runtime-neutral transcript of a step (`dbo.verification.runtime_diff`): how it names
the events a ring records and waits on."""

from __future__ import annotations

from dbo.sim import SimDevice
from dbo.verification.runtime_diff import log_event_calls


def test_an_event_made_after_another_died_is_logged_as_another_event():
    device = SimDevice()
    with log_event_calls(device) as calls:
        for _ in range(4):  # each event dies before the next is made, as a ran recv hook's does
            device.current_stream().record_event()
    assert len({call.event for call in calls}) == 4
