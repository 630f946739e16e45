"""Concurrent slot access: many ubatch threads hammering one WorkspaceManager with random
requests, growth, lock windows and allocation failures, checking its invariants and that
nothing hangs. Threads here run *outside* the DBO baton, the harder case for the manager.
The last test adds workspace lanes and persistent resources, and checks the orphan
accounting exactly against the views the threads still hold."""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

import pytest
import torch

from workspace import (
    WorkspaceAllocationError,
    WorkspaceLockedError,
    WorkspaceManager,
    use_workspace_lane,
)
from workspace.testing import InjectedAllocationError, as_ubatch

# Tests here start threads: each gets this bound unless it carries its own, so a hang fails
# the test, never the whole run.
pytestmark = pytest.mark.timeout(60)

NUM_THREADS = 8
JOIN_TIMEOUT_S = 40
DTYPES = [
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
]


def random_request(rng: random.Random, max_bytes: int) -> tuple:
    """1-4 (shape, dtype) pairs of 0-3 dims, each about max_bytes / n bytes at most."""
    pairs = []
    n = rng.randint(1, 4)
    for _ in range(n):
        dtype = rng.choice(DTYPES)
        budget = max(1, max_bytes // (n * dtype.itemsize))
        ndim = rng.randint(0, 3)
        if ndim == 0:
            shape: tuple[int, ...] = ()
        else:
            numel = rng.randint(0, budget) if rng.random() < 0.05 else rng.randint(1, budget)
            first = rng.randint(1, max(1, numel)) if numel else 0
            rest = numel // first if first else 1
            shape = (first,) + (1,) * (ndim - 2) + ((rest,) if ndim > 1 else ())
        pairs.append((shape if rng.random() < 0.8 else list(shape), dtype))
    return tuple(pairs)


class Harness:
    """One manager, an allocation log (with optional injected failures), a checker of equal
    lane slots and per-thread error capture."""

    def __init__(self, num_slots: int, num_lanes: int = 1) -> None:
        self.manager = WorkspaceManager("cpu", num_ubatches=num_slots, num_lanes=num_lanes)
        self.num_lanes = num_lanes
        self.allocations: list[int] = []
        self.errors: list[str] = []
        self.unequal_after_growth: list[list[int]] = []
        self.fail_rate = 0.0  # share of allocations that fail (InjectedAllocationError)
        self._fail_rng = random.Random(3)
        self._hooked = ExitStack()  # for the manager's life (the test's)
        self._hooked.enter_context(self.manager.allocation_hook(self._allocate))

    def _allocate(self, nbytes: int, allocate: Callable[[int], torch.Tensor]) -> torch.Tensor:
        # called under the manager's lock: the rng use is serial
        if self.fail_rate and self._fail_rng.random() < self.fail_rate:
            raise InjectedAllocationError(f"injected ({nbytes} bytes)")
        self.allocations.append(nbytes)  # the allocations made, not the failed attempts
        return allocate(nbytes)

    def _check_equal_lanes(self, stop: threading.Event) -> None:
        # slot_capacities() takes the manager's lock, so it sees only states between growths
        while not stop.is_set():
            caps = self.manager.slot_capacities()
            for lane in range(self.num_lanes):
                if len(set(caps[lane :: self.num_lanes])) != 1:
                    self.unequal_after_growth.append(caps)
            time.sleep(0.0005)

    def run_threads(self, targets: list[Callable[[], None]]) -> None:
        """Run targets[k] in a thread registered as ubatch k; join with a deadline."""

        def wrap(fn: Callable[[], None], k: int) -> Callable[[], None]:
            def body() -> None:
                try:
                    with as_ubatch(k):
                        fn()
                except BaseException as exc:  # reported by the test thread
                    self.errors.append(f"ubatch {k}: {type(exc).__name__}: {exc}")

            return body

        threads = [
            threading.Thread(target=wrap(fn, k), name=f"ubatch-{k}", daemon=True)
            for k, fn in enumerate(targets)
        ]
        stop = threading.Event()
        checker = threading.Thread(target=self._check_equal_lanes, args=(stop,), daemon=True)
        checker.start()
        for t in threads:
            t.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stop.set()
        checker.join(5)
        hung = [t.name for t in threads if t.is_alive()]
        assert not hung, f"threads did not finish: {hung}"
        assert not self.errors, "\n".join(self.errors[:10])
        assert not self.unequal_after_growth, self.unequal_after_growth[:5]


def check_views(
    manager: WorkspaceManager,
    k: int,
    request: tuple,
    views: list[torch.Tensor],
    gen_before: int,
    gen_after: int,
) -> None:
    """Every view: the requested shape and dtype, wholly inside a buffer of slot k that was
    slot k's buffer at some point during the call, and in no other slot's current buffer."""
    assert len(views) == len(request)
    others = [b for j, b in enumerate(manager.slot_buffers()) if j != k and b is not None]
    for view, (shape, dtype) in zip(views, request):
        assert tuple(view.shape) == tuple(shape) and view.dtype == dtype
        if view.numel() == 0:
            continue
        start, end = view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()
        info = manager.describe_buffer(start)
        assert info is not None, "view outside every slot buffer"
        assert info.slot == k, f"view of ubatch {k} lies in slot {info.slot}"
        assert gen_before <= info.generation <= gen_after, (
            f"slot {k} view from generation {info.generation}, call saw {gen_before}..{gen_after}"
        )
        assert end <= info.data_ptr + info.nbytes, "view runs past its slot buffer"
        assert view.untyped_storage().data_ptr() == info.data_ptr
        for other in others:
            assert end <= other.data_ptr or start >= other.data_ptr + other.nbytes, (
                f"slot {k} view overlaps slot {other.slot}"
            )


def fill_value(dtype: torch.dtype, k: int) -> int | bool:
    return True if dtype == torch.bool else k + 1


@pytest.mark.timeout(60)
def test_concurrent_ubatches_with_growth_and_lock_windows_keep_every_invariant():
    h = Harness(NUM_THREADS)
    m = h.manager
    iterations = 500
    stop = threading.Event()
    lock_windows: list[int] = []
    refusals = [0] * NUM_THREADS
    served = [0] * NUM_THREADS

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(1000 + k)
            for i in range(iterations):
                # the size bound creeps up, so growth keeps happening through the whole run
                request = random_request(rng, 2048 + i * 512)
                gen_before = m.slot_generation(k)
                try:
                    views = m.get_simultaneous(*request)
                except WorkspaceLockedError:
                    refusals[k] += 1
                    continue
                gen_after = m.slot_generation(k)
                check_views(m, k, request, views, gen_before, gen_after)
                # isolation by content: other threads' writes must never land in our views
                for v in views:
                    v.fill_(fill_value(v.dtype, k))
                time.sleep(0)
                for v in views:
                    assert bool((v == fill_value(v.dtype, k)).all()), f"slot {k} data clobbered"
                served[k] += 1

        return run

    def locker() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            m.lock()
            before = len(h.allocations)
            time.sleep(rng.uniform(0.001, 0.004))
            during = len(h.allocations) - before
            m.unlock()
            lock_windows.append(during)
            time.sleep(rng.uniform(0.0005, 0.002))

    workers = [worker(k) for k in range(NUM_THREADS)]
    locker_thread = threading.Thread(target=locker, daemon=True)
    locker_thread.start()
    try:
        h.run_threads(workers)
    finally:
        stop.set()
        locker_thread.join(5)
    assert not locker_thread.is_alive()
    assert lock_windows and all(n == 0 for n in lock_windows), "allocation while locked"
    assert sum(served) + sum(refusals) == NUM_THREADS * iterations
    growths = m.growth_history()
    assert len(growths) >= 5, "the run did not exercise growth"
    assert all(g.num_slots == NUM_THREADS and g.new_bytes > g.old_bytes for g in growths)
    assert len(set(m.slot_capacities())) == 1


@pytest.mark.timeout(60)
def test_simultaneous_first_requests_from_every_ubatch_grow_all_slots_to_the_largest():
    h = Harness(NUM_THREADS)
    m = h.manager
    barrier = threading.Barrier(NUM_THREADS, timeout=20)
    sizes = [(k + 1) * 4096 for k in range(NUM_THREADS)]
    got: dict[int, torch.Tensor] = {}

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            barrier.wait()
            gen_before = m.slot_generation(k)
            (v,) = m.get_simultaneous(((sizes[k],), torch.uint8))
            check_views(m, k, (((sizes[k],), torch.uint8),), [v], gen_before, m.slot_generation(k))
            got[k] = v

        return run

    h.run_threads([worker(k) for k in range(NUM_THREADS)])
    assert m.slot_capacities() == [max(sizes)] * NUM_THREADS
    growths = m.growth_history()
    assert 1 <= len(growths) <= NUM_THREADS
    assert [g.new_bytes for g in growths] == sorted({g.new_bytes for g in growths})
    # allocations: NUM_THREADS per growth, nothing else
    assert len(h.allocations) == NUM_THREADS * len(growths)
    assert sorted(got) == list(range(NUM_THREADS))


@pytest.mark.timeout(60)
def test_allocation_failures_under_contention_leave_slots_equal_and_nothing_hung():
    h = Harness(NUM_THREADS)
    m = h.manager
    failures = [0] * NUM_THREADS
    h.fail_rate = 0.15

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(50 + k)
            for i in range(300):
                request = random_request(rng, 1024 + i * 256)
                gen_before = m.slot_generation(k)
                try:
                    views = m.get_simultaneous(*request)
                except WorkspaceAllocationError as exc:
                    assert isinstance(exc.__cause__, InjectedAllocationError)
                    failures[k] += 1
                    continue
                check_views(m, k, request, views, gen_before, m.slot_generation(k))

        return run

    h.run_threads([worker(k) for k in range(NUM_THREADS)])
    assert sum(failures) > 0, "no injected failure was hit"
    assert m.stats().failed_growths > 0
    assert len(set(m.slot_capacities())) == 1
    h.fail_rate = 0.0
    need = m.capacity + 4096
    (v,) = m.get_simultaneous(((need,), torch.uint8))  # and it still grows afterwards
    assert v.numel() == need and m.slot_capacities() == [need] * NUM_THREADS


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_threads", [16, 32])
def test_lanes_persistent_resources_and_injected_failures_keep_orphan_accounting_exact(
    num_threads: int,
):
    """Many ubatches x 2 lanes, outside the baton: random requests in random lanes, views held
    across other threads' growths, injected allocation failures and lock windows. Every view
    lies in its own (ubatch, lane) slot, every lane's slots stay equal, persistent resources
    never move, and the orphaned bytes the manager reports equal, exactly, the bytes of
    replaced buffers that the held views keep alive (and fall to zero when they are dropped).
    """
    lanes = 2
    h = Harness(num_threads, num_lanes=lanes)
    m = h.manager
    failures = [0] * num_threads
    refusals = [0] * num_threads

    h.fail_rate = 0.1
    held: list[list[torch.Tensor]] = [[] for _ in range(num_threads)]
    persistent: dict[tuple[int, int], torch.Tensor] = {}
    stop = threading.Event()
    warmed = threading.Event()  # lock windows start once every persistent tensor exists
    warmup_done = threading.Barrier(num_threads, action=warmed.set, timeout=30)

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(900 + k)
            for lane in range(lanes):
                with use_workspace_lane(lane):
                    t = m.get_persistent(("state", k, lane), (4,), torch.int64, zero_init=True)
                    t.fill_(k * lanes + lane)
                    persistent[(k, lane)] = t
            warmup_done.wait()
            for i in range(1600 // num_threads):
                lane = rng.randrange(lanes)
                request = random_request(rng, 512 + i * 128)
                with use_workspace_lane(lane):
                    wid = k * lanes + lane
                    gen_before = m.slot_generation(wid)
                    try:
                        views = m.get_simultaneous(*request)
                    except WorkspaceAllocationError as exc:
                        assert isinstance(exc.__cause__, InjectedAllocationError)
                        failures[k] += 1
                        continue
                    except WorkspaceLockedError:
                        refusals[k] += 1
                        continue
                    check_views(m, wid, request, views, gen_before, m.slot_generation(wid))
                    again = m.get_persistent(("state", k, lane), (4,), torch.int64)
                    assert again is persistent[(k, lane)], "a persistent tensor moved"
                if rng.random() < 0.3:  # hold some views across later growths
                    held[k] = (held[k] + views)[-3:]

        return run

    def locker() -> None:
        rng = random.Random(5)
        warmed.wait(30)
        while not stop.is_set():
            m.lock()
            time.sleep(rng.uniform(0.0005, 0.002))
            m.unlock()
            time.sleep(rng.uniform(0.001, 0.003))

    locker_thread = threading.Thread(target=locker, daemon=True)
    locker_thread.start()
    try:
        h.run_threads([worker(k) for k in range(num_threads)])
    finally:
        stop.set()
        locker_thread.join(5)
    assert not locker_thread.is_alive()
    print(
        f"{num_threads} threads x {lanes} lanes: {len(m.growth_history())} growths, "
        f"{sum(failures)} injected failures, {sum(refusals)} locked refusals"
    )
    assert sum(failures) > 0 and m.stats().failed_growths > 0
    for lane in range(lanes):
        assert len(set(m.slot_capacities()[lane::lanes])) == 1
    for (k, lane), t in persistent.items():
        assert t.tolist() == [k * lanes + lane] * 4, "persistent contents clobbered"
    assert m.persistent_resource_count() == num_threads * lanes

    current = {b.data_ptr for b in m.slot_buffers() if b is not None}
    kept_alive: dict[int, int] = {}
    for views in held:
        for v in views:
            storage = v.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in current:
                kept_alive[storage.data_ptr()] = storage.nbytes()
    assert m.orphaned_bytes() == sum(kept_alive.values())
    assert m.stats().orphaned_buffers == len(kept_alive)
    held.clear()
    del v, views, storage  # the loop's last references
    gc.collect()
    assert m.orphaned_bytes() == 0
