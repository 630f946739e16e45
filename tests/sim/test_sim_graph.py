"""Graph capture and replay: values recomputed, no launch cost, same dependencies, pointer check."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import pytest
import torch

import dbo
from dbo.sim import COMM, COMPUTE, GRAPH_LAUNCH, H200, HANDOFF, GraphReplayError, SimDevice
from dbo.sim.calls import ShapeChangedError
from dbo.sim.options import SimOptions
from workspace import current_workspace_manager, init_workspace_manager, reset_workspace_manager

ROUND = replace(
    H200,
    name="round",
    launch_us=1.0,
    kernel_fixed_us=2.0,
    handoff_us=10.0,
    graph_launch_us=3.0,
    compute_efficiency=1.0,
    memory_efficiency=1.0,
)


def ops(records: list) -> list:
    return [r for r in records if r.kind in (COMPUTE, COMM)]


def capture_step(d: SimDevice, x: torch.Tensor, w: torch.Tensor):
    compute, comm = d.Stream("compute"), d.Stream("comm")
    out = torch.empty(4, 4)
    with d.thread_scope(0):
        d.set_stream(compute)
        with d.graph() as g:
            h = x @ w
            h.relu_()
            e = compute.record_event()
            d.set_stream(comm)
            comm.wait_event(e)
            with d.comm_region("dispatch", nbytes=1_000_000, ep_size=8) as handle:
                recv = h.clone()
            d.set_stream(compute)
            compute.wait_event(handle.event)
            torch.add(recv, 1, out=out)
    return g, out, h


def test_replay_recomputes_values_in_captured_tensors() -> None:
    d = SimDevice(SimOptions(ROUND))
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    g, out, h = capture_step(d, x, w)
    assert torch.allclose(out, (x @ w).relu() + 1)
    assert g.num_ops == 4
    x.copy_(torch.randn(4, 4))  # new input, as a CUDA graph's static input buffer
    g.replay()
    assert torch.allclose(h, (x @ w).relu())
    assert torch.allclose(out, (x @ w).relu() + 1)
    assert d.races == []


def test_replay_has_no_launch_cost_and_keeps_dependencies() -> None:
    d = SimDevice(SimOptions(ROUND))
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    g, _, _ = capture_step(d, x, w)
    captured = ops(d.timeline)
    d.synchronize()
    start = d.host_time_us
    m = d.mark()
    g.replay()
    new = d.since(m)
    launch = new[0]
    assert launch.kind == GRAPH_LAUNCH and (launch.start_us, launch.end_us) == (start, start + 3.0)
    replayed = ops(new)
    assert [r.name for r in replayed] == [r.name for r in captured]
    assert all(r.replayed for r in replayed)
    assert all(r.issue_us == start + 3.0 for r in replayed)  # the host launched nothing per op
    assert d.host_time_us == start + 3.0
    # the same chain as captured, packed without launch gaps: each op starts when its
    # predecessor (in-stream or via event) ends
    mm, relu, comm_op, add = replayed
    assert mm.start_us == start + 3.0
    assert relu.start_us == mm.end_us and comm_op.start_us == relu.end_us
    assert comm_op.stream == "comm" and add.start_us == comm_op.end_us
    for a, b in zip(captured, replayed):
        assert b.dur_us == pytest.approx(a.dur_us)
    # captured eagerly, the step paid one launch per op on the host
    assert captured[1].start_us - captured[0].start_us >= ROUND.launch_us


@pytest.mark.timeout(30)
def test_capture_from_several_threads_in_issue_order() -> None:
    d = SimDevice(SimOptions(ROUND))
    streams = [d.Stream("s0"), d.Stream("s1")]
    bufs = [torch.zeros(8), torch.zeros(8)]
    go = threading.Event()

    def ubatch(i: int) -> None:
        with d.thread_scope(i):
            d.set_stream(streams[i])
            if i == 1:
                go.wait()
            bufs[i].add_(i + 1)
            if i == 0:
                go.set()

    with d.graph() as g:
        threads = [threading.Thread(target=ubatch, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    g.replay()
    assert bufs[0].tolist() == [2.0] * 8 and bufs[1].tolist() == [4.0] * 8
    replayed = [r for r in d.timeline if r.replayed and r.kind == COMPUTE]
    assert [(r.ubatch, r.stream) for r in replayed] == [(0, "s0"), (1, "s1")]


@dataclass
class _Info:
    label: str
    live: bool


class FakeWorkspace:
    """Stands in for the WorkspaceManager: slots it can replace, described by pointer."""

    def __init__(self, nbytes: int, slots: int = 2) -> None:
        self.slots = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(slots)]
        self.retired: list[tuple[int, torch.Tensor]] = []

    def grow(self, slot: int, nbytes: int) -> None:
        self.retired.append((slot, self.slots[slot]))
        self.slots[slot] = torch.zeros(nbytes, dtype=torch.uint8)

    def describe_buffer(self, data_ptr: int) -> _Info | None:
        for i, buf in enumerate(self.slots):
            if buf.data_ptr() <= data_ptr < buf.data_ptr() + buf.numel():
                return _Info(f"workspace slot {i}", True)
        for i, buf in self.retired:
            if buf.data_ptr() <= data_ptr < buf.data_ptr() + buf.numel():
                return _Info(f"workspace slot {i}", False)
        return None


def test_replay_refuses_a_replaced_workspace_slot() -> None:
    d = SimDevice(SimOptions(ROUND))
    ws = FakeWorkspace(1024)
    d.add_buffer_owner(ws)
    x = torch.randn(16)
    with d.thread_scope(1):
        with d.graph() as g:
            scratch = ws.slots[1][256:320].view(torch.float32)
            scratch.copy_(x)
            y = scratch * 2
    g.replay()  # every slot still live
    ws.grow(1, 4096)  # slot 1 replaced after capture: the graph still points at the old one
    with pytest.raises(GraphReplayError, match="workspace slot 1") as info:
        g.replay()
    assert "aten::copy_" in str(info.value) and "ubatch 1" in str(info.value)
    d.remove_buffer_owner(ws)
    g.replay()  # nobody vouches for the buffer any more: no check
    assert torch.allclose(y, x * 2)


def test_graph_misuse_is_refused() -> None:
    d = SimDevice(SimOptions(ROUND))
    with d.graph() as g:
        with pytest.raises(RuntimeError, match="already"):
            with d.graph():
                pass
        with pytest.raises(RuntimeError, match="while it is being captured"):
            g.replay()
    with pytest.raises(RuntimeError, match="captured already"):
        with g:
            pass
    with pytest.raises(TypeError, match="describe_buffer"):
        d.add_buffer_owner(object())


def test_graph_on_meta_tensors() -> None:
    d = SimDevice(SimOptions(ROUND, tensor_device="meta"))
    a = torch.empty(1024, 1024, device="meta", dtype=torch.bfloat16)
    with d.thread_scope(0):
        with d.graph() as g:
            b = a @ a
            b.add_(1)
    g.replay()
    assert len([r for r in d.timeline if r.replayed and r.kind == COMPUTE]) == 2


def _two_ubatch_step(xs: list, w: torch.Tensor, outs: list):
    """Each ubatch: its scratch from the workspace, a GEMM into it, a yield, then a scale."""

    def fn(u: int) -> None:
        (scratch,) = current_workspace_manager().get_simultaneous(((4, 4), torch.float32))
        torch.mm(xs[u], w, out=scratch)
        dbo.dbo_yield()
        torch.mul(scratch, 2.0, out=outs[u])

    return fn


@pytest.fixture
def two_slot_workspace():
    reset_workspace_manager()
    init_workspace_manager("cpu", 2)
    yield current_workspace_manager()
    reset_workspace_manager()


@pytest.mark.timeout(30)
def test_ubatched_step_captured_through_run_ubatches_replays_with_one_launch_and_no_handoffs(
    two_slot_workspace,
) -> None:
    d = SimDevice(SimOptions(ROUND))
    w = torch.randn(4, 4)
    xs, outs = [torch.randn(4, 4) for _ in range(2)], [torch.empty(4, 4) for _ in range(2)]
    fn = _two_ubatch_step(xs, w, outs)
    dbo.run_ubatches(fn, [0, 1], device=d)  # warm-up: the workspace grows
    d.synchronize()
    eager = d.mark()
    dbo.run_ubatches(fn, [0, 1], device=d)
    d.synchronize()
    eager_us = d.elapsed_us(eager)
    assert sum(r.kind == HANDOFF for r in d.since(eager)) == 4  # two yields, two exits

    g = d.graph()
    dbo.run_ubatches(fn, [0, 1], device=d, graph=g)
    d.synchronize()
    for x in xs:
        x.copy_(torch.randn(4, 4))
    start = d.mark()
    g.replay()
    d.synchronize()
    new = d.since(start)
    ops = [r for r in new if r.kind == COMPUTE]
    assert [r.kind for r in new if r.stream == "host"] == [GRAPH_LAUNCH, "sync"]
    assert [(r.name, r.ubatch) for r in ops] == [
        ("aten::mm", 0),
        ("aten::mm", 1),
        ("aten::mul", 0),
        ("aten::mul", 1),
    ]
    assert all(r.replayed and r.issue_us == start.host_us + ROUND.graph_launch_us for r in ops)
    # one compute stream, no host gaps: the ops run back to back after the graph launch
    assert d.elapsed_us(start) == pytest.approx(ROUND.graph_launch_us + sum(r.dur_us for r in ops))
    assert d.elapsed_us(start) < eager_us  # the eager step paid 4 launches and 4 handoffs
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, (x @ w) * 2)


@pytest.mark.timeout(30)
def test_replay_after_workspace_growth_names_the_replaced_slot(two_slot_workspace) -> None:
    d = SimDevice(SimOptions(ROUND))
    d.add_buffer_owner(two_slot_workspace)
    w = torch.randn(4, 4)
    xs, outs = [torch.randn(4, 4) for _ in range(2)], [torch.empty(4, 4) for _ in range(2)]
    fn = _two_ubatch_step(xs, w, outs)
    dbo.run_ubatches(fn, [0, 1], device=d)
    g = d.graph()
    dbo.run_ubatches(fn, [0, 1], device=d, graph=g)
    g.replay()  # the slots captured are still the live ones
    two_slot_workspace.get_simultaneous(((1024,), torch.float32))  # growth replaces every slot
    with pytest.raises(GraphReplayError, match=r"workspace slot 0 .*aten::mm \(ubatch 0"):
        g.replay()


def test_one_device_captures_one_graph_at_a_time() -> None:
    d = SimDevice(SimOptions(ROUND))
    with d.graph():
        with pytest.raises(RuntimeError, match="already being captured"):
            with d.graph():
                pass
    with d.graph() as again:  # the first capture ended: a new one may start
        pass
    assert again.num_ops == 0


def test_replayed_list_op_recomputes_and_is_placed_again() -> None:
    d = SimDevice(SimOptions(ROUND))
    xs = [torch.ones(4), torch.ones(4)]
    with d.thread_scope(0):
        with d.graph() as g:
            torch._foreach_mul_(xs, 2.0)
    assert g.num_ops == 1
    d.reset()
    g.replay()
    assert [x.tolist() for x in xs] == [[4.0] * 4] * 2
    assert [r.name for r in ops(d.timeline)] == ["aten::_foreach_mul_"]
    assert d.races == []


def test_replay_refuses_a_data_dependent_shape_that_changed() -> None:
    d = SimDevice(SimOptions(ROUND))
    x = torch.tensor([1.0, -1.0, 2.0])
    with d.thread_scope(0), d.graph() as g:
        positive = x[x > 0]  # two rows at capture
    x.fill_(1.0)  # three positive values now
    with pytest.raises(ShapeChangedError, match=r"aten::index gave shape \(3,\).*\(2,\)"):
        g.replay()
    assert positive.shape == (2,)


def test_replay_restores_the_grad_mode_each_op_was_captured_under() -> None:
    d = SimDevice(SimOptions(ROUND))
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)  # w: a module parameter
    with d.thread_scope(0), d.graph() as g, torch.no_grad():
        h = (x @ w).t()  # a view made under no_grad; with grad on, recomputing it is refused
    g.replay()  # on this thread, where grad mode is on
    assert torch.equal(h, (x @ w).t()) and not h.requires_grad
