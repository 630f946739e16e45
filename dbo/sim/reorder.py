"""Races shown as values: re-execute a captured step in a legal order other than issue order.

The simulated device executes every op when it is issued, so an unordered access never reads
stale or clobbered data there: a racy step computes the same values as a correct one. To see
what a race does, `run_adversarially(device, step)` captures `step()` as a `SimGraph`, then
re-executes the recorded ops twice from the same starting memory: once in issue order and
once in an adversarial order, and reports every byte the two leave differently.

The adversarial order is legal for the device: an op never runs before an earlier op of its
own stream (or of the link track, for a low-latency transfer), nor before the recorded event
a wait of its stream waits on. Two accesses to common bytes (one a write) that the race
checker did not report keep their issue order too: something the graph does not record (a
host sync) ordered them, so only a reported race can run the other way round. Ops run in issue
order as soon as they may, except the earlier op of each reported race, which runs only when
nothing else can: its stream falls as far behind as its waits allow, and the later op of the
race runs first (a read before the write it should see, or a write clobbering a pending read).

Starting memory: a storage the step first writes is filled with 0xFF bytes (NaN in every
floating type) so that reading it too early shows; any other storage starts as the captured
run left it. Random ops draw from the same seed in both re-executions.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from dbo.sim.calls import CapturedCall
from dbo.sim.graph import GraphComm, GraphEventRecord, GraphEventWait, GraphOp, SimGraph
from dbo.sim.records import Access, RaceReport
from dbo.sim.regions import region_ops

__all__ = ["ReorderOutcome", "StorageChange", "run_adversarially"]

_SEED = 0
_POISON = 0xFF
_LINK = "link"


@dataclass(frozen=True)
class StorageChange:
    """One storage the two orders leave with different bytes."""

    written_by: str  # the op that first writes it, with its ubatch and stream
    bytes_differ: int
    nbytes: int


@dataclass
class ReorderOutcome:
    """What re-executing the step in the adversarial order changed."""

    moved: int  # ops that ran before an op issued earlier
    races: int  # races the checker reported in the captured step
    changes: list[StorageChange]
    issue_value: Any = None  # what `read` gave after each re-execution
    adversarial_value: Any = None
    mismatch: str | None = None  # set by the caller that compares the two values
    max_abs_diff: float | None = None
    skipped: str | None = None  # why the re-execution did not run (then nothing else is set)
    # Ops the adversarial order fed values they could not take: each raised, or produced
    # another data-dependent shape than in issue order (the captured shape is kept).
    faults: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.changes) or self.mismatch is not None or bool(self.faults)

    def describe(self) -> str:
        if self.skipped is not None:
            return f"adversarial order: not run ({self.skipped})"
        head = f"adversarial order ({self.moved} op(s) moved, {self.races} race(s))"
        if not self.changed and self.races == 0:
            return (
                f"{head}: the captured step has no race; benign here (a captured graph keeps "
                f"its tensors alive, so no race from reused freed memory occurs in it)"
            )
        if not self.changed:
            if self.moved == 0:
                return f"{head}: no legal order differs from issue order; benign here"
            return f"{head}: benign for these inputs (same outputs and memory as in issue order)"
        lines = [f"{head}: the race changes values"]
        if self.mismatch:
            lines.append(f"  outputs: {self.mismatch}")
        lines.extend(f"  {fault}" for fault in self.faults[:5])
        if len(self.faults) > 5:
            lines.append(f"  ... and {len(self.faults) - 5} more op(s) that failed")
        for change in self.changes[:5]:
            lines.append(
                f"  memory written by {change.written_by}: {change.bytes_differ} of "
                f"{change.nbytes} bytes differ"
            )
        if len(self.changes) > 5:
            lines.append(f"  ... and {len(self.changes) - 5} more storage(s)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "moved": self.moved,
            "races": self.races,
            "changed": self.changed,
            "mismatch": self.mismatch,
            "max_abs_diff": self.max_abs_diff,
            "skipped": self.skipped,
            "faults": list(self.faults),
            "storages_changed": [dict(c.__dict__) for c in self.changes],
            "summary": self.describe().splitlines()[0],
        }


# ------------------------------------------------------------------------------ the tasks


@dataclass
class _Task:
    index: int  # issue order
    name: str
    queue: Any
    ubatch: int | None
    accesses: list[Access]
    calls: tuple[CapturedCall, ...] = ()  # the torch calls it re-runs (a comm task: its block's)
    deps: set[int] = field(default_factory=set)

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(call.func._schema.name for call in self.calls)


def _comm_tasks(graph: SimGraph, item: GraphComm, start: int) -> list[_Task]:
    """The tasks a comm region was placed as (`dbo.sim.regions.region_ops`): one on its
    stream, or a send there and a transfer on the link track. The block's torch ops run with
    the task that writes (the transfer: its data lands then)."""
    region = item.region
    device = graph.device
    placed = region_ops(device.profile, region, device.ht_rdma_share, True, device.ht_nvl_share)
    tasks = []
    for k, op in enumerate(placed):
        last = k == len(placed) - 1
        tasks.append(
            _Task(
                start + k,
                op.name,
                _LINK if op.on_link else region.stream,
                item.ubatch,
                [*op.reads, *op.writes],
                tuple(item.ops) if last else (),
            )
        )
        if k:
            tasks[-1].deps.add(start + k - 1)
    return tasks


def _tasks(graph: SimGraph) -> list[_Task]:
    """One task per recorded item (two for a low-latency transfer), with the stream-order
    and event-wait dependencies."""
    tasks: list[_Task] = []
    last_in_queue: dict[Any, int] = {}
    last_record: dict[int, int] = {}
    for item in graph.items:
        i = len(tasks)
        if isinstance(item, GraphOp):
            op = item
            call = CapturedCall(op.func, op.args, op.kwargs, op.out, op.modes)
            new = [_Task(i, op.name, op.stream, op.ubatch, [*op.reads, *op.writes], (call,))]
        elif isinstance(item, GraphComm):
            new = _comm_tasks(graph, item, i)
            last_record[id(item.event)] = new[-1].index
        elif isinstance(item, GraphEventRecord):
            new = [_Task(i, "record", item.stream, None, [])]
            last_record[id(item.event)] = i
        elif isinstance(item, GraphEventWait):
            new = [_Task(i, "wait", item.stream, None, [])]
            if id(item.event) in last_record:
                new[0].deps.add(last_record[id(item.event)])
        else:
            continue
        for task in new:
            queue = id(task.queue) if task.queue != _LINK else _LINK
            if queue in last_in_queue:
                task.deps.add(last_in_queue[queue])
            last_in_queue[queue] = task.index
            tasks.append(task)
    return tasks


def _stream_name(queue: Any) -> str:
    return queue if isinstance(queue, str) else queue.name


def _sides(races: Iterable[RaceReport], alias: dict[int, int]) -> tuple[set, set]:
    """(storage, op, stream, ubatch) of every reported race's two sides, and of its first."""
    both, first = set(), set()
    for race in races:
        storage = alias.get(race.storage, race.storage)
        for site in (race.first, race.second):
            both.add((storage, site.op, site.stream, site.ubatch))
        first.add((storage, race.first.op, race.first.stream, race.first.ubatch))
    return both, first


