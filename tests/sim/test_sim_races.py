"""Race checker: correct schedules report nothing, each seeded bug is caught by name."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import dbo
from dbo import runner
from dbo.sim import RaceError, SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.races import user_stack
from workspace import current_workspace_manager, init_workspace_manager, reset_workspace_manager


def setup() -> tuple[SimDevice, object, object]:
    d = SimDevice(SimOptions("h200"))
    return d, d.Stream("compute"), d.Stream("comm")


def test_correct_ht_schedule_has_no_races() -> None:
    d, compute, comm = setup()
    x = torch.randn(64, 64)
    with d.thread_scope(0):
        d.set_stream(compute)
        y = x @ x  # compute writes y
        e = compute.record_event()
        d.set_stream(comm)
        comm.wait_event(e)
        with d.comm_region("dispatch", nbytes=y.numel() * 4, ep_size=8) as h:
            recv = y.clone()  # comm reads y, writes recv
        d.set_stream(compute)
        compute.wait_event(h.event)
        z = recv * 2  # compute reads recv after the comm op
        y.zero_()  # and may now overwrite y: the comm read is ordered before
        z.sum().item()
    assert d.races == []


def test_a_comm_without_waiting_for_compute() -> None:
    d, compute, comm = setup()
    x = torch.randn(64, 64)
    with d.thread_scope(0):
        d.set_stream(compute)
        y = x @ x
        d.set_stream(comm)  # bug: no wait on compute's event
        with d.comm_region("dispatch", nbytes=y.numel() * 4, ep_size=8):
            y.clone()
    (race,) = d.races
    assert (race.first.op, race.first.stream, race.first.is_write) == ("aten::mm", "compute", True)
    assert (race.second.op, race.second.stream, race.second.is_write) == (
        "comm::dispatch",
        "comm",
        False,
    )
    assert (race.first.start, race.first.end) == (0, 64 * 64 * 4)
    assert race.first.ubatch == race.second.ubatch == 0
    # a user stack of each side, pointing into this test
    assert "test_a_comm_without_waiting_for_compute" in race.first.stack[-1]
    assert "test_sim_races.py" in race.second.stack[-1]
    assert "aten::mm" in race.describe() and "comm::dispatch" in race.describe()


def test_b_workspace_slot_reissued_while_comm_reads_old_view() -> None:
    d, compute, comm = setup()
    slot = torch.zeros(4096, dtype=torch.uint8)  # one workspace slot

    def view(offset: int) -> torch.Tensor:
        return slot[offset : offset + 1024].view(torch.float32)

    src = torch.ones(256)
    with d.thread_scope(0):
        d.set_stream(compute)
        view(0).copy_(src)
        e = compute.record_event()
        d.set_stream(comm)
        comm.wait_event(e)
        with d.comm_region("dispatch", nbytes=1024, ep_size=8):
            sent = view(0).clone()  # comm stream reads bytes [0, 1024)
        d.set_stream(compute)
        view(2048).copy_(src)  # other bytes of the same slot: fine
        assert d.races == []
        view(512).copy_(src)  # overlaps [512, 1024) of the bytes in flight: race
        view(0).fill_(3.0)  # the slot reissued from offset 0: race
    assert len(d.races) == 2
    partial, reissued = d.races
    assert (partial.first.op, partial.first.start, partial.first.end) == ("comm::dispatch", 0, 1024)
    assert (partial.second.op, partial.second.start, partial.second.end) == (
        "aten::copy_",
        512,
        1536,
    )
    assert reissued.second.op == "aten::fill_" and reissued.second.is_write
    assert not reissued.first.is_write and reissued.first.stream == "comm"
    assert partial.storage == reissued.storage == slot.untyped_storage()._cdata
    del sent


@pytest.mark.timeout(30)
def test_c_two_ubatches_write_one_buffer() -> None:
    d = SimDevice(SimOptions("h200"))
    streams = [d.Stream("compute-0"), d.Stream("compute-1")]
    shared = torch.zeros(128)
    turn = [threading.Event(), threading.Event()]

    def ubatch(i: int) -> None:
        with d.thread_scope(i):
            d.set_stream(streams[i])
            if i == 1:
                turn[1].wait()
            shared.fill_(float(i))
            if i == 0:
                turn[1].set()

    threads = [threading.Thread(target=ubatch, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (race,) = d.races
    assert (race.first.ubatch, race.second.ubatch) == (0, 1)
    assert (race.first.stream, race.second.stream) == ("compute-0", "compute-1")
    assert race.first.is_write and race.second.is_write


@pytest.mark.parametrize("waits", [False, True])
def test_d_ll_recv_hook_must_wait_for_arrival(waits: bool) -> None:
    d, compute, _ = setup()
    x = torch.randn(32, 16)
    recv = torch.empty(32, 16)
    with d.thread_scope(0):
        d.set_stream(compute)
        with d.comm_region("combine", nbytes=recv.numel() * 4, mode="ll", ep_size=16) as h:
            recv.copy_(x)  # lands on the link track
        x.mul_(2)  # other compute on the sending stream meanwhile: no conflict with recv

        def recv_hook() -> torch.Tensor:
            if waits:
                compute.wait_event(h.event)
            return recv + 1

        recv_hook()
    if waits:
        assert d.races == []
    else:
        (race,) = d.races
        assert (race.first.op, race.first.stream, race.first.is_write) == (
            "comm::combine",
            "link",
            True,
        )
        assert (race.second.op, race.second.stream) == ("aten::add", "compute")
        # the ll send itself read x before x.mul_ on the same stream: ordered, no race
        assert all(r.second.op != "aten::mul_" for r in d.races)


def test_host_sync_orders_later_launches() -> None:
    for sync in ("device", "stream", "event"):
        d, compute, comm = setup()
        x = torch.randn(16)
        with d.thread_scope(0):
            d.set_stream(compute)
            x.mul_(2)
            e = compute.record_event()
            if sync == "device":
                d.synchronize()
            elif sync == "stream":
                compute.synchronize()
            else:
                e.synchronize()
            d.set_stream(comm)
            x.add_(1)  # issued after the host waited for compute: ordered
        assert d.races == [], sync


def test_read_read_is_not_a_race_and_wait_stream_orders() -> None:
    d, compute, comm = setup()
    x = torch.randn(16)
    with d.thread_scope(0):
        d.set_stream(compute)
        x + 1
        d.set_stream(comm)
        x + 2  # two reads on different streams
        comm.wait_stream(compute)
        x.zero_()  # write after waiting for compute's read, and after comm's own read
    assert d.races == []


def test_history_stays_bounded() -> None:
    d, compute, comm = setup()
    buf = torch.zeros(1024)
    with d.thread_scope(0):
        for i in range(500):
            d.set_stream(compute if i % 2 else comm)
            buf.add_(1)  # covers the whole buffer: older ordered entries are pruned
            (buf * 2).sum()  # temporaries die and take their history with them
            e = d.current_stream().record_event()
            (comm if i % 2 else compute).wait_event(e)
        gc.collect()
        buf.add_(1)
    checker = d.race_checker
    assert d.races == []
    assert len(checker.ops_at(buf.data_ptr())) <= 4
    assert checker.num_blocks < 20


def test_dead_storage_takes_its_history_along() -> None:
    """A storage that dies may see its address reused by the next allocation: its history
    must not outlive it (else the new buffer would race with the old one's accesses)."""
    d, compute, comm = setup()
    x = torch.randn(16)
    with d.thread_scope(0):
        d.set_stream(compute)
        y = x * 2
        address = y.data_ptr()
        assert d.race_checker.ops_at(address) == ["aten::mul"]
        del y
        gc.collect()
        d.set_stream(comm)
        x + 1  # any later op reaps the dead storages first
    assert d.race_checker.ops_at(address) in ([], ["aten::add"])
    assert d.races == []


def test_race_action_raise_and_meta_has_no_checker() -> None:
    d = SimDevice(SimOptions("h200", race_action="raise"))
    a, b = d.Stream("a"), d.Stream("b")
    x = torch.zeros(4)
    with d.thread_scope(0):
        d.set_stream(a)
        x.fill_(1)
        d.set_stream(b)
        with pytest.raises(RaceError, match="aten::fill_"):
            x.fill_(2)
    m = SimDevice(SimOptions("h200", tensor_device="meta"))
    assert m.race_checker is None
    with m.thread_scope(0):
        m.set_stream(m.Stream("a"))
        t = torch.zeros(4, device="meta")
        t.fill_(1)
        m.set_stream(m.Stream("b"))
        t.fill_(2)
    assert m.races == []


# -- the seeded bugs through the runtime and the real WorkspaceManager --------------------------


@pytest.fixture
def workspace2():
    reset_workspace_manager()
    init_workspace_manager("cpu", 2)
    yield current_workspace_manager()
    reset_workspace_manager()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sync", [False, True])
def test_a_dbo_switch_to_comm_without_sync_races_with_the_compute_it_skipped(sync: bool) -> None:
    d = SimDevice(SimOptions("h200"))
    bufs = [torch.zeros(64), torch.zeros(64)]

    def fn(u: int) -> None:
        bufs[u].add_(1.0)  # compute writes what the dispatch sends
        (dbo.dbo_switch_to_comm_sync if sync else dbo.dbo_switch_to_comm)()
        with dbo.current_device().comm_region("dispatch", nbytes=256, ep_size=8):
            bufs[u].clone()
        dbo.dbo_switch_to_compute_sync()

    dbo.run_ubatches(fn, [0, 1], device=d)
    if sync:
        assert d.races == []
    else:
        assert [(r.first.op, r.first.ubatch, r.second.op, r.second.ubatch) for r in d.races] == [
            ("aten::add_", 0, "comm::dispatch", 0),
            ("aten::add_", 1, "comm::dispatch", 1),
        ]


def test_b_get_simultaneous_reissues_bytes_the_comm_stream_still_reads(workspace2) -> None:
    d, compute, comm = setup()
    with d.thread_scope(None):  # DBO off: slot 0
        d.set_stream(compute)
        (send,) = workspace2.get_simultaneous(((256,), torch.float32))
        send.fill_(1.0)
        e = compute.record_event()
        d.set_stream(comm)
        comm.wait_event(e)
        with d.comm_region("dispatch", nbytes=1024, ep_size=8) as h:
            send.clone()  # the comm stream reads the view
        d.set_stream(compute)
        (scratch,) = workspace2.get_simultaneous(((64,), torch.float32))  # offset 0 again
        scratch.zero_()  # bug: no wait on the dispatch
        compute.wait_event(h.event)
        scratch.zero_()  # after the wait: fine
    (race,) = d.races
    assert (race.first.op, race.first.stream, race.first.is_write) == (
        "comm::dispatch",
        "comm",
        False,
    )
    assert (race.second.op, race.second.stream, race.second.is_write) == (
        "aten::zero_",
        "compute",
        True,
    )
    assert (race.second.start, race.second.end) == (0, 256) and race.first.end == 1024


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shared", [False, True])
def test_c_two_ubatches_served_one_slot_write_it_unordered(
    workspace2, monkeypatch, shared: bool
) -> None:
    """The prefill pattern on the one compute and one comm stream both ubatches share; the bug
    seeded: the manager hands every ubatch slot 0."""
    if shared:
        monkeypatch.setattr("workspace.manager._current_ubatch_id", lambda: 0)
    d = SimDevice(SimOptions("h200"))
    xs = [torch.randn(32), torch.randn(32)]
    outs: list = [None, None]
    slot_storages: set[int] = set()

    def fn(u: int) -> None:
        send, recv = current_workspace_manager().get_simultaneous(
            ((32,), torch.float32), ((32,), torch.float32)
        )
        slot_storages.add(send.untyped_storage()._cdata)
        send.copy_(xs[u])
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        with dbo.current_device().comm_region("dispatch", nbytes=128, ep_size=8):
            recv.copy_(send)  # the comm stream reads send, writes recv
        dbo.dbo_yield_and_switch_from_comm_to_compute()
        recv.mul_(2.0)
        outs[u] = recv.clone()

    dbo.run_ubatches(fn, [0, 1], device=d)
    if not shared:
        assert d.races == []
        assert all(torch.equal(o, x * 2) for o, x in zip(outs, xs))
        return
    (slot0,) = slot_storages  # both ubatches were served the one slot
    assert d.races and all(r.storage == slot0 for r in d.races)
    assert all({r.first.ubatch, r.second.ubatch} == {0, 1} for r in d.races)
    both_write = [r for r in d.races if r.first.is_write and r.second.is_write]
    assert both_write, [r.describe() for r in d.races]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("waits_first", [False, True])
def test_d_registered_recv_hook_that_reads_before_the_arrival_event(waits_first: bool) -> None:
    """Low-latency combine: the next ubatch runs the recv hook; a hook that reads the received
    rows before waiting on their arrival event races with the transfer on the link."""
    d = SimDevice(SimOptions("h200"))
    srcs = [torch.randn(16), torch.randn(16)]
    recvs = [torch.zeros(16), torch.zeros(16)]
    got: list = [None, None]

    def fn(u: int) -> None:
        dbo.dbo_maybe_run_recv_hook()
        with dbo.current_device().comm_region("combine", nbytes=64, mode="ll", ep_size=16) as h:
            recvs[u].copy_(srcs[u])  # arrives over the link track

        def hook() -> None:
            stream = dbo.current_stream()
            if waits_first:
                stream.wait_event(h.event)
            got[u] = recvs[u] + 1.0
            if not waits_first:
                stream.wait_event(h.event)

        dbo.dbo_register_recv_hook(hook)
        dbo.dbo_yield()
        dbo.dbo_maybe_run_recv_hook()

    dbo.run_ubatches(fn, [0, 1], device=d)
    if waits_first:
        assert d.races == []
    else:
        assert len(d.races) == 2
        for race, u in zip(d.races, (0, 1)):
            assert (race.first.op, race.first.stream, race.first.is_write) == (
                "comm::combine",
                "link",
                True,
            )
            assert (race.second.op, race.second.is_write) == ("aten::add", False)
            assert race.first.ubatch == u and race.second.ubatch == 1 - u  # the peer runs the hook
    assert all(torch.equal(g, s + 1.0) for g, s in zip(got, srcs))


# -- memory, not storage objects: reuse, second storages, strided footprints -----------------


def test_memory_reused_after_free_inherits_no_history() -> None:
    """A small tensor made, written once on alternating streams and freed: the allocator
    reuses its address, but a dead storage's accesses must not race with the next one's."""
    d, compute, comm = setup()
    with d.thread_scope(0):
        for i in range(200):
            d.set_stream(compute if i % 2 else comm)
            t = torch.tensor([1.0, 2.0])  # lifted, not allocated by a placed op
            t.mul_(2)
            del t
    assert d.races == []


def test_second_storage_over_the_same_memory_is_the_same_memory() -> None:
    d, compute, comm = setup()
    x = torch.zeros(64)
    y = torch.from_dlpack(x)  # another storage object over x's bytes
    assert y.untyped_storage()._cdata != x.untyped_storage()._cdata
    with d.thread_scope(0):
        d.set_stream(compute)
        x.fill_(1)
        d.set_stream(comm)
        y[32:].sum()  # reads bytes x wrote, through the other storage
    (race,) = d.races
    assert (race.first.op, race.second.op) == ("aten::fill_", "aten::sum")
    assert (race.second.start, race.second.end) == (128, 256)


def test_alias_through_a_view_races_with_the_base() -> None:
    d, compute, comm = setup()
    x = torch.zeros(8, 8)
    with d.thread_scope(0):
        d.set_stream(compute)
        x.t()[3].fill_(1)  # column 3 through a transposed view
        d.set_stream(comm)
        x[5].sum()  # row 5 holds one element of column 3
    (race,) = d.races
    assert race.first.op == "aten::fill_" and race.second.start == 5 * 32


def test_even_and_odd_elements_written_on_two_streams_are_clean() -> None:
    d, compute, comm = setup()
    buf = torch.zeros(1024)
    with d.thread_scope(0):
        d.set_stream(compute)
        buf[0::2].fill_(1)
        d.set_stream(comm)
        buf[1::2].fill_(2)
    assert d.races == []


def test_two_matrix_columns_written_on_two_streams_are_clean() -> None:
    d, compute, comm = setup()
    m = torch.zeros(16, 16)
    with d.thread_scope(0):
        d.set_stream(compute)
        m[:, 3].fill_(1)
        m[:, 4:8].fill_(1)
        d.set_stream(comm)
        m[:, 2].fill_(2)
        m[:, 8:].fill_(2)
    assert d.races == []


def test_strided_views_sharing_one_element_race() -> None:
    d, compute, comm = setup()
    buf = torch.zeros(64)
    with d.thread_scope(0):
        d.set_stream(compute)
        buf[0::3].fill_(1)  # elements 0, 3, 6, ..., 63
        d.set_stream(comm)
        buf[1::4].fill_(2)  # elements 1, 5, 9, ...: 9 is in both
    (race,) = d.races
    assert race.first.op == race.second.op == "aten::fill_"


def test_footprint_is_exact_for_strided_views() -> None:
    from dbo.sim.races import footprint, footprints_meet

    m = torch.zeros(8, 8)
    assert footprint(m) == (m.data_ptr(), m.data_ptr() + 256, 0, ())  # dense: one interval
    col = footprint(m[:, 1])
    assert col[2] == 4 and col[3] == ((8, 32),)  # 8 runs of 4 bytes, 32 bytes apart
    assert not footprints_meet(col, footprint(m[:, 2]))
    assert footprints_meet(col, footprint(m[4]))  # row 4 holds m[4, 1]
    assert not footprints_meet(footprint(m[0::2, :4]), footprint(m[1::2, :]))
    assert footprints_meet(footprint(m[0::2, :4]), footprint(m[2:3, 3:5]))
    assert footprint(m[:4, :].t()) == footprint(m[:4, :])  # same bytes, any order


# -- ops that return no tensor ---------------------------------------------------------------


def test_foreach_inplace_on_unordered_streams_races_per_tensor_and_takes_time() -> None:
    d, compute, comm = setup()
    xs = [torch.ones(16) for _ in range(10)]
    with d.thread_scope(0):
        d.set_stream(compute)
        torch._foreach_mul_(xs, 2.0)
        d.set_stream(comm)
        torch._foreach_mul_(xs, 3.0)
    assert len(d.races) == 10
    assert all(r.second.argument == "self" for r in d.races)
    ops = [r for r in d.timeline if r.name == "aten::_foreach_mul_"]
    assert len(ops) == 2 and all(r.dur_us > 0 for r in ops)


def test_fused_optimizer_step_is_checked() -> None:
    d, compute, comm = setup()
    params, grads = [torch.zeros(4)], [torch.ones(4)]
    exp_avg, exp_avg_sq, steps = [torch.zeros(4)], [torch.zeros(4)], [torch.tensor(0.0)]
    with d.thread_scope(0):
        d.set_stream(compute)
        grads[0].mul_(0.5)  # the gradient is produced on compute
        d.set_stream(comm)
        torch._fused_adam_(
            params,
            grads,
            exp_avg,
            exp_avg_sq,
            [],
            steps,
            lr=0.1,
            beta1=0.9,
            beta2=0.99,
            weight_decay=0.0,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )
    assert [(r.first.op, r.second.op) for r in d.races] == [("aten::mul_", "aten::_fused_adam_")]


def test_out_list_is_written() -> None:
    d, compute, comm = setup()
    x = torch.arange(4.0).view(2, 2)
    a, b = torch.zeros(2), torch.zeros(2)
    with d.thread_scope(0):
        d.set_stream(compute)
        b.sum()
        d.set_stream(comm)
        torch.ops.aten.unbind_copy.int_out(x, 0, out=[a, b])
    (race,) = d.races
    assert race.second.argument == "out" and race.second.is_write and not race.first.is_write


# -- the caching allocator -------------------------------------------------------------------


def _free_while_comm_reads(d: SimDevice, compute, comm, *, record: bool, wait: bool) -> None:
    x = torch.randn(256)
    with d.thread_scope(0):
        d.set_stream(compute)
        y = x * 2  # allocated on compute
        e = compute.record_event()
        d.set_stream(comm)
        comm.wait_event(e)
        with d.comm_region("dispatch", nbytes=1024, ep_size=8) as h:
            y.sum()  # the comm stream reads y
        if record:
            d.record_stream(y, comm)
        d.set_stream(compute)
        if wait:
            compute.wait_event(h.event)
        del y  # freed while the comm read may still run
        z = x + 1  # same size on compute: the allocator hands it y's block
        del z


def test_allocator_reuse_of_a_block_still_read_on_another_stream_races() -> None:
    d, compute, comm = setup()
    _free_while_comm_reads(d, compute, comm, record=False, wait=False)
    (race,) = d.races
    assert (race.first.op, race.first.stream) == ("comm::dispatch", "comm")
    second = (race.second.op, race.second.stream, race.second.argument)
    assert second == ("aten::add", "compute", "output")
    assert race.freed_allocation and "_free_while_comm_reads" in race.freed_allocation[-1]
    assert "reused after free" in race.describe()


def test_record_stream_orders_the_allocator_reuse() -> None:
    d, compute, comm = setup()
    _free_while_comm_reads(d, compute, comm, record=True, wait=False)
    assert d.races == []


def test_an_event_wait_before_the_free_orders_the_allocator_reuse() -> None:
    d, compute, comm = setup()
    _free_while_comm_reads(d, compute, comm, record=False, wait=True)
    assert d.races == []


def test_a_block_is_reused_only_by_its_own_streams_allocations() -> None:
    d, compute, comm = setup()
    x = torch.randn(256)
    with d.thread_scope(0):
        d.set_stream(compute)
        y = x * 2
        d.set_stream(comm)
        comm.wait_event(compute.record_event())
        y.sum()  # the comm stream reads y, allocated on compute
        del y  # freed while that read is pending
        z = x + 1  # allocated on comm: another pool
        del z
    assert len(d.races) == 0


# -- reports ---------------------------------------------------------------------------------


def test_report_names_ops_streams_ubatches_bytes_arguments_stacks_and_allocation() -> None:
    d, compute, comm = setup()
    a, c = torch.randn(16), torch.zeros(4)
    with d.thread_scope(1):
        d.set_stream(compute)
        buf = a * 2  # allocated here
        d.set_stream(comm)
        torch.add(c, buf[4:8], out=c)
    (race,) = d.races
    assert (race.first.op, race.first.stream, race.first.ubatch) == ("aten::mul", "compute", 1)
    assert (race.first.argument, race.first.is_write) == ("output", True)
    second = (race.second.op, race.second.stream, race.second.argument)
    assert second == ("aten::add", "comm", "other")
    assert (race.second.start, race.second.end) == (16, 32)
    assert "test_report_names" in race.allocation[-1]
    text = str(race)
    parts = ("aten::mul", "aten::add", "'comm'", "ubatch 1", "other", "[16, 32)", "allocated at")
    for part in parts:
        assert part in text, part
    assert text.count("test_sim_races.py") >= 3  # both stacks and the allocation site


# -- tensors without plain strided memory ----------------------------------------------------


@pytest.mark.parametrize("check_races", [True, False])
@pytest.mark.parametrize("kind", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_in_a_ubatch_are_checked_through_their_parts(
    kind: str, check_races: bool
) -> None:
    d = SimDevice(SimOptions("h200", check_races=check_races))
    compute, comm = d.Stream("compute"), d.Stream("comm")
    dense = torch.eye(4)
    sparse = dense.to_sparse() if kind == "coo" else dense.to_sparse_csr()
    with d.thread_scope(0):
        d.set_stream(compute)
        out = torch.mm(sparse, dense) if kind == "coo" else sparse @ dense
        sparse.values().mul_(2)  # writes the values the product read, on the same stream
        d.set_stream(comm)
        sparse.values().mul_(3)  # unordered with the write on compute
    assert torch.equal(out, dense)
    assert len(d.races) == (1 if check_races else 0)


@pytest.mark.parametrize("check_races", [True, False])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensor_in_a_ubatch_is_checked_through_its_buffer(check_races: bool) -> None:
    d = SimDevice(SimOptions("h200", check_races=check_races))
    compute, comm = d.Stream("compute"), d.Stream("comm")
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with d.thread_scope(0):
        d.set_stream(compute)
        nt.mul_(2)
        d.set_stream(comm)
        nt.mul_(3)
    assert len(d.races) == (1 if check_races else 0)
    assert nt.values().tolist() == [6.0] * 5


def test_mkldnn_tensor_is_placed_unchecked_and_noted_once() -> None:
    d, compute, _ = setup()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without MKL-DNN")
    m = torch.randn(4, 4).to_mkldnn()
    with d.thread_scope(0):
        d.set_stream(compute)
        with pytest.warns(RuntimeWarning, match="placed without a race check"):
            m + m
        m + m
    assert d.races == [] and len(d.race_checker.notes) == 1
    assert sum(r.name == "aten::add" for r in d.timeline) == 2


def test_report_says_when_the_allocation_was_not_seen() -> None:
    d, compute, comm = setup()
    x = torch.zeros(8)  # made before the device saw anything
    with d.thread_scope(0):
        d.set_stream(compute)
        x.fill_(1)
        d.set_stream(comm)
        x.fill_(2)
    (race,) = d.races
    assert race.allocation == () and "allocated outside" in str(race)


def test_low_latency_staging_freed_after_the_send_is_not_an_allocator_hazard() -> None:
    """Writes inside an "ll" region land on the link track; a temporary the region stages its
    send in, freed at once and its block reused on the sending stream, is not a race: data in
    flight lands in registered buffers, not in memory the allocator hands on."""
    d, compute, _ = setup()
    x = torch.randn(256)
    recv = torch.zeros(256)
    with d.thread_scope(0):
        d.set_stream(compute)
        with d.comm_region("dispatch", nbytes=1024, mode="ll", ep_size=16) as h:
            staged = x * 1.0  # staging buffer, allocated on the sending stream
            recv.copy_(staged)
        del staged
        y = x + 1  # same size on the sending stream: may get the staging block
        compute.wait_event(h.event)
        recv.sum()
        del y
    assert d.races == []


def _storage_at_dead_key(
    d: SimDevice, compute: object, x: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """A new tensor (allocated unplaced) whose storage object likely takes the address, and
    so the key, of a tiny temporary the checker saw and that just died, not yet reaped.
    Returns the tensor and whether the key was in fact reused."""
    with d.thread_scope(0):
        d.set_stream(compute)
        tiny = x.sum()  # seen by the checker as the sum's output
    key = tiny.untyped_storage()._cdata
    del tiny  # dead: its record waits on the dead list
    z = torch.empty(1024)  # outside the scope: no placement, no reap in between
    return z, z.untyped_storage()._cdata == key


def test_a_new_storage_at_a_dead_storages_key_is_checked_as_new() -> None:
    reused = 0
    for _ in range(5):
        d, compute, comm = setup()
        x = torch.randn(1024)
        z, hit = _storage_at_dead_key(d, compute, x)
        reused += hit
        with d.thread_scope(0):
            d.set_stream(comm)
            z.fill_(1.0)  # comm writes z...
            d.set_stream(compute)
            z.fill_(2.0)  # ...and compute too, unordered: a race however z was registered
        assert len(d.races) == 1, f"race missed (storage key reused: {hit})"
    assert reused, "the allocator never reused the dead key: the test proves nothing here"


def test_a_new_allocation_at_a_dead_storages_key_takes_the_freed_blocks_hazard() -> None:
    reused = 0
    for _ in range(5):
        d, compute, comm = setup()
        x = torch.randn(1024)
        with d.thread_scope(0):
            d.set_stream(compute)
            y = x * 2
            comm.wait_event(compute.record_event())
            d.set_stream(comm)
            y.add_(1.0)  # comm writes y; nothing orders compute after it
            d.set_stream(compute)
        del y  # the allocator hands y's block on with comm's write pending
        z, hit = _storage_at_dead_key(d, compute, x)
        reused += hit
        d.note_allocation(z)  # allocated on compute: gets y's block
        with d.thread_scope(0):
            z.fill_(2.0)
        assert len(d.races) == 1, f"allocator hazard missed (storage key reused: {hit})"
        assert d.races[0].first.op == "aten::add_"
    assert reused, "the allocator never reused the dead key: the test proves nothing here"


@pytest.mark.timeout(30)
def test_a_race_reports_user_stacks_without_the_ubatch_runtimes_frames() -> None:
    d = SimDevice(SimOptions("h200"))
    bufs = [torch.zeros(64), torch.zeros(64)]

    def step(u: int) -> None:
        bufs[u].add_(1.0)
        dbo.dbo_switch_to_comm()  # bug: no wait for the compute above
        with dbo.current_device().comm_region("dispatch", nbytes=256, ep_size=8):
            bufs[u].clone()
        dbo.dbo_switch_to_compute_sync()

    dbo.run_ubatches(step, [0, 1], device=d)
    assert d.races
    for race in d.races:
        for site in (race.first, race.second):
            assert site.stack and site.stack[-1].endswith(":step")
            assert not any(f.startswith(("dbo/runner.py", "dbo/ubatching.py")) for f in site.stack)


@pytest.mark.timeout(30)
def test_a_user_stack_with_only_runtime_frames_keeps_the_innermost_one() -> None:
    # A frame of the runtime's own file, on a thread with no user code below it.
    namespace: dict = {"user_stack": user_stack}
    source = "def runtime_issue(out):\n    out.append(user_stack(skip=1))\n"
    exec(compile(source, runner.__file__, "exec"), namespace)  # noqa: S102 -- a fixed source
    got: list = []
    t = threading.Thread(target=namespace["runtime_issue"], args=(got,))
    t.start()
    t.join()
    assert got == [((runner.__file__, 2, "runtime_issue"),)]


def test_a_storage_resized_to_new_memory_is_tracked_at_that_memory() -> None:
    d, compute, _ = setup()
    with d.thread_scope(0):
        d.set_stream(compute)
        y = torch.zeros(256) + 1
        old = y.data_ptr()
        y.resize_(1 << 16)  # reallocates the same storage object elsewhere
        assert y.data_ptr() != old
        y.fill_(1.0)
    checker = d.race_checker
    assert checker.ops_at(y.data_ptr()) == ["aten::fill_"]
    assert checker.ops_at(old) == []  # the old memory went back to the allocator
    assert checker.num_blocks == 1
