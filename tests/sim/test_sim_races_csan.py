"""Race checker verdicts on the event-handler cases of PyTorch's CUDA sanitizer (CSAN), each
case rebuilt on the simulated device with real tensors and streams: `launch(stream, reads,
writes)` issues one op that reads and writes whole tensors. The verdict (how many races the
op adds) must match CSAN's on every case."""

from __future__ import annotations

import torch

from dbo.sim import SimDevice
from dbo.sim.options import SimOptions


class Program:
    """Streams, events and tensors by number, as the upstream cases name them."""

    def __init__(self) -> None:
        self.device = SimDevice(SimOptions("h200"))
        self._streams: dict[int, object] = {}
        self._events: dict[int, object] = {}
        self._tensors: dict[int, torch.Tensor] = {}
        self._scope = self.device.thread_scope(0)
        self._scope.__enter__()

    def close(self) -> None:
        self._scope.__exit__(None, None, None)

    def stream(self, i: int):
        if i not in self._streams:
            self._streams[i] = self.device.Stream(f"s{i}")
        return self._streams[i]

    def tensor(self, i: int) -> torch.Tensor:
        if i not in self._tensors:
            with self.device.suspended():
                self._tensors[i] = torch.zeros(8)
        return self._tensors[i]

    def launch(self, stream: int, reads: list[int] = (), writes: list[int] = ()) -> int:
        """Issue one op on `stream`; the number of races it added."""
        before = len(self.device.races)
        self.device.set_stream(self.stream(stream))
        ins = [self.tensor(i) for i in reads]
        outs = [self.tensor(i) for i in writes]
        if outs:
            torch._foreach_add_(outs, [t.sum() for t in ins] if ins else 1.0)
        elif ins:
            torch._foreach_mul(ins, 1.0)
        return len(self.device.races) - before

    def record(self, event: int, stream: int) -> None:
        self._events[event] = self.stream(stream).record_event(self._events.get(event))

    def new_event(self, event: int) -> None:
        self._events[event] = self.device.Event()

    def wait(self, event: int, stream: int) -> None:
        self.stream(stream).wait_event(self._events.setdefault(event, self.device.Event()))


def run(case) -> Program:
    p = Program()
    try:
        case(p)
    finally:
        p.close()
    return p


def test_empty_kernel_launch_is_clean() -> None:
    def case(p: Program) -> None:
        assert p.launch(0) == 0

    run(case)


def test_two_reads_on_two_streams_are_clean() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, reads=[1]) == 0
        assert p.launch(2, reads=[1]) == 0

    run(case)


def test_write_after_unordered_read_is_a_race() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, reads=[1]) == 0
        assert p.launch(2, writes=[1]) == 1

    run(case)


def test_event_record_and_wait_orders_the_write() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, reads=[1]) == 0
        p.record(0, 1)
        p.wait(0, 2)
        assert p.launch(2, writes=[1]) == 0

    run(case)


def test_every_read_checks_the_last_write() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, writes=[1]) == 0
        p.record(0, 1)
        p.wait(0, 2)
        assert p.launch(2, reads=[1]) == 0
        assert p.launch(3, reads=[1]) == 1

    run(case)


def test_branches_may_read_but_not_write_without_more_sync() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, writes=[1]) == 0
        p.record(0, 1)
        p.wait(0, 2)
        p.wait(0, 3)
        assert p.launch(2, reads=[1]) == 0
        assert p.launch(3, reads=[1]) == 0
        assert p.launch(2, writes=[1]) == 1

    run(case)


def test_a_chain_of_waits_orders_the_last_stream() -> None:
    def case(p: Program) -> None:
        assert p.launch(0, reads=[1]) == 0
        for i in range(10):
            p.record(i, i)
            p.wait(i, i + 1)
        assert p.launch(10, writes=[1]) == 0

    run(case)


def test_a_wait_covers_only_work_recorded_before_the_event() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, reads=[1]) == 0
        p.record(0, 1)
        assert p.launch(1, reads=[1]) == 0
        p.wait(0, 2)
        assert p.launch(2, writes=[1]) == 1

    run(case)