def _site(task: _Task, storage: int) -> tuple:
    return (storage, task.name, _stream_name(task.queue), task.ubatch)


def _conflict_deps(tasks: list[_Task], racy: set, alias: dict[int, int]) -> None:
    """Keep the issue order of every conflicting pair on different queues that is not a
    reported race (something unrecorded, such as a host sync, ordered it)."""
    by_storage: dict[int, list[tuple[_Task, Access]]] = {}
    for task in tasks:
        for access in task.accesses:
            key = alias.get(access.storage, access.storage)
            by_storage.setdefault(key, []).append((task, access))
    for storage, touches in by_storage.items():
        for j, (later, b) in enumerate(touches):
            for earlier, a in touches[:j]:
                if earlier.queue is later.queue or earlier.index == later.index:
                    continue
                if not (a.is_write or b.is_write) or a.end <= b.start or b.end <= a.start:
                    continue
                if not (_site(earlier, storage) in racy and _site(later, storage) in racy):
                    later.deps.add(earlier.index)


def _held_back(tasks: list[_Task], first: set, alias: dict[int, int]) -> set[int]:
    """The tasks that are the earlier side of a reported race."""
    return {
        t.index
        for t in tasks
        if any(_site(t, alias.get(a.storage, a.storage)) in first for a in t.accesses)
    }


