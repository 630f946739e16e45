"""WorkspaceManager: per-ubatch scratch slots, grown in step, frozen by lock(), served fast.

Each ubatch thread (`dbo_current_ubatch_id()`) owns one lazily allocated 1-D uint8 slot.
`get_simultaneous((shape, dtype), ...)` lays the requested tensors out from offset 0 of the
caller's slot, each region rounded up to 256 bytes, and returns contiguous views into it, so
a later call aliases the views of an earlier one: that reuse is the point.

Hot path. A request whose signature this slot has served before is answered from a per-slot
cache of template views, keyed by the raw argument tuple: the caller's lane (a context
variable read) and ubatch id pick the cache, then one dict lookup, an exact-int check
of the dims (so `(2.0, 3)` or `(True, 3)` cannot ride on a cached `(2, 3)`), and one `.data`
alias per template (a new tensor object sharing storage, offset, sizes and strides, made
without a dispatcher round trip). No lock, no allocation, no arithmetic. Everything else --
new signatures, lists, numpy ints, growth, errors -- goes to the slow path, which validates
first and only ever caches validated layouts. Template caches are dropped before a growth
releases the buffers they point into. The plain per-call algorithm (byte sizes, round up,
accumulate, slice + view + reshape) redoes all of that arithmetic and several dispatcher
calls per tensor every time; how much the cache saves is measured by `dbo-sim bench`
(workspace.get_simultaneous.*) and reported in the README. Being `.data` aliases, results carry
no autograd view link (`_base` is None) and are never inference tensors, whatever mode made
the templates (scratch bytes are never part of an autograd graph).

Growth. When the caller's slot is too small, every slot is grown to the requested total,
slot by slot, each old buffer released before its replacement is allocated (peak per slot
= new, not old + new; `workspace.growth` does it). Every slot buffer comes from one allocator,
which `allocation_hook` lets a test or a stress run wrap (count, watch, fail). Feasibility is
decided before anything is released: a total beyond int64 (`plan_layout`), or a growth whose
resized slots together would need more than the device has in all (CPU: physical RAM; CUDA:
the device's total; meta: no bound), is refused with ValueError and changes nothing. A
failed allocation below that bound (a real out-of-memory) rolls every slot back to the
previous capacity (or, if even that fails, to empty), so slots stay valid and equal. While
`lock()`ed, a request that does not fit raises `WorkspaceLockedError` naming the caller; one
that fits is served and allocates nothing.

Threads. The slow path runs under one re-entrant lock and re-checks the fit under it, so
slot owners calling at once outside the runtime's baton grow correctly; `lock()` takes the
same lock, so no allocation can start after `lock()` returns. The hot path takes no lock: a
thread racing a growth by another thread may be handed views into its slot's just-replaced
buffer, which then shows up as an orphan (below) -- under the DBO baton that cannot happen.

Known tension, settled for "all slots equal". Growing every slot at once replaces slots
whose owners may still hold views into their old buffer (an init-time reservation kept as an
attribute, a result not yet consumed). That memory stays allocated until the views die: a
hidden peak of old + new for that slot, and on a GPU a hazard if queued kernels still write
it. Growing only the requesting slot avoids replacing the others but leaves them undersized
at lock time, so the first locked request from another ubatch fails (what later vLLM versions
had to patch). Shown in tests/workspace/test_workspace.py (test_synchronous_growth_*): a DBO warmup
in which only ubatch 0 sees the largest shape leaves per-slot growth with a slot that fails
under lock, while synchronous growth serves it. The cost of synchronous growth is exactly the
held views' old buffers: with no views held the peak is the new total; each held view keeps
its old buffer alive on top of it until the view dies (the README gives the figures measured
on a GPU, which matched what `peak_bytes` and `orphaned_bytes()` reported). So we count
orphans instead of hiding them: `orphaned_bytes()`, `stats().orphaning_growths`, `peak_bytes`
(orphans included), the resize debug log, and each `GrowthRecord.orphaned_bytes`.

Lanes and persistent resources (vLLM's names and semantics). A manager has `num_lanes`
independent lanes (`use_workspace_lane(lane)`), so there is one slot per (ubatch, lane),
numbered `ubatch * num_lanes + lane` as in vLLM. Growth stays synchronous *within a lane*:
every ubatch's slot of the requesting lane grows together, other lanes are not touched.
`get_persistent_resource(key, factory)` and `get_persistent(key, shape, dtype, zero_init=)`
keep one object per (ubatch, lane) for the manager's lifetime, apart from the slots, so
growth never moves them; once locked, a key not created during warmup is refused with
`WorkspaceLockedError`. `try_get_simultaneous` answers None where `get_simultaneous` would
raise the locked error; `reserve` grows the lane's slots without handing out views;
`available_bytes()` is what the caller's slot can serve without growing. Deliberate
difference: vLLM's V1 manager grows only the requesting slot (see "Known tension").

Pointer checks. `describe_buffer(ptr)` names the slot buffer (current or former, with its
generation) a device pointer falls in, for the simulator's graph-replay check; it needs a
real device: on `meta` every data_ptr is 0, so it returns None there.

The class is vLLM's API surface; its persistent resources are in `workspace.persistent`, what
it reports about itself (sizes, growths, orphans, pointers, stats) in `workspace.reporting`,
and the slot buffers' growth in `workspace.growth`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch

from dbo.checks import as_int
from dbo.ubatching import check_not_abandoned
from dbo.ubatching import dbo_current_ubatch_id as _current_ubatch_id

from .diagnostics import caller_info, debug_enabled, logger, mb
from .errors import WorkspaceLockedError, WorkspaceSlotError
from .growth import AllocationHook, HookedAllocations, SlotStore, nbytes_of
from .lanes import current_workspace_lane as _current_lane
from .layout import Layout, plan_layout
from .persistent import PersistentResources
from .reporting import WorkspaceReport
from .steps import sizing_story

__all__ = ["WorkspaceManager"]

# Distinct signatures cached per slot before the cache is dropped and refilled. Token counts
# vary per step, so signatures are unbounded in principle; a cleared cache costs one slow
# call per signature, an unbounded one costs memory forever.
MAX_CACHED_SIGNATURES = 4096


def _resolve_device(device: Any) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"device {device!r} is not a valid torch device: {exc}") from None
    inner = getattr(device, "torch_device", None)
    if isinstance(inner, (torch.device, str)):
        # dbo.streams.Device (CUDA or simulated): its tensors live on .torch_device
        return _resolve_device(inner)
    raise TypeError(
        f"device must be a torch.device, a string such as 'cpu', 'meta' or 'cuda:0', or an "
        f"object with a .torch_device (a dbo.streams.Device), got {type(device).__name__} "
        f"{device!r}"
    )


def _check_num_ubatches(num_ubatches: Any) -> int:
    if num_ubatches is None:
        return 1
    return as_int("num_ubatches (or None)", num_ubatches, minimum=1)


def _check_num_lanes(num_lanes: Any) -> int:
    return as_int("num_lanes", num_lanes, minimum=1)


def _check_alloc_context(alloc_context: Any) -> Callable[[], AbstractContextManager]:
    if not callable(alloc_context):
        raise TypeError(
            f"alloc_context must be a callable returning a context manager (such as "
            f"contextlib.nullcontext), got {type(alloc_context).__name__} {alloc_context!r}"
        )
    return cast(Callable[[], AbstractContextManager], alloc_context)


class WorkspaceManager(PersistentResources, WorkspaceReport):
    """Per-ubatch scratch slots on one device (see the module docstring for the contract).

    Failure modes of a growth. A request no slot or device could hold (beyond int64, or
    beyond the device's total memory over the slots it would resize) raises ValueError with
    nothing released: held views stay live, generations and capacities are unchanged. An
    allocation that fails below that bound (a real out-of-memory) happens after the lane's
    old buffers were released, so the rollback re-makes them: views the lane's owners held
    into the old buffers are then orphaned, and counted as any orphan is
    (`orphaned_bytes()`, `orphaning_growths`), before `WorkspaceAllocationError` is raised.
    """

    def __init__(
        self,
        device: Any,
        num_ubatches: int | None = None,
        num_lanes: int = 1,
        alloc_context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        self._device = _resolve_device(device)
        self._num_ubatches = _check_num_ubatches(num_ubatches)
        self._num_lanes = _check_num_lanes(num_lanes)
        n, lanes = self._num_ubatches, self._num_lanes
        # One slot per (ubatch, lane), at index ubatch * num_lanes + lane (vLLM's numbering).
        self._store = SlotStore(self._device, n, lanes, _check_alloc_context(alloc_context))
        self._slots = self._store.slots  # the same list, for the hot path
        self._persistent: list[dict[Hashable, Any]] = [{} for _ in range(n * lanes)]
        # lane -> ubatch -> {request key -> template views}; read lock-free by the hot path.
        # A lane's dict is replaced wholesale (never edited in place) when its buffers change.
        self._views: list[dict[int, dict[Any, tuple[torch.Tensor, ...]]]] = [
            {k: {} for k in range(n)} for _ in range(lanes)
        ]
        self._layouts: dict[Any, Layout] = {}
        self._empty: torch.Tensor | None = None  # 0-byte stand-in before a slot's first growth
        self._locked = False
        self._mutex = threading.RLock()

    # ---------------------------------------------------------------- hot path

    def get_simultaneous(
        self, *shapes_and_dtypes: tuple[Sequence[int], torch.dtype]
    ) -> list[torch.Tensor]:
        """Views for each (shape, dtype), laid out together from offset 0 of the caller's slot.

        Every call starts at offset 0 again, so it aliases the views of the previous call
        from the same ubatch. Grows all slots if needed (unless locked).
        """
        try:
            views = self._views[_current_lane()][_current_ubatch_id()][shapes_and_dtypes]
        except (KeyError, TypeError, IndexError):  # new signature, unhashable, foreign slot
            return self._get_simultaneous_slow(shapes_and_dtypes)
        # A hit means the args *equal* a validated request; equality would let 2.0 or True
        # stand in for 2 or 1, so only exact ints pass (others get validated on the slow path).
        for shape, _ in shapes_and_dtypes:
            for dim in shape:
                if dim.__class__ is not int:
                    return self._get_simultaneous_slow(shapes_and_dtypes)
        if len(views) == 1:  # the common call; skips the comprehension's frame
            return [views[0].data]
        return [view.data for view in views]

    # ---------------------------------------------------------------- slow path

    def try_get_simultaneous(
        self, *shapes_and_dtypes: tuple[Sequence[int], torch.dtype]
    ) -> list[torch.Tensor] | None:
        """`get_simultaneous`, but None where that would raise `WorkspaceLockedError`.

        For callers with a correct slower fallback. Bad input still raises, and an unlocked
        workspace still grows.
        """
        return self._serve(shapes_and_dtypes, soft=True)

    def reserve(self, *shapes_and_dtypes: tuple[Sequence[int], torch.dtype]) -> None:
        """Grow the caller's lane so every ubatch's slot fits this request; hand out nothing.

        For init-time sizing before `lock()`. Idempotent; a request that already fits
        allocates nothing. While locked, one that does not fit raises `WorkspaceLockedError`.
        """
        check_not_abandoned()  # it grows every ubatch's slot, not the caller's alone
        lane = self._check_lane(_current_lane())
        layout = self._layout_for(shapes_and_dtypes, "reserve")
        with self._mutex:
            have = self._store.lane_capacity(lane)
            if layout.total_bytes > have:
                caller = caller_info()
                if self._locked:
                    raise self._locked_error(caller, layout.total_bytes, have, lane)
                self._store.check_fits_device(lane, layout, "reserve", caller)
                self._grow(lane, layout.total_bytes, caller)

    def available_bytes(self) -> int:
        """Bytes the caller's slot (its ubatch and lane) can hand out without growing."""
        wid = self._slot_id(_current_ubatch_id(), _current_lane())
        with self._mutex:
            return nbytes_of(self._slots[wid])

    # ---------------------------------------------------------------- slow path

    def _get_simultaneous_slow(self, args: tuple[Any, ...]) -> list[torch.Tensor]:
        views = self._serve(args, soft=False)
        assert views is not None  # only soft calls answer None
        return views

    def _serve(self, args: tuple[Any, ...], soft: bool) -> list[torch.Tensor] | None:
        ubatch = self._check_slot(_current_ubatch_id())
        lane = self._check_lane(_current_lane())
        layout = self._layout_for(args)  # validates; raises before touching any state
        views = self._views[lane][ubatch].get(layout.key)
        if views is None:
            with self._mutex:
                wid = ubatch * self._num_lanes + lane
                # Size only, no reference: a local holding the buffer across _grow would keep
                # it allocated while its replacement is allocated.
                have = nbytes_of(self._slots[wid])
                if layout.total_bytes > have:
                    caller = caller_info()
                    if self._locked:
                        if soft:
                            return None
                        raise self._locked_error(caller, layout.total_bytes, have, lane)
                    who = "try_get_simultaneous" if soft else "get_simultaneous"
                    self._store.check_fits_device(lane, layout, who, caller)
                    self._grow(lane, layout.total_bytes, caller)
                views = self._make_views(self._slots[wid], layout)
                cache = self._views[lane][ubatch]
                if len(cache) >= MAX_CACHED_SIGNATURES:
                    cache.clear()
                cache[layout.key] = views
        return [view.data for view in views]

    def _locked_error(self, caller: str, need: int, have: int, lane: int) -> WorkspaceLockedError:
        return WorkspaceLockedError(
            f"Workspace is locked but allocation from '{caller}' requires {mb(need)}, current "
            f"size is {mb(have)}; growth is not allowed after lock_workspace() (call "
            f"unlock_workspace() to re-warm){sizing_story(self._store.growths, lane, need)}"
        )

    def _check_slot(self, ubatch: Any) -> int:
        if isinstance(ubatch, int) and 0 <= ubatch < self._num_ubatches:
            return ubatch
        raise WorkspaceSlotError(
            f"ubatch id {ubatch!r} has no workspace slot: the workspace manager was initialised "
            f"with num_ubatches={self._num_ubatches}; init it with more ubatches "
            f"(init_workspace_manager(device, num_ubatches=N) with N > every ubatch id in use)"
        )

    def _check_lane(self, lane: int) -> int:
        if 0 <= lane < self._num_lanes:
            return lane
        raise WorkspaceSlotError(
            f"workspace lane {lane} is not configured: the manager has {self._num_lanes} "
            f"lane(s); init it with more (init_workspace_manager(device, num_ubatches, "
            f"num_lanes=N) with N > every lane in use)"
        )

    def _slot_id(self, ubatch: Any, lane: int) -> int:
        return self._check_slot(ubatch) * self._num_lanes + self._check_lane(lane)

    def _layout_for(self, args: tuple[Any, ...], who: str = "get_simultaneous") -> Layout:
        try:
            layout = self._layouts.get(args)
        except TypeError:  # unhashable (lists): validate, then look up by the normalised key
            layout = None
        if layout is not None and all(dim.__class__ is int for pair in args for dim in pair[0]):
            return layout
        layout = plan_layout(args, who)
        if len(self._layouts) >= MAX_CACHED_SIGNATURES:
            self._layouts.clear()
        self._layouts[layout.key] = layout
        return layout

    def _make_views(self, buffer: torch.Tensor | None, layout: Layout) -> tuple[torch.Tensor, ...]:
        if buffer is None:  # only zero-byte requests get here: nothing to grow for
            if self._empty is None:
                with torch.inference_mode(False):
                    self._empty = torch.empty(0, dtype=torch.uint8, device=self._device)
            buffer = self._empty
        # Templates outlive the call and serve every later mode: made inside inference_mode,
        # view(dtype) would turn them into inference tensors, refused in-place work outside it.
        with torch.inference_mode(False):
            return tuple(
                buffer[r.offset : r.offset + r.nbytes].view(r.dtype).view(r.shape)
                for r in layout.regions
            )

    # ---------------------------------------------------------------- growth

    def allocation_hook(self, hook: AllocationHook) -> AbstractContextManager[None]:
        """Route every slot allocation in the block through `hook(nbytes, allocate)`, which
        returns the buffer, normally `allocate(nbytes)` (the next hook out, or the real
        allocator); it may count, watch or fail the allocation instead. Hooks nest; rollback
        allocations pass through them too. `workspace.testing` builds its helpers on it."""
        return HookedAllocations(self._store, self._mutex, hook)

    def _grow(self, lane: int, new_bytes: int, caller: str) -> None:
        """Grow every ubatch's slot of `lane` to new_bytes (`SlotStore.grow`).

        The caller holds the mutex and has validated the request and checked it against the
        device's memory: nothing is released for a request that could never be allocated.
        """
        # The templates pin the old buffers; they must go before the buffers are released.
        self._views[lane] = {k: {} for k in range(self._num_ubatches)}
        self._store.grow(lane, new_bytes, caller)

    # ---------------------------------------------------------------- lock

    def lock(self) -> None:
        """Forbid growth: requests that do not fit raise WorkspaceLockedError."""
        check_not_abandoned()
        with self._mutex:  # waits out a growth in flight, so none can run after we return
            self._locked = True
            sizes = self.slot_capacities()
        if debug_enabled():
            logger.info(
                "workspace locked; slot sizes: [%s] MB",
                ", ".join(f"{s / float(1 << 20):.2f}" for s in sizes),
            )

    def unlock(self) -> None:
        """Allow growth again (e.g. an elastic-EP re-warmup), until the next lock()."""
        check_not_abandoned()
        with self._mutex:
            self._locked = False
            sizes = self.slot_capacities()
        if debug_enabled():
            logger.info(
                "workspace unlocked; slot sizes: [%s] MB",
                ", ".join(f"{s / float(1 << 20):.2f}" for s in sizes),
            )

    def is_locked(self) -> bool:
        return self._locked

    def __repr__(self) -> str:
        return (
            f"<WorkspaceManager {self._device} slots={self.slot_capacities()} "
            f"{'locked' if self._locked else 'unlocked'}>"
        )