def test_waiting_on_a_new_unrecorded_event_orders_nothing() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, reads=[1]) == 0
        p.record(0, 1)
        p.new_event(0)  # the event was deleted and made again
        p.wait(0, 2)
        assert p.launch(2, writes=[1]) == 1

    run(case)


def test_a_write_checks_every_read_since_the_last_write() -> None:
    def case(p: Program) -> None:
        for i in range(1, 10):
            assert p.launch(i, reads=[1]) == 0
            p.record(i, i)
        for i in range(1, 10):
            p.wait(i, 0)
        assert p.launch(10, reads=[1]) == 0  # not waited for
        assert p.launch(0, writes=[1]) == 1

    run(case)


def test_a_write_after_waiting_for_every_read_is_clean() -> None:
    def case(p: Program) -> None:
        for i in range(1, 10):
            assert p.launch(i, reads=[1]) == 0
            p.record(i, i)
        for i in range(1, 10):
            p.wait(i, 0)
        assert p.launch(0, writes=[1]) == 0

    run(case)


def test_one_race_per_tensor_of_a_list_op() -> None:
    def case(p: Program) -> None:
        assert p.launch(0, writes=list(range(10))) == 0
        assert p.launch(1, writes=list(range(10))) == 10

    run(case)


def test_a_wait_joins_clocks_elementwise() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, writes=[1]) == 0
        assert p.launch(2, writes=[2]) == 0
        p.record(1, 1)
        p.record(2, 2)
        assert p.launch(1, writes=[1]) == 0
        assert p.launch(2, writes=[2]) == 0
        p.wait(1, 2)
        p.wait(2, 1)
        p.record(3, 2)
        p.wait(3, 1)
        assert p.launch(1, writes=[1, 2]) == 0

    run(case)


def test_recording_an_event_again_replaces_what_it_covers() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, reads=[1]) == 0
        assert p.launch(2, reads=[2]) == 0
        p.record(1, 1)
        p.record(1, 2)
        p.wait(1, 3)
        assert p.launch(3, writes=[1]) == 1

    run(case)


def test_one_event_may_be_waited_on_by_several_streams() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, writes=[1]) == 0
        p.record(1, 1)
        p.wait(1, 2)
        p.wait(1, 3)
        assert p.launch(2, reads=[1]) == 0
        assert p.launch(3, reads=[1]) == 0

    run(case)


def test_device_synchronize_orders_every_stream() -> None:
    def case(p: Program) -> None:
        for i in range(1, 10):
            assert p.launch(i, writes=[i]) == 0
        p.device.synchronize()
        assert p.launch(0, writes=list(range(1, 10))) == 0

    run(case)


def test_device_synchronize_orders_only_earlier_work() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, writes=[1]) == 0
        p.device.synchronize()
        assert p.launch(1, writes=[1]) == 0
        assert p.launch(2, writes=[1]) == 1

    run(case)


def test_a_stream_made_after_a_synchronize_is_ordered_after_it() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, writes=[1]) == 0
        p.device.synchronize()
        assert p.launch(2, writes=[1]) == 0  # stream 2 is created here

    run(case)


def test_stream_synchronize_orders_that_stream_only() -> None:
    def case(p: Program) -> None:
        assert p.launch(0, writes=[1]) == 0
        assert p.launch(1, writes=[2]) == 0
        p.stream(0).synchronize()
        assert p.launch(2, reads=[1]) == 0
        assert p.launch(3, reads=[1]) == 0
        assert p.launch(4, reads=[2]) == 1

    run(case)


def test_event_synchronize_orders_work_before_the_event_only() -> None:
    def case(p: Program) -> None:
        assert p.launch(1, writes=[1]) == 0
        p.record(1, 1)
        assert p.launch(1, writes=[2]) == 0
        p._events[1].synchronize()
        assert p.launch(2, writes=[1]) == 0
        assert p.launch(2, writes=[2]) == 1

    run(case)