def _adversarial_order(tasks: list[_Task], held: set[int]) -> list[_Task]:
    """A legal order: tasks run in issue order once their dependencies have run, except the
    `held` ones (each race's earlier side), which run only when nothing else can, so their
    stream falls as far behind as its waits allow and the race's later side runs first."""
    waiting = {t.index: set(t.deps) for t in tasks}
    users: dict[int, list[int]] = {}
    for t in tasks:
        for d in t.deps:
            users.setdefault(d, []).append(t.index)
    ready = [(t.index in held, t.index) for t in tasks if not t.deps]
    heapq.heapify(ready)
    by_index = {t.index: t for t in tasks}
    order = []
    while ready:
        _, index = heapq.heappop(ready)
        order.append(by_index[index])
        for user in users.get(index, ()):
            waiting[user].discard(index)
            if not waiting[user]:
                heapq.heappush(ready, (user in held, user))
    if len(order) != len(tasks):
        raise RuntimeError("the captured step's dependencies form a cycle; cannot reorder it")
    return order


# ---------------------------------------------------------------------------- the memory


def _storages(graph: SimGraph) -> tuple[dict[int, torch.UntypedStorage], dict[int, int]]:
    """The storages the graph touches, one per memory block (two storages over the same memory,
    as `torch.from_dlpack` makes, are one), and each storage identity's block."""
    found: dict[int, torch.UntypedStorage] = {}
    alias: dict[int, int] = {}

    def add(values: Iterable[Any]) -> None:
        for v in values:
            if isinstance(v, (list, tuple)):
                add(v)
            elif isinstance(v, torch.Tensor) and v.device.type != "meta":
                st = v.untyped_storage()
                if st.data_ptr():
                    found.setdefault(st.data_ptr(), st)
                    alias[st._cdata] = st.data_ptr()

    for item in graph.items:
        if isinstance(item, GraphOp):
            add((*item.args, *item.kwargs.values(), item.out))
        elif isinstance(item, GraphComm):
            for call in item.ops:
                add((*call.args, *call.kwargs.values(), call.out))
    return found, alias


# In-place ops that overwrite the bytes they write without reading them first; any other op
# that writes through one of its inputs (add_, mul_) reads them too.
_OVERWRITES = frozenset(
    {
        "aten::fill_",
        "aten::zero_",
        "aten::copy_",
        "aten::normal_",
        "aten::uniform_",
        "aten::random_",
        "aten::bernoulli_",
        "aten::exponential_",
    }
)


def _overwrites(task: _Task, access: Access) -> bool:
    if not access.is_write:
        return False
    if access.argument in ("output", "out") or task.name in _OVERWRITES:
        return True
    return bool(task.kernels) and all(name in _OVERWRITES for name in task.kernels)


def _first_writes(tasks: list[_Task], alias: dict[int, int]) -> tuple[set[int], dict[int, str]]:
    """Storages whose first access in issue order overwrites them without reading, and who
    writes each."""
    first: dict[int, bool] = {}
    writer: dict[int, str] = {}
    for task in tasks:
        kinds: dict[int, bool] = {}
        for a in task.accesses:
            key = alias.get(a.storage, a.storage)
            kinds[key] = kinds.get(key, True) and _overwrites(task, a)
            if a.is_write and key not in writer:
                writer[key] = (
                    f"{task.name} (ubatch {task.ubatch}, stream {_stream_name(task.queue)!r})"
                )
        for storage, write_only in kinds.items():
            first.setdefault(storage, write_only)
    return {s for s, w in first.items() if w}, writer


def _execute(
    order: list[_Task],
    start: dict[int, torch.UntypedStorage],
    storages: dict,
    faults: list[str] | None = None,
) -> None:
    """Run `order` from the memory `start`. With `faults` (the adversarial order), an op that
    raises or whose data-dependent output changes shape is noted there and the rest run on:
    on a GPU a race feeds an op whatever its memory holds. Without, those raise."""
    for key, saved in start.items():
        storages[key].copy_(saved)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        for task in order:
            for call in task.calls:
                if faults is None:
                    call.rerun()
                else:
                    _rerun_noting(call, task, faults)


