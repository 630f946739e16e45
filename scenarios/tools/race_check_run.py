"""The work of `dbo-sim race-check`: the seeded race programs, each run on the simulated
device's checker and under torch's CSAN, and their verdicts side by side.

Each program is written once against the `dbo.streams.Device` interface and the dbo
primitives, so the same code runs on the simulated device (our verdict) and, where CUDA is
present, on real streams under torch's CUDA sanitizer (CSAN). CSAN's dispatch mode is
thread-local, and the ubatch threads are outside its view when it is enabled as usual; here
one sanitizer (one event handler) is entered in every thread that issues work, through the
device's `thread_scope`, and its errors are collected instead of raised. The table shows,
per program, the expected verdict and both verdicts side by side (the number of races each
reported); a row where a checker disagrees with the expectation is marked.

The programs: the four seeded DBO bugs of the project's tests with their correct twins, and
the cases where histories by memory matter (memory reuse, list ops, a second storage over the
same memory, strided views, overlapping views at different starts, allocator reuse with and
without `record_stream`).
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dbo
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.streams import CudaDevice, Device
from scenarios.lib.usage import UsageError

__all__ = ["PROGRAMS", "Program", "Verdict", "format_table", "run_csan", "run_sim", "run"]


@dataclass(frozen=True)
class Program:
    name: str
    expect_race: bool
    body: Callable[[Device], None]  # issues its work on `device` (tensors on its torch_device)
    note: str = ""
    csan_sees: bool = True  # False: CSAN cannot see this kind of race (reason in note)


@dataclass(frozen=True)
class Verdict:
    races: int | None  # None: not run
    error: str | None = None

    def cell(self) -> str:
        if self.error is not None:
            return f"error: {self.error}"
        if self.races is None:
            return "n/a"
        return f"race x{self.races}" if self.races else "clean"


def _tensor(device: Device, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=device.torch_device)


# -------------------------------------------------------------------- the four seeded bugs


def _a_comm_skips_wait(sync: bool) -> Callable[[Device], None]:
    def body(device: Device) -> None:
        bufs = [_tensor(device, 64), _tensor(device, 64)]

        def fn(u: int) -> None:
            bufs[u].add_(1.0)  # compute writes what the dispatch sends
            (dbo.dbo_switch_to_comm_sync if sync else dbo.dbo_switch_to_comm)()
            with dbo.current_device().comm_region("dispatch", nbytes=256, ep_size=8):
                bufs[u].clone()
            dbo.dbo_switch_to_compute_sync()

        dbo.run_ubatches(fn, [0, 1], device=device)

    return body


def _b_slot_reissued(waits: bool) -> Callable[[Device], None]:
    def body(device: Device) -> None:
        slot = torch.zeros(4096, dtype=torch.uint8, device=device.torch_device)
        compute, comm = device.Stream("compute"), device.Stream("comm")
        with device.thread_scope(None):
            device.set_stream(compute)
            send = slot[:1024].view(torch.float32)
            send.fill_(1.0)
            e = compute.record_event()
            device.set_stream(comm)
            comm.wait_event(e)
            with device.comm_region("dispatch", nbytes=1024, ep_size=8) as h:
                send.clone()  # the comm stream reads the slot's first KiB
            device.set_stream(compute)
            if waits:
                compute.wait_event(h.event)
            slot[512:768].view(torch.float32).zero_()  # the slot handed out again, offset 512

    return body


def _c_two_ubatches_one_slot(shared: bool) -> Callable[[Device], None]:
    def body(device: Device) -> None:
        slots = [torch.zeros(64, device=device.torch_device) for _ in range(2)]
        xs = [_tensor(device, 32), _tensor(device, 32)]

        def fn(u: int) -> None:
            slot = slots[0 if shared else u]
            send, recv = slot[:32], slot[32:]
            send.copy_(xs[u])
            dbo.dbo_yield_and_switch_from_compute_to_comm()
            with dbo.current_device().comm_region("dispatch", nbytes=128, ep_size=8):
                recv.copy_(send)
            dbo.dbo_yield_and_switch_from_comm_to_compute()
            recv.mul_(2.0)

        dbo.run_ubatches(fn, [0, 1], device=device)

    return body


def _d_recv_hook_before_arrival(waits_first: bool) -> Callable[[Device], None]:
    def body(device: Device) -> None:
        srcs = [_tensor(device, 16), _tensor(device, 16)]
        recvs = [torch.zeros(16, device=device.torch_device) for _ in range(2)]

        def fn(u: int) -> None:
            dbo.dbo_maybe_run_recv_hook()
            with dbo.current_device().comm_region("combine", nbytes=64, mode="ll", ep_size=16) as h:
                recvs[u].copy_(srcs[u])

            def hook() -> None:
                stream = dbo.current_stream()
                if waits_first:
                    stream.wait_event(h.event)
                recvs[u] + 1.0
                if not waits_first:
                    stream.wait_event(h.event)

            dbo.dbo_register_recv_hook(hook)
            dbo.dbo_yield()
            dbo.dbo_maybe_run_recv_hook()

        dbo.run_ubatches(fn, [0, 1], device=device)

    return body


# ------------------------------------------------------------------- memory-level cases


@contextmanager
def _two_streams(device: Device) -> Iterator[tuple[Any, Any]]:
    with device.thread_scope(0):
        yield device.Stream("compute"), device.Stream("comm")
        device.synchronize()


def _memory_reuse_loop(device: Device) -> None:
    with _two_streams(device) as (a, b):
        for i in range(50):
            device.set_stream(a if i % 2 else b)
            t = torch.tensor([1.0, 2.0], device=device.torch_device)
            t.mul_(2)
            del t


def _foreach(ordered: bool) -> Callable[[Device], None]:
    def body(device: Device) -> None:
        xs = [_tensor(device, 16) for _ in range(10)]
        with _two_streams(device) as (a, b):
            device.set_stream(a)
            torch._foreach_mul_(xs, 2.0)
            if ordered:
                b.wait_event(a.record_event())
            device.set_stream(b)
            torch._foreach_mul_(xs, 3.0)

    return body


def _second_storage(device: Device) -> None:
    x = torch.zeros(64, device=device.torch_device)
    y = torch.from_dlpack(x)
    with _two_streams(device) as (a, b):
        device.set_stream(a)
        x.fill_(1)
        device.set_stream(b)
        y.sum()


def _even_odd(device: Device) -> None:
    buf = torch.zeros(1024, device=device.torch_device)
    with _two_streams(device) as (a, b):
        device.set_stream(a)
        buf[0::2].fill_(1)
        device.set_stream(b)
        buf[1::2].fill_(2)


def _overlapping_views(device: Device) -> None:
    slot = torch.zeros(256, device=device.torch_device)
    with _two_streams(device) as (a, b):
        device.set_stream(a)
        slot[0:128].fill_(1)
        device.set_stream(b)
        slot[64:192].fill_(2)  # a view starting elsewhere, sharing 64 elements


def _allocator_reuse(record: bool) -> Callable[[Device], None]:
    def body(device: Device) -> None:
        x = _tensor(device, 1 << 16)
        with _two_streams(device) as (compute, comm):
            device.set_stream(compute)
            y = x * 2  # allocated on compute
            comm.wait_event(compute.record_event())
            device.set_stream(comm)
            y.sum()  # the comm stream reads y
            if record:
                dbo.record_stream(y, comm)  # the same line on CUDA and the simulator
            device.set_stream(compute)
            del y  # freed while the read may still be queued
            z = x + 1  # same size on compute: handed y's block
            del z

    return body


PROGRAMS: tuple[Program, ...] = (
    Program("a: comm skips the compute wait", True, _a_comm_skips_wait(False)),
    Program("a twin: switch_to_comm_sync", False, _a_comm_skips_wait(True)),
    Program("b: slot reissued during the comm read", True, _b_slot_reissued(False)),
    Program("b twin: wait for the dispatch first", False, _b_slot_reissued(True)),
    Program(
        "c: two ubatches served one slot",
        True,
        _c_two_ubatches_one_slot(True),
        note="CSAN enabled as usual misses it: the ubatch threads are outside its view",
    ),
    Program("c twin: one slot per ubatch", False, _c_two_ubatches_one_slot(False)),
    Program(
        "d: recv hook reads before arrival",
        True,
        _d_recv_hook_before_arrival(False),
        note="on CUDA without DeepEP the ll transfer runs on the issuing stream",
        csan_sees=False,
    ),
    Program("d twin: hook waits for arrival", False, _d_recv_hook_before_arrival(True)),
    Program("memory reused after free", False, _memory_reuse_loop),
    Program("_foreach_mul_ on unordered streams", True, _foreach(False)),
    Program("_foreach_mul_ ordered by an event", False, _foreach(True)),
    Program("second storage (from_dlpack)", True, _second_storage),
    Program("even/odd strided views", False, _even_odd),
    Program(
        "overlapping views, other start",
        True,
        _overlapping_views,
        note="CSAN keys by data pointer: views that start elsewhere never meet",
        csan_sees=False,
    ),
    Program(
        "allocator reuse, no record_stream",
        True,
        _allocator_reuse(False),
        note="CSAN forgets a tensor at its free",
        csan_sees=False,
    ),
    Program("allocator reuse with record_stream", False, _allocator_reuse(True)),
)


# ---------------------------------------------------------------------------- runners


def run_sim(program: Program) -> Verdict:
    device = SimDevice(SimOptions("h200", tensor_device="cpu"))
    try:
        program.body(device)
    except Exception as exc:  # noqa: BLE001 -- a program that breaks is a row, not the end
        return Verdict(None, f"{type(exc).__name__}: {exc}")
    return Verdict(len(device.races))


class _CsanDevice(CudaDevice):
    """A CUDA device whose every `thread_scope` enters one shared CSAN dispatch mode, so the
    sanitizer sees the ubatch threads too; races are collected, not raised."""

    def __init__(self) -> None:
        super().__init__()
        from torch.cuda import _sanitizer as csan  # CUDA-only; imported when CUDA is used

        self._csan = csan
        self._root = csan.CUDASanitizerDispatchMode()
        self.errors: list[Any] = []
        handler = self._root.event_handler
        launch = handler._handle_kernel_launch

        def collect(*args: Any, **kwargs: Any) -> list:
            self.errors.extend(launch(*args, **kwargs))
            return []

        handler._handle_kernel_launch = collect
        self._entered = threading.local()

    def _mode_for_thread(self) -> Any:
        # One mode object per thread (its enter/exit bookkeeping is per object), one handler.
        mode = self._csan.CUDASanitizerDispatchMode.__new__(self._csan.CUDASanitizerDispatchMode)
        TorchDispatchMode.__init__(mode)
        mode.event_handler = self._root.event_handler
        return mode

    @contextmanager
    def thread_scope(self, ubatch_id: int | None = None) -> Iterator[None]:
        if getattr(self._entered, "depth", 0):
            yield
            return
        self._entered.depth = 1
        try:
            with self._mode_for_thread():
                yield
        finally:
            self._entered.depth = 0


def run_csan(program: Program) -> Verdict:
    if not torch.cuda.is_available():
        return Verdict(None)
    try:
        device = _CsanDevice()
        program.body(device)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 -- as in run_sim
        return Verdict(None, f"{type(exc).__name__}: {exc}")
    return Verdict(len(device.errors))


def _mark(program: Program, verdict: Verdict, *, csan: bool) -> str:
    cell = verdict.cell()
    if verdict.races is None or verdict.error is not None:
        return cell
    expected = program.expect_race and (program.csan_sees or not csan)
    return cell if bool(verdict.races) == expected else f"{cell} (!)"


def format_table(rows: Sequence[tuple[Program, Verdict, Verdict]]) -> str:
    header = ("program", "expected", "dbo-sim checker", "CSAN, every ubatch thread", "note")
    lines = [
        (
            p.name,
            "race" if p.expect_race else "clean",
            _mark(p, s, csan=False),
            _mark(p, c, csan=True),
            p.note,
        )
        for p, s, c in rows
    ]
    widths = [max(len(str(r[i])) for r in (header, *lines)) for i in range(4)]
    out = []
    for r in (header, *lines):
        out.append(("  ".join(str(r[i]).ljust(widths[i]) for i in range(4)) + f"  {r[4]}").rstrip())
        if r is header:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """Run the chosen programs and print the table; 1 if our checker is wrong on one."""
    chosen = [p for p in PROGRAMS if args.only is None or args.only in p.name]
    if not chosen:
        raise UsageError(f"no program name contains {args.only!r}; see --list")
    if args.list:
        for p in chosen:
            print(f"{p.name}  (expected: {'race' if p.expect_race else 'clean'})")
        return 0
    rows = [(p, run_sim(p), run_csan(p)) for p in chosen]
    print(format_table(rows))
    if not torch.cuda.is_available():
        print("\nCSAN column: n/a, no CUDA device here (run on a GPU machine to fill it).")
    wrong = [p.name for p, s, _ in rows if s.races is None or bool(s.races) != p.expect_race]
    if wrong:
        print(f"\ndbo-sim checker disagrees with the expectation on: {', '.join(wrong)}")
        return 1
    return 0