def _rerun_noting(call: CapturedCall, task: _Task, faults: list[str]) -> None:
    name = call.func._schema.name
    where = name if name == task.name else f"{name} in {task.name}"
    where += f" (ubatch {task.ubatch}, stream {_stream_name(task.queue)!r})"
    try:
        call.rerun(lambda captured, fresh: _fit(captured, fresh, where, faults))
    except Exception as error:  # noqa: BLE001 - a finding: what the race made the op do
        faults.append(f"{where} raised {type(error).__name__}: {_first_line(error)}")


def _fit(captured: torch.Tensor, fresh: torch.Tensor, where: str, faults: list[str]) -> None:
    """Keep the captured shape (later ops hold that tensor): the block both shapes share is
    copied and the rest poisoned, so what the changed shape left out or added shows."""
    faults.append(
        f"{where} gave shape {tuple(fresh.shape)} where issue order gave {tuple(captured.shape)}"
    )
    poison = torch.full((captured.element_size(),), _POISON, dtype=torch.uint8)
    captured.fill_(poison.view(captured.dtype)[0])
    if captured.dim() == fresh.dim() and captured.dtype == fresh.dtype:
        block = tuple(slice(0, min(a, b)) for a, b in zip(captured.shape, fresh.shape))
        captured[block].copy_(fresh[block])


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def run_adversarially(
    device: Any, step: Callable[[], Any], read: Callable[[Any], Any] | None = None
) -> ReorderOutcome:
    """Capture `step()` on `device` (a SimDevice computing on real tensors) and re-execute it
    in issue order and in the adversarial order from the same memory; `read(value)` (value:
    what `step` returned) takes what to compare after each. Errors of `step` propagate; a
    re-execution in issue order that fails (it should reproduce the capture) comes back as
    `skipped`, saying why."""
    races_before = len(device.races)
    with device.graph() as graph:
        value = step()
    device.synchronize()
    races = list(device.races)[races_before:]
    tasks = _tasks(graph)
    storages, alias = _storages(graph)
    racy, first = _sides(races, alias)
    _conflict_deps(tasks, racy, alias)
    poisoned, writer = _first_writes(tasks, alias)
    captured = {key: st.clone() for key, st in storages.items()}
    start = {}
    for key, saved in captured.items():
        start[key] = saved.clone().fill_(_POISON) if key in poisoned else saved
    read = read or (lambda v: None)
    with device.suspended():
        try:
            try:
                _execute(tasks, start, storages)
            except Exception as error:  # noqa: BLE001 - reported: the order cannot be compared
                why = f"re-executing it in issue order raised {type(error).__name__}: "
                return ReorderOutcome(0, len(races), [], skipped=why + _first_line(error))
            issue_value = read(value)
            issue_bytes = {k: st.clone() for k, st in storages.items() if k in writer}
            order = _adversarial_order(tasks, _held_back(tasks, first, alias))
            faults: list[str] = []
            _execute(order, start, storages, faults)
            adversarial_value = read(value)
            changes = _changes(issue_bytes, storages, writer)
        finally:
            for key, saved in captured.items():  # the step's memory as the captured run left it
                storages[key].copy_(saved)
    return ReorderOutcome(
        _moved(order), len(races), changes, issue_value, adversarial_value, faults=faults
    )


def _changes(before: dict, storages: dict, writer: dict[int, str]) -> list[StorageChange]:
    changes = []
    for key, saved in before.items():
        differ = int((_bytes(saved) != _bytes(storages[key])).sum().item())
        if differ:
            changes.append(StorageChange(writer[key], differ, saved.nbytes()))
    return changes


def _moved(order: list[_Task]) -> int:
    """Tasks that ran before a task issued earlier than them."""
    moved, lowest = 0, None
    for task in reversed(order):
        if lowest is not None and lowest < task.index:
            moved += 1
        lowest = task.index if lowest is None else min(lowest, task.index)
    return moved


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)
